from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.silence import SilenceConfig, SilenceDetector
from vigil.aggregator.fleet import Fleet

DETECTOR = SilenceDetector(SilenceConfig())


def fleet_with(*nodes, until=10.0):
    fleet = Fleet()
    t = 0.0
    while t <= until:
        for n in nodes:
            fleet.ingest(n.report(t), t)
        t += 2.5
    return fleet


def test_reporting_node_is_not_silent():
    assert DETECTOR.evaluate(fleet_with(FakeNode("a")).view(), 12.0) == []


def test_silent_node_is_alerted_then_drained():
    fleet = fleet_with(FakeNode("a"), until=10.0)
    assert DETECTOR.evaluate(fleet.view(), 20.0) == []
    [alert] = DETECTOR.evaluate(fleet.view(), 30.0)
    assert alert.action is Action.ALERT and alert.evidence["signal"] == "report_silence"
    [drain] = DETECTOR.evaluate(fleet.view(), 131.0)
    assert drain.action is Action.DRAIN and drain.node == "a" and drain.since == 10.0


def test_gpu_that_disappears_from_the_report_drains_the_node():
    node = FakeNode("a")
    fleet = fleet_with(node)
    fleet.ingest(node.report(12.5, drop_gpus=(6,)), 12.5)
    [f] = DETECTOR.evaluate(fleet.view(), 13.0)
    assert (f.action, f.gpu, f.evidence["signal"], f.evidence["uuid"]) == (Action.DRAIN, 6, "gpu_missing", "GPU-a-6")


def test_gpu_health_lost_and_reset_required():
    node = FakeNode("a")
    fleet = fleet_with(node)
    node.gpus[1]["health"] = "lost"
    node.gpus[2]["health"] = "reset_required"
    fleet.ingest(node.report(12.5), 12.5)
    found = {(f.gpu, f.action) for f in DETECTOR.evaluate(fleet.view(), 13.0)}
    assert found == {(1, Action.DRAIN), (2, Action.RESET_GPU)}


def test_nvml_unavailable_is_an_alert_not_eight_lost_gpus():
    node = FakeNode("a")
    fleet = fleet_with(node)
    node.nvml_available = False
    t = 12.5
    while t < 50:
        fleet.ingest(node.report(t, drop_gpus=tuple(range(8))), t)
        t += 2.5
    [f] = DETECTOR.evaluate(fleet.view(), t)
    assert f.action is Action.ALERT and f.evidence["signal"] == "nvml_unavailable"


def test_a_gpu_that_does_not_come_back_after_a_reboot_is_missing_from_the_new_boot():
    # Issue 21: "after a reboot, a GPU still missing ... produced nothing". The last boot's GPUs
    # are still expected; one that is absent is a new episode, counted from the new boot.
    node = FakeNode("a")
    fleet = fleet_with(node)
    node.reboot()
    del node.gpus[7]
    fleet.ingest(node.report(12.5), 12.5)
    fleet.ingest(node.report(15.0), 15.0)
    [found] = DETECTOR.evaluate(fleet.view(), 15.0)
    assert (found.gpu, found.key, found.since) == (7, "gpu_missing", 12.5)
