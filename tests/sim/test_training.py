"""The job model: synchronous step times, the slow rank's phase signature, stalls and hangs."""

from __future__ import annotations

import numpy as np

from sim.scenario import DataStall, Hang, Job, SlowNode
from sim.training import JobModel

NODES = [f"n{i:02d}" for i in range(16)]


def _job(**kw: object) -> Job:
    return Job.model_validate({"name": "train", "step_seconds": 2.0, "ranks_per_node": 4, **kw})


def _model(faults: list, seed: int = 1, **kw: object) -> JobModel:
    nodes = {i: ([f.node] if getattr(f, "node", None) else NODES) for i, f in enumerate(faults)}
    return JobModel(_job(**kw), NODES, faults, nodes, seed=seed, start=1000.0)


def test_every_rank_steps_as_long_as_the_slowest_and_slow_node_has_longest_compute_shortest_wait() -> None:
    slow = SlowNode(kind="slow_node", node="n05", at_seconds=0, factor=1.1)
    batch = _model([slow]).advance(1000.0 + 120)
    assert len(batch.step) > 40
    # synchronous: one step time per step, shared by every rank
    assert np.allclose(batch.step_seconds, batch.step_seconds[:, :1])
    compute = batch.compute_seconds.mean(axis=0)
    comm = batch.comm_seconds.mean(axis=0)
    slow_ranks = range(5 * 4, 6 * 4)
    assert set(np.argsort(compute)[-4:]) == set(slow_ranks)
    assert set(np.argsort(comm)[:4]) == set(slow_ranks)
    assert 1.07 < compute[20] / np.median(compute) < 1.13
    # phases add up to the step for every rank
    total = batch.compute_seconds + batch.comm_seconds + batch.data_seconds
    assert np.allclose(total, batch.step_seconds)


def test_same_seed_same_steps_other_seed_other_noise() -> None:
    a = _model([], seed=3).advance(1100.0)
    b = _model([], seed=3).advance(1100.0)
    c = _model([], seed=4).advance(1100.0)
    assert np.array_equal(a.compute_seconds, b.compute_seconds)
    assert not np.array_equal(a.compute_seconds[:1], c.compute_seconds[:1])


def test_windows_do_not_change_the_steps() -> None:
    whole = _model([]).advance(1100.0)
    m = _model([])
    parts = [m.advance(1000.0 + t) for t in (7.5, 33.0, 61.0, 100.0)]
    assert np.array_equal(np.concatenate([p.step for p in parts]), whole.step)
    assert np.allclose(np.vstack([p.compute_seconds for p in parts]), whole.compute_seconds)


def test_data_stall_slows_every_rank_through_data_not_compute() -> None:
    stall = DataStall(kind="data_stall", job="train", at_seconds=60, extra_seconds=1.0)
    m = _model([stall])
    before = m.advance(1060.0)
    after = m.advance(1180.0)
    assert after.step_seconds.mean() > before.step_seconds.mean() + 0.8
    assert abs(after.compute_seconds.mean() - before.compute_seconds.mean()) < 0.05
    # the step in flight at the stall began before it; every later one waits on data
    assert after.data_seconds[1:].min() > before.data_seconds.max()


def test_hang_stops_its_ranks_then_the_job() -> None:
    hang = Hang(kind="hang", job="train", node="n03", at_seconds=30, others_continue_seconds=40)
    m = _model([hang])
    batch = m.advance(1000.0 + 300)
    assert batch.end_ts.max() <= 1070.0
    assert batch.end_ts.max() > 1060.0  # the others went on after the hang
    late = batch.end_ts > 1031.0
    assert not batch.alive[late][:, 12:16].any() and batch.alive[late][:, :12].all()
    assert len(m.advance(1000.0 + 600).step) == 0


def test_a_restarted_job_steps_again() -> None:
    hang = Hang(kind="hang", job="train", nodes=NODES, at_seconds=30, others_continue_seconds=0,
                until_seconds=200)
    m = _model([hang])
    stuck = m.advance(1000.0 + 190)
    assert stuck.end_ts.max() <= 1030.0
    again = m.advance(1000.0 + 300)
    assert again.end_ts.min() > 1200.0 and len(again.step) > 40 and again.alive.all()
