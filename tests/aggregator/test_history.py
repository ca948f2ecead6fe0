"""A node's remediation history (``GET /v1/nodes/{node}/history``): a drain, a refused resume, a
failed then retried delivery, an operator's hold and resume, all in order with their actors; the
doors (401, 403, 400) and the limit's bounds."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.test_dispatch import T0, FakeClock, RecordingActuator
from tests.aggregator.test_openapi import check
from vigil.aggregator.app import make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.dispatch import DispatchConfig, Dispatcher
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import Gate
from vigil.aggregator.history import MAX_LIMIT, evidence_summary, node_history
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store

SITE_SECRET = b"site-secret-of-the-history-test-0123456789"
OPERATOR = {"Authorization": "Bearer operator-token-of-history-01"}
READ = {"Authorization": "Bearer read-token-of-the-history-01"}


@dataclass
class Bench:
    client: TestClient
    clock: FakeClock
    store: Store
    ledger: Ledger
    dispatcher: Dispatcher
    actuator: RecordingActuator


@pytest.fixture
async def bench(tmp_path: Path) -> AsyncIterator[Bench]:
    config = parse_config({"evaluate_interval_seconds": 3600, "dry_run": False})
    clock = FakeClock()
    store = Store(tmp_path / "d.sqlite")
    actuator = RecordingActuator(fail_first=1)  # the first delivery fails, its retry succeeds
    ledger = Ledger(Gate(config.gate), store, {actuator.name: actuator})
    dispatcher = Dispatcher(store, {actuator.name: actuator},
                            DispatchConfig(base_backoff_seconds=2, max_backoff_seconds=30), clock=clock,
                            rng=random.Random(7))
    credentials = Credentials(site_secret=SITE_SECRET, operator=OPERATOR["Authorization"][7:].encode(),
                              read=READ["Authorization"][7:].encode())
    app = make_app(config, Engine(config, ledger), ledger, clock=clock, credentials=credentials,
                   dispatcher=dispatcher)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield Bench(client, clock, store, ledger, dispatcher, actuator)
    finally:
        store.close()


def decision(id: str, action: Action, detector: str, ts: float, **evidence: Any) -> Decision:
    return Decision(id=id, ts=ts, node="n0", action=action, reason=f"{detector} says {action.value}",
                    detector=detector, evidence=evidence, dry_run=False)


async def live_a_day(b: Bench) -> None:
    """What the history must show: a drain (delivery fails once, then succeeds), a resume the
    recovery detector proposes too soon (refused: hysteresis), an operator's hold and resume."""
    drain = decision("drain-1", Action.DRAIN, "xid", T0, xid=79, gpu=3)
    assert b.ledger.submit([drain], T0 + 1, 10)
    b.clock.now = T0 + 2
    assert await b.dispatcher.run_once() == 1  # refused by the receiver: retried later
    b.clock.now = T0 + 60
    assert await b.dispatcher.run_once() == 1  # delivered
    assert b.actuator.received == ["drain-1"]
    early = decision("resume-early", Action.RESUME, "recovery", T0 + 100, boot_id="b2")
    assert not b.ledger.submit([early], T0 + 100, 10)
    b.clock.now = T0 + 200
    resp = await b.client.post("/v1/nodes/n0/hold", json={"note": "RMA 4411"}, headers=OPERATOR)
    assert resp.status == 200
    b.clock.now = T0 + 300
    resp = await b.client.post("/v1/nodes/n0/resume", json={"note": "cable swapped"}, headers=OPERATOR)
    assert resp.status == 200 and (await resp.json())["admitted"]


async def test_the_history_shows_everything_in_order_with_its_actors(bench: Bench) -> None:
    b = bench
    await live_a_day(b)
    # before the resume is delivered: the node is back in service, its resume delivery pending
    resp = await b.client.get("/v1/nodes/n0/history", headers=READ)
    assert resp.status == 200
    doc = await resp.json()
    check(doc, "NodeHistory")
    assert doc["order"] == "newest_first" and not doc["truncated"]
    ts = [e["ts"] for e in doc["entries"]]
    assert ts == sorted(ts, reverse=True)
    lines = [(e["kind"], e["action"], e["outcome"], e["actor"]) for e in reversed(doc["entries"])]
    assert lines == [
        ("proposed", "drain", "proposed", "xid"),
        ("verdict", "drain", "admitted", "gate"),
        ("delivery", "drain", "failed (attempt 1)", "rec"),
        ("delivery", "drain", "delivered (attempt 2)", "rec"),
        ("proposed", "resume", "proposed", "recovery"),
        ("verdict", "resume", "refused: hysteresis", "gate"),
        ("hold", "", "held", "operator"),
        ("release", "", "released", "operator"),
        ("proposed", "resume", "proposed", "operator"),
        ("verdict", "resume", "admitted", "gate"),
        ("delivery", "resume", "pending", "rec"),
    ]
    oldest = list(reversed(doc["entries"]))
    assert oldest[0]["decision"] == "drain-1" and oldest[0]["detail"] == "xid says drain [xid=79 gpu=3]"
    assert oldest[2]["detail"] == "attempt 1 refused" and oldest[3]["detail"] == "took drain"
    assert "removed" in oldest[5]["detail"] and oldest[5]["decision"] == "resume-early"
    assert oldest[6]["detail"] == "RMA 4411" and oldest[7]["detail"] == "cable swapped"
    assert "cable swapped" in oldest[8]["detail"]
    assert doc["standing"] == {"condition": "in_service", "removed": False, "removed_by": None,
                               "removed_decision": None, "removed_since": None, "held": False,
                               "held_since": None, "held_by": None, "hold_note": None}


async def test_the_standing_says_removed_by_which_decision_and_held_by_whom(bench: Bench) -> None:
    b = bench
    assert b.ledger.submit([decision("drain-1", Action.DRAIN, "xid", T0, xid=79)], T0 + 1, 10)
    b.clock.now = T0 + 5
    assert (await b.client.post("/v1/nodes/n0/hold", json={"note": "leave it"}, headers=OPERATOR)).status == 200
    doc = await (await b.client.get("/v1/nodes/n0/history", headers=OPERATOR)).json()
    assert doc["standing"] == {"condition": "removed", "removed": True, "removed_by": "drain",
                               "removed_decision": "drain-1", "removed_since": T0 + 1, "held": True,
                               "held_since": T0 + 5, "held_by": "operator", "hold_note": "leave it"}
    # a refusal while held: the gate's reason and the hold's note are in the entry
    b.clock.now = T0 + 4000
    assert not b.ledger.submit([decision("reboot-1", Action.REBOOT_NODE, "xid", T0 + 4000)], T0 + 4000, 10)
    newest = (await (await b.client.get("/v1/nodes/n0/history", headers=READ)).json())["entries"][0]
    assert (newest["kind"], newest["outcome"], newest["actor"]) == ("verdict", "refused: held", "gate")
    assert "leave it" in newest["detail"]


async def test_an_unknown_node_has_an_empty_history(bench: Bench) -> None:
    resp = await bench.client.get("/v1/nodes/never-seen/history", headers=READ)
    assert resp.status == 200
    doc = await resp.json()
    check(doc, "NodeHistory")
    assert doc["entries"] == [] and doc["standing"]["removed"] is False and doc["standing"]["held"] is False


@pytest.mark.parametrize(("headers", "status", "error"), [
    ({}, 401, "unauthenticated"),
    ({"Authorization": "Bearer wrong-token-000000000000000"}, 401, "bad_credential"),
    ({"Authorization": f"Bearer {node_token(SITE_SECRET, 'n0')}"}, 403, "forbidden"),  # the agent's own token
])
async def test_reading_history_needs_the_read_or_operator_role(bench: Bench, headers: dict[str, str], status: int,
                                                               error: str) -> None:
    resp = await bench.client.get("/v1/nodes/n0/history", headers=headers)
    assert resp.status == status
    assert (await resp.json())["error"] == error


@pytest.mark.parametrize("name", ["bad_name!", "a,b", "-lead", "x" * 300, "a..b"])
async def test_a_bad_node_name_is_400_with_the_reason(bench: Bench, name: str) -> None:
    resp = await bench.client.get(f"/v1/nodes/{name}/history", headers=READ)
    assert resp.status == 400
    body = await resp.json()
    check(body, "Error")
    assert body["error"] == "bad_node" and "node name" in body["detail"]


@pytest.mark.parametrize(("limit", "status"), [("0", 400), ("-1", 400), ("1001", 400), ("ten", 400), ("", 400),
                                               ("1", 200), ("1000", 200)])
async def test_the_limit_is_bounded(bench: Bench, limit: str, status: int) -> None:
    resp = await bench.client.get(f"/v1/nodes/n0/history?limit={limit}", headers=READ)
    assert resp.status == status, await resp.text()
    if status == 400:
        assert (await resp.json())["error"] == "bad_limit"


async def test_a_limit_keeps_the_newest_entries(bench: Bench) -> None:
    b = bench
    await live_a_day(b)
    full = (await (await b.client.get("/v1/nodes/n0/history", headers=READ)).json())["entries"]
    doc = await (await b.client.get("/v1/nodes/n0/history?limit=3", headers=READ)).json()
    assert doc["truncated"] and doc["limit"] == 3 and doc["entries"] == full[:3]
    assert len(node_history(b.store, "n0", MAX_LIMIT + 500)["entries"]) == len(full)  # clamped, not an error


def test_the_evidence_summary_is_one_bounded_line() -> None:
    gate_added = {"earlier_episodes": [{}], "escalated_from": "drain"}
    assert evidence_summary({"xid": 79, "gpu": 3, **gate_added}) == "xid=79 gpu=3"
    long = evidence_summary({"lines": ["x" * 100] * 10})
    assert len(long) == 240 and long.endswith("...") and "\n" not in long
