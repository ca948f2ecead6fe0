"""Webhook actuator against a loopback receiver that verifies deliveries with the documented
snippet (docs/webhooks.md) and fails at first; replays, tampering and secrets in URLs."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from tests.documented_webhook import WebhookRefused, verify_webhook
from vigil.aggregator.actuators.actuator import DeliveryError, DispatchConfig
from vigil.aggregator.actuators.alertmanager import AlertmanagerActuator, AlertmanagerConfig
from vigil.aggregator.actuators.webhook import WebhookActuator, WebhookConfig
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.dispatch import Dispatcher
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.redact import REDACTED, redact_text, redact_url
from vigil.aggregator.store import Store

T0 = 1_700_000_000.0
SECRET = b"s3cret-shared-with-the-receiver"


class Receiver:
    """Verifies each delivery with the documented snippet; answers 503 to the first ``fail_first``.
    ``requests`` keeps every verified request's headers and body, to be replayed."""

    def __init__(self, fail_first: int = 0, status: int = 503, now: Any = None) -> None:
        self.now = now  # the receiver's clock (None: the real one)
        self.fail_first = fail_first
        self.status = status
        self.attempts = 0
        self.accepted: list[dict] = []
        self.keys: list[str] = []
        self.bad_signatures = 0
        self.requests: list[tuple[dict[str, str], bytes, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            msg_id = verify_webhook(SECRET, request.headers, body, now=self.now() if self.now else None)
        except WebhookRefused:
            self.bad_signatures += 1
            return web.Response(status=401)
        self.requests.append(({k.lower(): v for k, v in request.headers.items()}, body, request.path_qs))
        self.attempts += 1
        if self.attempts <= self.fail_first:
            return web.Response(status=self.status)
        self.accepted.append(json.loads(body))
        self.keys.append(request.headers["Idempotency-Key"])
        assert msg_id == request.headers["Idempotency-Key"] + ":webhook"
        return web.Response(status=204)


async def serve(receiver: Receiver) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/hook"


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    r = Receiver(fail_first=2)
    runner, url = await serve(r)
    yield r, url
    await runner.cleanup()


def dec(id: str = "abc", action: Action = Action.DRAIN) -> Decision:
    return Decision(id=id, ts=T0, node="gpu-7", action=action, reason="Xid 79", detector="xid", dry_run=False)


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def test_signed_delivery_retried_until_the_receiver_accepts(tmp_path, receiver) -> None:
    r, url = receiver
    hook = WebhookActuator(WebhookConfig(enabled=True, url=url), secret=SECRET)
    clock, store = FakeClock(), Store(tmp_path / "d.db")
    Ledger(Gate(GateConfig()), store, {"webhook": hook}).submit([dec()], T0, 100)
    dispatcher = Dispatcher(store, {"webhook": hook}, DispatchConfig(max_attempts=5), clock=clock, rng=random.Random(1))
    for _ in range(4):
        await dispatcher.run_once()
        clock.now += 1000
    assert r.attempts == 3 and r.bad_signatures == 0
    assert r.keys == ["abc"]
    assert r.accepted[0]["id"] == "abc" and r.accepted[0]["action"] == "drain" and r.accepted[0]["node"] == "gpu-7"
    [d] = store.deliveries("abc")
    assert (d.state, d.attempts) == ("delivered", 3)


async def test_dead_letter_after_the_last_attempt(tmp_path) -> None:
    r = Receiver(fail_first=100)
    runner, url = await serve(r)
    try:
        hook = WebhookActuator(WebhookConfig(enabled=True, url=url), secret=SECRET)
        clock, store = FakeClock(), Store(tmp_path / "d.db")
        Ledger(Gate(GateConfig()), store, {"webhook": hook}).submit([dec()], T0, 100)
        dispatcher = Dispatcher(store, {"webhook": hook}, DispatchConfig(max_attempts=3), clock=clock)
        for _ in range(6):
            await dispatcher.run_once()
            clock.now += 1000
        [d] = store.deliveries("abc")
        assert (d.state, d.attempts, r.attempts) == ("dead", 3, 3)
        assert "HTTP 503" in d.last_error
    finally:
        await runner.cleanup()


async def test_a_wrong_secret_is_refused_by_the_receiver_and_not_retried() -> None:
    r = Receiver()
    runner, url = await serve(r)
    try:
        hook = WebhookActuator(WebhookConfig(enabled=True, url=url), secret=b"wrong")
        with pytest.raises(DeliveryError, match="HTTP 401") as info:
            await asyncio.to_thread(hook.deliver, dec())
        assert info.value.retryable is False and r.bad_signatures == 1
    finally:
        await runner.cleanup()


def test_unreachable_receiver_is_retryable() -> None:
    hook = WebhookActuator(WebhookConfig(enabled=True, url="http://127.0.0.1:9/hook", timeout_seconds=2), secret=SECRET)
    with pytest.raises(DeliveryError) as info:
        hook.deliver(dec())
    assert info.value.retryable is True


def test_secret_file_is_required_and_read(tmp_path) -> None:
    with pytest.raises(ValueError, match="secret_file"):
        WebhookActuator(WebhookConfig(enabled=True, url="http://127.0.0.1:1/"))
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    hook = WebhookActuator(WebhookConfig(enabled=True, url="http://127.0.0.1:1/", secret_file=str(tmp_path / "secret")))
    assert hook.secret == SECRET
    with pytest.raises(ValueError, match="http"):
        WebhookConfig(url="ftp://x")


async def test_a_replayed_or_tampered_delivery_is_refused_by_the_documented_receiver() -> None:
    """The docs/webhooks.md snippet, run on a real delivery: accepted as sent; refused when replayed
    after the tolerance, when its body, timestamp or id is changed, or under another secret."""
    clock = FakeClock()
    r = Receiver(now=clock)
    runner, url = await serve(r)
    try:
        clock.now = T0 + 0.7
        hook = WebhookActuator(WebhookConfig(enabled=True, url=url), secret=SECRET, clock=clock)
        await asyncio.to_thread(hook.deliver, dec())
        assert r.attempts == 1 and r.bad_signatures == 0
        [(headers, body, _)] = r.requests
        assert headers["webhook-id"] == "abc:webhook" and headers["webhook-timestamp"] == str(int(T0))
        assert headers["webhook-signature"].startswith("v1,")
        assert verify_webhook(SECRET, headers, body, now=T0 + 299) == "abc:webhook"

        def refused(headers: dict[str, str], body: bytes, now: float = T0 + 1, secret: bytes = SECRET) -> bool:
            try:
                verify_webhook(secret, headers, body, now=now)
            except WebhookRefused:
                return True
            return False

        assert refused(headers, body, now=T0 + 301)  # replayed five minutes later
        assert refused(headers, body, now=T0 - 301)  # or "from the future"
        tampered = json.loads(body)
        tampered["node"] = "gpu-8"
        assert refused(headers, json.dumps(tampered).encode())  # another node to drain
        assert refused(headers, body.replace(b'"drain"', b'"reboot_node"'))
        assert refused({**headers, "webhook-timestamp": str(int(T0) + 3600)}, body, now=T0 + 3600)  # re-dated
        assert refused({**headers, "webhook-id": "abd:webhook"}, body)  # a new id to dodge dedup
        assert refused({k: v for k, v in headers.items() if k != "webhook-signature"}, body)
        assert refused(headers, body, secret=b"another-secret")
        # The same delivery arrives again (a retry): same id, fresh timestamp, valid signature.
        clock.now = T0 + 600
        await asyncio.to_thread(hook.deliver, dec())
        headers2 = r.requests[1][0]
        assert headers2["webhook-id"] == headers["webhook-id"]
        assert headers2["webhook-timestamp"] == str(int(T0 + 600))
    finally:
        await runner.cleanup()


def test_a_standard_webhooks_secret_is_decoded(tmp_path) -> None:
    key = b"0123456789abcdef0123456789abcdef"
    whsec = b"whsec_" + base64.b64encode(key)
    (tmp_path / "secret").write_bytes(whsec + b"\n")
    hook = WebhookActuator(WebhookConfig(enabled=True, url="http://127.0.0.1:1/", secret_file=str(tmp_path / "secret")))
    assert hook._key == key


SECRETS = ("hunter2-pass", "K3Y-abc123", "tok-998877", "s1gn-xyz")


def _secret_free(text: str) -> bool:
    return not any(s in text for s in SECRETS)


def test_redaction_of_urls() -> None:
    url = "https://ops:hunter2-pass@hooks.example:8443/v1/hook?api_key=K3Y-abc123&team=gpu&Token=tok-998877"
    shown = redact_url(url)
    assert shown == f"https://{REDACTED}@hooks.example:8443/v1/hook?api_key={REDACTED}&team=gpu&Token={REDACTED}"
    assert redact_url("https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/abcdEFGH1234ijklMNOP5678") == \
        f"https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/{REDACTED}"
    assert redact_url("http://[::1]:9093/api?x-signature=s1gn-xyz") == f"http://[::1]:9093/api?x-signature={REDACTED}"
    assert redact_url("http://[not-an-ip/") == REDACTED
    assert _secret_free(redact_text(f"<urlopen error [Errno 111] {url} refused>"))


class FailingAlertmanager:
    def __init__(self) -> None:
        self.authorization: list[str | None] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.authorization.append(request.headers.get("Authorization"))
        return web.json_response({"error": "boom"}, status=500)


async def test_secrets_in_urls_never_appear_in_actuator_outputs(tmp_path, caplog) -> None:
    """Delivery details and errors (the store's, which GET /v1/decisions shows), log lines and
    reprs, for the webhook and the Alertmanager actuators, delivered and failing."""
    r = Receiver(fail_first=1, status=500)
    runner, base = await serve(r)
    am = FailingAlertmanager()
    am_app = web.Application()
    am_app.router.add_post("/api/v2/alerts", am.handle)
    am_runner = web.AppRunner(am_app)
    await am_runner.setup()
    await web.TCPSite(am_runner, "127.0.0.1", 0).start()
    am_port = am_runner.addresses[0][1]
    try:
        hook_url = base.replace("http://", "http://ops:hunter2-pass@") + "?api_key=K3Y-abc123&team=gpu"
        hook = WebhookActuator(WebhookConfig(enabled=True, url=hook_url), secret=SECRET)
        alerts = AlertmanagerActuator(AlertmanagerConfig(enabled=True, url=f"http://admin:tok-998877@127.0.0.1:{am_port}"))
        dead_hook = WebhookActuator(WebhookConfig(enabled=True, url="http://u:s1gn-xyz@127.0.0.1:9/h?token=tok-998877",
                                                  timeout_seconds=2), secret=SECRET)
        actuators: dict[str, Any] = {"webhook": hook, "alertmanager": alerts}
        clock, store = FakeClock(), Store(tmp_path / "d.db")
        Ledger(Gate(GateConfig()), store, actuators).submit([dec()], T0, 100)
        dispatcher = Dispatcher(store, actuators, DispatchConfig(max_attempts=2), clock=clock)
        outputs: list[str] = []
        with caplog.at_level(logging.DEBUG):
            for _ in range(3):
                await dispatcher.run_once()
                clock.now += 1000
            with pytest.raises(DeliveryError) as unreachable:
                dead_hook.deliver(dec())
            outputs.append(str(unreachable.value))
        deliveries = {d.actuator: d for d in store.deliveries("abc")}
        assert deliveries["webhook"].state == "delivered" and deliveries["alertmanager"].state == "dead"
        for d in deliveries.values():
            outputs += [str(d.last_error), str(getattr(d, "detail", ""))]
        outputs += [str(d) for d in deliveries.values()]
        outputs += [repr(hook), repr(alerts), repr(dead_hook), repr(hook.config), str(hook.config), repr(alerts.config)]
        # Every log line but the test receiver's own access log (which is not vigil's output).
        outputs += [rec.getMessage() for rec in caplog.records if rec.name != "aiohttp.access"]
        assert any("HTTP 500" in o for o in outputs) and any(REDACTED in o for o in outputs)
        leaked = [o for o in outputs if not _secret_free(o)]
        assert leaked == []
        # The credentials still did their job: basic auth from the userinfo, the query to the receiver.
        headers, _, path_qs = r.requests[-1]
        assert headers["authorization"] == "Basic " + base64.b64encode(b"ops:hunter2-pass").decode()
        assert "api_key=K3Y-abc123" in path_qs
        assert am.authorization[-1] == "Basic " + base64.b64encode(b"admin:tok-998877").decode()
    finally:
        await runner.cleanup()
        await am_runner.cleanup()
