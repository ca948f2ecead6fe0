from tests.aggregator.conftest import FakeNode, drive, proposals_ledger
from vigil.aggregator.config import AggregatorConfig, parse_config
from vigil.aggregator.decision import Action
from vigil.aggregator.engine import Engine
from vigil.aggregator.ledger import Ledger
from vigil.contract.wire import Event


class CountingSink(Ledger):
    """The real ledger over a store in memory, recording each proposal (and admitting none with
    ``admit=False``)."""

    def __init__(self, admit=True):
        memory = proposals_ledger()
        super().__init__(memory.gate, memory.store, memory.actuators)
        self.calls = []
        self.admit = admit

    def submit(self, decisions, now, fleet_nodes):
        self.calls.append((list(decisions), now, fleet_nodes))
        return super().submit(decisions, now, fleet_nodes) if self.admit else []


def test_a_persisting_fault_is_decided_once():
    sink = CountingSink()
    engine = Engine(AggregatorConfig(), sink)
    nodes = [FakeNode(f"n{i}") for i in range(3)]

    def storm(t):
        if t >= 50:
            nodes[1].gpus[2]["ecc_uncorrected_volatile"] += 1
    decisions = drive(engine, nodes, 0.0, 300.0, before=storm)
    assert [(d.node, d.gpu, d.action, d.detector) for d in decisions] == [("n1", 2, Action.DRAIN, "memory")]
    assert decisions[0].dry_run is True
    assert sink.calls[0][2] == 3
    assert sink.recent() == decisions


def test_a_refused_decision_is_proposed_again_with_the_same_id_while_its_fault_persists():
    # Refused (breaker open, maintenance, opt-out) is not forgotten: once the reason is gone the
    # sink admits the very same decision, so the engine offers it every cycle.
    sink = CountingSink(admit=False)
    engine = Engine(AggregatorConfig(), sink)
    node = FakeNode("n0")

    def storm(t):
        if t >= 50:
            node.gpus[0]["ecc_uncorrected_volatile"] += 1
    assert drive(engine, [node], 0.0, 200.0, before=storm) == []
    offered = [d for decisions, _, _ in sink.calls for d in decisions]
    assert len(offered) > 10 and len({d.id for d in offered}) == 1


def test_dry_run_false_is_carried_into_decisions():
    engine = Engine(parse_config({"dry_run": False}), proposals_ledger())
    node = FakeNode("n0")
    engine.ingest(node.report(0.0), 0.0)
    engine.ingest(node.report(2.5, events=[Event(kind="xid", ts=2.0, code=79, gpu=4, urgent=True)]), 2.5)
    [d] = engine.evaluate(2.6)
    assert d.dry_run is False and d.gpu == 4 and d.detector == "xid"


def test_healthy_fleet_produces_no_decisions():
    engine = Engine(AggregatorConfig(), proposals_ledger())
    assert drive(engine, [FakeNode(f"n{i}") for i in range(4)], 0.0, 300.0) == []


def test_disabled_detector_does_not_run():
    engine = Engine(parse_config({"detectors": {"xid": {"enabled": False}}}), proposals_ledger())
    assert "xid" not in [d.name for d in engine.detectors]
