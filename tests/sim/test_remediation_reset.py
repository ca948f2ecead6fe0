"""GPU resets carried out by the simulator (``remediation.reset_seconds``) through the real outbox
and the node's real NodeActionRunner, and their time to return to service.

Tiny fleets (4 nodes of 2 GPUs, no job) and short runs: each test simulates at most 150 s."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sim.conftest import next_report
from vigil.sim.run import SimDecision, SimResult, run_scenario
from vigil.sim.scenario import ScenarioError, parse_scenario
from vigil.sim.score import return_to_service

FAULT_AT = 10.0
RESET_SECONDS = 5.0
REBOOT_SECONDS = 30.0
PERSISTENCE_SECONDS = 20.0  # the recovery detector's clean window, shortened for a quick test


def tiny(remediation: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    """node-0001's GPU 1 needs a reset at 10 s (NVML reset required: reset_gpu); recovery on."""
    data: dict[str, Any] = {
        "name": "tiny-reset",
        "seed": 6,
        "duration_seconds": 90,
        "report_interval_seconds": 5,
        "fleet": {"nodes": 4, "gpus_per_node": 2, "hcas_per_node": 1},
        "faults": [{"kind": "reset_required", "node": "node-0001", "gpu": 1, "at_seconds": FAULT_AT}],
        "remediation": remediation if remediation is not None else {"reset_seconds": RESET_SECONDS},
        "aggregator": {"detectors": {"recovery": {"enabled": True,
                                                  "persistence_seconds": PERSISTENCE_SECONDS}}},
        "gate": {"min_removed_seconds": 20, "cooldown_seconds": 20},
    }
    data.update(over)
    return {k: v for k, v in data.items() if v is not None}


def admitted(result: SimResult, action: str, node: str = "node-0001") -> list[SimDecision]:
    return [d for d in result.decisions if d.admitted and d.action == action and d.node == node]


def test_an_admitted_reset_is_run_by_the_node_s_agent_and_the_fix_returns_it_to_service() -> None:
    sc = parse_scenario(tiny())
    result = run_scenario(sc)
    [reset] = admitted(result, "reset_gpu")
    assert reset.gpu == 1
    # Offered in the answer to the node's next report, run RESET_SECONDS later by its runner: a
    # `done` proves the request was signed under the node's key, for its boot and GPU uuid.
    [done] = result.remediations
    assert (done.action, done.node, done.gpu, done.decision_id, done.outcome, done.clears) == (
        "reset_gpu", "node-0001", 1, reset.id, "done (done)", True)
    assert done.back_seconds == round(next_report(sc, "node-0001", reset.t, strictly=True) + RESET_SECONDS, 3)
    assert set(result.fleet_silent) == {0}  # a reset is no reboot: the node keeps reporting
    [resume] = admitted(result, "resume")
    # Verified from the report carrying the result (at the reset's time here) for 20 s.
    assert resume.t >= done.back_seconds + PERSISTENCE_SECONDS
    assert resume.evidence["removed_by"] == "reset_gpu" and resume.evidence["reset"]["outcome"] == "done"
    assert not admitted(result, "reboot_node") and not admitted(result, "inspect_hardware")
    by_action = return_to_service(result)["by_action"]
    assert by_action["reset_gpu"]["returned"] == 1
    assert by_action["reset_gpu"]["seconds"]["max"] == resume.t - FAULT_AT


def test_a_reset_that_does_not_clear_fails_and_the_reboot_after_it_does() -> None:
    result = run_scenario(parse_scenario(tiny(
        {"reset_seconds": RESET_SECONDS, "reset_clears": False, "reboot_seconds": REBOOT_SECONDS, "clears": True},
        duration_seconds=150)))
    [reset] = admitted(result, "reset_gpu")
    [reboot] = admitted(result, "reboot_node")
    failed, rebooted = result.remediations
    assert (failed.action, failed.outcome, failed.clears) == ("reset_gpu", "failed (command_failed)", False)
    assert reboot.detector == "recovery" and reboot.evidence["signal"] == "reset_failed"
    # The gate's cooldown (20 s here) holds the reboot after the reset's admission.
    assert reboot.t >= max(failed.back_seconds, reset.t + 20)
    assert (rebooted.action, rebooted.t, rebooted.back_seconds) == ("reboot_node", reboot.t, reboot.t + REBOOT_SECONDS)
    [resume] = admitted(result, "resume")
    assert resume.t >= rebooted.back_seconds + PERSISTENCE_SECONDS and resume.evidence["new_boot"] is True
    assert not admitted(result, "inspect_hardware")
    # The spell is the reset's: the node was taken out by it and came back after the reboot.
    assert return_to_service(result)["by_action"]["reset_gpu"]["seconds"]["max"] == resume.t - FAULT_AT


def test_reset_clears_as_a_nodeset_picks_the_nodes_whose_reset_fixes_it() -> None:
    sc = parse_scenario(tiny({"reset_seconds": RESET_SECONDS, "reset_clears": "node-0000..node-0001"}))
    assert [sc.reset_clears(n) for n in sc.node_names()] == [True, True, False, False]
    assert not parse_scenario(tiny({"reboot_seconds": 60})).reset_clears("node-0001")  # resets off


def test_without_reset_seconds_a_reset_decision_changes_nothing() -> None:
    result = run_scenario(parse_scenario(tiny({"reboot_seconds": REBOOT_SECONDS}, duration_seconds=60)))
    assert admitted(result, "reset_gpu")
    assert result.remediations == []
    assert not admitted(result, "resume")  # nothing the agent reported, nothing followed: still out


@pytest.mark.parametrize(("remediation", "message"), [
    ({"reset_clears": True}, "reset_clears needs reset_seconds"),
    ({"reset_seconds": 0}, "remediation.reset_seconds"),
    ({"reset_seconds": 5, "reset_clears": "node-0009"}, "remediation.reset_clears"),
    ({"reset_seconds": 5, "reset_clear": True}, "remediation.reset_clear"),
])
def test_reset_keys_are_checked(remediation: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(tiny(remediation))
