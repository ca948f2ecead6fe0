"""The PCIe link detector: a GPU link trained down under load, an HCA link below its maximum, AER
errors; the lookalikes (an idle GPU at Gen1, a single flicker, a healthy link) do not act."""

import json
from collections.abc import Callable

from tests.aggregator.conftest import FakeNode, drive, proposals_ledger
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.pcie_link import PcieLinkConfig, PcieLinkDetector, describe_link
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet, LoadedRun, normal_bus_id

DETECTOR = PcieLinkDetector(PcieLinkConfig())


def linked_node(name: str = "a") -> FakeNode:
    node = FakeNode(name)
    for g in node.gpus.values():
        g.update(pcie_link_generation=5, pcie_link_generation_max=5, pcie_link_width=16, pcie_link_width_max=16)
    node.pcie = [{"pci_bus_id": f"0000:{0x18 + i:02x}:00.0", "kind": "gpu", "aer_correctable_total": 0,
                  "aer_nonfatal_total": 0, "aer_fatal_total": 0} for i in range(8)]
    node.pcie += [{"pci_bus_id": f"0000:{0x40 + i:02x}:00.0", "kind": "hca", "name": f"mlx5_{i}",
                   "link_generation": 5, "link_generation_max": 5, "link_width": 16, "link_width_max": 16,
                   "aer_correctable_total": 0, "aer_nonfatal_total": 0, "aer_fatal_total": 0} for i in range(8)]
    return node


def judge(change: Callable[[FakeNode, float], None], end: float = 600.0, node: FakeNode | None = None) -> list:
    node = node or linked_node()
    fleet = Fleet()
    t = 0.0
    found: list = []
    while t <= end:
        change(node, t)
        fleet.ingest(node.report(t), t)
        found = DETECTOR.evaluate(fleet.view(), t)
        t += 2.5
    return found


def test_gpu_link_at_x8_under_load_drains_with_the_link_in_words():
    def x8(n, t):
        if t >= 100:
            n.gpus[3]["pcie_link_width"] = 8
    [f] = judge(x8)
    assert (f.action, f.gpu, f.key) == (Action.DRAIN, 3, "gpu_link")
    assert f.reason.startswith("GPU 3 PCIe Gen5 x8 of x16")
    assert f.since == 100.0


def test_idle_gpu_at_gen1_does_not_act():
    def idle(n, t):
        for g in n.gpus.values():
            g.update(utilization_gpu_ratio=0.0, pcie_link_generation=1)
    assert judge(idle) == []


def test_gpu_trained_down_acts_only_after_persistence_under_load():
    def down_then_load(n, t):
        g = n.gpus[2]
        g["pcie_link_generation"] = 3
        g["utilization_gpu_ratio"] = 0.0 if t < 300 else 0.95  # idle first: power saving, not judged
    assert judge(down_then_load, end=410.0) == []
    [f] = judge(down_then_load, end=430.0)
    assert f.gpu == 2 and f.since == 300.0  # the first loaded report and "PCIe Gen3 of Gen5 x16" in f.reason


def test_a_dip_in_load_restarts_the_persistence():
    def dip(n, t):
        n.gpus[1]["pcie_link_width"] = 8
        n.gpus[1]["utilization_gpu_ratio"] = 0.1 if 500 <= t < 505 else 0.97
    assert judge(dip, end=600.0) == []


def test_single_flicker_does_not_act():
    def flicker(n, t):
        n.gpus[4]["pcie_link_width"] = 8 if 200 <= t < 210 else 16
    assert judge(flicker) == []


def test_hca_link_below_max_drains_after_its_longer_persistence():
    def hca_x8(n, t):
        if t >= 200:
            n.pcie[9]["link_width"] = 8
    assert judge(hca_x8, end=495.0) == []
    [f] = judge(hca_x8, end=520.0)
    assert (f.action, f.key, f.gpu) == (Action.DRAIN, "link:0000:41:00.0", None)
    assert "mlx5_1" in f.reason and "PCIe Gen5 x8 of x16" in f.reason


def test_uncorrectable_aer_on_a_gpu_drains_naming_the_gpu():
    def aer(n, t):
        if t == 300:
            n.pcie[6] = {**n.pcie[6], "aer_nonfatal_total": 1}
    [f] = judge(aer)
    assert (f.action, f.gpu, f.evidence["signal"]) == (Action.DRAIN, 6, "aer_uncorrectable")
    assert f.since == 300.0 and f.evidence["nonfatal"] == 1


def test_correctable_aer_rate_alerts_and_a_trickle_does_not():
    def storm(n, t):
        n.pcie[10] = {**n.pcie[10], "aer_correctable_total": int(t)}  # 24/min
    [f] = judge(storm)
    assert (f.action, f.evidence["signal"], f.gpu) == (Action.ALERT, "aer_correctable", None)

    def trickle(n, t):
        n.pcie[10] = {**n.pcie[10], "aer_correctable_total": int(t // 60)}  # 1/min
    assert judge(trickle) == []


def test_reboot_resets_aer_counters_without_a_finding():
    node = linked_node()

    def reboot(n, t):
        if t < 300:
            n.pcie[0] = {**n.pcie[0], "aer_nonfatal_total": 0, "aer_correctable_total": 50}
        elif t == 300:
            n.reboot()
            n.pcie[0] = {**n.pcie[0], "aer_correctable_total": 0}
    assert judge(reboot, node=node) == []


def test_healthy_node_is_passed_over():
    assert judge(lambda n, t: None) == []


def test_bus_ids_of_nvml_and_sysfs_name_one_device():
    assert normal_bus_id("00000000:18:00.0") == normal_bus_id("0000:18:00.0") == "0000:18:00.0"
    assert normal_bus_id("00000001:AB:00.0") == "0001:ab:00.0"


def test_loaded_run_answers_any_threshold():
    run = LoadedRun(0.0)
    for ts, u in [(0, 0.0), (10, 0.9), (20, 0.4), (30, 0.95), (40, 0.97)]:
        run.observe(float(ts), u)
    assert run.loaded_since(0.5) == 30.0
    assert run.loaded_since(0.3) == 10.0
    assert run.loaded_since(0.99) is None


def test_describe_link():
    assert describe_link(5, 5, 8, 16) == "PCIe Gen5 x8 of x16"
    assert describe_link(3, 5, 16, 16) == "PCIe Gen3 of Gen5 x16"
    assert describe_link(3, 5, 8, 16) == "PCIe Gen3 x8 of Gen5 x16"


def test_engine_decides_one_drain_for_the_x8_gpu_and_nothing_else():
    engine = Engine(parse_config({}), proposals_ledger())
    nodes = [linked_node(f"n{i}") for i in range(4)]
    for node in nodes[1:]:  # idle peers: Gen1 at idle is power saving
        for g in node.gpus.values():
            g.update(utilization_gpu_ratio=0.0, pcie_link_generation=1)
    nodes[0].gpus[3]["pcie_link_width"] = 8
    decisions = drive(engine, nodes, 0.0, 400.0)
    assert [(d.node, d.detector, d.action, d.gpu) for d in decisions] == [("n0", "pcie_link", Action.DRAIN, 3)]
    assert decisions[0].reason.startswith("GPU 3 PCIe Gen5 x8 of x16")
    json.loads(decisions[0].model_dump_json())
