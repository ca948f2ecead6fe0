"""The fabric detector: GPUs not registered with the NVLink fabric past the boot grace, one decision
per node naming them and Fabric Manager as the cause; the lookalikes (a booting node, a node
without NVSwitch, a registration that completes within the grace) do not act."""

import json
from collections.abc import Callable

import pytest

from tests.aggregator.conftest import FakeNode, drive, proposals_ledger
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.fabric import FabricConfig, FabricDetector
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet

DETECTOR = FabricDetector(FabricConfig())


def nvswitch_node(name: str = "a") -> FakeNode:
    node = FakeNode(name)
    for g in node.gpus.values():
        g["fabric_state"] = "completed"
    node.host = {"uptime_seconds": 3600.0, "fabric_manager_state": "active"}
    return node


def judge(node: FakeNode, change: Callable[[FakeNode, float], None], end: float = 600.0,
          detector: FabricDetector = DETECTOR) -> list:
    fleet = Fleet()
    t = 0.0
    found: list = []
    while t <= end:
        change(node, t)
        if node.host is not None and "uptime_seconds" in node.host:
            node.host = {**node.host, "uptime_seconds": node.host["uptime_seconds"] + 2.5}
        fleet.ingest(node.report(t), t)
        found = detector.evaluate(fleet.view(), t)
        t += 2.5
    return found


def test_fabric_manager_down_at_boot_drains_once_naming_gpus_and_cause():
    node = nvswitch_node()
    node.host = {"uptime_seconds": 20.0, "fabric_manager_state": "failed"}

    def fm_failed(n, t):
        for g in n.gpus.values():
            g["fabric_state"] = "in_progress"
    [f] = judge(node, fm_failed)
    assert (f.action, f.key, f.gpu) == (Action.DRAIN, "fabric_unusable", None)
    assert f.reason == "Fabric Manager failed: NVLink fabric not usable on GPU 0,1,2,3,4,5,6,7 in_progress"
    assert [g["gpu"] for g in f.evidence["gpus"]] == list(range(8))


def test_booting_node_in_progress_within_grace_does_not_act():
    node = nvswitch_node()
    node.host = {"uptime_seconds": 5.0, "fabric_manager_state": "activating"}

    def registering(n, t):
        for g in n.gpus.values():
            g["fabric_state"] = "in_progress" if t < 90 else "completed"
        n.host = {**n.host, "fabric_manager_state": "activating" if t < 60 else "active"}
    assert judge(node, registering) == []


def test_still_in_progress_past_the_grace_acts_even_with_fabric_manager_active():
    node = nvswitch_node()
    node.host = {"uptime_seconds": 5.0, "fabric_manager_state": "active"}

    def stuck(n, t):
        n.gpus[3]["fabric_state"] = "in_progress"
    [f] = judge(node, stuck, end=400.0)
    assert f.action is Action.DRAIN and f.reason == "NVLink fabric not usable on GPU 3 in_progress"
    # Just before the grace ends it does not.
    node = nvswitch_node()
    node.host = {"uptime_seconds": 5.0, "fabric_manager_state": "active"}
    assert judge(node, stuck, end=290.0) == []


def test_completed_with_an_error_status_is_unusable():
    def errored(n, t):
        n.gpus[5]["fabric_status"] = "NVML_ERROR_INSUFFICIENT_RESOURCES"
    [f] = judge(nvswitch_node(), errored)
    assert f.action is Action.DRAIN and f.reason == (
        "NVLink fabric not usable on GPU 5 completed, status NVML_ERROR_INSUFFICIENT_RESOURCES")


def test_no_nvswitch_is_never_judged():
    node = FakeNode("pcie-only")  # fabric_state None on every GPU, no Fabric Manager expected
    node.host = {"uptime_seconds": 9000.0}
    assert judge(node, lambda n, t: None) == []


def test_a_flicker_shorter_than_the_persistence_does_not_act():
    def flicker(n, t):
        n.gpus[2]["fabric_state"] = "in_progress" if 100 <= t < 140 else "completed"
    assert judge(nvswitch_node(), flicker) == []


def test_health_conditions_alert_and_do_not_drain():
    def degraded(n, t):
        n.gpus[1]["fabric_health"] = ["degraded_bandwidth"]
    [f] = judge(nvswitch_node(), degraded)
    assert (f.action, f.key) == (Action.ALERT, "fabric_degraded")
    assert f.reason == "NVLink fabric unhealthy on GPU 1 degraded_bandwidth"


def test_fabric_manager_down_while_gpus_keep_registration_alerts_after_its_wait():
    def fm_dies(n, t):
        if t >= 100:
            n.host = {**n.host, "fabric_manager_state": "inactive"}
    assert judge(nvswitch_node(), fm_dies, end=390.0) == []
    [f] = judge(nvswitch_node(), fm_dies, end=420.0)
    assert (f.action, f.key) == (Action.ALERT, "fabric_degraded") and "Fabric Manager inactive" in f.reason


def test_fabric_manager_state_unknown_is_not_down():
    # The agent could not read the unit's state (agent/collectors/host.py: counted, reported "unknown").
    def unreadable(n, t):
        n.host = {**n.host, "fabric_manager_state": "unknown"}
    assert judge(nvswitch_node(), unreadable, end=900.0) == []


def test_decision_is_stable_across_passes():
    node = nvswitch_node()
    node.host = {"uptime_seconds": 20.0, "fabric_manager_state": "failed"}
    fleet = Fleet()
    ids = set()
    for i in range(200):
        t = i * 2.5
        for g in node.gpus.values():
            g["fabric_state"] = "not_started"
        fleet.ingest(node.report(t), t)
        ids.update((f.key, f.since) for f in DETECTOR.evaluate(fleet.view(), t))
    assert len(ids) == 1


def test_reset_gpu_is_refused_as_its_action():
    with pytest.raises(ValueError, match="action"):
        FabricConfig(action="reset_gpu")  # one decision per node names no single GPU to reset


def test_engine_decides_one_drain_for_the_node_whose_fabric_manager_failed_and_nothing_else():
    engine = Engine(parse_config({}), proposals_ledger())
    nodes = [nvswitch_node(f"n{i}") for i in range(4)]
    nodes[2].host = {"uptime_seconds": 30.0, "fabric_manager_state": "failed"}
    for g in nodes[2].gpus.values():
        g["fabric_state"] = "in_progress"

    def uptime(t):
        for node in nodes:
            node.host = {**node.host, "uptime_seconds": node.host["uptime_seconds"] + 2.5}
    decisions = drive(engine, nodes, 0.0, 600.0, before=uptime)
    assert [(d.node, d.detector, d.action, d.gpu) for d in decisions] == [("n2", "fabric", Action.DRAIN, None)]
    assert decisions[0].reason.startswith("Fabric Manager failed: NVLink fabric not usable on GPU 0,1,2")
    json.loads(decisions[0].model_dump_json())
