"""The service over HTTP: fake agents post Report JSON, the test drives the clock and evaluation."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import FakeNode, proposals_ledger, set_training
from vigil.aggregator.app import EVALUATE_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import AggregatorConfig, ConfigError, parse_config
from vigil.aggregator.decision import Action
from vigil.aggregator.engine import Engine
from vigil.contract.wire import Event, encode

SECRET = b"site-secret-for-tests-0123456789abcdef"
# Node "a"'s credential; Service.post uses each node's own.
AUTH = {"Authorization": f"Bearer {node_token(SECRET, 'a')}"}


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Service:
    def __init__(self, client: TestClient, clock: Clock, app) -> None:
        self.client = client
        self.clock = clock
        self.app = app

    async def post(self, node: FakeNode, **kw):
        body = encode(node.report(self.clock.t, **kw))
        auth = {"Authorization": f"Bearer {node_token(SECRET, node.name)}"}
        resp = await self.client.post("/v1/reports", data=body, headers={**auth, "Content-Type": "application/json"})
        assert resp.status == 202, await resp.text()

    async def decisions(self):
        resp = await self.client.get("/v1/decisions", params={"limit": "1000"})
        assert resp.status == 200
        return (await resp.json())["decisions"]


@pytest.fixture
async def service():
    clock = Clock()
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    app = make_app(config, Engine(config, sink), sink, clock=clock, credentials=Credentials(site_secret=SECRET))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Service(client, clock, app)


# Bad input -------------------------------------------------------------------------------------

async def test_missing_or_wrong_token_is_401_and_counted(service):
    body = encode(FakeNode("a").report(1000.0))
    token = node_token(SECRET, "a")
    other_site = node_token(b"another-site-secret-0123456789abcdef", "a")
    cases = [({}, "unauthenticated"), ({"Authorization": "Bearer nope"}, "bad_credential"),
             ({"Authorization": token}, "unauthenticated"),
             ({"Authorization": f"Bearer {other_site}"}, "bad_credential")]
    for headers, reason in cases:
        resp = await service.client.post("/v1/reports", data=body, headers=headers)
        assert resp.status == 401
        assert (await resp.json())["error"] == reason
    metrics = await (await service.client.get("/metrics")).text()
    assert 'vigil_aggregator_report_rejections_total{reason="unauthenticated"} 2.0' in metrics
    assert 'vigil_aggregator_refusals_total{door="reports",reason="bad_credential"} 2.0' in metrics
    assert "vigil_aggregator_reports_total 0.0" in metrics


async def test_a_node_reports_only_for_itself(service):
    body = encode(FakeNode("b").report(1000.0))
    resp = await service.client.post("/v1/reports", data=body, headers=AUTH)  # a's token, b's report
    assert resp.status == 403 and (await resp.json())["error"] == "node_mismatch"
    assert (await (await service.client.get("/v1/nodes")).json())["nodes"] == []


async def test_malformed_json_is_400_with_reason(service):
    resp = await service.client.post("/v1/reports", data=b'{"node": "a", ', headers=AUTH)
    assert resp.status == 400
    assert (await resp.json())["error"] == "invalid_json"


async def test_schema_error_names_the_key_path(service):
    good = json.loads(encode(FakeNode("a").report(1.0)))

    def wrong_index(report):
        report["gpus"][3]["index"] = "three"

    def unknown_key(report):
        report["gpus"][1]["temprature"] = 3

    def missing(report):
        del report["boot_id"]

    # The decoder stops at the first error: each fault alone, each named by its path.
    for spoil, path in ((wrong_index, "gpus.3.index"), (unknown_key, "gpus.1.temprature"), (missing, "boot_id")):
        report = json.loads(json.dumps(good))
        spoil(report)
        resp = await service.client.post("/v1/reports", json=report, headers=AUTH)
        assert resp.status == 400
        body = await resp.json()
        assert body["error"] == "schema"
        assert [e["path"] for e in body["errors"]] == [path], body
    bad: object
    for bad in ([], "text", 3, None):
        resp = await service.client.post("/v1/reports", json=bad, headers=AUTH)
        assert resp.status == 400


async def test_oversized_body_is_413(service):
    node = FakeNode("a")
    huge = node.report(1.0, events=[Event(kind="xid", ts=1.0, code=13, message="x" * 4096)] * 300)
    body = encode(huge)
    resp = await service.client.post("/v1/reports", data=io.BytesIO(body), headers=AUTH)
    assert resp.status == 413

    async def chunks():  # no Content-Length: the limit holds while reading
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]
    resp = await service.client.post("/v1/reports", data=chunks(), headers=AUTH)
    assert resp.status == 413
    metrics = await (await service.client.get("/metrics")).text()
    assert 'vigil_aggregator_report_rejections_total{reason="too_large"} 2.0' in metrics


async def test_form_body_is_400(service):
    resp = await service.client.post("/v1/reports", data=b"node=a",
                                     headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status == 400


async def test_bad_queries_and_unknown_paths(service):
    for limit in ("abc", "0", "-1", "100000"):
        resp = await service.client.get("/v1/decisions", params={"limit": limit})
        assert resp.status == 400
    assert (await service.client.get("/v1/nodes/nope")).status == 404
    assert (await service.client.get("/v1/nope")).status == 404
    assert (await service.client.get("/v1/reports")).status == 405
    assert (await service.client.post("/v1/decisions")).status == 405


async def test_rejections_never_lose_accepted_state(service):
    node = FakeNode("a")
    await service.post(node)
    await service.client.post("/v1/reports", data=b"{", headers=AUTH)
    resp = await service.client.get("/v1/nodes/a")
    assert resp.status == 200
    assert (await resp.json())["reports"] == 1


# Queries ---------------------------------------------------------------------------------------

async def test_nodes_and_node_detail(service):
    node = FakeNode("gpu-001", topology={"rack": "r1", "leaf_switch": "leaf-1"})
    await service.post(node)
    nodes = (await (await service.client.get("/v1/nodes")).json())["nodes"]
    assert [(n["node"], n["state"], n["gpus"], n["topology"]["rack"]) for n in nodes] == [("gpu-001", "ok", 8, "r1")]
    detail = await (await service.client.get("/v1/nodes/gpu-001")).json()
    assert detail["boot_id"] == node.boot_id and len(detail["gpus"]) == 8 and detail["decisions"] == []
    health = await (await service.client.get("/healthz")).json()
    assert health == {"status": "ok", "nodes": 1, "dry_run": True, "role": "leader"}
    metrics = await (await service.client.get("/metrics")).text()
    assert 'vigil_aggregator_nodes{state="ok"} 1.0' in metrics
    assert "vigil_aggregator_reports_total 1.0" in metrics
    assert "vigil_aggregator_ingest_duration_seconds_count 1.0" in metrics


async def test_urgent_fatal_xid_becomes_a_decision_without_waiting_for_the_timer(service):
    node = FakeNode("a")
    await service.post(node)
    service.clock.t += 1
    await service.post(node, urgent=True,
                       events=[Event(kind="xid", ts=service.clock.t, code=79, gpu=2, urgent=True, source="kmsg")])
    for _ in range(100):  # the evaluator wakes at once; bounded wait, not a timing assertion
        decisions = await service.decisions()
        if decisions:
            break
        await asyncio.sleep(0.02)
    assert [(d["node"], d["gpu"], d["detector"]) for d in decisions] == [("a", 2, "xid")]
    detail = await (await service.client.get("/v1/nodes/a")).json()
    assert detail["state"] == "failing"
    assert [d["id"] for d in detail["decisions"]] == [decisions[0]["id"]]
    assert detail["evidence"][0]["evidence"]["codes"] == [79]
    metrics = await (await service.client.get("/metrics")).text()
    assert "vigil_aggregator_decisions_total{action=" in metrics


# End to end: fake agents, a fault each ------------------------------------------------------------

def fleet():
    return [FakeNode(f"n{i:02d}", topology={"leaf_switch": f"leaf-{i // 4}", "rack": f"rack-{i // 8}"})
            for i in range(8)]


async def run(service, nodes, seconds, fault=None, slow=None, scale=None):
    """Every node posts each 2.5 s; the job trains on all of them; evaluation follows each round."""
    start = service.clock.t
    while service.clock.t - start <= seconds:
        elapsed = service.clock.t - start
        job_scale = scale(elapsed) if scale else 1.0
        set_training(nodes, "llm", service.clock.t, slow=slow(elapsed) if slow else None, scale=job_scale,
                     ranks_per_node=8, step=int(elapsed))
        if fault is not None:
            fault(elapsed, nodes)
        for node in nodes:
            await service.post(node)
        service.app[EVALUATE_KEY]()
        service.clock.t += 2.5
    return [(d["action"], d["node"], d["detector"]) for d in await service.decisions()], await service.decisions()


async def test_e2e_healthy_fleet_no_decisions(service):
    got, _ = await run(service, fleet(), 100)
    assert got == []


async def test_e2e_slow_node_is_drained_alone(service):
    got, decisions = await run(service, fleet(), 120, slow=lambda e: {"n05": 1.12} if e >= 30 else None)
    assert got == [("drain", "n05", "straggler")]
    assert decisions[0]["evidence"]["signal"] == "compute_seconds_p50"
    assert decisions[0]["ts"] - 1030 <= 30


async def test_e2e_ecc_storm(service):
    def storm(elapsed, nodes):
        g = nodes[3].gpus[2]
        g["ecc_corrected_volatile"] += 1 if elapsed < 50 else 400
        if elapsed >= 80:
            g["ecc_uncorrected_volatile"] = 2
            g["remap_pending"] = True
    got, decisions = await run(service, fleet(), 100, fault=storm)
    assert sorted(got) == [("drain", "n03", "memory"), ("reset_gpu", "n03", "memory")]
    assert {d["evidence"]["signal"] for d in decisions} == {"ecc_corrected_rate", "remap_pending"}
    assert all(d["gpu"] == 2 for d in decisions)


async def test_e2e_gpu_lost(service):
    def lost(elapsed, nodes):
        if elapsed >= 50:
            nodes[7].gpus[4]["health"] = "lost"
    got, decisions = await run(service, fleet(), 70, fault=lost)
    assert got == [("drain", "n07", "silence")]
    assert decisions[0]["gpu"] == 4 and decisions[0]["evidence"]["signal"] == "gpu_health"


async def test_e2e_leaf_switch_link_errors(service):
    def errors(elapsed, nodes):
        if elapsed >= 50:
            for node in nodes[4:8]:  # every node under leaf-1
                node.ports[0]["counters"]["symbol_error"] += 5000
    got, decisions = await run(service, fleet(), 90, fault=errors)
    assert sorted(got) == [("alert", "leaf-1", "topology"), ("inspect_hardware", "leaf-1", "topology")]
    assert decisions[0]["component"] == "leaf-1"
    assert decisions[0]["evidence"]["signals"] == ["symbol_error_rate"]


async def test_e2e_whole_job_data_loader_stall_drains_nobody(service):
    got, _ = await run(service, fleet(), 100, scale=lambda e: 2.0 if 30 <= e < 70 else 1.0)
    assert got == []


def test_secret_files_are_read_and_checked(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET.decode() + "\n")
    path.chmod(0o600)  # the aggregator refuses a credential others may read
    config = parse_config({"auth": {"site_secret_file": str(path)}})
    sink = proposals_ledger()
    assert make_app(config, Engine(config, sink), sink) is not None
    (tmp_path / "short").write_text("abc")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(ConfigError, match="at least 32"):
        cfg = parse_config({"auth": {"site_secret_file": str(tmp_path / "short")}})
        make_app(cfg, Engine(cfg, sink), sink)
    with pytest.raises(ConfigError, match="cannot read"):
        cfg = parse_config({"auth": {"operator_token_file": str(tmp_path / "missing")}})
        make_app(cfg, Engine(cfg, sink), sink)


def test_acting_without_credentials_refuses_to_start():
    config = AggregatorConfig(dry_run=False)
    sink = proposals_ledger()
    with pytest.raises(ConfigError, match="dry_run is false but no credentials are configured"):
        make_app(config, Engine(config, sink), sink)
    assert Action.DRAIN.value == "drain"
