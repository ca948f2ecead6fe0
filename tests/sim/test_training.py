"""The job model: synchronous step times, the slow rank's phase signature, stalls and hangs."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from vigil.sim.scenario import DataStall, Hang, Job, SlowNode
from vigil.sim.training import JobModel

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


def _compute_by_rank(batch) -> np.ndarray:
    return batch.compute_seconds.mean(axis=0)


def test_one_rank_or_one_gpu_slow_not_the_whole_node() -> None:
    one_rank = SlowNode(kind="slow_node", node="n05", ranks=[2], at_seconds=0, factor=1.3)
    c = _compute_by_rank(_model([one_rank]).advance(1120.0))
    assert int(np.argmax(c)) == 5 * 4 + 2
    assert np.sort(c)[-2] / np.median(c) < 1.05  # the node's other ranks are not slow
    # gpus: with 2 GPUs per node and 4 ranks, GPU 1 drives local ranks 1 and 3
    m = JobModel(_job(), NODES, [SlowNode(kind="slow_node", node="n05", gpus=[1], at_seconds=0, factor=1.3)],
                 {0: ["n05"]}, seed=1, start=1000.0, gpus_per_node=2)
    c = _compute_by_rank(m.advance(1120.0))
    assert set(np.argsort(c)[-2:]) == {21, 23}


def test_intermittent_straggler_is_slow_only_in_its_bursts() -> None:
    burst = SlowNode(kind="slow_node", node="n05", at_seconds=0, factor=1.5, period_seconds=120, slow_seconds=20)
    assert burst.active(5) and not burst.active(30) and burst.active(125) and not burst.active(239)
    batch = _model([burst]).advance(1000.0 + 240)
    begun = batch.end_ts - batch.step_seconds[:, 0] - 1000.0
    in_burst = (begun % 120) < 20
    ratio = batch.compute_seconds[:, 20] / np.median(batch.compute_seconds, axis=1)
    assert ratio[in_burst].mean() > 1.4 and ratio[~in_burst].mean() < 1.05


def test_partial_data_stall_slows_only_the_target_nodes_data() -> None:
    stall = DataStall(kind="data_stall", job="train", nodes=["n02", "n03"], at_seconds=0, extra_seconds=1.0)
    m = JobModel(_job(), NODES, [stall], {0: ["n02", "n03"]}, seed=1, start=1000.0)
    d = m.advance(1100.0).data_seconds.mean(axis=0)
    assert d[8:16].min() > 1.0 > d[:8].max()


def test_checkpoint_pause_stops_every_rank_and_the_job_ends() -> None:
    job = _job(pauses=[{"kind": "checkpoint", "every_seconds": 100, "seconds": 30, "first_at_seconds": 50}],
               end_seconds=250)
    m = JobModel(job, NODES, [], {}, seed=1, start=1000.0)
    batch = m.advance(1000.0 + 400)
    begun = batch.end_ts - batch.step_seconds[:, 0] - 1000.0
    # no step begins inside a pause (50-80 s, 150-180 s), none after the end
    assert not (((begun - 50) % 100 < 30) & (begun >= 50)).any()
    assert batch.end_ts.max() <= 1000.0 + 250 + 3 and m.finished
    assert len(m.advance(1000.0 + 600).step) == 0


def test_hang_of_one_gpu_stops_only_its_rank() -> None:
    hang = Hang(kind="hang", job="train", node="n03", gpus=[0], at_seconds=30, others_continue_seconds=1000)
    m = JobModel(_job(), NODES, [hang], {0: ["n03"]}, seed=1, start=1000.0, gpus_per_node=4)
    batch = m.advance(1000.0 + 120)
    late = batch.end_ts > 1031.0
    assert not batch.alive[late][:, 12].any() and batch.alive[late][:, 13:16].all()


def test_hardware_faults_reach_the_job() -> None:
    from vigil.sim.run import job_impact
    from vigil.sim.scenario import NvmlFault, PortDown

    throttle = NvmlFault.model_validate({"kind": "thermal_throttle", "node": "n01", "gpu": 2, "at_seconds": 10,
                                         "duration_seconds": 60, "clock_ratio": 0.5})
    slow = job_impact(throttle, "train")
    assert isinstance(slow, SlowNode) and slow.gpus == [2] and slow.factor == 2.0 and slow.until_seconds == 70
    lost = job_impact(NvmlFault.model_validate({"kind": "gpu_lost", "node": "n01", "gpu": 5, "at_seconds": 10}),
                      "train")
    assert isinstance(lost, Hang) and lost.gpus == [5] and lost.others_continue_seconds == 0
    down = job_impact(PortDown(kind="port_down", node="n01", at_seconds=10, duration_seconds=30), "train")
    assert isinstance(down, Hang) and down.gpus is None and down.until_seconds == 40
    m = JobModel(_job(), NODES, [down], {0: ["n01"]}, seed=1, start=1000.0)
    batch = m.advance(1000.0 + 120)
    assert not ((batch.end_ts > 1012.5) & (batch.end_ts < 1040.0)).any()  # blocked while the port is down
    assert batch.end_ts.max() > 1100.0  # and steps again once it is back


def test_nodes_of_a_slower_profile_compute_longer_by_their_factor() -> None:
    # Mixed hardware: the job's H100 nodes compute 12% longer than its H200 nodes, every step,
    # and everyone waits for them; a profile the job does not name computes at 1.
    profiles = ["h200-sxm-141gb"] * 12 + ["h100-sxm-80gb"] * 4
    job = _job(profile_compute_factor={"h100-sxm-80gb": 1.12})
    batch = JobModel(job, NODES, [], {}, seed=2, start=1000.0, profiles=profiles).advance(1000.0 + 120)
    compute = batch.compute_seconds.mean(axis=0)
    h100 = np.arange(12 * 4, 16 * 4)
    assert 1.10 < compute[h100].mean() / compute[: 12 * 4].mean() < 1.14
    assert set(np.argsort(batch.comm_seconds.mean(axis=0))[:16]) == set(h100)
    plain = JobModel(_job(), NODES, [], {}, seed=2, start=1000.0, profiles=profiles).advance(1000.0 + 120)
    assert 0.98 < plain.compute_seconds.mean(axis=0)[h100].mean() / plain.compute_seconds.mean() < 1.02


def test_a_compute_factor_must_name_a_known_profile() -> None:
    with pytest.raises(ValidationError, match="not one of"):
        _job(profile_compute_factor={"b200": 0.5})
