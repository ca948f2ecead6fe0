"""The training collector's window summary (``_window_fields``, the loop that runs for every rank
every cycle) against the plain computation it replaced, over randomized histories: steps and
restarts, phase announcements, missing phases, application signals (finite and not), records
after the window's end and a clock that steps back; windows of one and of two records (their own
shortcuts), and the summary copied from the rank's template against ``RankSummary``'s own constructor."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest

from vigil.agent.collectors.training import (
    TrainingCollector,
    TrainingConfig,
    _Checkpoint,
    _Rank,
    _Record,
    p50_p90,
    percentile,
)
from vigil.contract.wire import RankSummary, encode

_QUANTILE_KEYS = tuple((f"{name}_seconds_p50", f"{name}_seconds_p90") for name in ("step", "compute", "comm", "data"))


def _reference(r: _Rank, end: float) -> dict[str, Any]:
    """The window's fields the long way: one loop gathering everything, as first written."""
    steps = 0
    prev = r.baseline_step
    first_step: int | None = None
    step_v: list[float] = []
    compute_v: list[float] = []
    comm_v: list[float] = []
    data_v: list[float] = []
    losses: list[float] = []
    norms: list[float] = []
    nonfinite = nonfinite_loss = 0
    nonfinite_first: int | None = None
    for rec in r.history:
        if rec.ts >= end:
            break
        step = rec.step
        if prev is None:
            steps += 1
        elif step > prev:
            steps += step - prev
        prev = step
        if first_step is None or step < first_step:
            first_step = step
        if rec.loss is not None or rec.grad_norm is not None:
            loss, norm = rec.loss, rec.grad_norm
            if isinstance(loss, str) or isinstance(norm, str):
                nonfinite += 1
                nonfinite_loss += isinstance(loss, str)
                if nonfinite_first is None:
                    nonfinite_first = step
            if isinstance(loss, float):
                losses.append(loss)
            if isinstance(norm, float):
                norms.append(norm)
        if rec.step_seconds is not None and rec.phase is None:
            step_v.append(rec.step_seconds)
        if rec.compute_seconds is not None:
            compute_v.append(rec.compute_seconds)
        if rec.comm_seconds is not None:
            comm_v.append(rec.comm_seconds)
        if rec.data_seconds is not None:
            data_v.append(rec.data_seconds)
    fields: dict[str, Any] = {"steps": steps, "first_step": first_step}
    for (k50, k90), values in zip(_QUANTILE_KEYS, (step_v, compute_v, comm_v, data_v), strict=True):
        if values:
            values.sort()
            fields[k50], fields[k90] = percentile(values, 0.5), percentile(values, 0.9)
    if losses or norms or nonfinite:
        loss_last = losses[-1] if losses else None
        losses.sort()
        fields.update(loss_p50=percentile(losses, 0.5) if losses else None, loss_last=loss_last,
                      grad_norm_p50=percentile(sorted(norms), 0.5) if norms else None,
                      grad_norm_max=max(norms) if norms else None, nonfinite_steps=nonfinite,
                      nonfinite_first_step=nonfinite_first, nonfinite_loss_steps=nonfinite_loss)
    return fields


def _value(rng: random.Random) -> float | None:
    return rng.choice((None, 0.0, -0.0, rng.uniform(0, 3), rng.lognormvariate(0, 1)))


def _signal(rng: random.Random) -> float | str | None:
    return rng.choice((None, None, None, rng.uniform(-2, 5), "nan", "inf", "-inf"))


@pytest.mark.parametrize("seed", range(8))
def test_window_fields_equal_the_long_way(seed: int) -> None:
    rng = random.Random(seed)
    compared = with_signals = one_record = two_records = 0
    for _ in range(400):
        ts, step = 1000.0, rng.randrange(0, 50)
        history: deque[_Record] = deque()
        signals = rng.random() < 0.3
        for _ in range(rng.randrange(1, 12)):
            ts += rng.uniform(-0.5, 2.0)  # a clock that steps back now and then
            step = max(0, step - rng.randrange(1, 6)) if rng.random() < 0.1 else step + rng.randrange(0, 3)
            history.append(_Record(
                ts, step, _value(rng), _value(rng), _value(rng), _value(rng),
                phase=rng.choice((None, None, None, "checkpointing", "evaluating")),
                loss=_signal(rng) if signals else None, grad_norm=_signal(rng) if signals else None))
        first = history[0]
        r = _Rank(job="j", rank=0, gpu=0, pid=1, last=history[-1], trust="in_process", owner_pid=None,
                  last_progress_ts=ts, last_seen_ts=ts, history=history,
                  baseline_step=rng.choice((None, first.step, max(0, first.step - 2), first.step + 3)))
        ends = [first.ts, rng.uniform(first.ts, ts + 1.0), ts + 5.0]
        if len(history) > 1:
            ends[0] = rng.uniform(first.ts, history[1].ts) if history[1].ts > first.ts else first.ts + 1e-6
        for end in ends:
            r.window = None
            got = TrainingCollector._window_fields(r, end)
            want = _reference(r, end)
            assert got.keys() == want.keys()
            assert got == want  # bit for bit: the quantiles are the same arithmetic
            assert [repr(got[k]) for k in want] == [repr(want[k]) for k in want]  # -0.0 stays apart from 0.0
            compared += 1
            with_signals += "nonfinite_steps" in want
            in_window = sum(1 for rec in history if rec.ts < end)
            one_record += in_window == 1
            two_records += in_window == 2 and "nonfinite_steps" not in want
    assert compared == 1200 and with_signals > 50 and one_record > 200 and two_records > 50


@pytest.mark.parametrize("seed", range(4))
def test_summary_from_the_template_is_the_constructors(seed: int) -> None:
    rng = random.Random(seed)
    collector = TrainingCollector(TrainingConfig(window_seconds=rng.choice((2.5, 5.0))), samples=False)
    for _ in range(300):
        ts, step = 1000.0, rng.randrange(0, 50)
        history: deque[_Record] = deque()
        signals = rng.random() < 0.3
        for _ in range(rng.randrange(1, 6)):
            ts += rng.uniform(0.0, 2.0)
            step += rng.randrange(0, 3)
            history.append(_Record(ts, step, _value(rng), _value(rng), _value(rng), _value(rng),
                                   phase=rng.choice((None, None, "checkpointing", "evaluating")),
                                   loss=_signal(rng) if signals else None,
                                   grad_norm=_signal(rng) if signals else None))
        r = _Rank(job=rng.choice(("j", "123")), rank=rng.randrange(64), gpu=rng.choice((None, 0, 7)),
                  pid=rng.choice((None, 4242)), last=history[-1], trust="in_process", owner_pid=None,
                  last_progress_ts=ts - rng.uniform(0, 9), last_seen_ts=ts, history=history,
                  baseline_step=rng.choice((None, max(0, history[0].step - 1))),
                  state=rng.choice(("running", "hung", "exited")),
                  checkpoint=_Checkpoint(step, ts, 3.5) if rng.random() < 0.3 else None)
        for end in (rng.uniform(history[0].ts, ts + 1.0), ts + 5.0):  # a second cycle: the template reused
            fields = _reference(r, end)
            if r.checkpoint is not None:
                fields.update(checkpoint_step=r.checkpoint.step, checkpoint_ts=r.checkpoint.ts,
                              checkpoint_seconds=r.checkpoint.seconds)
            want = RankSummary(job=r.job, rank=r.rank, gpu=r.gpu, pid=r.pid, state=r.state,
                               window_seconds=collector.config.window_seconds, window_end_ts=end,
                               last_step=r.last.step, last_progress_ts=r.last_progress_ts,
                               phase=r.last.phase, **fields)  # type: ignore[arg-type]
            got = collector._summary(r, end)
            assert got == want
            assert encode(got) == encode(want)


def test_p50_p90_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="no values"):
        p50_p90([])
