"""The node's standing in the answer to each report: untrusted while vigil has it out (a real
engine, gate and store behind the real app), trusted for a healthy node; and the lookalikes that
must leave a node trusted (dry run, a tripped breaker, an operator's hold, a finding that takes
nothing away, a resume)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.app import EVALUATE_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision, Finding, decision_id
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import BreakerRecord, Gate, GateState, HistoryEntry, NodeRecord
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.node_standing import NodeStanding
from vigil.aggregator.store import Store
from vigil.contract.wire import Event, encode

SECRET = b"site-secret-for-tests-0123456789abcdef"
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def _service(tmp_path: Path, dry_run: bool) -> AsyncIterator[tuple[TestClient, Clock, Ledger]]:
    clock = Clock(T0)
    config = parse_config({"dry_run": dry_run, "evaluate_interval_seconds": 3600})
    store = Store(tmp_path / "decisions.sqlite")
    sink = Ledger(Gate(config.gate), store, {})
    app = make_app(config, Engine(config, sink), sink, clock=clock, credentials=Credentials(site_secret=SECRET))
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield client, clock, sink
    finally:
        store.close()


async def _post(client: TestClient, clock: Clock, node: FakeNode, events: list[Event] | None = None) -> dict:
    body = encode(node.report(clock.t, events=events))
    resp = await client.post("/v1/reports", data=body, headers={
        "Authorization": f"Bearer {node_token(SECRET, node.name)}", "Content-Type": "application/json"})
    assert resp.status == 202, await resp.text()
    return await resp.json()


async def _drain_one(client: TestClient, clock: Clock, sick: FakeNode, healthy: FakeNode) -> Decision:
    for n in (sick, healthy):
        assert (await _post(client, clock, n))["standing"] == \
            {"trusted": True, "reason": "", "decision": "", "since": None}
    clock.t += 2.5
    # Xid 79 (fallen off the bus): the catalog's node-level removal.
    await _post(client, clock, sick, [Event(kind="xid", ts=clock.t, code=79, gpu=2, message="Xid 79")])
    await _post(client, clock, healthy)
    [admitted] = client.app[EVALUATE_KEY]()
    assert admitted.node == sick.name and admitted.action in (Action.DRAIN, Action.REBOOT_NODE, Action.RESET_GPU)
    return admitted


async def test_a_drained_node_is_untrusted_in_its_answer_and_a_healthy_one_trusted(tmp_path: Path) -> None:
    sick, healthy = FakeNode("gpu-1"), FakeNode("gpu-2")
    async with _service(tmp_path, dry_run=False) as (client, clock, ledger):
        admitted = await _drain_one(client, clock, sick, healthy)
        clock.t += 2.5
        standing = (await _post(client, clock, sick))["standing"]
        assert standing["trusted"] is False
        assert standing["decision"] == admitted.id and standing["since"] == T0 + 2.5
        assert admitted.action.value in standing["reason"] and admitted.detector in standing["reason"]
        assert (await _post(client, clock, healthy))["standing"]["trusted"] is True
        # The answer stays within the published schema (additionalProperties false everywhere).
        answer = await _post(client, clock, sick)
        assert set(answer) == {"status", "node", "seq", "report_versions", "standing"}
        # An operator resumes it (a resume decision through the ledger, as POST .../resume makes).
        resume = Decision(id="resume-1", ts=clock.t, node=sick.name, action=Action.RESUME, reason="fixed",
                          detector="operator", dry_run=False)
        assert ledger.submit([resume], clock.t, 2) == [resume]
        # Out of the gate's hands; the Xid's finding of the last evaluation still proposes the removal.
        standing = (await _post(client, clock, sick))["standing"]
        assert standing["trusted"] is False and standing["reason"].startswith(f"xid proposes {admitted.action}")


async def test_in_dry_run_the_node_stays_trusted_with_what_vigil_would_say(tmp_path: Path) -> None:
    sick, healthy = FakeNode("gpu-1"), FakeNode("gpu-2")
    async with _service(tmp_path, dry_run=True) as (client, clock, _):
        admitted = await _drain_one(client, clock, sick, healthy)
        standing = (await _post(client, clock, sick))["standing"]
        assert standing["trusted"] is True and standing["reason"].startswith("dry_run: vigil would distrust it")
        assert standing["decision"] == admitted.id


# The standing's rules, one lookalike at a time (gate state and findings as the app hands them) --

def _finding(node: str, action: Action = Action.DRAIN) -> Finding:
    return Finding(detector="straggler", node=node, action=action, reason="15% slower than its peers", since=T0)


def _of(state: GateState | None, findings: list[Finding], node: str, dry_run: bool = False) -> dict[str, Any]:
    return NodeStanding(lambda: state, lambda: findings, dry_run=dry_run).of(node)


def test_a_finding_that_proposes_removal_distrusts_before_the_gate_has_acted() -> None:
    f = _finding("n1")
    got = _of(GateState(), [f], "n1")
    assert got == {"trusted": False, "reason": "straggler proposes drain: 15% slower than its peers",
                   "decision": decision_id(f), "since": T0}
    assert _of(None, [f], "n1")["trusted"] is False  # a sink without a gate: findings alone
    assert _of(GateState(), [f], "n2")["trusted"] is True


def test_lookalikes_that_must_leave_the_node_trusted() -> None:
    f = _finding("n1")
    # A finding that takes nothing away (an alert, a job restart the planner chose).
    assert _of(GateState(), [_finding("n1", Action.ALERT), _finding("n1", Action.OBSERVE)], "n1")["trusted"]
    # The breaker holds automation back: a finding alone must not take the node out through the launcher.
    tripped = GateState(breaker=BreakerRecord(tripped=True, tripped_ts=T0, reason="storm"))
    got = _of(tripped, [f], "n1")
    assert got["trusted"] is True and got["reason"].startswith("breaker tripped")
    # An operator holds the node: automation leaves it alone.
    held = GateState(holds={"n1": (T0, "mine")})
    assert _of(held, [f], "n1")["trusted"] is True
    # Resumed: back in service, no finding left.
    resumed = GateState(nodes={"n1": NodeRecord("in_service", Action.DRAIN, T0)})
    assert _of(resumed, [], "n1")["trusted"] is True
    # Dry run: nothing acts.
    assert _of(GateState(), [f], "n1", dry_run=True)["trusted"] is True


def test_out_of_service_is_untrusted_even_when_held_or_the_breaker_tripped() -> None:
    entry = HistoryEntry(ts=T0, id="d-1", action=Action.INSPECT_HARDWARE, gpu=None, detector="xid", since=T0)
    state = GateState(nodes={"n1": NodeRecord("awaiting_inspection", Action.INSPECT_HARDWARE, T0)},
                      history={"n1": [entry]}, holds={"n1": (T0, "")},
                      breaker=BreakerRecord(tripped=True, tripped_ts=T0, reason="storm"))
    got = _of(state, [], "n1")
    assert got == {"trusted": False, "reason": "vigil has the node out (inspect_hardware, xid)",
                   "decision": "d-1", "since": T0}


def test_the_findings_index_is_rebuilt_only_when_the_engine_has_new_findings() -> None:
    current: list[list[Finding]] = [[_finding("n1")]]
    standing = NodeStanding(lambda: None, lambda: current[0], dry_run=False)
    assert standing.of("n1")["trusted"] is False
    current[0] = []  # the next evaluation found nothing
    assert standing.of("n1")["trusted"] is True


def test_the_reason_is_bounded() -> None:
    f = Finding(detector="x", node="n1", action=Action.DRAIN, reason="y" * 5000, since=T0)
    assert len(json.dumps(_of(GateState(), [f], "n1"))) < 400
