"""docs/openapi.yaml against the code: the schemas equal the models (the wire's msgspec Structs,
the aggregator's pydantic models), and the service
answers every documented path with bodies that match the documented schemas."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate as validate_spec
from pydantic import BaseModel

from tests.aggregator.conftest import FakeNode, proposals_ledger, set_training
from vigil.aggregator.app import EVALUATE_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Decision, Finding
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import Gate
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.wire import (
    CollectiveState,
    Event,
    GpuState,
    HostFacts,
    NodeConfig,
    PcieDevice,
    PortState,
    RankSummary,
    Report,
    encode,
    replace,
)

SPEC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
SPEC: dict[str, Any] = yaml.safe_load(SPEC_PATH.read_text())
SCHEMAS = SPEC["components"]["schemas"]
SITE_SECRET = b"site-secret-of-the-openapi-test-0123456789"
ALERTMANAGER_WEBHOOK = {
    "version": "4", "status": "firing", "receiver": "vigil", "groupKey": "{}:{}", "truncatedAlerts": 0,
    "alerts": [{"status": "firing", "labels": {"alertname": "GpuHot", "node": "n2", "vigil_action": "alert"},
                "annotations": {"summary": "GPU 3 over 87 C"}, "startsAt": "2024-05-01T00:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "f00d"}],
}
AUTH = {"Authorization": f"Bearer {node_token(SITE_SECRET, 'n0')}"}
ALERTMANAGER = {"Authorization": "Bearer alertmanager-token-0123"}
OPERATOR = {"Authorization": "Bearer operator-token-0123456"}


def auth(node: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {node_token(SITE_SECRET, node)}"}


def test_spec_is_valid_openapi():
    validate_spec(SPEC)


@pytest.mark.parametrize("model", [Report, GpuState, PortState, RankSummary, CollectiveState, HostFacts, PcieDevice,
                                   NodeConfig, Event,
                                   Decision, Finding])
def test_documented_schema_has_the_models_fields(model: type[BaseModel] | type[msgspec.Struct]):
    schema = SCHEMAS[model.__name__]
    if issubclass(model, msgspec.Struct):
        fields = {f.name: f.required for f in msgspec.structs.fields(model)}
    else:
        fields = {name: f.is_required() for name, f in model.model_fields.items()}
    assert set(schema["properties"]) == set(fields)
    required = {name for name, is_required in fields.items() if is_required}
    if model is Finding:  # documented as the service returns it: defaults included
        assert required <= set(schema["required"])
    else:
        assert set(schema.get("required", [])) == required


def check(body: Any, schema_name: str) -> None:
    jsonschema.validate(body, {**SPEC, "$ref": f"#/components/schemas/{schema_name}"},
                        cls=jsonschema.Draft202012Validator)


def documented(path: str, method: str, status: int) -> str | None:
    """The schema name documented for a response, None for a non-JSON one; fails if undocumented."""
    responses = SPEC["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answered {status}, not documented"
    content = responses[str(status)].get("content", {})
    if "application/json" not in content:
        return None
    return str(content["application/json"]["schema"]["$ref"]).rsplit("/", 1)[1]


@pytest.fixture
async def client():
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    credentials = Credentials(site_secret=SITE_SECRET, alertmanager=ALERTMANAGER["Authorization"][7:].encode(),
                              operator=OPERATOR["Authorization"][7:].encode())
    app = make_app(config, Engine(config, sink), sink, clock=lambda: 5000.0, credentials=credentials)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        nodes = [FakeNode(f"n{i}", topology={"rack": "r1"}) for i in range(3)]
        set_training(nodes, "job", 4999.0, ranks_per_node=4)
        for node in nodes:
            resp = await c.post("/v1/reports", data=encode(node.report(4999.0)), headers=auth(node.name))
            assert resp.status == 202
        xid = Event(kind="xid", ts=4999.5, code=79, gpu=1, urgent=True, source="kmsg")
        resp = await c.post("/v1/reports", data=encode(nodes[0].report(4999.5, events=[xid], urgent=True)),
                            headers=AUTH)
        assert resp.status == 202
        check(await resp.json(), "Accepted")
        app[EVALUATE_KEY]()  # (the urgent report may already have woken the evaluator)
        yield c


async def test_every_documented_path_answers_as_documented(client):
    answered: set[tuple[str, str]] = set()
    requests: list[tuple[str, str, str, dict[str, Any]]] = [
        ("get", "/v1/nodes", "/v1/nodes", {}),
        ("get", "/v1/nodes/{node}", "/v1/nodes/n0", {}),
        ("get", "/v1/nodes/{node}", "/v1/nodes/nobody", {}),
        ("get", "/v1/decisions", "/v1/decisions", {}),
        ("get", "/v1/decisions", "/v1/decisions?node=n0&limit=5", {}),
        ("get", "/v1/decisions", "/v1/decisions?limit=zero", {}),
        ("get", "/metrics", "/metrics", {}),
        ("get", "/healthz", "/healthz", {}),
        ("post", "/v1/reports", "/v1/reports", {"data": b"{}", "headers": AUTH}),
        ("post", "/v1/reports", "/v1/reports", {"data": b"{]", "headers": AUTH}),
        ("post", "/v1/reports", "/v1/reports", {"data": b"{}"}),
        ("post", "/v1/reports", "/v1/reports", {"data": b"{}", "headers": ALERTMANAGER}),
        ("post", "/v1/reports", "/v1/reports", {"data": encode(FakeNode("n1").report(5000.0)),
                                                "headers": AUTH}),
        ("post", "/v1/reports", "/v1/reports", {"data": encode(FakeNode("n1").report(9000.0)),
                                                "headers": auth("n1")}),
        ("post", "/v1/reports", "/v1/reports", {"data": encode(replace(FakeNode("n1").report(5000.0), seq=1 << 40)),
                                                 "headers": auth("n1")}),
        ("post", "/v1/alertmanager", "/v1/alertmanager", {"json": ALERTMANAGER_WEBHOOK, "headers": ALERTMANAGER}),
        ("post", "/v1/alertmanager", "/v1/alertmanager", {"json": ALERTMANAGER_WEBHOOK}),
        ("post", "/v1/alertmanager", "/v1/alertmanager", {"json": {"version": "3", "status": "firing", "alerts": []},
                                                          "headers": ALERTMANAGER}),
        ("post", "/v1/alertmanager", "/v1/alertmanager", {"data": b"{]", "headers": ALERTMANAGER}),
        ("post", "/v1/alertmanager", "/v1/alertmanager", {"data": io.BytesIO(b"{" + b" " * (1 << 20) + b"}"),
                                                          "headers": ALERTMANAGER}),
        # the gate's operator routes (every service has a gate)
        ("post", "/v1/breaker/reset", "/v1/breaker/reset", {"headers": OPERATOR}),
        ("post", "/v1/breaker/reset", "/v1/breaker/reset", {"headers": ALERTMANAGER}),
        ("get", "/v1/breaker", "/v1/breaker", {"headers": OPERATOR}),
        ("get", "/v1/gate", "/v1/gate", {"headers": OPERATOR}),
        ("post", "/v1/nodes/{node}/hold", "/v1/nodes/n0/hold", {"headers": OPERATOR}),
        ("post", "/v1/nodes/{node}/resume", "/v1/nodes/n0/resume", {"headers": OPERATOR}),
        ("get", "/v1/nodes/{node}/history", "/v1/nodes/n0/history", {"headers": OPERATOR}),
        # probing off here: 409 disabled; a bad body 400; no token 401; the listing empty
        ("post", "/v1/probes/isolations", "/v1/probes/isolations", {"json": {"nodes": ["n1", "n2"]},
                                                                    "headers": OPERATOR}),
        ("post", "/v1/probes/isolations", "/v1/probes/isolations", {"json": {"nodes": "n1"}, "headers": OPERATOR}),
        ("post", "/v1/probes/isolations", "/v1/probes/isolations", {"json": {"nodes": ["n1"]}}),
        ("post", "/v1/probes/isolations", "/v1/probes/isolations", {"json": {"nodes": ["n1"]},
                                                                    "headers": ALERTMANAGER}),
        ("get", "/v1/probes/isolations", "/v1/probes/isolations", {"headers": OPERATOR}),
        # precision off here: 409 precision_disabled; a bad body 400; no token 401; the listing empty
        ("post", "/v1/decisions/{decision}/outcome", "/v1/decisions/d1/outcome", {"json": {"fault": True},
                                                                                  "headers": OPERATOR}),
        ("post", "/v1/decisions/{decision}/outcome", "/v1/decisions/d1/outcome", {"json": {"fault": 1},
                                                                                  "headers": OPERATOR}),
        ("post", "/v1/decisions/{decision}/outcome", "/v1/decisions/d1/outcome", {"json": {"fault": True}}),
        ("post", "/v1/precision/{detector}/{rule}/promote", "/v1/precision/thermal/x/promote", {"headers": OPERATOR}),
        ("get", "/v1/precision", "/v1/precision", {"headers": OPERATOR}),
        ("post", "/v1/reports", "/v1/reports", {"data": io.BytesIO(b"{" + b" " * (2 << 20) + b"}"), "headers": AUTH}),
    ]
    for method, path, url, kw in requests:
        resp = await client.request(method, url, **kw)
        name = documented(path, method, resp.status)
        if name is None:
            assert resp.status == 200 and "vigil_aggregator_reports_total 4.0" in await resp.text()
        else:
            check(await resp.json(), name)
        answered.add((path, method))
    assert answered == {(p, m) for p, ops in SPEC["paths"].items() for m in ops}


async def test_populated_responses_match(client):
    detail = await (await client.get("/v1/nodes/n0")).json()
    check(detail, "NodeDetail")
    assert detail["decisions"] and detail["evidence"] and detail["events"] and detail["ranks"]
    decisions = await (await client.get("/v1/decisions")).json()
    check(decisions, "DecisionList")
    assert [Decision.model_validate(d).node for d in decisions["decisions"]] == ["n0"]
    nodes = await (await client.get("/v1/nodes")).json()
    check(nodes, "NodeList")
    assert [n["state"] for n in nodes["nodes"]] == ["failing", "ok", "ok"]


async def test_the_gate_routes_answer_as_documented(tmp_path):
    config = parse_config({"evaluate_interval_seconds": 3600, "dry_run": False})
    store = Store(tmp_path / "d.sqlite")
    ledger = Ledger(Gate(config.gate), store, {})
    credentials = Credentials(site_secret=SITE_SECRET, operator=OPERATOR["Authorization"][7:].encode())
    app = make_app(config, Engine(config, ledger), ledger, clock=lambda: 5000.0, credentials=credentials)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as c:
            node = FakeNode("n0")
            xid = Event(kind="xid", ts=4999.5, code=79, gpu=1, urgent=True, source="kmsg")
            await c.post("/v1/reports", data=encode(node.report(4999.5, events=[xid], urgent=True)),
                         headers=AUTH)
            app[EVALUATE_KEY]()
            cases: list[tuple[str, str, str, dict[str, Any], int]] = [
                ("get", "/v1/breaker", "/v1/breaker", {"headers": OPERATOR}, 200),
                ("get", "/v1/gate", "/v1/gate", {"headers": OPERATOR}, 200),
                ("post", "/v1/nodes/{node}/hold", "/v1/nodes/n1/hold",
                 {"json": {"note": "rma"}, "headers": OPERATOR}, 200),
                ("post", "/v1/nodes/{node}/hold", "/v1/nodes/n1/hold", {"data": b"{]", "headers": OPERATOR}, 400),
                ("post", "/v1/nodes/{node}/resume", "/v1/nodes/n0/resume", {"headers": OPERATOR}, 200),
                ("get", "/v1/nodes/{node}/history", "/v1/nodes/n0/history", {"headers": OPERATOR}, 200),
                ("get", "/v1/nodes/{node}/history", "/v1/nodes/n_0/history", {"headers": OPERATOR}, 400),
                ("get", "/healthz", "/healthz", {}, 200),
            ]
            for method, path, url, kw, status in cases:
                resp = await c.request(method, url, **kw)
                assert resp.status == status, (url, await resp.text())
                check(await resp.json(), documented(path, method, status) or "")
            gate = await (await c.get("/v1/gate", headers=OPERATOR)).json()
            assert gate["holds"]["n1"]["note"] == "rma" and gate["history"]["n0"]
    finally:
        store.close()
