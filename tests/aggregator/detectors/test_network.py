from aggregator.decision import Action
from aggregator.detectors.network import NetworkConfig, NetworkDetector
from aggregator.fleet import Fleet
from tests.aggregator.conftest import FakeNode

DETECTOR = NetworkDetector(NetworkConfig())


def judge(change=None, end=300.0):
    node = FakeNode("a")
    fleet = Fleet()
    t = 0.0
    while t <= end:
        if change is not None:
            change(node, t)
        fleet.ingest(node.report(t), t)
        t += 2.5
    return DETECTOR.evaluate(fleet.view(), t - 2.5)


def test_healthy_ports_produce_nothing():
    assert judge() == []


def test_port_down_drains_after_its_grace():
    def down(node, t):
        if t >= 290:
            node.ports[3]["state"] = "DOWN"
            node.ports[3]["phys_state"] = "Polling"
    [f] = judge(down)
    assert (f.action, f.evidence["signal"], f.evidence["device"]) == (Action.DRAIN, "port_state", "mlx5_3")
    assert judge(down, end=295.0) == []  # 5 s down: could be a flap


def test_port_never_up_in_this_boot_is_not_down():
    def unused(node, t):
        node.ports[7]["state"] = "DOWN"
    assert judge(unused) == []


def test_flapping_link_drains():
    def flap(node, t):
        if t in (100.0, 150.0, 200.0):
            node.ports[1]["counters"]["link_downed"] += 1
    [f] = judge(flap)
    assert (f.action, f.evidence["signal"], f.evidence["events"]) == (Action.DRAIN, "link_flaps", 3)


def test_symbol_errors_above_ibta_ber_drain_and_below_do_not():
    def noisy(node, t):
        node.ports[2]["counters"]["symbol_error"] += 2000  # 2000 / (400e9 * 2.5) = 2e-9
    [f] = judge(noisy)
    assert f.evidence["signal"] == "symbol_error_rate" and f.evidence["bit_error_ratio"] > 1e-12

    def rare(node, t):
        node.ports[2]["counters"]["symbol_error"] += 1 if t % 50 == 0 else 0
    assert judge(rare) == []


def test_link_retrained_at_lower_rate_drains():
    def degrade(node, t):
        if t >= 200:
            node.ports[4]["rate_bits_per_second"] = 200e9
    [f] = judge(degrade)
    assert (f.action, f.evidence["signal"], f.evidence["expected_rate_bits_per_second"]) == (
        Action.DRAIN, "rate_bits_per_second", 400e9)


def test_congestion_only_informs():
    def congested(node, t):
        node.ports[0]["counters"]["np_ecn_marked_roce_packets"] += 1_000_000
    [f] = judge(congested)
    assert f.action is Action.OBSERVE


def flapping_every(period_s, hours):
    """A port whose link drops once every ``period_s``; the findings per minute for ``hours``."""
    node = FakeNode("a", gpus=0)
    fleet = Fleet()
    out = []
    for minute in range(int(hours * 60) + 1):
        t = minute * 60.0
        if minute and t % period_s == 0:
            node.ports[2]["counters"]["link_downed"] += 1
        fleet.ingest(node.report(t), t)
        out.append((t, DETECTOR.evaluate(fleet.view(), t)))
    return out


def test_a_port_dropping_every_six_minutes_alerts_within_the_hour_then_drains_when_it_persists():
    found = flapping_every(360, 4)
    first_alert = next(t for t, fs in found if any(f.action is Action.ALERT for f in fs))
    first_drain = next(t for t, fs in found if any(f.action is Action.DRAIN for f in fs))
    assert first_alert <= 3600.0  # 3 drops in an hour: 18 minutes in
    assert 2 * 3600.0 <= first_drain <= 3 * 3600.0 + 60  # 3 drops in each of 3 hours
    [drain] = [f for f in found[-1][1] if f.action is Action.DRAIN]
    assert drain.evidence["horizon"] == "long" and drain.evidence["device"] == "mlx5_2"


def test_a_link_retraining_twice_an_hour_never_drains():
    assert all(not fs for _, fs in flapping_every(1800, 6))
