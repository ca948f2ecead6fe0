"""Training progress from log files: follow a file across rotation and truncation, parse step lines.

Parsers turn Megatron-LM iteration lines, DeepSpeed progress lines, or lines matching a user's
regex with named groups into ``StepLine``s; ``LogFollower`` hands back the complete lines appended
since the last read, without blocking. Neither keeps per-rank state nor decides anything: the
``training`` collector does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StepLine:
    """One progress line: the step reached and, where the log says, the time one step took."""

    step: int
    step_seconds: float | None = None
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    data_seconds: float | None = None


class LineError(ValueError):
    """A line that looks like a progress line but whose numbers cannot be used."""


class StepParser(Protocol):
    def feed(self, line: str) -> StepLine | None: ...


# Megatron-LM's training_log() (megatron/training/training.py) prints, on the last rank, every
# --log-interval iterations:
#   " [2024-05-02 10:11:12] iteration      100/  500000 | consumed samples: ... |
#     elapsed time per iteration (ms): 1234.5 | ..."
# The elapsed time is the mean over the log interval. Some forks print "(ms): 1234.5/1200.1"
# (last/running mean); the first number is taken.
_MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(?:\d+|infinity)\s*\|")
_MEGATRON_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")


class MegatronParser:
    def feed(self, line: str) -> StepLine | None:
        it = _MEGATRON_ITER.search(line)
        if it is None:
            return None
        elapsed = _MEGATRON_ELAPSED.search(line, it.end())
        if elapsed is None:
            return None  # an iteration line without timing (e.g. a validation header)
        step = int(it.group(1))
        ms = _finite(elapsed.group(1), "elapsed time per iteration (ms)")
        return StepLine(step=step, step_seconds=ms / 1000.0)


# DeepSpeed logs through its logger, formatted "[%(asctime)s] [%(levelname)s] [file:line:func] msg"
# (deepspeed/utils/logging.py), and, every `steps_per_print` steps:
#   engine._report_progress:  "[Rank 0] step=100, skipped=0, lr=[...], mom=[...]"
#                             (older releases: "rank:0 step=100, skipped=0, ...")
#   ThroughputTimer.stop:     "epoch=0/micro_step=400/global_step=100, RunningAvgSamplesPerSec=...,
#                              CurrSamplesPerSec=..., MemAllocated=...GB, MaxMemAllocated=...GB"
# Neither line carries the step's duration, so it is derived from the asctime of successive
# progress lines: (t2 - t1) / (step2 - step1).
_DEEPSPEED_STEP = re.compile(r"(?:\[Rank \d+\] step=|\brank:\d+ step=|/global_step=)(\d+),")
_DEEPSPEED_TIME = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3})\]")


class DeepSpeedParser:
    def __init__(self) -> None:
        self._prev: tuple[int, float] | None = None  # (step, log time) of the previous progress line

    def feed(self, line: str) -> StepLine | None:
        m = _DEEPSPEED_STEP.search(line)
        if m is None:
            return None
        step = int(m.group(1))
        logged_at = _deepspeed_time(line)
        step_seconds = None
        if logged_at is not None and self._prev is not None:
            prev_step, prev_at = self._prev
            if step > prev_step and logged_at >= prev_at:
                step_seconds = (logged_at - prev_at) / (step - prev_step)
        if self._prev is not None and step == self._prev[0]:
            # Both progress lines of one step are printed together; the second adds nothing.
            return None
        self._prev = (step, logged_at) if logged_at is not None else None
        return StepLine(step=step, step_seconds=step_seconds)


def _deepspeed_time(line: str) -> float | None:
    m = _DEEPSPEED_TIME.match(line)
    if m is None:
        return None
    try:
        stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    # Naive local time: only differences between lines of one file are used.
    return stamp.timestamp() + int(m.group(2)) / 1000.0


REGEX_SECONDS_GROUPS = ("step_seconds", "compute_seconds", "comm_seconds", "data_seconds")


def compile_step_regex(pattern: str) -> re.Pattern[str]:
    """Compile a user regex; it needs a named group ``step`` and may have ``step_seconds`` or
    ``step_ms`` and the phase groups ``compute_seconds``, ``comm_seconds``, ``data_seconds``."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
    if "step" not in compiled.groupindex:
        raise ValueError(f"regex {pattern!r} needs a named group (?P<step>...)")
    if "step_seconds" in compiled.groupindex and "step_ms" in compiled.groupindex:
        raise ValueError(f"regex {pattern!r}: give step_seconds or step_ms, not both")
    return compiled


class RegexParser:
    def __init__(self, pattern: str) -> None:
        self._re = compile_step_regex(pattern)

    def feed(self, line: str) -> StepLine | None:
        m = self._re.search(line)
        if m is None:
            return None
        groups = m.groupdict()
        try:
            step = int(groups["step"])
        except (TypeError, ValueError):
            raise LineError(f"step {groups['step']!r} is not an integer") from None
        values: dict[str, float | None] = {}
        for name in REGEX_SECONDS_GROUPS:
            raw = groups.get(name)
            values[name] = None if raw is None else _finite(raw, name)
        if groups.get("step_ms") is not None:
            values["step_seconds"] = _finite(groups["step_ms"], "step_ms") / 1000.0
        return StepLine(step=step, **values)


def _finite(raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise LineError(f"{what} {raw!r} is not a number") from None
    if not (value >= 0.0 and value != float("inf")):
        raise LineError(f"{what} {raw!r} is not a finite non-negative number")
    return value


def make_parser(fmt: str, regex: str | None = None) -> StepParser:
    if fmt == "megatron":
        return MegatronParser()
    if fmt == "deepspeed":
        return DeepSpeedParser()
    if fmt == "regex":
        if regex is None:
            raise ValueError("format 'regex' needs a regex")
        return RegexParser(regex)
    raise ValueError(f"unknown log format {fmt!r}")


class LogFollower:
    """Follows one file the way ``tail -F`` does: across rotation (a new inode at the path) and
    truncation (the file shrank below our offset). A file present at start is followed from its
    end (history is not progress); a file that appears later is read from its beginning.

    ``read_lines`` returns the complete lines appended since the last call, reading at most
    ``max_bytes`` so one call stays short; the rest waits for the next call. An unfinished last
    line is kept until its newline arrives.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = 1 << 20,
                 max_line_bytes: int = 64 << 10) -> None:
        self.path = os.fspath(path)
        self._max_bytes = max_bytes
        self._max_line_bytes = max_line_bytes
        self._file: int | None = None  # an fd: os.read on a regular file never blocks on a pipe
        self._inode: tuple[int, int] | None = None
        self._offset = 0
        self._partial = b""
        self.rotations = 0
        self.truncations = 0
        self.overlong_lines = 0
        try:
            st = os.stat(self.path)
        except OSError:
            return
        self._open(st, at_end=True)

    def _open(self, st: os.stat_result, *, at_end: bool) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._file = fd
        self._inode = (st.st_dev, st.st_ino)
        self._offset = st.st_size if at_end else 0
        self._partial = b""

    def read_lines(self) -> list[str]:
        """New complete lines. Raises OSError when the file exists but cannot be read."""
        lines: list[str] = []
        budget = self._max_bytes
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None  # rotated away and not yet recreated: drain the old file below
        if self._file is not None and st is not None and (st.st_dev, st.st_ino) != self._inode:
            # Rotated: what the writer appended to the old file before the rename comes first.
            budget -= self._drain(lines, budget)
            self._close()
            self.rotations += 1
            self._open(st, at_end=False)
        elif self._file is None and st is not None:
            self._open(st, at_end=False)
        elif self._file is not None and st is not None and st.st_size < self._offset:
            self.truncations += 1
            self._offset = 0
            self._partial = b""
        if self._file is not None:
            self._drain(lines, budget)
        return lines

    def _drain(self, lines: list[str], budget: int) -> int:
        assert self._file is not None
        used = 0
        while used < budget:
            chunk = os.pread(self._file, min(256 << 10, budget - used), self._offset)
            if not chunk:
                break
            used += len(chunk)
            self._offset += len(chunk)
            data = self._partial + chunk
            *complete, self._partial = data.split(b"\n")
            lines.extend(c.decode("utf-8", "replace") for c in complete)
            if len(self._partial) > self._max_line_bytes:
                self.overlong_lines += 1  # a line this long is not a progress line; skip it
                self._partial = b""
        return used

    def _close(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None

    def close(self) -> None:
        self._close()
