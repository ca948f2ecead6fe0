from agent.wire import Event
from aggregator.decision import Action
from aggregator.detectors.xid import XidConfig, XidDetector
from aggregator.fleet import Fleet
from tests.aggregator.conftest import FakeNode

DETECTOR = XidDetector(XidConfig())


def xid(code, ts, gpu=None, source="kmsg", pci=None, message=""):
    return Event(kind="xid", ts=ts, code=code, gpu=gpu, pci_bus_id=pci, source=source, urgent=True, message=message)


def judge(events_at, end=30.0, config=None):
    detector = XidDetector(config) if config else DETECTOR
    node = FakeNode("a")
    fleet = Fleet()
    t = 0.0
    while t <= end:
        fleet.ingest(node.report(t, events=events_at.get(t, [])), t)
        t += 2.5
    return detector.evaluate(fleet.view(), t - 2.5)


def test_fallen_off_the_bus_seen_twice_is_one_finding_on_the_right_gpu():
    found = judge({10.0: [xid(79, 9.1, pci="00000000:1B:00.0", source="kmsg"), xid(79, 9.3, gpu=3, source="nvml")]})
    assert len(found) == 1
    [f] = found
    assert f.gpu == 3 and f.action in (Action.DRAIN, Action.REBOOT_NODE, Action.RESET_GPU, Action.INSPECT_HARDWARE)
    assert f.evidence["signal"] == "xid" and f.evidence["codes"] == [79]
    assert f.evidence["sources"] == ["kmsg", "nvml"]
    assert f.since == 9.1


def test_single_application_xid_does_not_take_the_node():
    [f] = judge({10.0: [xid(13, 9.0, gpu=1)]})
    assert f.action not in (Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE)


def test_site_override_wins():
    [f] = judge({10.0: [xid(79, 9.0, gpu=0)]}, config=XidConfig(overrides={79: Action.ALERT}))
    assert f.action is Action.ALERT


def test_old_xids_age_out():
    assert judge({10.0: [xid(79, 9.0, gpu=0)]}, end=4000.0, config=XidConfig(window_seconds=600.0)) == []
