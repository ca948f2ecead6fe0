"""The one file follower both the kernel-log (xid) and the step-log (training) collectors use:
rotation, truncation, partial and over-long lines, bounded reads, resuming from a cursor."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil.agent.file_follower import FileFollower


def append(path: Path, text: str) -> None:
    with path.open("a") as fh:
        fh.write(text)


def test_file_follower_reads_appends_and_waits_for_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old line\n")
    follower = FileFollower(log, start="end")
    assert follower.read_lines(100) == []
    with log.open("a") as fh:
        fh.write("first\nsecond, half")
    assert follower.read_lines(100) == ["first"]
    with log.open("a") as fh:
        fh.write(" done\n")
    assert follower.read_lines(100) == ["second, half done"]
    follower.close()


def test_file_follower_survives_rotation_and_truncation(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\n")
    follower = FileFollower(log, start="beginning")
    assert follower.read_lines(100) == ["a"]
    with log.open("a") as fh:
        fh.write("b\n")
    log.rename(tmp_path / "kern.log.1")
    log.write_text("c\n")
    assert follower.read_lines(100) == ["b", "c"]
    assert follower.rotations == 1
    log.write_text("")  # logrotate's copytruncate
    assert follower.read_lines(100) == []
    assert follower.truncations == 1
    with log.open("a") as fh:
        fh.write("d\n")
    assert follower.read_lines(100) == ["d"]
    with log.open("a") as fh:
        fh.write("a much longer line\n")
    assert follower.read_lines(100) == ["a much longer line"]
    log.write_text("e\n")  # truncated and rewritten shorter between two cycles
    assert follower.read_lines(100) == ["e"]
    assert follower.truncations == 2
    follower.close()


def test_file_follower_limits_a_cycle_and_keeps_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    follower = FileFollower(log, start="beginning")
    assert follower.read_lines(4) == [f"line {i}" for i in range(4)]
    assert follower.read_lines(4) == [f"line {i}" for i in range(4, 8)]
    assert follower.read_lines(4) == ["line 8", "line 9"]
    follower.close()


def test_file_follower_resumes_from_cursor_and_ignores_a_stale_one(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    first = FileFollower(log, start="beginning")
    assert first.read_lines(1) == ["a"]
    cursor = first.cursor()
    first.close()
    with log.open("a") as fh:
        fh.write("c\n")
    resumed = FileFollower(log, start="end", cursor=cursor)
    assert resumed.read_lines(100) == ["b", "c"]
    resumed.close()
    stale = FileFollower(log, start="end", cursor={**cursor, "inode": -1})
    assert stale.read_lines(100) == ["a", "b", "c"]
    stale.close()


def test_file_follower_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot open"):
        FileFollower(tmp_path / "nope").read_lines(10)


def test_a_file_present_at_start_is_followed_from_its_end_one_appearing_later_from_its_beginning(
        tmp_path: Path) -> None:
    present, later = tmp_path / "present.log", tmp_path / "later.log"
    present.write_text("history\n")
    follower, waiting = FileFollower(present), FileFollower(later)
    append(present, "new\n")  # written between construction and the first read: not history
    assert follower.read_lines() == ["new"]
    with pytest.raises(FileNotFoundError):  # the training collector treats this as "not there yet"
        waiting.read_lines()
    later.write_text("first\nsecond\n")
    assert waiting.read_lines() == ["first", "second"]
    follower.close()
    waiting.close()


def test_rotation_keeps_the_old_files_last_lines_and_its_unended_line(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    follower = FileFollower(log)
    assert follower.read_lines() == []
    append(log, "step 1\nstep 2 unended")
    log.rename(tmp_path / "train.log.1")
    assert follower.read_lines() == ["step 1"]  # rotated away, nothing new at the path yet
    append(tmp_path / "train.log.1", " now ended\n")
    log.write_text("step 3\n")
    assert follower.read_lines() == ["step 2 unended now ended", "step 3"]
    assert (follower.rotations, follower.truncations) == (1, 0)
    append(tmp_path / "train.log.1", "late\n")  # the old file is let go once the new one is open
    assert follower.read_lines() == []
    follower.close()


def test_an_unended_line_left_in_a_rotated_file_is_handed_over(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\n")
    follower = FileFollower(log, start="beginning")
    assert follower.read_lines() == ["a"]
    append(log, "cut short")
    log.rename(tmp_path / "kern.log.1")
    log.write_text("b\n")
    assert follower.read_lines() == ["cut short", "b"]
    follower.close()


def test_an_overlong_line_is_dropped_and_counted(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    follower = FileFollower(log, max_line_bytes=16)
    append(log, "short\n" + "x" * 40)
    assert follower.read_lines() == ["short"]
    assert follower.overlong_lines == 1
    append(log, "\nnext\n")
    assert follower.read_lines()[-1] == "next"
    follower.close()


def test_reads_are_bounded_in_bytes_and_the_rest_comes_next_call(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    follower = FileFollower(log, max_bytes=8)
    append(log, "aaa\nbbb\nccc\n")
    assert follower.read_lines() == ["aaa", "bbb"]
    assert follower.read_lines() == ["ccc"]
    # A rotated file is read to its end, within the budget, before the new file is opened.
    append(log, "ddd\neee\nfff\n")
    log.rename(tmp_path / "train.log.1")
    log.write_text("ggg\n")
    assert follower.read_lines() == ["ddd", "eee"]
    assert follower.rotations == 0
    assert follower.read_lines() == ["fff", "ggg"]
    assert follower.rotations == 1
    follower.close()


def test_the_cursor_points_before_a_held_partial_line(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\nhal")
    first = FileFollower(log, start="beginning")
    assert first.read_lines(10) == ["a"]
    cursor = first.cursor()
    first.close()
    append(log, "f\n")
    resumed = FileFollower(log, start="end", cursor=cursor)
    assert resumed.read_lines(10) == ["half"]
    resumed.close()
