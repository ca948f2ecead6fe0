"""Step times from real Megatron-LM and DeepSpeed logs (tests/fixtures/training-logs): one clock per
format, every DeepSpeed release's line format, tqdm-shared lines, and pauses that are not steps."""

from __future__ import annotations

import itertools
from datetime import datetime
from pathlib import Path

import pytest

from vigil.agent.collectors.training import TrainingCollector, TrainingConfig
from vigil.agent.step_log import (
    PAUSE_ACCEPT_AFTER,
    PAUSE_UNREFERENCED_SECONDS,
    DeepSpeedParser,
    MegatronParser,
    PauseGuard,
    StepLine,
    make_parser,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "training-logs"


def parse(name: str, fmt: str = "deepspeed") -> list[StepLine]:
    parser = make_parser(fmt)
    out = []
    for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines():
        parsed = parser.feed(line)
        if parsed is not None:
            out.append(parsed)
    return out


def stamp(text: str) -> float:
    """A DeepSpeed asctime ("2023-07-25 21:03:17,269") as seconds, by hand."""
    day, ms = text.split(",")
    return datetime.strptime(day, "%Y-%m-%d %H:%M:%S").timestamp() + int(ms) / 1000


def test_deepspeed_times_steps_timer_to_timer_not_from_the_earlier_step_line() -> None:
    # deepspeed issue 3742 (0.9.x): the step=35 line is stamped 455 ms before step 35's timer
    # line. Timing from the first line of a step gave 3.768 s, 10.8% low; timer to timer is right.
    lines = parse("deepspeed-3742-timer-and-step-lines.log")
    truth = stamp("2023-07-25 21:03:21,492") - stamp("2023-07-25 21:03:17,269")
    assert [(s.step, s.step_seconds is None) for s in lines] == [(34, True), (35, False)]
    assert lines[1].step_seconds == pytest.approx(truth, rel=0.01)
    assert truth == pytest.approx(4.223, abs=1e-6)


def test_deepspeed_0_7_7_timer_every_step_behind_a_launcher_prefix() -> None:
    # deepspeed issue 2629: "stdout: [asctime] ... 0/17, RunningAvgSamplesPerSec=..." every step.
    lines = parse("deepspeed-2629-0.7.7-timer-every-step.log")
    stamps = ["26,101", "26,325", "26,531", "26,741", "26,950", "27,159"]
    times = [stamp(f"2022-12-20 08:26:{s}") for s in stamps]
    assert [s.step for s in lines] == list(range(17, 23))
    assert lines[0].step_seconds is None
    for parsed, (t0, t1) in zip(lines[1:], itertools.pairwise(times), strict=True):
        assert parsed.step_seconds == pytest.approx(t1 - t0, rel=0.01)


def test_deepspeed_samplespersec_format_before_0_6() -> None:
    # deepspeed issue 1825 (2022-03): step= and "0/40, SamplesPerSec=" every 10 steps.
    lines = parse("deepspeed-1825-samplespersec.log")
    assert [s.step for s in lines] == [40, 50]
    truth = (stamp("2022-03-11 02:07:14,130") - stamp("2022-03-11 02:06:58,985")) / 10
    assert lines[1].step_seconds == pytest.approx(truth, rel=0.01)
    # deepspeed PR 849 (2021): the timer line without the memory fields.
    assert [s.step for s in parse("deepspeed-849-samplespersec-2021.log")] == [25]


def test_old_timer_counts_micro_steps_and_the_step_line_gives_the_ratio() -> None:
    # Before 0.8 the timer counted micro steps (deepspeed PR 2553). Constructed lines in the real
    # format, gradient accumulation 4: micro 40 is optimizer step 10.
    p = DeepSpeedParser()
    assert p.feed("[2022-03-11 02:00:00,000] [INFO] [logging.py:69:log_dist] [Rank 0] step=10, skipped=0, "
                  "lr=[5e-05], mom=[[0.9, 0.999]]") == StepLine(step=10)
    assert p.feed("[2022-03-11 02:00:00,000] [INFO] [timer.py:189:stop] 0/40, SamplesPerSec=83.4") is None
    p.feed("[2022-03-11 02:00:20,000] [INFO] [logging.py:69:log_dist] [Rank 0] step=20, skipped=0, lr=[5e-05]")
    later = p.feed("[2022-03-11 02:00:20,000] [INFO] [timer.py:189:stop] 0/80, SamplesPerSec=83.4")
    assert later == StepLine(step=20, step_seconds=2.0)


def test_a_tqdm_bar_sharing_the_line_does_not_hide_the_timestamp() -> None:
    # huggingface/transformers issue 14531: the bar and DeepSpeed's step=2000 line share a line.
    lines = parse("transformers-14531-tqdm-shared.log")
    assert [s.step for s in lines] == [2000]
    # The next progress line (constructed in the same format, 10 steps later at tqdm's own 3.33 s/it)
    # is timed from the shared line's stamp, which was read.
    p = DeepSpeedParser()
    for line in (FIXTURES / "transformers-14531-tqdm-shared.log").read_text(encoding="utf-8").splitlines():
        p.feed(line)
    nxt = p.feed("[2021-11-26 03:07:49,794] [INFO] [timer.py:181:stop] 0/2010, SamplesPerSec=9.6")
    assert nxt is not None and nxt.step == 2010 and nxt.step_seconds == pytest.approx(3.33, rel=0.01)


@pytest.mark.parametrize(("name", "steps", "seconds"), [
    ("megatron-756-mixtral-h100.log", [43, 44, 45], [5.4449, 5.5338, 5.7186]),
    ("megatron-llm-11-86s-iterations.log", [122, 123, 124, 125], [86.5452, 87.8716, 89.4748, 89.0752]),
])
def test_megatron_elapsed_time_per_iteration(name: str, steps: list[int], seconds: list[float]) -> None:
    lines = parse(name, "megatron")
    assert [s.step for s in lines] == steps
    assert [s.step_seconds for s in lines] == pytest.approx(seconds, rel=1e-6)
    assert all(s.pause_seconds is None for s in lines)


def ds_step(step: int, at: float) -> str:
    text = datetime.fromtimestamp(1_700_000_000 + at).strftime("%Y-%m-%d %H:%M:%S")
    ms = round((at % 1) * 1000)
    return (f"[{text},{ms:03d}] [INFO] [timer.py:215:stop] epoch=0/micro_step={step}/global_step={step}, "
            "RunningAvgSamplesPerSec=7.8, CurrSamplesPerSec=8.0, MemAllocated=59.65GB, MaxMemAllocated=63.31GB")


def test_a_resume_after_an_hour_is_a_pause_not_a_step() -> None:
    p = DeepSpeedParser()
    got = [p.feed(ds_step(step, at)) for step, at in
           [(10, 0.0), (20, 25.0), (30, 50.0), (40, 3650.0), (50, 3675.0)]]
    assert [g.step_seconds if g else None for g in got] == [None, 2.5, 2.5, None, 2.5]
    assert got[3] is not None and got[3].pause_seconds == pytest.approx(3600.0)


def test_a_first_gap_beyond_the_hang_threshold_is_a_pause_and_a_new_pace_is_accepted() -> None:
    guard = PauseGuard()
    assert guard.is_pause(PAUSE_UNREFERENCED_SECONDS + 1, PAUSE_UNREFERENCED_SECONDS + 1)
    assert not guard.is_pause(20.0, 2.0)
    # A job that really became 5x slower, logging every 10 steps: paused twice, then its pace.
    verdicts = [guard.is_pause(100.0, 10.0) for _ in range(PAUSE_ACCEPT_AFTER)]
    assert verdicts == [True] * (PAUSE_ACCEPT_AFTER - 1) + [False]
    assert not guard.is_pause(100.0, 10.0)
    # A 30% slowdown is never a pause.
    fresh = PauseGuard()
    assert not any(fresh.is_pause(90.0, s) for s in (1.0, 1.0, 1.3, 1.3, 1.3))


def test_megatron_restart_gap_is_a_pause() -> None:
    p = MegatronParser()
    line = " iteration {:8d}/  500000 | consumed samples: 1 | elapsed time per iteration (ms): {} | lr: 1.0E-05 |"
    assert p.feed(line.format(10, 1250.0)) == StepLine(step=10, step_seconds=1.25)
    assert p.feed(line.format(20, 1240.0)) == StepLine(step=20, step_seconds=1.24)
    # A fork without interval-timer stops around a checkpoint: 10 iterations averaged 61.2 s.
    assert p.feed(line.format(30, 61200.0)) == StepLine(step=30, pause_seconds=612.0)


def test_the_collector_never_sees_a_pause_as_a_step(tmp_path: Path) -> None:
    log = tmp_path / "run1.log"
    log.write_text("")
    c = TrainingCollector(TrainingConfig.model_validate({"log_files": [{"path": str(log), "format": "deepspeed"}]}))
    with log.open("a") as f:
        for step, at in [(10, 0.0), (20, 25.0), (30, 50.0), (40, 3650.0), (50, 3675.0)]:
            f.write(ds_step(step, at) + "\n")
    # The lines are read at the first cycle; the next cycle summarises the window they fell in.
    c.collect(1_700_000_000.0)
    (summary,) = c.collect(1_700_000_000.0 + c.config.window_seconds).report["ranks"]
    assert summary.last_step == 50
    assert summary.step_seconds_p90 == pytest.approx(2.5)
