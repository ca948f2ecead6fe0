from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.xid import XidConfig, XidDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import Event

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


# Peer-relative application Xids ----------------------------------------------------------------

REMOVALS = {Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE, Action.RESTART_JOB}


def job_fleet(n_nodes, bursts, *, code=13, job="train"):
    """``n_nodes`` 8-GPU nodes running one job (a rank per GPU); ``bursts`` maps (node index, gpu)
    to the times of that GPU's Xid bursts (three bursts 5 min apart repeat by the catalog's rule)."""
    from tests.aggregator.conftest import rank_summary

    nodes = [FakeNode(f"n{i:03d}", ports=0) for i in range(n_nodes)]
    for i, node in enumerate(nodes):
        node.ranks = [rank_summary(job, i * 8 + g, compute=0.8, comm=0.1, ts=0.0, gpu=g) for g in range(8)]
    fleet = Fleet()
    times = sorted({t for ts in bursts.values() for t in ts} | {0.0})
    for t in times:
        for i, node in enumerate(nodes):
            events = [xid(code, t, gpu=g) for (ni, g), ts in bursts.items() if ni == i and t in ts]
            fleet.ingest(node.report(t + 0.5, events=events), t + 0.5)
    return fleet, times[-1] + 1.0


BURSTS = (0.0, 300.0, 600.0)


def test_a_user_bug_on_every_gpu_of_a_job_removes_nothing_and_alerts_the_job_once():
    fleet, now = job_fleet(16, {(i, g): BURSTS for i in range(16) for g in range(8)})  # 128 GPUs
    found = DETECTOR.evaluate(fleet.view(), now)
    assert not [f for f in found if f.action in REMOVALS]
    [job_alert] = [f for f in found if f.key == "xid:13:job"]
    assert job_alert.action is Action.ALERT and job_alert.job == "train"
    assert job_alert.evidence["gpus_sharing"] == 128


def test_a_gpu_whose_application_xids_repeat_alone_is_suspect():
    fleet, now = job_fleet(16, {(5, 3): BURSTS, (9, 1): (0.0,)})  # one GPU repeats; one peer had one
    found = DETECTOR.evaluate(fleet.view(), now)
    [removal] = [f for f in found if f.action in REMOVALS]
    assert (removal.node, removal.gpu, removal.action) == ("n005", 3, Action.DRAIN)


def test_a_job_wide_crash_excuses_its_own_burst_only_not_the_gpus_later_solo_repeats():
    # The whole job crashes at 0 s (all 128 GPUs); later node 5's GPU 3 repeats Xid 13 alone.
    everyone = {(i, g): (0.0,) for i in range(16) for g in range(8)}
    fleet, now = job_fleet(16, {**everyone, (5, 3): (0.0, 300.0, 600.0, 900.0)})
    found = DETECTOR.evaluate(fleet.view(), now)
    [removal] = [f for f in found if f.action in REMOVALS]
    assert (removal.node, removal.gpu, removal.action) == ("n005", 3, Action.DRAIN)
    assert (removal.evidence["bursts_own"], removal.evidence["bursts_shared"]) == (3, 1)
    assert removal.since == 300.0  # its own episode starts with its first solo burst


def test_two_solo_bursts_after_a_job_wide_crash_are_not_yet_a_repeat():
    # The lookalike: the job-wide burst plus two of its own is three bursts, but only two are the GPU's.
    everyone = {(i, g): (0.0,) for i in range(16) for g in range(8)}
    fleet, now = job_fleet(16, {**everyone, (5, 3): (0.0, 300.0, 600.0)})
    found = DETECTOR.evaluate(fleet.view(), now)
    assert not [f for f in found if f.action in REMOVALS]
    [shared] = [f for f in found if f.key == "xid:13:shared"]
    assert (shared.evidence["bursts_own"], shared.evidence["bursts_shared"]) == (2, 1)


def test_a_job_wide_burst_is_judged_per_burst_within_its_tolerance():
    # Peers' lines 40 s from the GPU's are the same crash (steps, read cadence, clock placement);
    # lines two minutes away are another moment and excuse nothing.
    config = XidConfig()
    assert config.app_peer_burst_seconds == 60.0
    peers_near = {(i, g): (40.0, 340.0, 640.0) for i in range(16) for g in range(8) if (i, g) != (5, 3)}
    fleet, now = job_fleet(16, {**peers_near, (5, 3): (0.0, 300.0, 600.0)})
    assert not [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action in REMOVALS]
    peers_far = {(i, g): (120.0, 420.0, 720.0) for i in range(16) for g in range(8) if (i, g) != (5, 3)}
    fleet, now = job_fleet(16, {**peers_far, (5, 3): (0.0, 300.0, 600.0)})
    removals = [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action in REMOVALS]
    assert {(f.node, f.gpu) for f in removals} == {("n005", 3)}


def test_without_a_job_the_node_is_the_peer_group():
    node = FakeNode("solo", ports=0)
    fleet = Fleet()
    for t in BURSTS:
        fleet.ingest(node.report(t + 0.5, events=[xid(31, t, gpu=g) for g in range(8)]), t + 0.5)
    assert not [f for f in DETECTOR.evaluate(fleet.view(), 700.0) if f.action in REMOVALS]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_nodes=st.integers(2, 12), code=st.sampled_from([13, 31, 43, 45, 68]), data=st.data())
def test_an_application_xid_shared_by_most_of_a_job_never_removes(n_nodes, code, data):
    gpus = [(i, g) for i in range(n_nodes) for g in range(8)]
    # at least half the job's GPUs repeat the same application Xid (each with its own timing)
    chosen = data.draw(st.lists(st.sampled_from(gpus), min_size=len(gpus) // 2, unique=True))
    shift = data.draw(st.floats(0.0, 60.0))
    fleet, now = job_fleet(n_nodes, {gpu: tuple(t + shift for t in BURSTS) for gpu in chosen}, code=code)
    assert not [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action in REMOVALS]
