from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.pcie_nvlink import PcieNvlinkConfig, PcieNvlinkDetector
from vigil.aggregator.fleet import Fleet

DETECTOR = PcieNvlinkDetector(PcieNvlinkConfig())


def judge(change, end=300.0):
    node = FakeNode("a")
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
