import pytest
from pydantic import ValidationError

from tests.aggregator.conftest import FakeNode, drive, proposals_ledger
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.network import NetworkConfig, NetworkDetector
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet, FleetConfig


def judge(change=None, end=300.0):
    node = FakeNode("a")
    fleet = Fleet()
    t = 0.0
    while t <= end:
        if change is not None:
            change(node, t)
        fleet.ingest(node.report(t), t)
        t += 2.5
    return NetworkDetector(NetworkConfig()).evaluate(fleet.view(), t - 2.5)


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


def flapping_every(period_s, hours, counter="link_downed", *, fleet=None, config=None):
    """A port whose link drops once every ``period_s``; the findings per minute for ``hours``. The
    detector keeps a memory of drops: one per fleet, as in the aggregator."""
    node = FakeNode("a", gpus=0)
    fleet = fleet or Fleet()
    detector = NetworkDetector(config or NetworkConfig())
    out = []
    for minute in range(int(hours * 60) + 1):
        t = minute * 60.0
        if minute and t % period_s == 0:
            node.ports[2]["counters"][counter] += 1
        fleet.ingest(node.report(t), t)
        out.append((t, detector.evaluate(fleet.view(), t)))
    return out


def drops_at(schedule, hours, phase_seconds=0.0):
    """Nodes whose port 2 drops at the given times (seconds), each reporting every 30 s (the
    i-th node ``i * phase_seconds`` later than the first); each node's findings per minute."""
    nodes = {name: FakeNode(name, gpus=0, ports=4) for name in schedule}
    fleet = Fleet()
    detector = NetworkDetector(NetworkConfig())
    out: dict[str, list] = {name: [] for name in schedule}
    for step in range(int(hours * 120) + 1):
        base = step * 30.0
        for i, (name, node) in enumerate(nodes.items()):
            t = base + i * phase_seconds
            node.ports[2]["counters"]["link_downed"] += sum(1 for d in schedule[name] if t - 30.0 < d <= t)
            fleet.ingest(node.report(t), t)
        if step % 2 == 0:
            now = base + len(nodes) * phase_seconds
            found = detector.evaluate(fleet.view(), now)
            for name in schedule:
                out[name].append((now, [f for f in found if f.node == name]))
    return out


def test_a_port_dropping_every_six_minutes_alerts_at_its_third_drop_and_drains_at_its_fifth():
    found = flapping_every(360, 1)
    first_alert = next(t for t, fs in found if any(f.action is Action.ALERT for f in fs))
    first_drain = next(t for t, fs in found if any(f.action is Action.DRAIN for f in fs))
    assert first_alert == 18 * 60.0  # 3 drops in an hour: 6, 12, 18 minutes
    assert first_drain == 30 * 60.0  # the fifth drop; never 3 in 10 minutes
    [drain] = found[30][1]  # t = 30 min
    assert (drain.action, drain.evidence["horizon"], drain.evidence["events"], drain.evidence["device"]) == (
        Action.DRAIN, "slow", 5, "mlx5_2")
    assert drain.since == 6 * 60.0


def test_a_port_dropping_every_six_minutes_still_drains_when_it_persists_for_hours():
    [drain] = flapping_every(360, 4)[-1][1]
    assert drain.action is Action.DRAIN and drain.evidence["horizon"] in ("long", "slow")


def test_a_link_down_twice_an_hour_drains_at_its_fifth_drop():
    found = flapping_every(1800, 6)
    first_drain = next(t for t, fs in found if any(f.action is Action.DRAIN for f in fs))
    assert first_drain == 5 * 1800.0


def test_a_link_retraining_without_going_down_twice_an_hour_never_drains():
    # link_error_recovery: the link recovered from errors and stayed up; only the 10-minute and
    # hourly rules count it, and two an hour reach neither.
    assert all(not fs for _, fs in flapping_every(1800, 6, counter="link_error_recovery"))


def test_one_drop_never_fires():
    assert all(not fs for _, fs in drops_at({"a": [600.0]}, hours=7)["a"])


def test_four_drops_in_six_hours_do_not_drain():
    # A maintenance (leaf reboot, then its firmware activation) and two stray drops hours apart.
    found = drops_at({"a": [600.0, 900.0, 3 * 3600.0, 5 * 3600.0]}, hours=6)["a"]
    assert all(f.action is not Action.DRAIN for _, fs in found for f in fs)


def test_drops_two_hours_apart_never_fill_the_slow_window_but_alert_on_the_daily_one():
    found = drops_at({"a": [h * 7200.0 for h in range(1, 7)]}, hours=13)["a"]
    assert all(f.action is Action.ALERT for _, fs in found for f in fs)
    first_alert = next(t for t, fs in found if fs)
    assert first_alert == 3 * 7200.0  # the report that sees the third drop


def test_a_link_dropping_once_an_hour_alerts_at_its_third_drop_and_drains_at_its_fifth():
    found = flapping_every(3600, 6)
    first_alert = next(t for t, fs in found if fs)
    first_drain = next(t for t, fs in found if any(f.action is Action.DRAIN for f in fs))
    assert first_alert == 3 * 3600.0  # drops at 1, 2 and 3 h: two hours after the first, not five
    [alert] = dict(found)[first_alert]
    assert (alert.action, alert.key, alert.evidence["horizon"], alert.evidence["events"]) == (
        Action.ALERT, "flap_daily:mlx5_2/1", "daily", 3)
    assert alert.since == 3600.0
    assert first_drain == 5 * 3600.0  # the slow tier's fifth drop still drains


def test_drops_more_than_half_a_day_apart_never_alert():
    # The lookalike: a reseated cable, a leaf's firmware activation, another maintenance the next
    # day - never three of the port's own drops inside 24 h.
    found = drops_at({"a": [1800.0, 13.5 * 3600.0, 26.0 * 3600.0]}, hours=27)["a"]
    assert all(not fs for _, fs in found)


def test_two_drops_in_a_day_never_alert():
    found = drops_at({"a": [1800.0, 2400.0]}, hours=24)["a"]
    assert all(not fs for _, fs in found)


def test_drop_counts_survive_the_fleets_counter_ring():
    # The fleet keeps only 4 increases per counter (history_reports, its minimum): the fifth
    # drop evicts the first from the view, not from the detector's memory.
    found = flapping_every(1800, 6, fleet=Fleet(FleetConfig(history_reports=4)))
    first_drain = next(t for t, fs in found if any(f.action is Action.DRAIN for f in fs))
    assert first_drain == 5 * 1800.0
    found = flapping_every(3600, 6, fleet=Fleet(FleetConfig(history_reports=4)),
                           config=NetworkConfig(flap_daily_threshold=6, flap_slow_threshold=7))
    assert not any(fs for _, fs in found[:-1])
    [alert] = found[-1][1]  # the sixth drop, at 6 h: six remembered, four in the ring
    assert (alert.evidence["events"], alert.evidence["horizon"]) == (6, "daily")


def test_the_drop_memory_forgets_what_is_past_the_window():
    detector = NetworkDetector(NetworkConfig())
    node = FakeNode("a", gpus=0)
    fleet = Fleet()
    t = 0.0
    for t in (0.0, 60.0, 120.0, 180.0):
        node.ports[2]["counters"]["link_downed"] += 1 if t else 0
        fleet.ingest(node.report(t), t)
        detector.evaluate(fleet.view(), t)
    assert detector.drops_remembered == 3
    fleet.ingest(node.report(25 * 3600.0), 25 * 3600.0)
    assert detector.evaluate(fleet.view(), 25 * 3600.0) == []
    assert detector.drops_remembered == 0


def test_the_drop_memory_is_bounded_per_port():
    detector = NetworkDetector(NetworkConfig())
    node = FakeNode("a", gpus=0)
    fleet = Fleet()
    for minute in range(200):  # a drop every minute: drained on the short horizon, remembered up to 64
        node.ports[2]["counters"]["link_downed"] += 1
        fleet.ingest(node.report(minute * 60.0), minute * 60.0)
        detector.evaluate(fleet.view(), minute * 60.0)
    assert detector.drops_remembered == 64


def test_drops_shared_by_many_nodes_at_once_are_the_fabrics():
    # A leaf switch rebooting five times over five hours: every node's port drops at the same
    # moments (each node's report sees it within one interval). No node-level slow flap; the
    # per-node findings of a faster-flapping switch are the topology pass's.
    switch = [3600.0 * h + 30.0 for h in range(5)]
    nodes = {f"n{i}": switch for i in range(4)}
    found = drops_at(nodes, hours=5, phase_seconds=2.5)
    assert all(not fs for name in nodes for _, fs in found[name])


def test_one_own_drop_plus_four_shared_does_not_drain_but_five_own_do():
    switch = [3600.0 * h + 30.0 for h in range(1, 5)]
    nodes = {"n0": [600.0, *switch], "n1": switch, "n2": switch, "n3": [600.0 + 1200.0 * k for k in range(5)]}
    found = drops_at(nodes, hours=5)
    assert all(not fs for _, fs in found["n0"])
    [drain] = found["n3"][-1][1]
    assert (drain.action, drain.evidence["events"], drain.evidence["shared_with_other_nodes"]) == (
        Action.DRAIN, 5, 0)


def test_two_nodes_dropping_together_are_not_yet_the_fabric():
    # Two bad cables that happen to drop in the same reports are still two bad cables.
    both = [600.0 + 1200.0 * k for k in range(5)]
    found = drops_at({"a": both, "b": both}, hours=2)
    for name in ("a", "b"):
        [drain] = found[name][-1][1]
        assert (drain.action, drain.evidence["horizon"]) == (Action.DRAIN, "slow")


def test_slow_flap_counters_must_be_tracked():
    with pytest.raises(ValidationError):
        NetworkConfig(flap_slow_counters=["link_downed", "port_rcv_errors"])


def test_a_leaf_switch_flapping_every_six_minutes_is_one_ticket_for_the_switch_not_node_drains():
    # The whole pipeline (detectors, topology pass, gate): the four nodes under leaf-1 lose their
    # link at the same moments for 40 minutes; the nodes under leaf-0 stay healthy.
    nodes = [FakeNode(f"n{i}", gpus=0, ports=2, interval=30.0,
                      topology={"leaf_switch": f"leaf-{i // 4}", "rack": "rack-0"}) for i in range(8)]

    def switch_flaps(t):
        if t and t % 360 == 0:
            for node in nodes[4:]:
                node.ports[0]["counters"]["link_downed"] += 1
    decisions = drive(Engine(AggregatorConfig(), proposals_ledger()), nodes, 0.0, 2400.0, before=switch_flaps)
    assert decisions and all(d.node == "leaf-1" for d in decisions)
    assert {d.action for d in decisions} <= {Action.ALERT, Action.INSPECT_HARDWARE}
