"""The agent's HTTP and UDP endpoints: /metrics, /healthz, /v1/state, and heartbeat intake.

/metrics renders the cached snapshot (a scrape never touches hardware); /v1/state is the snapshot
and the last report as JSON; heartbeats (HTTP POST /v1/heartbeat and UDP datagrams) are handed to
the training collector's ``ingest``, which validates and counts them. It collects nothing itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from agent.exporter import CONTENT_TYPE
from agent.snapshot import Snapshot

log = logging.getLogger("vigil.agent.server")

MAX_HEARTBEAT_BYTES = 4096


class HeartbeatSink(Protocol):
    def ingest(self, payload: bytes, now: float) -> str | None: ...


class _HeartbeatDatagrams(asyncio.DatagramProtocol):
    def __init__(self, sink: HeartbeatSink, clock: Callable[[], float]) -> None:
        self._sink = sink
        self._clock = clock

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._sink.ingest(data, self._clock())  # rejections are counted by the collector


def make_app(
    *,
    snapshot: Snapshot,
    render_metrics: Callable[[], bytes],
    state_extra: Callable[[], dict[str, Any]],
    heartbeat_sink: HeartbeatSink | None,
    clock: Callable[[], float],
) -> web.Application:
    app = web.Application(client_max_size=1 << 20)

    async def metrics(_: web.Request) -> web.Response:
        body = render_metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_: web.Request) -> web.Response:
        failed = snapshot.failed()
        body = {"status": "ok", "collectors": sorted(snapshot.results()), "failed_collectors": failed}
        return web.json_response(body)

    async def state(_: web.Request) -> web.Response:
        body = {"collectors": snapshot.to_json(), **state_extra()}
        return web.Response(text=json.dumps(body, default=str), content_type="application/json")

    async def heartbeat(request: web.Request) -> web.Response:
        if heartbeat_sink is None:
            return web.json_response({"error": "the training collector is disabled"}, status=404)
        payload = await request.content.read(MAX_HEARTBEAT_BYTES + 1)
        reason = heartbeat_sink.ingest(payload, clock())
        if reason is not None:
            return web.json_response({"error": reason}, status=400)
        return web.json_response({"status": "accepted"}, status=202)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/state", state)
    app.router.add_post("/v1/heartbeat", heartbeat)
    return app


async def start_udp(sink: HeartbeatSink, host: str, port: int, clock: Callable[[], float]) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _HeartbeatDatagrams(sink, clock), local_addr=(host, port))
    return transport


def split_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{what}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)
