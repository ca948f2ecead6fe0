"""Webhook actuator against a loopback receiver that checks signatures and fails at first."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import random
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from aggregator.actuators.actuator import DeliveryError, DispatchConfig
from aggregator.actuators.webhook import WebhookActuator, WebhookConfig
from aggregator.decision import Action, Decision
from aggregator.dispatch import Dispatcher, GatedSink
from aggregator.gate import Gate, GateConfig
from aggregator.store import Store

T0 = 1_700_000_000.0
SECRET = b"s3cret-shared-with-the-receiver"


class Receiver:
    """Verifies X-Vigil-Signature like a careful receiver would; answers 503 to the first ``fail_first``."""

    def __init__(self, fail_first: int = 0, status: int = 503) -> None:
        self.fail_first = fail_first
        self.status = status
        self.attempts = 0
        self.accepted: list[dict] = []
        self.keys: list[str] = []
        self.bad_signatures = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        expected = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(request.headers.get("X-Vigil-Signature", ""), expected):
            self.bad_signatures += 1
            return web.Response(status=401)
        self.attempts += 1
        if self.attempts <= self.fail_first:
            return web.Response(status=self.status)
        self.accepted.append(json.loads(body))
        self.keys.append(request.headers["Idempotency-Key"])
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
    GatedSink(Gate(GateConfig()), store, {"webhook": hook}).submit([dec()], T0, 100)
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
        GatedSink(Gate(GateConfig()), store, {"webhook": hook}).submit([dec()], T0, 100)
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
