"""Scoring: expectations met in time, every removal judged on its own, forbid, the removal cap."""

from __future__ import annotations

from typing import Any

import pytest

from vigil.sim.run import SimDecision, SimResult
from vigil.sim.scenario import ScenarioError, parse_scenario
from vigil.sim.score import score, summary

BASE: dict[str, Any] = {
    "name": "score-test",
    "duration_seconds": 600,
    "fleet": {"nodes": 40, "topology": {"nodes_per_leaf": 8}},
    "jobs": [{"name": "train", "nodes": "node-0000..node-0015", "step_seconds": 2.0}],
}
SCENARIO = parse_scenario({
    **BASE,
    "faults": [
        {"kind": "slow_node", "node": "node-0003", "at_seconds": 100},
        {"kind": "port_errors", "component": "leaf-002", "at_seconds": 200},
    ],
    "expect": [
        {"node": "node-0003", "action": "drain", "within_seconds": 30},
        {"component": "leaf-002", "action": ["inspect_hardware", "alert"], "within_seconds": 60},
    ],
})


def _d(t: float, node: str, action: str, *, admitted: bool = True, component: str | None = None,
       gpu: int | None = None, job: str | None = None) -> SimDecision:
    return SimDecision(t=t, ts=t, id="", node=node, action=action, detector="x", reason="r", admitted=admitted,
                       verdict="admitted" if admitted else "breaker_open", component=component, gpu=gpu, job=job)


def _result(decisions: list[SimDecision], *, tripped: bool = False, scenario=SCENARIO) -> SimResult:
    return SimResult(scenario=scenario, seed=0, decisions=decisions, simulated_seconds=600, wall_seconds=1.0,
                     reports=0, heartbeats=0, heartbeats_rejected={}, breaker_tripped=tripped, collectors=[],
                     jobs=[])


def _leaf(t: float = 230) -> SimDecision:
    return _d(t, "leaf-002", "inspect_hardware", component="leaf-002")


def test_all_met_in_time_passes_with_latencies() -> None:
    s = score(_result([_d(120, "node-0003", "drain"), _leaf()]))
    assert s.passed and s.recall == 1.0 and s.precision == 1.0
    assert s.latencies == [20.0, 30.0]
    out = summary(_result([]), s)
    assert out["detection_latency_seconds"] == {"p50": 25.0, "p95": 29.5, "max": 30.0}
    assert out["removals"] == 2 and out["alerts"] == 0


def test_late_wrong_action_or_refused_decisions_do_not_count() -> None:
    s = score(_result([_d(140, "node-0003", "drain"),  # 40 s: too late
                       _d(210, "leaf-002", "alert", component="leaf-002"),
                       _d(205, "node-0018", "drain", admitted=False)]))  # refused: not a removal
    assert [e.met for e in s.expectations] == [False, True]
    assert s.expectations[0].latency_seconds == 40.0
    assert not s.passed and s.recall == 0.5
    assert not s.false_removals and len(s.alerts) == 1


def test_a_node_alert_does_not_answer_the_switch() -> None:
    # An alert on a node under the leaf is about that node, not an answer for the switch.
    s = score(_result([_d(120, "node-0003", "drain"), _d(210, "node-0017", "alert")]))
    assert [e.met for e in s.expectations] == [True, False]


def test_a_drain_nobody_asked_for_is_unjustified() -> None:
    s = score(_result([_d(120, "node-0003", "drain"), _leaf(),
                       _d(300, "node-0030", "drain"), _d(50, "node-0003", "drain")]))
    assert [(d.node, d.t) for d in s.false_removals] == [("node-0030", 300), ("node-0003", 50)]
    why = {r.decision.t: r.why for r in s.removals}
    assert "healthy" in why[300] and "before node-0003's fault" in why[50]
    assert not s.passed
    assert s.precision == 0.5


def test_one_node_too_many_fails_even_when_every_expectation_is_met() -> None:
    s = score(_result([_d(120, "node-0003", "drain"), _leaf(), _d(125, "node-0004", "drain")]))
    assert s.recall == 1.0 and not s.passed
    assert [d.node for d in s.false_removals] == ["node-0004"]


def test_the_wrong_action_class_on_the_right_node_is_unjustified() -> None:
    s = score(_result([_d(120, "node-0003", "drain"), _leaf(), _d(400, "node-0003", "reboot_node")]))
    assert not s.passed
    assert "wrong action class: reboot_node" in s.removals[-1].why


def test_an_escalation_the_expectation_names_is_justified() -> None:
    sc = SCENARIO.model_copy(update={"expect": [
        SCENARIO.expect[0].model_copy(update={"action": ["drain", "reboot_node"]}), SCENARIO.expect[1]]})
    s = score(_result([_d(120, "node-0003", "drain"), _d(400, "node-0003", "reboot_node"), _leaf()], scenario=sc))
    assert s.passed and s.removal_count == 3


def test_the_wrong_gpu_does_not_answer_a_gpu_expectation() -> None:
    sc = parse_scenario({**BASE, "faults": [{"kind": "ecc_uncorrectable", "node": "node-0005", "gpu": 3,
                                             "at_seconds": 60}],
                         "expect": [{"node": "node-0005", "gpu": 3, "action": "reset_gpu", "within_seconds": 30}]})
    assert score(_result([_d(70, "node-0005", "reset_gpu", gpu=3)], scenario=sc)).passed
    s = score(_result([_d(70, "node-0005", "reset_gpu", gpu=4)], scenario=sc))
    assert not s.passed and s.false_removals


def test_draining_the_nodes_of_a_bad_leaf_does_not_answer_the_leaf() -> None:
    # All eight nodes of leaf-002 drained: the old scorer called that "met"; it is eight false drains.
    drains = [_d(230, f"node-{i:04d}", "drain") for i in range(16, 24)]
    s = score(_result([_d(120, "node-0003", "drain"), *drains]))
    assert [e.met for e in s.expectations] == [True, False]
    assert len(s.false_removals) == 8
    assert all("no fault of its own" in r.why and "leaf-002" in r.why for r in s.removals[1:])


def test_the_wrong_node_under_a_bad_leaf_with_one_truly_bad_node() -> None:
    sc = parse_scenario({**BASE, "faults": [
        {"kind": "port_errors", "component": "leaf-002", "at_seconds": 200},
        {"kind": "port_down", "node": "node-0019", "at_seconds": 220}],
        "expect": [{"component": "leaf-002", "action": "inspect_hardware", "within_seconds": 60},
                   {"node": "node-0019", "action": "drain", "within_seconds": 60}],
        "forbid": [{"component": "leaf-002", "action": "drain", "reason": "the leaf's nodes are healthy"}]})
    right = [_leaf(), _d(230, "node-0019", "drain")]
    s = score(_result(right, scenario=sc))
    assert not s.passed and s.violations  # forbid wins over the node-0019 expectation
    sc = sc.model_copy(update={"forbid": []})
    assert score(_result(right, scenario=sc)).passed
    s = score(_result([_leaf(), _d(230, "node-0018", "drain")], scenario=sc))
    assert not s.passed and [d.node for d in s.false_removals] == ["node-0018"]
    assert s.expectations[1].met is False


def test_include_nodes_lets_a_component_answer_through_its_nodes() -> None:
    sc = parse_scenario({**BASE, "faults": [{"kind": "silence", "component": "leaf-002", "at_seconds": 200}],
                         "expect": [{"component": "leaf-002", "action": "drain", "within_seconds": 60,
                                     "include_nodes": True}]})
    s = score(_result([_d(230, "node-0017", "drain"), _d(231, "node-0018", "drain")], scenario=sc))
    assert s.passed
    s = score(_result([_d(230, "node-0030", "drain"), _d(231, "node-0018", "drain")], scenario=sc))
    assert not s.passed and [d.node for d in s.false_removals] == ["node-0030"]


def test_an_application_xid_on_every_gpu_of_a_job_may_drain_nothing() -> None:
    sc = parse_scenario({**BASE, "faults": [
        {"kind": "kernel_xid", "nodes": "node-0000..node-0015", "gpus": "all", "code": 13, "at_seconds": 60}],
        "forbid": [{"job": "train"}], "max_removals": 0})
    assert score(_result([_d(70, "node-0002", "alert")], scenario=sc)).passed
    s = score(_result([_d(70, "node-0002", "drain"), _d(70, "node-0002", "reset_gpu", gpu=1)], scenario=sc))
    assert not s.passed
    assert len(s.violations) == 2 and s.over_cap and s.removal_count == 2
    # without the forbid, still unjustified: nothing expects a removal for a job's own bug
    assert score(_result([_d(70, "node-0002", "drain")],
                         scenario=sc.model_copy(update={"forbid": [], "max_removals": None}))).false_removals


def test_job_restart_is_a_removal_class_of_its_own() -> None:
    sc = parse_scenario({**BASE, "faults": [{"kind": "hang", "job": "train", "at_seconds": 60,
                                             "others_continue_seconds": 0}],
                         "expect": [{"job": "train", "action": "restart_job", "within_seconds": 400}]})
    ok = score(_result([_d(400, "node-0000", "restart_job", job="train")], scenario=sc))
    assert ok.passed and ok.removal_count == 1
    s = score(_result([_d(400, "node-0000", "restart_job", job="train"), _d(400, "node-0000", "drain", job="train")],
                      scenario=sc))
    assert not s.passed and "no fault of its own" in s.removals[1].why
    with pytest.raises(ScenarioError, match="a job expectation takes only"):
        parse_scenario({**BASE, "expect": [{"job": "train", "action": "drain", "within_seconds": 9}]})


def test_allow_justifies_removals_on_faulty_nodes_after_their_fault_and_the_cap_bounds_them() -> None:
    sc = parse_scenario({**BASE, "faults": [
        {"kind": "ecc_uncorrectable", "nodes": "node-0010..node-0029", "gpu": 0, "at_seconds": 120}],
        "allow": [{"nodes": "node-0010..node-0029", "action": ["reset_gpu", "drain"]}],
        "max_removals": 2, "expect_breaker": "tripped"})
    two = [_d(125, "node-0010", "drain"), _d(125, "node-0011", "reset_gpu", gpu=0)]
    assert score(_result(two, tripped=True, scenario=sc)).passed
    s = score(_result([*two, _d(125, "node-0012", "drain")], tripped=True, scenario=sc))
    assert not s.false_removals and s.over_cap and not s.passed
    s = score(_result([_d(100, "node-0010", "drain"), _d(125, "node-0030", "drain")], tripped=True, scenario=sc))
    assert len(s.false_removals) == 2


def test_a_repeated_decision_is_one_removal() -> None:
    sc = SCENARIO.model_copy(update={"max_removals": 2})
    s = score(_result([_d(120, "node-0003", "drain"), _d(130, "node-0003", "drain"), _leaf()], scenario=sc))
    assert s.removal_count == 2 and s.passed


def test_forbid_without_subject_and_forbidden_alerts() -> None:
    sc = SCENARIO.model_copy(update={"forbid": [parse_scenario({**BASE, "forbid": [{"action": "alert"}]}).forbid[0]]})
    s = score(_result([_d(120, "node-0003", "drain"), _leaf(), _d(300, "node-0001", "alert")], scenario=sc))
    assert not s.passed and [v.decision.node for v in s.violations] == ["node-0001"]


def test_breaker_expectation() -> None:
    sc = SCENARIO.model_copy(update={"expect": [], "expect_breaker": "tripped"})
    assert not score(_result([], scenario=sc)).passed
    assert score(_result([], tripped=True, scenario=sc)).passed
    healthy = SCENARIO.model_copy(update={"expect": [], "faults": []})
    s = score(_result([], scenario=healthy))
    assert s.passed and s.precision is None and s.recall is None


def test_a_job_restart_may_be_allowed_once_one_of_its_nodes_has_a_fault() -> None:
    sc = parse_scenario({**BASE, "faults": [{"kind": "gpu_lost", "node": "node-0004", "gpu": 1, "at_seconds": 100}],
                         "expect": [{"node": "node-0004", "action": "drain", "within_seconds": 30}],
                         "allow": [{"job": "train", "action": "restart_job"}]})
    restart = _d(110, "node-0000", "restart_job", job="train")
    assert score(_result([_d(105, "node-0004", "drain"), restart], scenario=sc)).passed
    early = _d(90, "node-0000", "restart_job", job="train")
    assert not score(_result([_d(105, "node-0004", "drain"), early], scenario=sc)).passed
