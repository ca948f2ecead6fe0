from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.thermal import ThermalConfig, ThermalDetector
from vigil.aggregator.detectors.topology import is_onset
from vigil.aggregator.fleet import Fleet

DETECTOR = ThermalDetector(ThermalConfig())


def judge(node, start_fault, end=200.0, fault=None):
    fleet = Fleet()
    t = 0.0
    while t <= end:
        if t >= start_fault and fault is not None:
            fault(node)
        fleet.ingest(node.report(t), t)
        t += 2.5
    return DETECTOR.evaluate(fleet.view(), t - 2.5)


def throttle(reason):
    def apply(node):
        g = node.gpus[3]
        g["sm_clock_hertz"] = 1.1e9
        g["clock_event_reasons"] = ["hw_slowdown", reason]
    return apply


def test_busy_gpu_held_down_by_heat_for_a_minute_drains():
    [f] = judge(FakeNode("a"), 100.0, fault=throttle("hw_thermal_slowdown"))
    assert (f.action, f.gpu, f.evidence["signal"]) == (Action.DRAIN, 3, "clock_event_reasons")
    assert "hw_thermal_slowdown" in f.evidence["reasons"]


def test_short_brake_is_ignored():
    # 30 s held down: no finding to act on, only the onset the topology pass reads
    [onset] = judge(FakeNode("a"), 170.0, fault=throttle("hw_power_brake_slowdown"))
    assert (onset.action, onset.key, onset.gpu) == (Action.OBSERVE, "clock_throttle:onset", 3)
    assert is_onset(onset) and onset.since == 170.0


def test_onset_waits_for_three_reports_and_five_seconds():
    # a brake of 2 reports (2.5 s) is no onset; the third report (5 s) is
    assert judge(FakeNode("a"), 197.5, fault=throttle("hw_thermal_slowdown")) == []
    [onset] = judge(FakeNode("a"), 192.5, fault=throttle("hw_thermal_slowdown"), end=197.5)
    assert is_onset(onset) and onset.evidence["throttled_seconds"] == 5.0


def test_power_cap_alone_is_normal():
    def capped(node):
        node.gpus[3]["sm_clock_hertz"] = 1.2e9
        node.gpus[3]["clock_event_reasons"] = ["sw_power_cap"]
    assert judge(FakeNode("a"), 0.0, fault=capped) == []


def test_idle_gpu_clocked_down_is_not_throttled():
    def idle(node):
        throttle("hw_thermal_slowdown")(node)
        node.gpus[3]["utilization_gpu_ratio"] = 0.0
    assert judge(FakeNode("a"), 0.0, fault=idle) == []


def test_hbm_near_its_limit_alerts():
    def hot(node):
        node.gpus[6]["memory_temperature_celsius"] = 93.0
    [f] = judge(FakeNode("a"), 50.0, fault=hot)
    assert (f.action, f.gpu, f.evidence["signal"]) == (Action.ALERT, 6, "memory_temperature_celsius")


def job_of(nodes, throttled, end=200.0):
    from tests.aggregator.conftest import rank_summary

    for i, node in enumerate(nodes):
        node.ranks = [rank_summary("job", i * 8 + g, compute=0.8, comm=0.1, ts=0.0, gpu=g) for g in range(8)]
    fleet = Fleet()
    t = 0.0
    while t <= end:
        for node in nodes:
            if t >= 100.0 and node.name in throttled:
                throttle("hw_power_brake_slowdown")(node)
            fleet.ingest(node.report(t), t)
        t += 2.5
    return DETECTOR.evaluate(fleet.view(), t - 2.5)


def test_throttling_across_most_of_a_job_is_the_jobs_not_its_nodes():
    nodes = [FakeNode(f"n{i}", ports=0) for i in range(8)]
    found = job_of(nodes, {f"n{i}" for i in range(6)})
    assert not [f for f in found if f.action is Action.DRAIN]
    [alert] = [f for f in found if f.action is Action.ALERT]
    assert alert.job == "job" and alert.evidence["nodes_throttled"] == 6


def test_one_throttled_node_of_a_job_is_still_drained():
    nodes = [FakeNode(f"n{i}", ports=0) for i in range(8)]
    [f] = job_of(nodes, {"n5"})
    assert (f.node, f.action) == ("n5", Action.DRAIN)


def test_a_gpu_braking_in_short_bursts_is_alerted_then_drained_over_the_long_horizon():
    # held down 30 s of every 2 minutes: never the 60 s in a row of the short horizon
    detector = ThermalDetector(ThermalConfig())
    node = FakeNode("a", ports=0)
    fleet = Fleet()
    healthy = dict(node.gpus[3])
    found = []
    t = 0.0
    while t <= 1800.0:
        if t % 120 < 30:
            throttle("hw_power_brake_slowdown")(node)
        else:
            node.gpus[3] = dict(healthy)
        fleet.ingest(node.report(t), t)
        found.append((t, [f for f in detector.evaluate(fleet.view(), t) if not is_onset(f)]))
        t += 2.5
    actions = [(t, f.action) for t, fs in found for f in fs]
    assert all(f.key == "clock_throttle:intermittent" and f.gpu == 3 for _, fs in found for f in fs)
    first_alert = min(t for t, a in actions if a is Action.ALERT)
    first_drain = min(t for t, a in actions if a is Action.DRAIN)
    assert first_alert < first_drain  # 10% of the horizon (3 min) then 25% (7.5 min) throttled


def test_brief_brakes_now_and_then_never_add_up_to_a_finding():
    detector = ThermalDetector(ThermalConfig())
    node = FakeNode("a", ports=0)
    fleet = Fleet()
    healthy = dict(node.gpus[3])
    t = 0.0
    while t <= 3600.0:
        if t % 300 < 5:  # 5 s of every 5 minutes: under 2% of the time
            throttle("hw_power_brake_slowdown")(node)
        else:
            node.gpus[3] = dict(healthy)
        fleet.ingest(node.report(t), t)
        assert detector.evaluate(fleet.view(), t) == []
        t += 2.5
