"""The role table and the middleware: which credential each route needs, on loopback and beyond."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import proposals_ledger
from vigil.aggregator.app import make_app
from vigil.aggregator.auth import ROUTE_ROLES, Credentials, Role, node_token, role_for
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine

SECRET = b"site-secret-of-the-auth-test-0123456789abcdef"
OPERATOR, READ, AM = b"operator-token-0123456789", b"read-token-0123456789ab", b"alertmanager-token-01234"


def bearer(token: bytes | str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token.decode() if isinstance(token, bytes) else token}"}


def test_unlisted_posts_need_the_operator_and_unlisted_gets_the_reader() -> None:
    assert role_for("POST", "/v1/nodes/{node}/resume") is Role.OPERATOR  # a route added later
    assert role_for("DELETE", "/v1/anything") is Role.OPERATOR
    assert role_for("GET", "/v1/something-new") is Role.READ
    assert role_for("HEAD", "/healthz") is Role.PUBLIC
    assert {k for k, v in ROUTE_ROLES.items() if v is Role.PUBLIC} == {("GET", "/healthz"), ("GET", "/metrics")}


def test_every_route_of_the_service_has_a_role_and_only_health_and_metrics_are_public() -> None:
    config = parse_config({})
    sink = proposals_ledger()
    app = make_app(config, Engine(config, sink), sink, credentials=Credentials())
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        role = role_for(route.method, path)
        assert (role is Role.PUBLIC) == (path in ("/healthz", "/metrics")), (route.method, path)
        if route.method == "POST":
            assert role is not Role.READ


async def client_for(listen: str, credentials: Credentials, dry_run: bool = True) -> TestClient:
    config = parse_config({"listen": listen, "dry_run": dry_run})
    sink = proposals_ledger()
    client = TestClient(TestServer(make_app(config, Engine(config, sink), sink, credentials=credentials),
                                   host="127.0.0.1"))
    await client.start_server()
    return client


async def test_beyond_loopback_reads_need_a_read_or_operator_token() -> None:
    client = await client_for("0.0.0.0:9500", Credentials(site_secret=SECRET, operator=OPERATOR, read=READ))
    try:
        assert (await client.get("/v1/nodes")).status == 401
        assert (await client.get("/v1/nodes", headers=bearer(READ))).status == 200
        assert (await client.get("/v1/decisions", headers=bearer(OPERATOR))).status == 200
        assert (await client.get("/v1/nodes", headers=bearer(node_token(SECRET, "n1")))).status == 403
        assert (await client.get("/healthz")).status == 200 and (await client.get("/metrics")).status == 200
        # A reader may not act.
        resp = await client.post("/v1/breaker/reset", headers=bearer(READ))
        assert resp.status == 403 and (await resp.json())["error"] == "forbidden"
    finally:
        await client.close()
    client = await client_for("0.0.0.0:9500", Credentials(site_secret=SECRET))
    try:  # beyond loopback with no read credential at all: reads are closed, not open
        resp = await client.get("/v1/nodes")
        assert resp.status == 403 and (await resp.json())["error"] == "role_not_configured"
        # and so is Alertmanager's door, even in dry run
        assert (await client.post("/v1/alertmanager", json={})).status == 403
    finally:
        await client.close()


async def test_on_loopback_unconfigured_roles_are_open_only_in_dry_run() -> None:
    client = await client_for("127.0.0.1:9500", Credentials(site_secret=SECRET), dry_run=False)
    try:
        assert (await client.get("/v1/nodes")).status == 200  # reads on loopback
        resp = await client.post("/v1/alertmanager", json={})
        assert resp.status == 403 and (await resp.json())["error"] == "role_not_configured"
        assert (await client.post("/v1/breaker/reset")).status == 403
        metrics = await (await client.get("/metrics")).text()
        assert 'vigil_aggregator_refusals_total{door="alertmanager",reason="role_not_configured"} 1.0' in metrics
    finally:
        await client.close()
    client = await client_for("127.0.0.1:9500", Credentials(), dry_run=True)
    try:
        assert (await client.post("/v1/alertmanager", json={"version": "4", "status": "firing",
                                                            "alerts": []})).status == 200
    finally:
        await client.close()
