from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.pcie_nvlink import PcieNvlinkConfig, PcieNvlinkDetector
from vigil.aggregator.fleet import Fleet

DETECTOR = PcieNvlinkDetector(PcieNvlinkConfig())


def judge(change, end=300.0, vendor=None):
    node = FakeNode("a")
    for gpu in node.gpus.values():
        if vendor is not None:
            gpu.update(vendor=vendor, name="AMD Instinct MI300X" if vendor == "amd" else "NVIDIA H100 80GB HBM3")
    fleet = Fleet()
    t = 0.0
    while t <= end:
        change(node, t)
        fleet.ingest(node.report(t), t)
        t += 2.5
    return DETECTOR.evaluate(fleet.view(), t - 2.5)


def test_a_few_replays_per_minute_are_normal():
    def few(node, t):
        node.gpus[0]["pcie_replay_total"] += 1 if int(t / 2.5) % 10 == 0 else 0  # 2.4/min
    assert judge(few) == []


def test_pcie_replay_storm_drains():
    def storm(node, t):
        if t > 100:
            node.gpus[0]["pcie_replay_total"] += 5  # 120/min
    [f] = judge(storm)
    assert (f.action, f.gpu, f.evidence["signal"]) == (Action.DRAIN, 0, "pcie_replay_total")
    assert f.evidence["rate_per_second"] > 8 / 60


def test_nvlink_crc_flood_and_link_down():
    def bad(node, t):
        node.gpus[2]["nvlink_crc_errors_total"] += 1000
        if t > 200:
            node.gpus[5]["nvlink_links_down"] = [3]
    found = {(f.gpu, f.action, f.evidence["signal"]) for f in judge(bad)}
    assert found == {(2, Action.DRAIN, "nvlink_crc_errors_total"), (5, Action.REBOOT_NODE, "nvlink_links_down")}


def _bad_links(node, t):
    node.gpus[2]["nvlink_crc_errors_total"] += 1000
    node.gpus[3]["nvlink_replay_errors_total"] += 1
    if t > 200:
        node.gpus[5]["nvlink_links_down"] = [3]


def test_an_amd_gpus_xgmi_links_are_named_xgmi_with_the_same_decisions_and_keys():
    nvidia, amd = judge(_bad_links, vendor="nvidia"), judge(_bad_links, vendor="amd")
    decided = {(f.gpu, f.action, f.key, f.evidence["signal"]) for f in nvidia}
    assert decided == {(2, Action.DRAIN, "nvlink_crc_errors_total", "nvlink_crc_errors_total"),
                       (3, Action.DRAIN, "nvlink_replay_errors_total", "nvlink_replay_errors_total"),
                       (5, Action.REBOOT_NODE, "nvlink_down", "nvlink_links_down")}
    assert {(f.gpu, f.action, f.key, f.evidence["signal"]) for f in amd} == decided
    for f in amd:
        assert "XGMI" in f.reason and "NVLink" not in f.reason, f.reason
        assert f.evidence["link"] == "XGMI"
    for f in nvidia:
        assert "NVLink" in f.reason and "XGMI" not in f.reason, f.reason
        assert f.evidence["link"] == "NVLink"
    assert {f.reason for f in amd} >= {"GPU 5: XGMI(s) 3 down"}


def test_an_agent_without_a_vendor_is_read_as_nvidia_and_pcie_words_do_not_change():
    def storm(node, t):
        node.gpus[0]["pcie_replay_total"] += 5
        node.gpus[1]["nvlink_crc_errors_total"] += 1000
    legacy, amd = judge(storm), judge(storm, vendor="amd")
    assert {f.gpu: f.reason.split(" at ")[0] for f in legacy} == {0: "GPU 0: PCIe replays",
                                                                  1: "GPU 1: NVLink CRC errors"}
    assert {f.gpu: f.reason.split(" at ")[0] for f in amd} == {0: "GPU 0: PCIe replays", 1: "GPU 1: XGMI CRC errors"}
    assert "link" not in next(f for f in amd if f.gpu == 0).evidence
