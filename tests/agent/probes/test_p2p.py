"""gpu_p2p over the fake engine (torch on the CPU): every ordered pair measured, one result per
source GPU with its slowest pair; a GPU whose copies slow only under load shows in every pair it
is in; one GPU is skipped."""

from __future__ import annotations

import pytest

from tests.agent.probes.conftest import TickClock

pytest.importorskip("torch")

from vigil.agent.probes import p2p
from vigil.agent.probes.engine_fake import FakeLoadEngine
from vigil.agent.probes.engine_torch import TorchEngine


def test_every_ordered_pair_is_measured_and_the_slow_gpu_is_in_every_slow_pair(node, make_ctx):
    fake, backend = node({"gpus": 3, "faults": [
        {"at_seconds": 0, "gpu": 1, "kind": "under_load", "memory_factor": 0.01}]})
    engine = FakeLoadEngine(TorchEngine(use_cuda=False, clock=TickClock(0.01), matmul_n=8), fake)
    results = {r.gpu: r for r in p2p.run(make_ctx(engine, backend, [0, 1, 2]))}
    assert sorted(results[0].metrics) == ["p2p_0_1", "p2p_0_2"]
    assert sorted(k for r in results.values() for k in r.metrics) == [
        "p2p_0_1", "p2p_0_2", "p2p_1_0", "p2p_1_2", "p2p_2_0", "p2p_2_1"]
    assert all(r.status == "pass" and r.unit == "gb_per_s" for r in results.values())
    # A pair with GPU 1 moves at 1% of the others' rate (copies counted on the ticking clock).
    assert results[0].value == results[0].metrics["p2p_0_1"] == pytest.approx(results[0].metrics["p2p_0_2"] * 0.01)
    assert results[2].value == results[2].metrics["p2p_2_1"]


def test_a_single_gpu_is_skipped(make_ctx):
    engine = TorchEngine(use_cuda=False, clock=TickClock(0.01), matmul_n=8)
    [r] = p2p.run(make_ctx(engine, None, [0]))
    assert r.status == "skipped" and r.reason == "single_gpu"


def test_the_deadline_stops_the_pairs(make_ctx):
    engine = TorchEngine(use_cuda=False, clock=TickClock(0.01), matmul_n=8)
    results = p2p.run(make_ctx(engine, None, [0, 1], deadline=-1.0))
    assert [(r.status, r.reason) for r in results] == [("error", "timeout"), ("error", "timeout")]
