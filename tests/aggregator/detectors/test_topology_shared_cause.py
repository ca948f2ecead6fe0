"""Shared cause first (issue 38): the topology pass reads straggler, GPU and thermal findings too,
indicts a component by a binomial test against the fleet's erring rate, holds its nodes' removals
only while it is plausible and never longer than max_hold_seconds, and a component's finding that
the breaker refuses still pages."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from tests.aggregator.conftest import FakeNode, drive
from tests.aggregator.test_ledger import dec
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.topology import ONSET, TopologyAttributor, TopologyConfig, binomial_tail, episode
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet, FleetView
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store


def fleet_view(n: int = 64, per_rack: int = 4, per_leaf: int = 16, per_row: int = 16) -> FleetView:
    """``n`` nodes n00.. in racks of 4, leaves of 16, rows of 16 (the scenarios' layout)."""
    fleet = Fleet()
    for i in range(n):
        node = FakeNode(f"n{i:02d}", ports=1, gpus=1, topology={
            "rack": f"rack-{i // per_rack}", "leaf_switch": f"leaf-{i // per_leaf}", "row": f"row-{i // per_row}"})
        fleet.ingest(node.report(0.0), 0.0)
    return fleet.view()


def straggler(node: str, since: float = 100.0) -> Finding:
    return Finding(detector="straggler", node=node, job="pretrain", action=Action.DRAIN, since=since, key="pretrain",
                   reason="slow", evidence={"signal": "compute_seconds_p50"})


def onset(node: str, since: float = 100.0) -> Finding:
    return Finding(detector="thermal", node=node, gpu=0, action=Action.OBSERVE, since=since,
                   key="clock_throttle:onset", reason="hot", evidence={"signal": "clock_event_reasons", ONSET: True})


def port_errors(node: str, since: float = 100.0) -> Finding:
    return Finding(detector="network", node=node, action=Action.DRAIN, since=since, key="symbol_error:mlx5_0/1",
                   reason="errors", evidence={"signal": "symbol_error_rate", "device": "mlx5_0", "port": 1})


def released_at(topology: TopologyAttributor, view: FleetView, findings: list[Finding], subject: str,
                start: float = 100.0) -> float:
    """When ``subject``'s straggler finding (first seen at ``start``) is first passed on, each
    evaluation 2.5 s apart."""
    first_seen = {episode(f): start for f in findings}
    t = start
    while t < start + 600.0:
        out = topology.evaluate(view, t, findings, first_seen)
        assert not [f for f in out if f.component is not None], "no component may be indicted here"
        if any(f.node == subject and f.detector == "straggler" for f in out):
            return t - start
        t += 2.5
    raise AssertionError("never released")


def test_binomial_tail_against_known_values():
    assert binomial_tail(0, 4, 0.01) == 1.0
    assert binomial_tail(5, 4, 0.5) == 0.0
    assert binomial_tail(4, 4, 0.5) == pytest.approx(1 / 16)
    exact = 1 - sum(math.comb(16, i) * 0.01 ** i * 0.99 ** (16 - i) for i in range(3))
    assert binomial_tail(3, 16, 0.01) == pytest.approx(exact, rel=1e-9)
    assert binomial_tail(1000, 1000, 0.5) > 0.0  # log space: no underflow to a wrong 0 before the end


def test_a_lone_hot_straggler_waits_hold_seconds_only_and_is_not_its_racks():
    # The lookalike: one node's own heat (its onset and its straggler finding), nobody else erring.
    topology = TopologyAttributor(TopologyConfig())
    delay = released_at(topology, fleet_view(), [onset("n21"), straggler("n21")], "n21")
    assert delay == TopologyConfig().hold_seconds == 5.0


def test_a_coincident_rack_mate_delays_a_lone_node_by_max_hold_seconds_at_most():
    # n22 throttles for good (its onset persists) but never becomes a third: the rack is
    # plausible (2 of 4), never indicted; n21's drain waits exactly the bound, then goes out.
    topology = TopologyAttributor(TopologyConfig())
    delay = released_at(topology, fleet_view(), [onset("n21"), straggler("n21"), onset("n22")], "n21")
    assert delay == TopologyConfig().max_hold_seconds == 30.0


def test_two_nodes_erring_in_a_fleet_that_errs_everywhere_hold_nobody():
    # 2 of a rack's 4 nodes err, but so does one node of every other rack: the rack is no more
    # likely a cause than chance (tail 0.26 against a rate of 1/4): n21 waits hold_seconds only.
    others = [onset(f"n{i:02d}") for i in range(0, 64, 4) if i != 20]
    topology = TopologyAttributor(TopologyConfig())
    delay = released_at(topology, fleet_view(), [straggler("n21"), onset("n22"), *others], "n21")
    assert delay == 5.0


def test_a_rack_turning_hot_node_by_node_is_indicted_before_any_drain_and_takes_them_all():
    view, topology = fleet_view(), TopologyAttributor(TopologyConfig())
    findings = [onset("n20", 100.0), straggler("n20", 100.0), onset("n21", 110.0)]
    first_seen = {episode(f): 115.0 for f in findings}
    # two of the rack erring: plausible, n20's drain held (past hold_seconds), nothing indicted
    assert topology.evaluate(view, 125.0, findings, first_seen) == []
    findings.append(onset("n22", 120.0))
    out = topology.evaluate(view, 127.5, findings, first_seen)
    assert sorted((f.action, f.node, f.component) for f in out) == [
        (Action.ALERT, "rack-5", "rack-5"), (Action.INSPECT_HARDWARE, "rack-5", "rack-5")]
    assert out[0].evidence["nodes"] == ["n20", "n21", "n22"] and out[0].evidence["classes"] == ["slow", "thermal"]
    assert out[0].evidence["p_value"] < TopologyConfig().alpha and out[0].since == 100.0
    # the last node turns slow long after: the rack stays indicted and takes it, same episode
    findings += [straggler("n23", 150.0), straggler("n21", 140.0)]
    later = topology.evaluate(view, 200.0, findings, first_seen)
    assert {(f.action, f.node) for f in later} == {(Action.ALERT, "rack-5"), (Action.INSPECT_HARDWARE, "rack-5")}
    assert later[0].evidence["nodes"] == ["n20", "n21", "n22", "n23"] and later[0].since == 100.0


def test_leaf_errors_are_the_leafs_even_when_the_first_three_share_a_rack():
    # The wrong rack tickets: the first three ports to cross are all in rack-4 (under
    # leaf-1). A rack's power and cooling make no symbol errors: the leaf is indicted, no rack.
    view, topology = fleet_view(), TopologyAttributor(TopologyConfig())
    findings = [port_errors(n) for n in ("n16", "n17", "n18")]
    out = topology.evaluate(view, 100.0, findings, {})
    assert sorted((f.action, f.component) for f in out) == [
        (Action.ALERT, "leaf-1"), (Action.INSPECT_HARDWARE, "leaf-1")]


def test_a_leaf_takes_the_slowness_of_its_erring_nodes_not_other_faults_under_it():
    view, topology = fleet_view(), TopologyAttributor(TopologyConfig())
    ecc = Finding(detector="memory", node="n17", gpu=0, action=Action.DRAIN, since=90.0, key="ecc", reason="ecc")
    findings = [*(port_errors(n) for n in ("n16", "n17", "n20")), straggler("n16"), straggler("n30"), ecc]
    out = topology.evaluate(view, 200.0, findings, {})
    assert sorted((f.action, f.node) for f in out if f.component is None) == [
        (Action.DRAIN, "n17"), (Action.DRAIN, "n30")]  # n17's ECC and n30's own slowness stand


def test_half_a_population_is_not_needed_and_not_enough():
    # 3 of a row of 16 with nobody else erring is a row (tail 5e-4); 8 of 16 when 40 of the other
    # 48 err too is not (the fleet errs everywhere: a job's or the facility's, not the row's).
    view = fleet_view()
    out = TopologyAttributor(TopologyConfig()).evaluate(view, 100.0, [straggler(n) for n in ("n16", "n21", "n26")], {})
    assert {f.component for f in out} == {"row-1"}
    everywhere = [straggler(f"n{i:02d}") for i in (*range(16, 24), *range(24, 64))]
    out = TopologyAttributor(TopologyConfig()).evaluate(view, 200.0, everywhere, {})
    assert not [f for f in out if f.component is not None] and len(out) == len(everywhere)


def test_config_is_checked():
    with pytest.raises(ValueError, match="no class"):
        TopologyConfig(explains={"rack": ["cosmic_rays"]})
    with pytest.raises(ValueError, match="max_hold_seconds"):
        TopologyConfig(hold_seconds=10.0, max_hold_seconds=5.0)
    with pytest.raises(ValueError, match="plausible_alpha"):
        TopologyConfig(alpha=0.2, plausible_alpha=0.1)


def rack_fleet() -> list[FakeNode]:
    return [FakeNode(f"n{i}", ports=1, topology={"leaf_switch": f"leaf-{i // 16}", "rack": f"rack-{i // 4}"})
            for i in range(32)]


@pytest.mark.parametrize("tripped_by", ["earlier_drains", "the_component"])
def test_a_component_refused_by_the_breaker_still_pages(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                        tripped_by: str) -> None:
    # The breaker's budget (floor 1 node) is spent: either earlier drains tripped it already, or the
    # rack's own inspection is the removal that trips it. Either way an alert naming the rack and
    # its fault reaches people, counted and logged.
    nodes = rack_fleet()
    gate = GateConfig(dry_run=False, breaker_max_share=0.01, breaker_floor_nodes=1, breaker_startup_grace_seconds=0)
    book = Ledger(Gate(gate, started=0.0), Store(tmp_path / "d.db"), {})
    engine = Engine(AggregatorConfig(), book)
    drive(engine, nodes, 0.0, 50.0)
    spent = [dec("n30", Action.DRAIN, "d30", ts=50.0)]  # the budget's one node
    if tripped_by == "earlier_drains":
        spent.append(dec("n31", Action.DRAIN, "d31", ts=50.0))
    book.submit(spent, 50.0, 32)
    assert book.store.state.breaker.tripped is (tripped_by == "earlier_drains")
    caplog.set_level(logging.WARNING, logger="vigil.aggregator.ledger")
    decisions = drive(engine, nodes, 52.5, 400.0, skip=lambda node, t: t >= 100.0 and node.name in {"n4", "n5", "n6"})
    assert book.store.state.breaker.tripped
    paged = [d for d in decisions if d.action is Action.ALERT and d.node == "rack-1"]
    refused = [d for d in paged if d.id.startswith("breaker-refused-")]
    assert len(refused) == 1 and refused[0].component == "rack-1"
    assert refused[0].reason.startswith("vigil did not inspect_hardware rack-1 (circuit breaker open): 3 of 4 nodes")
    verdict = "breaker_open" if tripped_by == "earlier_drains" else "breaker_tripped"
    assert book.recorded[("inspect_hardware", "topology", verdict)] == 1
    assert book.recorded[("alert", "gate", "gate_alert")] >= 1
    assert any("gate alert breaker-refused" in r.getMessage() and "rack-1" in r.getMessage() for r in caplog.records)
    assert not [d for d in decisions if d.action is Action.DRAIN]  # nor are its nodes drained instead
    book.store.close()
