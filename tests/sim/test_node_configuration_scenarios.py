"""Issue 44's scenarios, each with the right decision and nothing else: Fabric Manager down on one
node, one GPU's PCIe link at x8 (idle GPUs' power-saving link generation beside it), a node on
another driver inside a job, and a staged driver roll-out across half the fleet; and the healthy
fleets (one of them mixed H100/H200 in one job) free of findings of the new detectors."""

from __future__ import annotations

from typing import Any

import pytest

from vigil.sim.run import SIM_KERNEL, SimResult, Simulation, run_scenario
from vigil.sim.scenario import REMOVAL_ACTIONS, ScenarioError, load_scenario, parse_scenario, shortened
from vigil.sim.score import score, summary

# The detectors of issue 44 (aggregator/detectors/): none may speak where nothing is wrong.
NEW_DETECTORS = ("fabric", "pcie_link", "config_drift")


def _passed(result: SimResult) -> None:
    s = score(result)
    report = summary(result, s)
    assert s.passed, {k: report[k] for k in ("expectations", "false_drain_decisions", "forbid_violations",
                                             "removals", "breaker")}


def _acts(result: SimResult) -> list[Any]:
    """Every decision that does something (an alert or a removal; an observe finding costs nobody)."""
    return [d for d in result.decisions if d.action != "observe"]


def _new(result: SimResult) -> list[Any]:
    return [d for d in result.decisions if d.detector in NEW_DETECTORS]


def _one_drain(name: str, node: str, detector: str) -> tuple[Any, Simulation, SimResult, Any]:
    """Run ``name``: it passes, and every decision that acts is ``detector``'s on ``node``, an
    admitted drain among them; returns (the scenario, the simulation, its result, the first drain)."""
    sc = load_scenario(name)
    sim = Simulation(sc)
    result = sim.run()
    _passed(result)
    acts = _acts(result)
    assert acts and {(d.node, d.detector) for d in acts} == {(node, detector)}, acts
    drains = [d for d in acts if d.action == "drain" and d.admitted]
    assert drains
    assert not [d for d in _new(result) if d.node != node]
    return sc, sim, result, drains[0]


def test_fabric_manager_down_drains_that_node_and_nothing_else() -> None:
    sc, sim, _, drain = _one_drain("fabric-manager-down", "node-0005", "fabric")
    # Not at the first report that shows it: after the persistence (a Fabric Manager restarting
    # re-registers the GPUs within seconds).
    assert drain.t >= sc.faults[0].at_seconds + sim.engine.config.detectors.fabric.persistence_seconds
    assert drain.evidence["fabric_manager_state"] == "failed"
    # The host side agreed with NVML: the node's Fabric Manager failed, everyone else's active.
    view = sim.engine.view()
    states = {n: view.nodes[n].host.fabric_manager_state for n in sc.node_names()}
    assert states.pop("node-0005") == "failed"
    assert set(states.values()) == {"active"}


def test_pcie_link_at_x8_drains_that_node_and_idle_links_never_act() -> None:
    sc, sim, result, drain = _one_drain("pcie-link-x8", "node-0003", "pcie_link")
    assert drain.gpu == 2
    assert drain.t >= sc.faults[0].at_seconds + sim.engine.config.detectors.pcie_link.gpu_persistence_seconds
    idle = set(sc.resolve_nodes(sc.fleet.idle or []))
    assert not [d for d in result.decisions if d.node in idle]
    # The lookalike was there: the idle nodes' GPUs reported a link generation below their maximum.
    view = sim.engine.view()
    links = {(g.last.pcie_link_generation, g.last.pcie_link_generation_max, g.last.utilization_gpu_ratio)
             for n in idle for g in view.nodes[n].gpus.values()}
    assert links == {(1, 5, 0.0)}, "the idle GPUs' links must sit at Gen1 of Gen5: the lookalike"


def test_an_hca_link_at_x8_drains_that_node_after_the_hca_persistence() -> None:
    sc, sim, _, drain = _one_drain("hca-pcie-x8", "node-0002", "pcie_link")
    assert drain.t >= sc.faults[0].at_seconds + sim.engine.config.detectors.pcie_link.hca_persistence_seconds
    # The agent's pcie collector read the trained-down link from the node's sysfs tree.
    [hca] = [d.last for d in sim.engine.view().nodes["node-0002"].pcie.values()
             if d.last.kind == "hca" and d.last.name == "mlx5_1"]
    assert (hca.link_width, hca.link_width_max) == (8, 16)


def test_an_uncorrectable_aer_error_drains_and_a_correctable_trickle_never_acts() -> None:
    sc, sim, _, drain = _one_drain("gpu-aer-uncorrectable", "node-0006", "pcie_link")
    assert drain.t >= sc.faults[1].at_seconds
    # The lookalike was there: node-0004's HCA counted its correctable errors (1 every 30 s).
    view = sim.engine.view()
    [hca] = [d.last for d in view.nodes["node-0004"].pcie.values() if d.last.kind == "hca"]
    assert hca.aer_correctable_total is not None and hca.aer_correctable_total >= 6
    assert [d.last.aer_nonfatal_total for d in view.nodes["node-0006"].pcie.values()
            if d.last.kind == "gpu" and d.last.aer_nonfatal_total] == [1]


def test_a_node_on_another_driver_in_a_job_is_alerted_once_and_never_removed() -> None:
    result = run_scenario(load_scenario("driver-drift-in-job"))
    _passed(result)
    drift = [d for d in result.decisions if d.detector == "config_drift" and d.action != "observe"]
    assert [(d.node, d.action) for d in drift] == [("node-0007", "alert")], drift
    assert not [d for d in result.decisions if d.action in REMOVAL_ACTIONS]
    assert not [d for d in _acts(result) if d.detector != "config_drift"]


def test_a_staged_rollout_across_half_the_fleet_alerts_each_mixed_job_once_and_removes_nothing() -> None:
    sc = load_scenario("driver-rollout-half")
    result = run_scenario(sc)
    _passed(result)
    assert not [d for d in result.decisions if d.action in REMOVAL_ACTIONS]
    assert not result.breaker_tripped
    drift = [d for d in result.decisions if d.detector == "config_drift" and d.action != "observe"]
    per_job: dict[str, int] = {}
    for d in drift:
        assert d.action == "alert", d
        job = d.job or next(j.name for j in sc.jobs if d.node in sc.resolve_nodes(j.nodes))
        per_job[job] = per_job.get(job, 0) + 1
    assert per_job == {"mixed-a": 1, "mixed-b": 1}, drift
    assert not [d for d in _acts(result) if d.detector != "config_drift"]


@pytest.mark.parametrize(("name", "seconds"), [("healthy-2s5-fleet", 240.0), ("mixed-h100-h200", 100.0)])
def test_healthy_fleets_give_the_new_detectors_nothing(name: str, seconds: float) -> None:
    # healthy-2s5-fleet's llm-mixed job and mixed-h100-h200's one job span H100 and H200 nodes: a
    # GPU model is a hardware class, not configuration drift (the fleet runs one driver: the H200
    # profile's own recording has another). Judged at once (no persistence): stricter than the
    # shipped 10 minutes, which these runs would not reach.
    sc = shortened(load_scenario(name), seconds)
    strict = {**sc.aggregator, "detectors": {**sc.aggregator.get("detectors", {}),
                                             "config_drift": {"persistence_seconds": 0}}}
    result = run_scenario(sc.model_copy(update={"aggregator": strict}))
    assert {"host", "node_config", "pcie"} <= set(result.collectors), result.collectors
    assert not _new(result), _new(result)


def test_idle_nodes_are_refused_to_a_job() -> None:
    data = {"duration_seconds": 60, "fleet": {"nodes": 4, "idle": "node-0002..node-0003"},
            "jobs": [{"name": "j", "nodes": "all", "step_seconds": 1.0}]}
    with pytest.raises(ScenarioError, match=r"jobs\.0\.nodes: .*idle"):
        parse_scenario(data)
    data["jobs"][0]["nodes"] = "node-0000..node-0001"
    assert parse_scenario(data).resolve_nodes("node-0002..node-0003") == ["node-0002", "node-0003"]


def test_a_mixed_fleet_runs_one_driver_and_each_model_keeps_its_class_facts() -> None:
    # The H200 profile was recorded on driver 580, the H100's on 535: a site runs one image, so the
    # H200 nodes report the fleet profile's driver; their VBIOS and GPU model stay the H200's. The
    # node_config and host collectors read the simulated node, not this machine.
    data = {"duration_seconds": 20, "report_interval_seconds": 5,
            "fleet": {"nodes": 2, "profiles": [{"nodes": "node-0001", "profile": "h200-sxm-141gb"}]}}
    sim = Simulation(parse_scenario(data))
    sim.run()
    view = sim.engine.view()
    h100, h200 = (view.nodes[n].config for n in ("node-0000", "node-0001"))
    assert h100 is not None and h200 is not None
    assert (h200.driver_version, h200.cuda_driver_version) == (h100.driver_version, h100.cuda_driver_version) \
        == ("535.161.08", "12.2")
    assert h200.gpu_model != h100.gpu_model and h200.vbios_version != h100.vbios_version
    assert h100.kernel == h200.kernel == SIM_KERNEL
    assert {view.nodes[n].host.fabric_manager_state for n in ("node-0000", "node-0001")} == {"active"}


@pytest.mark.parametrize(("clears", "state"), [(False, "failed"), (True, "active")])
def test_a_reboot_restarts_fabric_manager_only_where_it_clears_the_fault(clears: bool, state: str) -> None:
    data = {"duration_seconds": 300, "report_interval_seconds": 10, "fleet": {"nodes": 2},
            "faults": [{"kind": "fabric_manager_down", "node": "node-0001", "at_seconds": 20},
                       {"kind": "reboot", "node": "node-0001", "at_seconds": 100, "down_seconds": 60,
                        "clears": clears}],
            "description": "no drain judged here: the test reads the node's Fabric Manager after its reboot"}
    sim = Simulation(parse_scenario(data))
    sim.run()
    view = sim.engine.view()
    assert view.nodes["node-0001"].host.fabric_manager_state == state
    assert {g.last.fabric_state for g in view.nodes["node-0001"].gpus.values()} == \
        ({"not_started"} if not clears else {"completed"})
    assert view.nodes["node-0000"].host.fabric_manager_state == "active"
