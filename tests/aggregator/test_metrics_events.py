"""``vigil_aggregator_events_received_total{kind}``, read from the service's own /metrics.

Fake nodes post real, authenticated reports over HTTP to the aggregator application: the events
of each accepted report are counted under their kind (a kind no agent sends under "other"), and
a report the aggregator refuses (bad JSON, schema, another node's credential, a seq jump, a stale
clock, an oversized body) adds nothing, whatever events it carries.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.aggregator.conftest import FakeNode, proposals_ledger
from vigil.aggregator.app import make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.aggregator.metrics import EVENT_KINDS, ActingReadings, AggregatorMetrics
from vigil.contract.wire import Event, encode

SECRET = b"site-secret-for-metrics-tests-0123456789"
NOW = 1_000_000.0
MAX_BODY_BYTES = 64 * 1024


def events(ts: float, **kinds: int) -> list[Event]:
    return [Event(kind=kind, ts=ts, code=13 if kind == "xid" else None, message=f"{kind} {i}")
            for kind, n in kinds.items() for i in range(n)]


class Service:
    def __init__(self, client: TestClient) -> None:
        self.client = client

    async def post(self, node: FakeNode, body: str | bytes, expect: int, token_of: str | None = None) -> str:
        auth = {"Authorization": f"Bearer {node_token(SECRET, token_of or node.name)}",
                "Content-Type": "application/json"}
        resp = await self.client.post("/v1/reports", data=body, headers=auth)
        text = await resp.text()
        assert resp.status == expect, text
        return text

    async def received(self) -> dict[str, float]:
        """kind -> vigil_aggregator_events_received_total, every series the family has."""
        text = await (await self.client.get("/metrics")).text()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vigil_aggregator_events_received_total":
                    out[sample.labels["kind"]] = sample.value
        return out


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    config = parse_config({"evaluate_interval_seconds": 3600, "max_body_bytes": MAX_BODY_BYTES})
    sink = proposals_ledger()
    app = make_app(config, Engine(config, sink), sink, clock=lambda: NOW, credentials=Credentials(site_secret=SECRET))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Service(client)


async def test_every_kind_is_exported_at_zero_before_any_report(service: Service) -> None:
    assert await service.received() == dict.fromkeys((*EVENT_KINDS, "other"), 0.0)


async def test_accepted_reports_count_their_events_by_kind(service: Service) -> None:
    a, b = FakeNode("node-a"), FakeNode("node-b")
    await service.post(a, encode(a.report(NOW, events=events(NOW, xid=3, link_down=1))), 202)
    await service.post(b, encode(b.report(NOW, events=events(NOW, xid=2, hang=1))), 202)
    await service.post(a, encode(a.report(NOW + 1)), 202)  # no events: nothing to count
    # A kind no agent sends is counted, under "other" (a node cannot mint series).
    await service.post(a, encode(a.report(NOW + 2, events=events(NOW, made_up_kind=2))), 202)
    got = await service.received()
    assert got["xid"] == 5 and got["link_down"] == 1 and got["hang"] == 1 and got["other"] == 2
    assert "made_up_kind" not in got
    assert sum(got.values()) == 9


async def test_refused_reports_count_no_events(service: Service) -> None:
    node = FakeNode("node-a")
    await service.post(node, encode(node.report(NOW, events=events(NOW, xid=1))), 202)
    before = await service.received()
    assert before["xid"] == 1

    flood = events(NOW, xid=4, sxid=2)
    report = node.report(NOW, events=flood)
    await service.post(node, encode(report)[:-10], 400)  # cut short: invalid_json
    bad = json.loads(encode(report))
    bad["events"][0]["code"] = "thirteen"
    await service.post(node, json.dumps(bad), 400)  # schema
    await service.post(node, encode(report), 403, token_of="node-b")  # another node's credential
    node.seq += 1_000_000
    await service.post(node, encode(node.report(NOW, events=flood)), 409)  # seq_jump
    node.seq -= 1_000_000
    big = encode(node.report(NOW, events=events(NOW, xid=MAX_BODY_BYTES // 50)))
    assert len(big) > MAX_BODY_BYTES
    await service.post(node, big, 413)

    assert await service.received() == before
    # The refusals were counted where refusals are: the same node's next report still counts.
    await service.post(node, encode(node.report(NOW + 1, events=events(NOW, xid=1))), 202)
    assert (await service.received())["xid"] == 2


def test_kubernetes_events_not_recorded_are_exposed_only_with_that_actuator() -> None:
    without = AggregatorMetrics(lambda: {}, acting=lambda: ActingReadings()).render().decode()
    assert "vigil_aggregator_kubernetes_events_not_recorded" not in without
    with_kube = AggregatorMetrics(lambda: {}, acting=lambda: ActingReadings(kubernetes_events_not_recorded=3))
    assert "vigil_aggregator_kubernetes_events_not_recorded_total 3.0" in with_kube.render().decode()
