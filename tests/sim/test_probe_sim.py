"""Faults only a probe sees, in whole simulations: invisible to every passive signal (no decision
at all without probing), and run_probes answered by the simulated agents through the real outbox."""

from __future__ import annotations

import math
from typing import Any

import pytest

from vigil.aggregator.group_testing import worst_case_tests
from vigil.sim.run import run_scenario
from vigil.sim.scenario import parse_scenario
from vigil.sim.score import return_to_service, score, summary


def quiet(**over: Any) -> dict[str, Any]:
    """4 nodes of 4 GPUs in one job; node-0001 has every fault only a load shows, from 10 s."""
    data: dict[str, Any] = {
        "name": "probe-only-faults",
        "seed": 11,
        "duration_seconds": 120,
        "report_interval_seconds": 5,
        "hardware_disrupts_jobs": True,
        "fleet": {"nodes": 4, "gpus_per_node": 4, "hcas_per_node": 1},
        "jobs": [{"name": "pretrain", "nodes": "all", "ranks_per_node": 4, "step_seconds": 2.0}],
        "faults": [
            {"kind": "probe_only", "what": "hbm", "node": "node-0001", "gpu": 1, "at_seconds": 10},
            {"kind": "probe_only", "what": "power", "node": "node-0001", "gpu": 2, "at_seconds": 10},
            {"kind": "probe_only", "what": "nvlink", "node": "node-0001", "gpu": 3, "at_seconds": 10},
            {"kind": "probe_only", "what": "rdma", "node": "node-0001", "at_seconds": 10},
            {"kind": "probe_slow", "node": "node-0001", "factor": 1.04, "at_seconds": 10},
        ],
        "aggregator": {"detectors": {"recovery": {"enabled": True}}},
    }
    data.update(over)
    return data


def test_faults_only_a_probe_sees_change_nothing_in_the_passive_reports() -> None:
    faulty = run_scenario(parse_scenario(quiet()))
    healthy = run_scenario(parse_scenario(quiet(faults=[])))
    # Nothing decided on either: no Xid, no throttle, no port error, no straggler to see.
    assert faulty.decisions == [] == healthy.decisions
    assert faulty.reports == healthy.reports and faulty.probe_runs == [] == healthy.probe_runs
    # The job is not slowed by them either (a probe_slow is the probe's side only).
    assert faulty.jobs[0].step_seconds == healthy.jobs[0].step_seconds


def shipped(name: str) -> Any:
    from vigil.sim.scenario import load_scenario

    return load_scenario(name)


def test_a_reboot_that_looks_fine_but_fails_under_load_is_not_resumed_and_goes_to_inspection() -> None:
    sc = shipped("reboot-looks-fine-fails-under-load")
    result = run_scenario(sc)
    s = score(result)
    assert s.passed, summary(result, s)["expectations"]
    [reboot] = result.remediations
    [run] = [r for r in result.probe_runs if r.node == "node-0005"]
    # Probed from the new boot's first clean reports (in parallel with the 60 s passive window),
    # never before the node was back; signed results came back.
    assert reboot.back_seconds <= run.t < reboot.back_seconds + 60 and run.outcome == "done"
    assert run.failed == ("gpu_memory gpu 3: pattern_errors",)
    [inspect] = [d for d in result.decisions if d.admitted and d.action == "inspect_hardware"]
    assert inspect.node == "node-0005" and inspect.detector == "recovery" and inspect.t >= run.done_seconds
    assert not [d for d in result.decisions if d.action == "resume"]
    # Without probing the same node goes straight back to service on passive evidence alone.
    blind = sc.model_copy(update={"aggregator": {"detectors": {"recovery": {"enabled": True}}}})
    resumed = [d for d in run_scenario(blind).decisions if d.admitted and d.action == "resume"]
    assert [d.node for d in resumed] == ["node-0005"]


def test_a_reboot_that_fixes_the_node_is_resumed_only_after_its_probes_pass() -> None:
    result = run_scenario(shipped("reboot-fixes-probe-passes"))
    s = score(result)
    assert s.passed, summary(result, s)["expectations"]
    [run] = [r for r in result.probe_runs if r.node == "node-0005"]
    assert run.outcome == "done" and run.failed == ()
    # dcgm_diag is asked for and skipped (no DCGM on these nodes); the burn, memory and P2P ran per GPU.
    assert {(p, g) for p, g, _ in run.values if p == "gpu_compute"} == {("gpu_compute", g) for g in range(8)}
    [resume] = [d for d in result.decisions if d.admitted and d.action == "resume"]
    [reboot] = result.remediations
    # Resumed once both the probes passed and the passive window (60 s clean) had passed.
    assert resume.t >= max(run.done_seconds, reboot.back_seconds + 60) and "probes" in resume.reason
    rts = return_to_service(result)["by_action"]["reboot_node"]
    assert rts["returned"] == 1 and rts["seconds"]["max"] == resume.t - 60


def test_a_sub_floor_slow_node_is_drained_only_by_its_failed_probe_and_its_lookalike_stays() -> None:
    result = run_scenario(shipped("sub-floor-slow-confirmed-by-probe"))
    s = score(result)
    assert s.passed, (summary(result, s)["expectations"], summary(result, s)["forbid_violations"])
    runs = {r.node: r for r in result.probe_runs}
    assert set(runs) == {"node-0003", "node-0021"}  # both suspects probed, nobody else
    assert all(r.t >= 300 for r in runs.values())  # not while the job held them
    # The agent sees nothing wrong on either (a few per cent is no absolute fault); the baseline does.
    assert runs["node-0003"].failed == () == runs["node-0021"].failed
    slow = [v for p, _, v in runs["node-0003"].values if p == "gpu_compute"]
    fine = [v for p, _, v in runs["node-0021"].values if p == "gpu_compute"]
    assert max(slow) < 675 <= min(fine)
    removals = [d for d in result.decisions if d.admitted and d.action in ("drain", "reboot_node", "inspect_hardware")]
    assert [(d.node, d.detector) for d in removals] == [("node-0003", "probe_verdict")]
    assert removals[0].t >= runs["node-0003"].done_seconds


def test_three_bad_among_64_repaired_are_found_by_group_tests_and_drained_and_nobody_else() -> None:
    result = run_scenario(shipped("repaired-64-three-bad"))
    s = score(result)
    report = summary(result, s)
    assert s.passed, (report["expectations"], report["forbid_violations"], report["isolation_problems"])
    [iso] = result.isolations
    assert (iso.source, iso.state, iso.faulty) == ("sim", "done", ("node-0005", "node-0026", "node-0049"))
    assert len(iso.cleared) == 61 and iso.information_bound == pytest.approx(math.log2(math.comb(64, 3)))
    # Within the group-testing module's own worst case for d = 3 (its tests hold it there), and
    # the figure the run reports: 19 tests against the bound of 15.35.
    assert iso.tests_used == len(iso.tests) <= worst_case_tests(64, 3, 3)
    assert report["isolations"][0]["tests_used"] == iso.tests_used
    # Every run was a collective, and nothing passive ever named a node.
    assert {r.probes for r in result.probe_runs} == {("collective",)}
    removals = [d for d in result.decisions if d.admitted]
    assert sorted((d.node, d.action, d.detector) for d in removals) == [
        (n, "drain", "probe_verdict") for n in ("node-0005", "node-0026", "node-0049")]
    # Each drain names its test alone with a known-healthy partner, after the isolation finished.
    for d in removals:
        alone = [t for t in d.evidence["failed_tests"] if t["members"] == [d.node]]
        assert alone and alone[0]["partner"] not in iso.faulty
        assert iso.finished is not None and d.t >= 30 + (iso.finished - iso.started)  # started at 30 s


def test_an_isolation_the_prober_refuses_fails_the_score() -> None:
    sc = shipped("repaired-64-three-bad")
    aggregator = {**sc.aggregator, "probes": {**sc.aggregator["probes"], "max_fleet_share": 0.5}}
    # The isolation starts (and is refused) at 30 s: two minutes of the run say all there is.
    result = run_scenario(sc.model_copy(update={"aggregator": aggregator, "duration_seconds": 120.0}))
    assert [r[1] for r in result.isolations_refused] == ["fleet_share"]
    assert result.decisions == [] and not score(result).passed
