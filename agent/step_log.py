"""Training progress from log lines: Megatron-LM, DeepSpeed or a user's regex -> ``StepLine``s.

Parsers turn Megatron-LM iteration lines, DeepSpeed progress lines (every release's format,
timed from one consistent clock per log), or lines matching a user's regex with named groups
into ``StepLine``s, and report a long gap as a pause rather than a step. They neither read files
(``agent.file_follower`` does) nor keep per-rank state or decide anything (the ``training``
collector does).
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StepLine:
    """One progress line: the step reached and, where the log says, the time one step took.
    ``pause_seconds`` is set instead of ``step_seconds`` when the time since the previous
    progress line was a pause (a resume, a restart, a long checkpoint), not steps."""

    step: int
    step_seconds: float | None = None
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    data_seconds: float | None = None
    pause_seconds: float | None = None


class LineError(ValueError):
    """A line that looks like a progress line but whose numbers cannot be used."""


class StepParser(Protocol):
    def feed(self, line: str) -> StepLine | None: ...


# A gap between two progress lines is a pause, not steps, when it is longer than a minute AND its
# per-step time is more than PAUSE_FACTOR x the median of the last accepted step times: a
# slowdown the detectors must see (5-30% in DESIGN.md's budget, a few x at worst) stays a step,
# while a resume after a crash or a checkpoint of minutes does not become one enormous step.
PAUSE_MIN_GAP_SECONDS = 60.0
PAUSE_FACTOR = 3.0
# Before any step time is known, only a gap longer than the training collector's default hang
# threshold (300 s, which stays under PyTorch NCCL's 10-minute collective timeout) is a pause.
PAUSE_UNREFERENCED_SECONDS = 300.0
# The same slow pace this many times in a row is the job's new pace, not a pause.
PAUSE_ACCEPT_AFTER = 3
_PAUSE_REFERENCE_STEPS = 5


class PauseGuard:
    """Tells a pause from steps, from the gap between two progress lines and the per-step time."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=_PAUSE_REFERENCE_STEPS)
        self._flagged = 0

    def is_pause(self, gap_seconds: float, per_step_seconds: float) -> bool:
        if self._recent:
            reference = statistics.median(self._recent)
            pause = gap_seconds > PAUSE_MIN_GAP_SECONDS and per_step_seconds > PAUSE_FACTOR * reference
        else:
            pause = gap_seconds > PAUSE_UNREFERENCED_SECONDS
        if pause:
            self._flagged += 1
            if self._flagged < PAUSE_ACCEPT_AFTER:
                return True
        self._flagged = 0
        self._recent.append(per_step_seconds)
        return False


# Megatron-LM's training_log() (megatron/training/training.py) prints, on the last rank, every
# --log-interval iterations:
#   " [2024-05-02 10:11:12] iteration      100/  500000 | consumed samples: ... |
#     elapsed time per iteration (ms): 1234.5 | ..."
# The elapsed time is the mean over the log interval, measured by Megatron's own interval timer
# (the clock used here: iteration line to iteration line). Some forks print "(ms): 1234.5/1200.1"
# (last/running mean); the first number is taken.
_MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(?:\d+|infinity)\s*\|")
_MEGATRON_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")


class MegatronParser:
    def __init__(self) -> None:
        self._prev_step: int | None = None
        self._pauses = PauseGuard()

    def feed(self, line: str) -> StepLine | None:
        it = _MEGATRON_ITER.search(line)
        if it is None:
            return None
        elapsed = _MEGATRON_ELAPSED.search(line, it.end())
        if elapsed is None:
            return None  # an iteration line without timing (e.g. a validation header)
        step = int(it.group(1))
        seconds = _finite(elapsed.group(1), "elapsed time per iteration (ms)") / 1000.0
        prev, self._prev_step = self._prev_step, step
        steps = step - prev if prev is not None and step > prev else 1
        if self._pauses.is_pause(seconds * steps, seconds):
            return StepLine(step=step, pause_seconds=seconds * steps)
        return StepLine(step=step, step_seconds=seconds)


# DeepSpeed logs through its logger, formatted "[%(asctime)s] [%(levelname)s] [file:line:func] msg"
# (deepspeed/utils/logging.py). Two progress lines, each every `steps_per_print` steps:
#   engine._report_progress:  "[Rank 0] step=100, skipped=0, lr=[...], mom=[...]"
#                             (older releases: "rank:0 step=100, skipped=0, ...")
#   ThroughputTimer.stop:     "epoch=0/micro_step=400/global_step=100, RunningAvgSamplesPerSec=...,
#                              CurrSamplesPerSec=..., MemAllocated=...GB, MaxMemAllocated=...GB"
#                             (before 0.8: "0/400, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=...",
#                             and earlier "0/400, SamplesPerSec=...", the count in micro steps;
#                             0.7.7 printed it every step whatever steps_per_print said).
# Neither carries the step's duration, so it is derived from the asctime of successive lines of
# ONE kind: (t2 - t1) / (step2 - step1). The timer line is stamped when the step ends; the step=
# line is stamped before it, by up to half a second in real logs (deepspeed issue 3742), so
# mixing the two makes steps look shorter. Once a log shows a timer line, only timer lines time
# steps. The asctime is found anywhere on the line: a tqdm bar or a launcher's "stdout: " may
# come first.
_DEEPSPEED_STEP = re.compile(r"(?:\[Rank \d+\] step=|\brank:\d+ step=)(\d+),")
_DEEPSPEED_TIMER = re.compile(r"/global_step=(\d+),")
_DEEPSPEED_OLD_TIMER = re.compile(r"(?:^|\s)\d+/(\d+), (?:RunningAvgSamplesPerSec|SamplesPerSec)=")
_DEEPSPEED_TIME = re.compile(r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3})\]")
# An old-format timer line and a step= line stamped within this of each other report the same
# optimizer step; their counts give the gradient-accumulation factor (micro steps per step).
_SAME_STEP_SECONDS = 1.0


class DeepSpeedParser:
    def __init__(self) -> None:
        self._timer_seen = False
        self._prev: tuple[int, float] | None = None  # (step, log time) of the previous timing line
        self._last_step: int | None = None  # the last step handed out
        self._step_line: tuple[int, float | None] | None = None  # the last step= line
        self._micro_per_step = 1
        self._pauses = PauseGuard()

    def feed(self, line: str) -> StepLine | None:
        found = self._progress(line)
        if found is None:
            return None
        step, logged_at = found
        step_seconds = pause_seconds = None
        if logged_at is not None and self._prev is not None:
            prev_step, prev_at = self._prev
            if step > prev_step and logged_at >= prev_at:
                gap = logged_at - prev_at
                per_step = gap / (step - prev_step)
                if self._pauses.is_pause(gap, per_step):
                    pause_seconds = gap
                else:
                    step_seconds = per_step
        self._prev = (step, logged_at) if logged_at is not None else None
        if step == self._last_step:
            return None  # both progress lines of one step: the second adds nothing
        self._last_step = step
        return StepLine(step=step, step_seconds=step_seconds, pause_seconds=pause_seconds)

    def _progress(self, line: str) -> tuple[int, float | None] | None:
        """(step, log time) of a progress line of the clock in use (timer lines once seen)."""
        m = _DEEPSPEED_STEP.search(line)
        if m is not None:
            step, logged_at = int(m.group(1)), _deepspeed_time(line, m.start())
            self._step_line = (step, logged_at)
            if self._timer_seen:
                return None  # the timer line of the same step times it and reports it
            return step, logged_at
        m = _DEEPSPEED_TIMER.search(line)
        old = None if m is not None else _DEEPSPEED_OLD_TIMER.search(line)
        if m is None and old is None:
            return None
        timer = m if m is not None else old
        assert timer is not None
        logged_at = _deepspeed_time(line, timer.start())
        if not self._timer_seen:
            self._timer_seen = True
            self._prev = None  # the step= clock ends here; timer-to-timer from the next one
        if m is not None:
            return int(m.group(1)), logged_at
        micro = int(timer.group(1))
        paired = self._step_line
        if (paired is not None and paired[0] > 0 and micro % paired[0] == 0 and logged_at is not None
                and paired[1] is not None and abs(logged_at - paired[1]) <= _SAME_STEP_SECONDS):
            self._micro_per_step = micro // paired[0]
        return micro // self._micro_per_step, logged_at


def _deepspeed_time(line: str, before: int) -> float | None:
    """The last DeepSpeed asctime stamp on the line before position ``before``."""
    found = None
    for found in _DEEPSPEED_TIME.finditer(line, 0, before):  # noqa: B007 - the last one is wanted
        pass
    if found is None:
        return None
    try:
        stamp = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    # Naive local time: only differences between lines of one file are used.
    return stamp.timestamp() + int(found.group(2)) / 1000.0


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
