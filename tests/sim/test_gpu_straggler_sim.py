"""One slow GPU end to end (real agents' collectors, engine, gate on the simulated clock): found by
the GPU straggler detector and by nothing else, and its lookalike, a whole-job slowdown of the same
job, removes nobody."""

from __future__ import annotations

from tests.sim.conftest import raw
from vigil.sim.run import run_scenario
from vigil.sim.scenario import parse_scenario
from vigil.sim.score import score, summary


def test_one_slow_gpu_of_a_ci_sized_slow_gpu_1024_is_drained_in_time() -> None:
    # slow-gpu-1024's job model, fault and deadline on 64 nodes (512 ranks).
    data = raw("slow-gpu-1024")
    data["fleet"]["nodes"] = 64
    data["duration_seconds"] = 160  # the fault at 120 s and its 30 s deadline
    data["faults"][0]["node"] = data["expect"][0]["node"] = "node-0037"
    result = run_scenario(parse_scenario(data))
    s = score(result)
    assert s.passed, {k: summary(result, s)[k] for k in ("expectations", "false_drain_decisions", "removals")}
    assert s.latencies[0] <= 30
    removal = next(d for d in result.decisions if d.action == "drain")
    assert (removal.detector, removal.node, removal.gpu) == ("gpu_straggler", "node-0037", 5)


def test_without_the_gpu_straggler_the_slow_gpu_is_invisible() -> None:
    # The finding, kept as a test: the node statistic alone never moves for one GPU of eight.
    data = raw("slow-gpu-32")
    data["aggregator"] = {"detectors": {"gpu_straggler": {"enabled": False}}}
    s = score(run_scenario(parse_scenario(data)))
    assert not s.passed and s.recall == 0.0 and s.expectations[0].decision is None


def test_the_same_job_slowing_down_as_a_whole_removes_nobody() -> None:
    data = raw("slow-gpu-32")
    data["faults"] = [{"kind": "slow_node", "nodes": "all", "at_seconds": 60, "factor": 1.25}]
    data["expect"] = []
    data["max_removals"] = 0
    data["forbid"] = [{"reason": "a job-wide slowdown is no GPU's fault"}]
    result = run_scenario(parse_scenario(data))
    s = score(result)
    assert s.passed and not result.decisions, [(d.detector, d.node, d.action) for d in result.decisions]
