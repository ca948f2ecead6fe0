"""Fleet membership and intake checks: who counts as a member, when a node is forgotten (and
archived), which report timestamps and sequence numbers are refused, and that a refused report
leaves the fleet untouched."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import FakeNode, proposals_ledger
from vigil.aggregator.app import EVALUATE_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Decision
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet, FleetConfig
from vigil.aggregator.gate import Gate
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.wire import Event, encode, replace

T0 = 1_800_000_000.0
SECRET = b"site-secret-of-the-membership-test-0123456789"
AM = b"alertmanager-token-0123456789"


def test_a_report_ts_far_from_the_receivers_clock_is_taken_and_its_skew_measured() -> None:
    """A node's clock is not a reason to refuse its report (issue 37): the skew is measured."""
    fleet = Fleet(FleetConfig(max_clock_skew_seconds=120))
    node = FakeNode("n1")
    for ts in (T0 + 119, T0 - 119, T0 + 121, T0 - 3600):
        assert fleet.refusal(node.report(ts), T0) is None
    fleet.ingest(node.report(T0 + 121), T0)
    n1 = fleet.view().nodes["n1"]
    assert n1.clock_skew_seconds == n1.clock_offset_seconds == 121 and fleet.is_skewed(n1)


def test_seq_may_advance_as_far_as_the_node_could_have_reported() -> None:
    fleet = Fleet(FleetConfig(max_seq_jump=1000, max_reports_per_second=20))
    node = FakeNode("n1")
    fleet.ingest(node.report(T0), T0)
    ahead = replace(node.report(T0 + 1), seq=1 + 1000)
    assert fleet.refusal(ahead, T0 + 1) is None
    assert (fleet.refusal(replace(ahead, seq=2 + 1000 + 20), T0 + 1) or ("",))[0] == "seq_jump"
    # After an hour of silence (an aggregator outage), the node's seq has legitimately moved on.
    later = replace(node.report(T0 + 3600), seq=1 + 3600 // 3)
    assert fleet.refusal(later, T0 + 3600) is None
    # A new boot starts its own sequence: no bound against the old one.
    node.reboot()
    assert fleet.refusal(replace(node.report(T0 + 2), seq=10**9), T0 + 2) is None


def test_members_reporting_since_and_forgetting_departed_nodes() -> None:
    fleet = Fleet(FleetConfig(forget_after_seconds=86400))
    a, b = FakeNode("a"), FakeNode("b")
    fleet.ingest(a.report(T0), T0)
    fleet.ingest(b.report(T0 + 3000), T0 + 3000)
    assert fleet.reporting_since(T0 + 1) == 1 and fleet.reporting_since(T0) == 2
    assert fleet.is_member("a", T0 + 86399) and not fleet.is_member("a", T0 + 86400)
    assert not fleet.is_member("never", T0)
    assert fleet.forget_departed(T0 + 86399) == []
    gone = fleet.forget_departed(T0 + 86401)
    assert [n.name for n in gone] == ["a"] and set(fleet.view().nodes) == {"b"}
    assert gone[0].summary()["reports"] == 1


async def test_a_departed_node_is_archived_and_can_no_longer_be_named(tmp_path: Path) -> None:
    clock = [T0]
    config = parse_config({"dry_run": False, "evaluate_interval_seconds": 3600,
                           "fleet": {"forget_after_seconds": 3600}})
    store = Store(tmp_path / "d.sqlite")
    sink = Ledger(Gate(config.gate), store, {})
    app = make_app(config, Engine(config, sink), sink, clock=lambda: clock[0],
                   credentials=Credentials(site_secret=SECRET, alertmanager=AM))
    alert = {"version": "4", "status": "firing", "alerts": [{
        "status": "firing", "labels": {"alertname": "X", "node": "gone-1", "vigil_action": "alert"},
        "startsAt": "2026-01-01T00:00:00Z"}]}
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            node = FakeNode("gone-1")
            resp = await client.post("/v1/reports", data=encode(node.report(T0)),
                                     headers={"Authorization": f"Bearer {node_token(SECRET, 'gone-1')}"})
            assert resp.status == 202
            clock[0] = T0 + 3601
            app[EVALUATE_KEY]()
            assert (await (await client.get("/v1/nodes")).json())["nodes"] == []
            [(name, when, summary)] = store.departed_nodes()
            assert (name, when, summary["reports"]) == ("gone-1", T0 + 3601, 1)
            out = await (await client.post("/v1/alertmanager", json=alert,
                                           headers={"Authorization": f"Bearer {AM.decode()}"})).json()
            assert out["proposed"] == 0 and out["refused"][0]["error"] == "unknown_node"
    finally:
        store.close()


class Budgets(Ledger):
    """The real ledger over a store in memory, recording the fleet size each submission's breaker
    budget is computed from."""

    def __init__(self) -> None:
        memory = proposals_ledger()
        super().__init__(memory.gate, memory.store, memory.actuators)
        self.fleet_nodes: list[int] = []

    def submit(self, decisions: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        self.fleet_nodes.append(fleet_nodes)
        return super().submit(decisions, now, fleet_nodes)


def test_the_breakers_budget_counts_only_nodes_that_reported_within_its_window() -> None:
    config = parse_config({"gate": {"breaker_window_seconds": 600}})
    sink = Budgets()
    engine = Engine(config, sink)
    old = [FakeNode(f"old-{i}", gpus=1, ports=0) for i in range(50)]
    for node in old:  # reported once, long ago (or forged, and never again)
        engine.ingest(node.report(T0), T0)
    live = [FakeNode(f"live-{i}", gpus=1, ports=0) for i in range(4)]
    for node in live:
        engine.ingest(node.report(T0 + 3000), T0 + 3000)
    sick = live[0]
    engine.ingest(sick.report(T0 + 3001, events=[Event(kind="xid", ts=T0 + 3001, code=79, gpu=0, urgent=True)],
                              urgent=True), T0 + 3001)
    assert engine.evaluate(T0 + 3002)
    assert sink.fleet_nodes == [4]
