import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.aggregator.conftest import FakeNode, drive, proposals_ledger
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.topology import TopologyAttributor, TopologyConfig
from vigil.aggregator.engine import Engine


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
    engine = Engine(AggregatorConfig(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 200.0, before=port_errors(nodes, {"n4", "n5", "n6", "n7"}, 100.0))
    assert sorted((d.action, d.node, d.component) for d in decisions) == [
        (Action.ALERT, "leaf-1", "leaf-1"), (Action.INSPECT_HARDWARE, "leaf-1", "leaf-1")]
    assert decisions[0].evidence["nodes"] == ["n4", "n5", "n6", "n7"]
    assert decisions[0].evidence["signals"] == ["symbol_error_rate"]
    assert decisions[0].evidence["classes"] == ["network"]


def test_one_bad_cable_under_a_leaf_drains_only_that_node():
    nodes = leaf_fleet()
    engine = Engine(AggregatorConfig(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 200.0, before=port_errors(nodes, {"n5"}, 100.0))
    assert [(d.action, d.node) for d in decisions] == [(Action.DRAIN, "n5")]


def test_rack_power_loss_is_one_ticket_not_a_drain_per_node():
    nodes = leaf_fleet(8, per_leaf=4)
    engine = Engine(AggregatorConfig(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 250.0, skip=lambda node, t: t >= 100.0)
    assert sorted((d.action, d.component) for d in decisions) == [
        (Action.ALERT, "rack-0"), (Action.INSPECT_HARDWARE, "rack-0")]


def test_rack_going_dark_over_several_seconds_is_still_one_ticket():
    # The nodes' last reports land over 5 s (staggered agents): the first node's silence must
    # wait for its neighbours instead of being alerted alone.
    nodes = leaf_fleet(8, per_leaf=4)
    engine = Engine(AggregatorConfig(), proposals_ledger())
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

    engine = Engine(AggregatorConfig(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 220.0, before=before)
    assert not [d for d in decisions if d.action in REMOVING and d.component is None]
    assert any(d.action is Action.INSPECT_HARDWARE and d.component == "leaf-1" for d in decisions)


# A rail-optimised fabric as sim/scenario.py builds it: racks of 4 nodes, one row, groups of 8
# nodes with one leaf per rail (HCA r, mlx5_<r>, of every node in a group cables to its rail-r leaf).
RAILS = 4
RAIL_LABELS = [f"rail{r}_leaf" for r in range(RAILS)]


def rail_fleet(n=16, per_group=8, per_rack=4):
    return [FakeNode(f"n{i}", ports=RAILS, topology={
        "row": "row-0", "rack": f"rack-{i // per_rack}",
        **{f"rail{r}_leaf": f"leaf-{i // per_group}-rail{r}" for r in range(RAILS)}}) for i in range(n)]


def rail_config(**topology):
    return AggregatorConfig.model_validate(
        {"detectors": {"topology": {"labels": [*RAIL_LABELS, "rack", "row"], **topology}}})


def errors_on(nodes, ports_of, start):
    """From ``start`` on, symbol errors on the ports ``ports_of[node name]`` (HCA indexes)."""
    def before(t):
        if t >= start:
            for node in nodes:
                for p in ports_of.get(node.name, ()):
                    node.ports[p]["counters"]["symbol_error"] += 5000
    return before


GROUP_1 = [f"n{i}" for i in range(8, 16)]


@pytest.mark.parametrize("rail", range(RAILS))
def test_a_failing_rail_leaf_is_indicted_not_the_other_rails_leaves(rail):
    # Every node of group 1 counts errors on its rail-`rail` HCA only: that rail's leaf, and no
    # other leaf of the group (each covers the same 8 nodes), nor their racks, nor the nodes.
    nodes = rail_fleet()
    engine = Engine(rail_config(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 200.0, before=errors_on(nodes, dict.fromkeys(GROUP_1, (rail,)), 100.0))
    leaf = f"leaf-1-rail{rail}"
    assert sorted((d.action, d.node, d.component) for d in decisions) == [
        (Action.ALERT, leaf, leaf), (Action.INSPECT_HARDWARE, leaf, leaf)]
    assert decisions[0].evidence["nodes"] == sorted(GROUP_1)
    assert decisions[0].evidence["port"] == f"mlx5_{rail}"


@pytest.mark.parametrize("rails", [[0, 2], [0, 1, 2, 3]])
def test_errors_on_several_rails_of_the_same_nodes_are_not_a_rail_leafs(rails):
    # Lookalike: every node of group 1 counts errors on several HCAs. Each of those rails' leaves
    # alone covers all 8 nodes, but two switches failing in the same seconds is far less likely
    # than one cause shared by the nodes (a firmware push): no rail leaf is indicted, and no rack
    # or row either (their power and cooling make no symbol errors): the nodes stand on their own
    # findings (the gate's breaker is what stops a fleet-wide push).
    nodes = rail_fleet()
    engine = Engine(rail_config(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 200.0, before=errors_on(nodes, dict.fromkeys(GROUP_1, tuple(rails)), 100.0))
    assert not [d for d in decisions if d.component is not None]
    assert {d.node for d in decisions if d.action is Action.DRAIN} == set(GROUP_1)


def test_one_node_erroring_on_every_rail_drains_that_node_alone():
    # Lookalike: one node's four HCAs all count errors (its own PCIe switch or HCA firmware): one
    # node on each rail leaf is a bad node, not four bad switches.
    nodes = rail_fleet()
    engine = Engine(rail_config(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 200.0, before=errors_on(nodes, {"n9": range(RAILS)}, 100.0))
    assert {(d.action, d.node) for d in decisions} == {(Action.DRAIN, "n9")}


def test_a_bad_cable_during_a_rail_leaf_fault_drains_only_its_node():
    # Rail 2's leaf fails while n9 also has a bad cable on rail 0: the leaf is indicted with all
    # 8 nodes' rail-2 errors (not n9's rack), and n9's rail-0 errors drain n9 on their own.
    nodes = rail_fleet()
    ports = {**dict.fromkeys(GROUP_1, (2,)), "n9": (0, 2)}
    engine = Engine(rail_config(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 200.0, before=errors_on(nodes, ports, 100.0))
    assert sorted((d.action, d.node) for d in decisions) == [
        (Action.ALERT, "leaf-1-rail2"), (Action.DRAIN, "n9"), (Action.INSPECT_HARDWARE, "leaf-1-rail2")]
    assert next(d for d in decisions if d.node == "leaf-1-rail2").evidence["nodes"] == sorted(GROUP_1)
    assert next(d for d in decisions if d.node == "n9").evidence["device"] == "mlx5_0"


def test_silent_nodes_are_not_their_rail_leafs_fault():
    # A node's reports do not cross its compute rails: a silent group is not rail 0's leaf's. Half
    # of the only row dark at once is the row's (two whole racks of 4 against a rest-of-fleet rate
    # of 4 in 12 are p = 0.012 each, the row's 8 of 16 against the floor is ~1e-12): one ticket.
    nodes = rail_fleet()
    engine = Engine(rail_config(), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 250.0, skip=lambda node, t: t >= 100.0 and node.name in GROUP_1)
    assert sorted((d.action, d.component) for d in decisions) == [
        (Action.ALERT, "row-0"), (Action.INSPECT_HARDWARE, "row-0")]
    assert decisions[0].evidence["nodes"] == sorted(GROUP_1)


def test_a_site_maps_its_rails_to_its_own_hca_names():
    # HCAs not numbered by rail (rail 1 on mlx5_3): errors on mlx5_3 indict rail 1's leaf, and under
    # the default mapping (rail 1 on mlx5_1) they would indict no rail leaf at all.
    nodes = rail_fleet()
    mapping = {"rail0_leaf": "mlx5_0", "rail1_leaf": "mlx5_3", "rail2_leaf": "mlx5_1", "rail3_leaf": "mlx5_2"}
    engine = Engine(rail_config(port_labels=mapping), proposals_ledger())
    decisions = drive(engine, nodes, 0.0, 200.0, before=errors_on(nodes, dict.fromkeys(GROUP_1, (3,)), 100.0))
    assert sorted((d.action, d.component) for d in decisions) == [
        (Action.ALERT, "leaf-1-rail1"), (Action.INSPECT_HARDWARE, "leaf-1-rail1")]


def test_port_labels_default_and_validation():
    topology = TopologyAttributor(TopologyConfig())
    assert topology.port_of("rail2_leaf") == "mlx5_2"
    assert topology.port_of("rail12_leaf") == "mlx5_12"
    assert [topology.port_of(label) for label in ("leaf_switch", "rack", "row", "rail_leaf", "xrail2_leaf")] == [
        None] * 5
    with pytest.raises(ValidationError, match="does not capture"):
        TopologyConfig(port_labels={r"rail(\d+)_leaf": "mlx5_{rail}"})
    with pytest.raises(ValidationError, match="not a regex"):
        TopologyConfig(port_labels={"rail(": "mlx5_0"})
