from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.config import AggregatorConfig
from aggregator.decision import Action
from aggregator.engine import Engine
from aggregator.sink import RecordingSink
from tests.aggregator.conftest import FakeNode, drive


def leaf_fleet(n=8, per_leaf=4):
    return [FakeNode(f"n{i}", topology={"leaf_switch": f"leaf-{i // per_leaf}", "rack": "rack-0"})
            for i in range(n)]


def port_errors(nodes, names, start):
    def before(t):
        if t >= start:
            for node in nodes:
                if node.name in names:
                    node.ports[0]["counters"]["symbol_error"] += 5000
    return before


def test_errors_on_every_node_of_one_leaf_indict_the_switch_not_the_nodes():
    nodes = leaf_fleet()
    engine = Engine(AggregatorConfig(), RecordingSink())
    decisions = drive(engine, nodes, 0.0, 200.0, before=port_errors(nodes, {"n4", "n5", "n6", "n7"}, 100.0))
    assert sorted((d.action, d.node, d.component) for d in decisions) == [
        (Action.ALERT, "leaf-1", "leaf-1"), (Action.INSPECT_HARDWARE, "leaf-1", "leaf-1")]
    assert decisions[0].evidence["nodes"] == ["n4", "n5", "n6", "n7"]
    assert decisions[0].evidence["signal"] == "symbol_error_rate"


def test_one_bad_cable_under_a_leaf_drains_only_that_node():
    nodes = leaf_fleet()
    engine = Engine(AggregatorConfig(), RecordingSink())
    decisions = drive(engine, nodes, 0.0, 200.0, before=port_errors(nodes, {"n5"}, 100.0))
    assert [(d.action, d.node) for d in decisions] == [(Action.DRAIN, "n5")]


def test_rack_power_loss_is_one_ticket_not_a_drain_per_node():
    nodes = leaf_fleet(8, per_leaf=4)
    engine = Engine(AggregatorConfig(), RecordingSink())
    decisions = drive(engine, nodes, 0.0, 250.0, skip=lambda node, t: t >= 100.0)
    assert sorted((d.action, d.component) for d in decisions) == [
        (Action.ALERT, "rack-0"), (Action.INSPECT_HARDWARE, "rack-0")]


def test_rack_going_dark_over_several_seconds_is_still_one_ticket():
    # The nodes' last reports land over 5 s (staggered agents): the first node's silence must
    # wait for its neighbours instead of being alerted alone.
    nodes = leaf_fleet(8, per_leaf=4)
    engine = Engine(AggregatorConfig(), RecordingSink())
    decisions = drive(engine, nodes, 0.0, 250.0, skip=lambda node, t: t >= 100.0 + 2.5 * (int(node.name[1:]) % 3))
    assert sorted((d.action, d.component) for d in decisions) == [
        (Action.ALERT, "rack-0"), (Action.INSPECT_HARDWARE, "rack-0")]


REMOVING = {Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.RESTART_JOB}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(per_leaf=st.integers(3, 8), port=st.integers(0, 7), fault=st.sampled_from(["errors", "down", "flaps"]),
       stagger=st.sampled_from([0.0, 2.5]))
def test_a_shared_switch_never_drains_its_nodes(per_leaf, port, fault, stagger):
    """Every node under leaf-1 sees the same fault on its uplink (arriving over up to one report
    interval): one ticket for the switch, no node removed."""
    nodes = leaf_fleet(2 * per_leaf, per_leaf=per_leaf)
    under = {n.name for n in nodes[per_leaf:]}

    def before(t):
        for i, node in enumerate(nodes):
            if node.name not in under or t < 100.0 + stagger * (i % 2):
                continue
            p = node.ports[port]
            if fault == "errors":
                p["counters"]["symbol_error"] += 5000
            elif fault == "down":
                p["state"], p["phys_state"] = "DOWN", "Polling"
            elif t in (100.0 + stagger * (i % 2), 130.0, 160.0):
                p["counters"]["link_downed"] += 1

    engine = Engine(AggregatorConfig(), RecordingSink())
    decisions = drive(engine, nodes, 0.0, 220.0, before=before)
    assert not [d for d in decisions if d.action in REMOVING and d.component is None]
    assert any(d.action is Action.INSPECT_HARDWARE and d.component == "leaf-1" for d in decisions)
