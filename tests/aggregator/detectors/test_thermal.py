from aggregator.decision import Action
from aggregator.detectors.thermal import ThermalConfig, ThermalDetector
from aggregator.fleet import Fleet
from tests.aggregator.conftest import FakeNode

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
    assert judge(FakeNode("a"), 170.0, fault=throttle("hw_power_brake_slowdown")) == []


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
