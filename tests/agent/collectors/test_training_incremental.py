"""The training collector's window summaries reuse what was computed while the window's records
are unchanged: randomized against the same collector computing every summary from scratch."""

from __future__ import annotations

import json
import random

import pytest

from tests.agent.collectors.test_training import T0, FakeProcesses, make
from vigil.agent.attribution import IN_PROCESS
from vigil.agent.collectors.training import TrainingCollector, TrainingConfig, p50_p90, percentile


def _from_scratch(c: TrainingCollector) -> None:
    for r in c._ranks.values():  # the reference forgets every computed window and sample
        r.window = None
        r.sampled = None
        r.window_samples = None


@pytest.mark.parametrize("seed", range(6))
def test_reused_windows_equal_a_fresh_computation(seed: int) -> None:
    rng = random.Random(seed)
    # A small ring (16 records) so records are pushed out mid-window; 1-3 s windows against
    # cycles of 0.4-2.5 s, so one window is summarised several times and some cycles see none.
    config = {"window_seconds": rng.choice((1.0, 2.0, 3.0)), "max_steps_per_rank": 16, "hang_seconds": 30.0}
    procs = FakeProcesses(*range(100, 112))
    inc, ref = make(procs, **config), make(procs, **config)
    # The simulator's statistics path: the same collector building no /metrics samples.
    lean = TrainingCollector(TrainingConfig.model_validate(config), pid_alive=procs, samples=False)
    steps = dict.fromkeys(range(12), 0)
    now = T0
    reused = samples_reused = quantiles_reused = 0
    for _ in range(300):
        for _ in range(rng.randrange(0, 20)):
            rank = rng.randrange(12)
            now += rng.uniform(0.0, 0.3)
            if rng.random() < 0.03:
                now -= rng.uniform(0.5, 3.0)  # the wall clock steps back: a late record before the window's end
            if rng.random() < 0.05:
                steps[rank] = max(0, steps[rank] - rng.randrange(1, 5))  # a restart from a checkpoint
            elif rng.random() < 0.9:
                steps[rank] += rng.randrange(1, 3)
            body: dict[str, object] = {"job": f"j{rank % 3}", "rank": rank, "step": steps[rank],
                                       "step_seconds": rng.uniform(0.5, 2.0), "pid": 100 + rank}
            if rng.random() < 0.7:
                body.update(compute_seconds=rng.uniform(0, 1), comm_seconds=rng.uniform(0, 1))
            if rng.random() < 0.3:
                body["data_seconds"] = rng.uniform(0, 1)
            if rng.random() < 0.1:
                body["phase"] = rng.choice(("checkpointing", "evaluating", "training"))
            if rng.random() < 0.2:
                body["loss"] = rng.choice((rng.uniform(0, 5), "nan"))
            if rng.random() < 0.2:
                body["grad_norm"] = rng.choice((rng.uniform(0, 5), "inf"))
            payload = json.dumps(body).encode()
            assert inc.ingest(payload, now, IN_PROCESS) == ref.ingest(payload, now, IN_PROCESS) \
                == lean.ingest(payload, now, IN_PROCESS)
        now += rng.uniform(0.0, 2.5)
        before = {key: r.window for key, r in inc._ranks.items()}
        sampled = {key: (r.sampled, r.window_samples) for key, r in inc._ranks.items()}
        _from_scratch(ref)
        got, want = inc.collect(now), ref.collect(now)
        assert got.report == want.report
        assert got.samples == want.samples
        lean_got = lean.collect(now)
        assert lean_got.report == want.report and lean_got.events == want.events and lean_got.samples == []
        reused += sum(1 for key, r in inc._ranks.items() if r.window is not None and r.window is before.get(key))
        for key, r in inc._ranks.items():
            was = sampled.get(key, (None, None))
            samples_reused += r.sampled is not None and r.sampled is was[0]
            quantiles_reused += r.window_samples is not None and r.window_samples is was[1]
    assert reused > 30  # the reuse happened: this compared something
    assert samples_reused > 30 and quantiles_reused > 30


@pytest.mark.parametrize("seed", range(4))
def test_p50_p90_is_percentile_at_both(seed: int) -> None:
    """The window's quantiles in one call are percentile's floats, bit for bit (-0.0 included:
    percentile's arithmetic turns a lone -0.0 into 0.0)."""
    rng = random.Random(seed)
    cases = [[-0.0], [0.0], [1.5], [-0.0, -0.0], [2.0, 2.0, 2.0]]
    for _ in range(500):
        n = rng.choice((1, 1, 2, 3, 4, 5, 8, 17, 40))
        cases.append(sorted(rng.choice((0.0, -0.0, rng.uniform(0, 9), rng.lognormvariate(0, 3))) for _ in range(n)))
    for values in cases:
        got = p50_p90(values)
        want = (percentile(values, 0.5), percentile(values, 0.9))
        assert [v.hex() for v in got] == [v.hex() for v in want], values
