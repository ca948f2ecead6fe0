"""Scoring: expectations met in time, false drains, precision, recall, the breaker."""

from __future__ import annotations

from sim.run import SimDecision, SimResult
from sim.scenario import parse_scenario
from sim.score import score, summary

SCENARIO = parse_scenario({
    "name": "score-test",
    "duration_seconds": 600,
    "fleet": {"nodes": 40, "topology": {"nodes_per_leaf": 8}},
    "faults": [
        {"kind": "slow_node", "node": "node-0003", "at_seconds": 100},
        {"kind": "port_errors", "component": "leaf-002", "at_seconds": 200},
    ],
    "expect": [
        {"node": "node-0003", "action": "drain", "within_seconds": 30},
        {"component": "leaf-002", "action": ["inspect_hardware", "alert"], "within_seconds": 60},
    ],
})


def _d(t: float, node: str, action: str, *, admitted: bool = True, component: str | None = None) -> SimDecision:
    return SimDecision(t=t, node=node, action=action, detector="x", reason="r", admitted=admitted,
                       verdict="admitted" if admitted else "breaker_open", component=component)


def _result(decisions: list[SimDecision], *, tripped: bool = False, scenario=SCENARIO) -> SimResult:
    return SimResult(scenario=scenario, seed=0, decisions=decisions, simulated_seconds=600, wall_seconds=1.0,
                     reports=0, heartbeats=0, heartbeats_rejected={}, breaker_tripped=tripped, collectors=[],
                     jobs=[])


def test_all_met_in_time_passes_with_latencies() -> None:
    s = score(_result([_d(120, "node-0003", "drain"), _d(230, "leaf-002", "inspect_hardware", component="leaf-002")]))
    assert s.passed and s.recall == 1.0 and s.precision == 1.0
    assert s.latencies == [20.0, 30.0]
    out = summary(_result([]), s)
    assert out["detection_latency_seconds"] == {"p50": 25.0, "p95": 29.5, "max": 30.0}


def test_late_wrong_action_or_refused_decisions_do_not_count() -> None:
    s = score(_result([_d(140, "node-0003", "drain"),  # 40 s: too late
                       _d(210, "node-0017", "alert"),  # right subject (under leaf-002), kept
                       _d(205, "node-0018", "drain", admitted=False)]))
    met = [e.met for e in s.expectations]
    assert met == [False, True]
    assert s.expectations[0].latency_seconds == 40.0
    assert not s.passed and s.recall == 0.5


def test_a_drain_nobody_asked_for_is_a_false_drain() -> None:
    s = score(_result([_d(120, "node-0003", "drain"), _d(230, "leaf-002", "alert", component="leaf-002"),
                       _d(300, "node-0030", "drain"), _d(50, "node-0003", "drain")]))
    assert [(d.node, d.t) for d in s.false_drains] == [("node-0030", 300), ("node-0003", 50)]
    assert not s.passed
    assert s.precision == 1 / 3  # node-0003 at 120 answered; two drains did not


def test_escalation_on_the_faulty_node_is_not_a_false_drain() -> None:
    s = score(_result([_d(120, "node-0003", "drain"), _d(400, "node-0003", "reboot_node"),
                       _d(230, "leaf-002", "alert", component="leaf-002")]))
    assert s.passed and not s.false_drains


def test_breaker_expectation() -> None:
    sc = SCENARIO.model_copy(update={"expect": [], "expect_breaker": "tripped"})
    assert not score(_result([], scenario=sc)).passed
    assert score(_result([], tripped=True, scenario=sc)).passed
    healthy = SCENARIO.model_copy(update={"expect": [], "faults": []})
    s = score(_result([], scenario=healthy))
    assert s.passed and s.precision is None and s.recall is None


def test_removing_a_node_with_its_own_fault_is_not_false_but_one_under_a_faulty_switch_is() -> None:
    sc = SCENARIO.model_copy(update={"expect": []})
    s = score(_result([_d(150, "node-0003", "drain"),  # slow node, after its fault
                       _d(250, "node-0017", "drain")],  # under leaf-002, whose switch is at fault
                      scenario=sc))
    assert [d.node for d in s.false_drains] == ["node-0017"]
