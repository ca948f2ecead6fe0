"""The reporter's backlog journal: what is pending is on disk, what was released goes away."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vigil.agent.backlog import JOURNAL_FILE, Backlog


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.exists() else []


def test_the_journal_follows_the_pending_events(tmp_path: Path) -> None:
    backlog = Backlog(max_bytes=1 << 20, state_dir=tmp_path)
    journal = tmp_path / JOURNAL_FILE
    events = [b'{"n":%d}' % i for i in range(10)]
    backlog.append(events[:6])
    backlog.append(events[6:])
    assert _lines(journal) == events and backlog.first_id == 0
    assert backlog.release_through(4) == 4
    assert _lines(journal) == events  # 4 released, 6 pending: not worth a rewrite yet
    assert backlog.release_through(6) == 2
    assert _lines(journal) == events[6:]  # released lines outnumbered pending ones: rewritten
    assert backlog.release_through(6) == 0  # an id already released releases nothing
    backlog.close()
    assert _lines(journal) == events[6:]
    assert Backlog(1 << 20, tmp_path).recover() == events[6:] and not journal.exists()


def test_the_bound_drops_the_oldest_and_the_journal_forgets_them(tmp_path: Path) -> None:
    backlog = Backlog(max_bytes=3 * 8, state_dir=tmp_path)
    events = [b'{"n":%02d}' % i for i in range(5)]  # 8 bytes each
    assert backlog.append(events) == 2
    assert list(backlog) == events[2:] and backlog.first_id == 2 and backlog.bytes == 24
    assert backlog.release_through(5) == 3
    assert not (tmp_path / JOURNAL_FILE).exists()


def test_a_journal_that_cannot_be_written_is_logged_once_and_costs_nothing_in_memory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    backlog = Backlog(max_bytes=1 << 20, state_dir=not_a_dir)
    with caplog.at_level(logging.ERROR, logger="vigil.agent.backlog"):
        for i in range(3):
            backlog.append([b'{"n":%d}' % i])
    assert len(backlog) == 3
    assert sum("cannot write the event journal" in r.getMessage() for r in caplog.records) == 1


def test_without_a_state_dir_nothing_is_written(tmp_path: Path) -> None:
    backlog = Backlog(max_bytes=1 << 20)
    backlog.append([b"{}"])
    backlog.close()
    assert backlog.recover() == [] and list(tmp_path.iterdir()) == []
