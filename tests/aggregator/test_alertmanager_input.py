"""POST /v1/alertmanager: a site's Alertmanager proposes decisions that pass through the gate."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from vigil.aggregator.alertmanager_input import add_routes
from vigil.aggregator.auth import Refusals
from vigil.aggregator.decision import Action
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store

NOW = 1_714_557_600.0  # 2024-05-01T10:00:00Z


def payload(node: str = "gpu-7", action: str = "drain", status: str = "firing", **labels: str) -> dict[str, Any]:
    """A version-4 body as Alertmanager 0.25 sends it."""
    return {
        "version": "4",
        "groupKey": '{}:{alertname="GpuHot"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "vigil",
        "groupLabels": {"alertname": "GpuHot"},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": [
            {
                "status": status,
                "labels": {"alertname": "GpuHot", "instance": f"{node}:9400", "vigil_action": action, **labels},
                "annotations": {"summary": "HBM above 95 C for 10 minutes"},
                "startsAt": "2024-05-01T09:50:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://prometheus:9090/graph",
                "fingerprint": "a1b2c3d4",
            }
        ],
    }


MEMBERS = {"gpu-1", "gpu-2", "gpu-7", "gpu-8", "gpu-9"}


class Counts:
    """The alertmanager door's refusals, read back from the registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.refusals = Refusals(self.registry)

    def __getitem__(self, reason: str) -> float:
        value = self.registry.get_sample_value("vigil_aggregator_refusals_total",
                                               {"door": "alertmanager", "reason": reason})
        return value or 0.0


async def client_for(tmp_path, gate: GateConfig) -> tuple[TestClient, Store, Counts]:
    store = Store(tmp_path / "d.db")
    sink = Ledger(Gate(gate), store, {})
    app = web.Application()
    counts = Counts()
    add_routes(app, sink, clock=lambda: NOW, dry_run=False, refusals=counts.refusals, fleet_nodes=lambda now: 100,
               is_member=lambda node, now: node in MEMBERS, breaker=sink)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, store, counts


async def test_firing_alert_with_vigil_action_becomes_a_gated_decision(tmp_path) -> None:
    client, store, _ = await client_for(tmp_path, GateConfig())
    resp = await client.post("/v1/alertmanager", json=payload())
    assert resp.status == 200
    out = await resp.json()
    assert out["proposed"] == 1 and len(out["admitted"]) == 1
    [row] = store.decisions()
    d = row.decision
    assert (d.node, d.action, d.detector, d.reason) == (
        "gpu-7",
        Action.DRAIN,
        "alertmanager",
        "HBM above 95 C for 10 minutes",
    )
    # Alertmanager repeats its notification every group_interval: the same alert is one decision.
    again = await (await client.post("/v1/alertmanager", json=payload())).json()
    assert again["admitted"] == [] and len(store.decisions()) == 1
    await client.close()


async def test_alert_input_cannot_bypass_opt_out_or_the_breaker(tmp_path) -> None:
    client, store, _ = await client_for(tmp_path, GateConfig(opt_out_nodes=["gpu-7"], breaker_max_nodes=1))
    assert (await (await client.post("/v1/alertmanager", json=payload())).json())["admitted"] == []
    assert store.decisions()[0].verdict == "opt_out"
    assert len((await (await client.post("/v1/alertmanager", json=payload("gpu-1"))).json())["admitted"]) == 1
    tripped = await (await client.post("/v1/alertmanager", json=payload("gpu-2"))).json()
    # Two alerts: the breaker's trip, and the refused drain's own (what was not done, and why).
    alerts = [d.decision for d in store.decisions(admitted_only=True) if d.decision.action is Action.ALERT]
    assert sorted(a.id.rsplit("-", 1)[0] for a in alerts) == ["breaker", "breaker-refused"]
    assert store.breaker().tripped and len(tripped["admitted"]) == 2
    reset = await (await client.post("/v1/breaker/reset")).json()
    assert reset == {"reset": True, "was_tripped": True} and not store.breaker().tripped
    await client.close()


async def test_resolved_unlabelled_and_unknown_actions_are_skipped_and_counted(tmp_path) -> None:
    client, _, counts = await client_for(tmp_path, GateConfig())
    body = payload()
    body["alerts"] += [
        {**body["alerts"][0], "status": "resolved"},
        {**body["alerts"][0], "labels": {"alertname": "Other", "instance": "gpu-8:9400"}},
        {**body["alerts"][0], "labels": {"instance": "gpu-9:9400", "vigil_action": "format_disk"}},
    ]
    out = await (await client.post("/v1/alertmanager", json=body)).json()
    assert out["proposed"] == 1
    assert out["skipped"] == {"resolved": 1, "no_vigil_action": 1}
    assert [(r["index"], r["error"]) for r in out["refused"]] == [(3, "unknown_action")]
    assert counts["unknown_action"] == 1
    await client.close()


async def test_one_bad_alert_is_refused_alone_and_the_batch_is_200(tmp_path) -> None:
    client, store, counts = await client_for(tmp_path, GateConfig())
    body = payload()
    good = body["alerts"][0]
    body["alerts"] += [
        {**good, "labels": {**good["labels"], "instance": "vnode[1-5]:9400"}},  # a Slurm hostlist
        {**good, "labels": {**good["labels"], "instance": "gpu-1,gpu-2:9400"}},
        {**good, "labels": {**good["labels"], "instance": "never-reported:9400"}},
        {**good, "labels": {**good["labels"], "vigil_action": "resume"}},
        {**good, "labels": {**good["labels"], "gpu": "\u00b2"}},
        {**good, "startsAt": "not a time"},
        "not an alert",
    ]
    resp = await client.post("/v1/alertmanager", json=body)
    assert resp.status == 200
    out = await resp.json()
    assert out["proposed"] == 1 and len(out["admitted"]) == 1
    assert [r["error"] for r in out["refused"]] == [
        "bad_node_name", "bad_node_name", "unknown_node", "action_not_allowed", "bad_gpu", "malformed", "malformed"]
    assert (counts["bad_node_name"], counts["unknown_node"], counts["malformed"]) == (2, 1, 2)
    assert [r.decision.node for r in store.decisions()] == ["gpu-7"]
    await client.close()


async def test_malformed_bodies_get_400_with_the_reason(tmp_path) -> None:
    client, store, counts = await client_for(tmp_path, GateConfig())
    resp = await client.post("/v1/alertmanager", data=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await resp.json())["error"] == "malformed"
    no_alerts = {k: v for k, v in payload().items() if k != "alerts"}
    resp = await client.post("/v1/alertmanager", json=no_alerts)
    body = await resp.json()
    assert resp.status == 400 and body["detail"].startswith("alerts:")
    resp = await client.post("/v1/alertmanager", json={**payload(), "version": "3"})
    assert resp.status == 400 and (await resp.json())["error"] == "unsupported_version"
    assert (counts["malformed"], counts["unsupported_version"]) == (2, 1)
    assert store.decisions() == []
    await client.close()
