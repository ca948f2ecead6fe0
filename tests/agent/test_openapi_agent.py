"""docs/openapi-agent.yaml against the running agent: the Heartbeat schema is the wire model's,
and every documented path answers with the documented shape on the listener it documents."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate as validate_spec

from vigil.agent.collectors.collector import Collection
from vigil.agent.collectors.training import TrainingCollector, TrainingConfig
from vigil.agent.server import HeartbeatIntake, make_app, make_heartbeat_app
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.contract.wire import Heartbeat

SPEC: dict[str, Any] = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs" / "openapi-agent.yaml").read_text())


def check(body: Any, schema: str) -> None:
    jsonschema.validate(body, {**SPEC, "$ref": f"#/components/schemas/{schema}"}, cls=jsonschema.Draft202012Validator)


def test_spec_is_valid_and_heartbeat_matches_the_wire_model() -> None:
    validate_spec(SPEC)
    doc = SPEC["components"]["schemas"]["Heartbeat"]
    fields = msgspec.structs.fields(Heartbeat)
    assert set(doc["properties"]) == {f.name for f in fields}
    assert set(doc["required"]) == {f.name for f in fields if f.required}


@pytest.fixture
async def clients() -> Any:
    """(the /metrics listener, the heartbeat listener, their intake), both on loopback."""
    snapshot = Snapshot()
    snapshot.put("host", CollectorResult(Collection(), True, 0.001, 1.0))
    training = TrainingCollector(TrainingConfig(), pid_alive=lambda pid: True)
    intake = HeartbeatIntake(training, clock=lambda: 100.0, accept_unverified=True)  # HTTP: an opted-in site
    app = make_app(snapshot=snapshot, render_metrics=lambda: b"# nothing\n",
                   state_extra=lambda: {"node": "n1", "version": "0", "boot_id": "b", "nvml_backend": "fake",
                                        "last_report": None},
                   intake=intake)
    async with TestClient(TestServer(app)) as c, TestClient(TestServer(make_heartbeat_app(intake))) as h:
        yield c, h, intake


async def test_every_documented_path_answers_as_documented(
        clients: tuple[TestClient, TestClient, HeartbeatIntake]) -> None:
    client, heartbeats, intake = clients
    assert SPEC["paths"]["/v1/heartbeat"]["servers"][0]["url"] == "http://127.0.0.1:9401"
    hb = {"job": "llm", "rank": 3, "step": 10, "step_seconds": 1.2, "compute_seconds": 0.9, "gpu": 3, "pid": 77}
    check(hb, "Heartbeat")
    resp = await heartbeats.post("/v1/heartbeat", data=json.dumps(hb))
    assert resp.status == 202
    check(await resp.json(), "Accepted")
    for bad, status, reason in ((b"{not json", 400, "invalid_json"),
                                (json.dumps({**hb, "rnak": 1}).encode(), 400, "unknown_field"),
                                (json.dumps({**hb, "step": -1}).encode(), 400, "schema"),
                                (b" " * 5000, 413, "too_large")):
        resp = await heartbeats.post("/v1/heartbeat", data=bad)
        assert resp.status == status
        body = await resp.json()
        check(body, "Error")
        assert body["error"] == reason
        assert str(status) in SPEC["paths"]["/v1/heartbeat"]["post"]["responses"]
    for bad, reason in ((json.dumps({**hb, "job": "a\nb"}).encode(), "bad_text"),
                        (json.dumps({**hb, "job": "4242"}).encode(), "job_mismatch"),
                        (json.dumps({**hb, "job": "a,b"}).encode(), "bad_job_name")):
        resp = await heartbeats.post("/v1/heartbeat", data=bad)
        assert (resp.status, (await resp.json())["error"]) == (400, reason)
        assert reason in SPEC["paths"]["/v1/heartbeat"]["post"]["responses"]["400"]["description"]
    # Where the site has not opted in, HTTP heartbeats are refused for carrying no identity.
    intake.accept_unverified = False
    resp = await heartbeats.post("/v1/heartbeat", data=json.dumps(hb))
    assert resp.status == 403
    body = await resp.json()
    check(body, "Error")
    assert body["error"] == "unverified"
    # The /metrics listener takes no heartbeat, whoever sends it.
    resp = await client.post("/v1/heartbeat", data=json.dumps(hb))
    assert resp.status == 403
    body = await resp.json()
    check(body, "Error")
    assert body["error"] == "metrics_listener"
    resp = await client.get("/v1/state")
    check(await resp.json(), "State")
    resp = await client.get("/healthz")
    check(await resp.json(), "Health")
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    documented = {(p, m) for p, ops in SPEC["paths"].items() for m in ops if m != "servers"}
    assert documented == {("/v1/heartbeat", "post"), ("/v1/state", "get"), ("/metrics", "get"), ("/healthz", "get")}
