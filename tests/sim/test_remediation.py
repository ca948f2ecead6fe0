"""The simulator as the actuator (scenario ``remediation``) and the time to return to service.

Tiny fleets (4 nodes of 2 GPUs, no job) and short runs: each test simulates at most 90 s."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sim.conftest import next_report
from vigil.sim.run import SimDecision, SimResult, run_scenario
from vigil.sim.scenario import ScenarioError, parse_scenario
from vigil.sim.score import out_of_service, return_to_service, score, summary

FAULT_AT = 10.0
REBOOT_SECONDS = 30.0
PERSISTENCE_SECONDS = 20.0  # the recovery detector's clean window, shortened for a quick test


def tiny(**over: Any) -> dict[str, Any]:
    """node-0001's GPU 1 falls off the bus at 10 s (Xid 79: reboot_node); recovery on."""
    data: dict[str, Any] = {
        "name": "tiny-remediation",
        "seed": 5,
        "duration_seconds": 90,
        "report_interval_seconds": 5,
        "fleet": {"nodes": 4, "gpus_per_node": 2, "hcas_per_node": 1},
        "faults": [{"kind": "gpu_lost", "node": "node-0001", "gpu": 1, "at_seconds": FAULT_AT}],
        "remediation": {"reboot_seconds": REBOOT_SECONDS, "clears": True},
        "aggregator": {"detectors": {"recovery": {"enabled": True,
                                                  "persistence_seconds": PERSISTENCE_SECONDS}}},
        "gate": {"min_removed_seconds": 30},
    }
    data.update(over)
    return {k: v for k, v in data.items() if v is not None}


def admitted(result: SimResult, action: str, node: str = "node-0001") -> list[SimDecision]:
    return [d for d in result.decisions if d.admitted and d.action == action and d.node == node]


def test_an_admitted_reboot_reboots_the_node_and_the_fix_returns_it_to_service() -> None:
    sc = parse_scenario(tiny())
    result = run_scenario(sc)
    reboot = admitted(result, "reboot_node")
    # The Xid is read at node-0001's next report; the urgent report is judged at once.
    read = next_report(sc, "node-0001", FAULT_AT)
    assert reboot and reboot[0].t == read
    assert [(r.node, r.t, r.back_seconds, r.clears) for r in result.remediations] == [
        ("node-0001", read, round(read + REBOOT_SECONDS, 3), True)]
    assert result.remediations[0].decision_id == reboot[0].id
    # Silent while it reboots: no report from it (4 nodes, 3 reporting) for the whole down time.
    down = [n for t, n in zip(result.fleet_t, result.fleet_silent, strict=True)
            if read < t < read + REBOOT_SECONDS]
    assert down and set(down) == {1}
    resume = admitted(result, "resume")
    assert len(resume) == 1
    # Back 30 s after the reboot, clean for 20 s: resumed no sooner than that.
    assert resume[0].t >= read + REBOOT_SECONDS + PERSISTENCE_SECONDS
    assert not admitted(result, "inspect_hardware")

    rts = summary(result, score(result))["return_to_service"]
    [spell] = rts["spells"]
    assert spell == {"node": "node-0001", "action": "reboot_node", "fault_at_seconds": FAULT_AT,
                     "removed_at_seconds": read, "resumed_at_seconds": resume[0].t, "returned": True,
                     "seconds": resume[0].t - FAULT_AT, "final_state": "resumed"}
    assert rts["by_action"] == {"reboot_node": {
        "removed": 1, "returned": 1, "not_returned": {"inspect_hardware": 0, "still_out": 0},
        "seconds": {"p50": resume[0].t - FAULT_AT, "max": resume[0].t - FAULT_AT}}}
    assert rts["remediations"][0]["node"] == "node-0001"


def test_a_reboot_that_does_not_fix_it_never_returns_the_node() -> None:
    result = run_scenario(parse_scenario(tiny(remediation={"reboot_seconds": REBOOT_SECONDS, "clears": False})))
    assert [r.clears for r in result.remediations] == [False]
    assert not admitted(result, "resume")
    inspect = admitted(result, "inspect_hardware")
    assert inspect and inspect[0].t >= FAULT_AT + REBOOT_SECONDS
    rts = return_to_service(result)
    assert [(s["returned"], s["seconds"], s["final_state"]) for s in rts["spells"]] == [
        (False, None, "inspect_hardware")]
    assert rts["by_action"]["reboot_node"]["returned"] == 0
    assert rts["by_action"]["reboot_node"]["seconds"] == {"p50": None, "max": None}


def test_per_node_clears_fixes_only_the_named_nodes() -> None:
    # clears names another node: node-0001's reboot does not fix it.
    result = run_scenario(parse_scenario(tiny(remediation={"reboot_seconds": REBOOT_SECONDS,
                                                           "clears": ["node-0002"]})))
    assert [r.clears for r in result.remediations] == [False]
    assert not admitted(result, "resume")


def test_without_the_setting_a_reboot_decision_reboots_nothing() -> None:
    result = run_scenario(parse_scenario(tiny(remediation=None, duration_seconds=60)))
    assert admitted(result, "reboot_node")
    assert result.remediations == []
    assert set(result.fleet_silent) == {0}  # the node never went down
    assert not admitted(result, "resume")  # no new boot: nothing to verify
    [spell] = out_of_service(result)
    assert (spell.returned, spell.final_state, spell.seconds) == (False, "still_out", None)


def test_a_refused_reboot_reboots_nothing() -> None:
    # An opted-out node: the gate refuses its reboot_node; the simulator must not carry it out.
    result = run_scenario(parse_scenario(tiny(gate={"opt_out_nodes": ["node-0001"]}, duration_seconds=60)))
    refused = [d for d in result.decisions if d.action == "reboot_node" and d.node == "node-0001"]
    assert refused and not any(d.admitted for d in refused)
    assert result.remediations == []
    assert set(result.fleet_silent) == {0}
    assert return_to_service(result) == {"by_action": {}, "spells": [], "remediations": []}


def _decision(t: float, action: str, node: str = "node-0001", admitted: bool = True) -> SimDecision:
    return SimDecision(t=t, ts=t, id="", node=node, action=action, detector="test", reason="", admitted=admitted,
                       verdict="admitted" if admitted else "refused")


def test_return_time_counts_from_the_latest_fault_before_each_removal() -> None:
    sc = parse_scenario(tiny(remediation=None, faults=[
        {"kind": "gpu_lost", "node": "node-0001", "gpu": 1, "at_seconds": 10},
        {"kind": "xid", "node": "node-0001", "gpu": 0, "code": 79, "at_seconds": 70},
        {"kind": "reboot", "node": "node-0002", "at_seconds": 5},  # a reboot is no fault to return from
    ]))
    decisions = [
        _decision(12, "drain"), _decision(15, "reboot_node"),  # one spell: the drain took it out
        _decision(20, "resume", admitted=False),  # refused: still out
        _decision(50, "resume"),
        _decision(72, "reboot_node"), _decision(80, "inspect_hardware"),
        _decision(30, "drain", node="node-0002"),  # no fault of its own: timed from the removal
        _decision(45, "resume", node="node-0002"),
        _decision(40, "resume", node="node-0003"),  # never removed: no spell
    ]
    result = SimResult(scenario=sc, seed=0, decisions=sorted(decisions, key=lambda d: d.t), simulated_seconds=90,
                       wall_seconds=0, reports=0, heartbeats=0, heartbeats_rejected={}, breaker_tripped=False,
                       collectors=[], jobs=[])
    got = [(s.node, s.action, s.fault_t, s.removed_t, s.resumed_t, s.seconds, s.final_state)
           for s in out_of_service(result)]
    assert got == [
        ("node-0001", "drain", 10, 12, 50, 40, "resumed"),
        ("node-0002", "drain", None, 30, 45, 15, "resumed"),
        ("node-0001", "reboot_node", 70, 72, None, None, "inspect_hardware"),
    ]
    by = return_to_service(result)["by_action"]
    assert by["drain"] == {"removed": 2, "returned": 2, "not_returned": {"inspect_hardware": 0, "still_out": 0},
                           "seconds": {"p50": 27.5, "max": 40}}
    assert by["reboot_node"]["not_returned"] == {"inspect_hardware": 1, "still_out": 0}


@pytest.mark.parametrize(("remediation", "where"), [
    ({"reboot_second": 30}, "remediation.reboot_second"),
    ({"reboot_seconds": 0}, "remediation.reboot_seconds"),
    ({"clears": "node-0099"}, "remediation.clears"),
])
def test_a_bad_remediation_setting_is_refused_by_name(remediation: dict[str, Any], where: str) -> None:
    with pytest.raises(ScenarioError, match=where.replace(".", r"\.")):
        parse_scenario(tiny(remediation=remediation))
