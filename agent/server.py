"""The agent's listeners: /metrics, /healthz and /v1/state on ``listen``; heartbeats on node-local ones.

/metrics renders the cached snapshot (a scrape never touches hardware); /v1/state is the snapshot
and the last report as JSON. Heartbeats are trusted input about a job, so they are taken only from
processes on this node: UDP datagrams and HTTP ``POST /v1/heartbeat`` on a loopback address, and
datagrams on a Unix socket. Every heartbeat listener also checks the socket's peer address (never a
header), and the /metrics listener takes no heartbeat at all; refusals are counted in
``vigil_agent_heartbeats_rejected_total{reason}``. Accepted payloads go to the training collector's
``ingest``, which validates and counts them. This module collects nothing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from vigil.agent.exporter import CONTENT_TYPE
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.snapshot import Snapshot
from vigil.agent.validation import split_host_port

log = logging.getLogger("vigil.agent.server")

# A heartbeat is one small JSON object (agent.wire.Heartbeat, ~200 bytes); the training
# collector applies its own max_payload_bytes. Bodies past this are refused unread.
MAX_HEARTBEAT_BYTES = 4096
# A local sender writes its whole body at once; one that dribbles is cut off.
HEARTBEAT_READ_TIMEOUT_SECONDS = 5.0
HEARTBEAT_PATH = "/v1/heartbeat"

# A connection that has not sent a whole request (or sits idle between requests) this long is
# closed: aiohttp's keep-alive timer runs from accept and is not reset by dribbled headers.
IDLE_TIMEOUT_SECONDS = 10.0
REFUSE_REASONS = ("not_local", "metrics_listener")
HEARTBEATS_REFUSED = MetricSpec(
    "vigil_agent_heartbeats_rejected_total", MetricKind.COUNTER,
    "Heartbeats refused for where they came from: not_local (the socket's peer is not on this node), "
    "metrics_listener (sent to the /metrics listener, which takes none).", labels=("reason",))
CONNECTIONS_REFUSED = MetricSpec(
    "vigil_agent_connections_refused_total", MetricKind.COUNTER,
    "Connections to the /metrics listener closed at accept because listen_max_connections were open.")
SERVER_SPECS = (HEARTBEATS_REFUSED, CONNECTIONS_REFUSED)


class HeartbeatSink(Protocol):
    def ingest(self, payload: bytes, now: float) -> str | None: ...


def is_loopback_peer(peer: Any) -> bool:
    """True when an AF_INET/AF_INET6 peer address (as the socket reports it) is a loopback address.

    IPv4-mapped IPv6 (``::ffff:127.0.0.1``) counts as its IPv4 address. The kernel drops packets
    that arrive on another interface with a loopback source (martians), unless a site has turned
    on ``net.ipv4.conf.*.route_localnet``, so a loopback peer is a process on this node."""
    if not isinstance(peer, tuple) or not peer:
        return False
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class HeartbeatIntake:
    """Where every heartbeat listener hands its payloads: counts refusals, passes the rest on."""

    specs = SERVER_SPECS

    def __init__(self, sink: HeartbeatSink | None, clock: Callable[[], float]) -> None:
        self.sink = sink
        self._clock = clock
        self._lock = threading.Lock()
        self.refused = dict.fromkeys(REFUSE_REASONS, 0)

    def refuse(self, reason: str, peer: Any) -> None:
        with self._lock:
            first = self.refused[reason] == 0
            self.refused[reason] += 1
        if first:  # once per reason per run: a flood of refusals must not become a flood of logs
            log.warning("heartbeat refused (%s) from %s; further refusals are only counted in %s",
                        reason, peer, HEARTBEATS_REFUSED.name)

    def ingest(self, payload: bytes) -> str | None:
        assert self.sink is not None
        return self.sink.ingest(payload, self._clock())

    def samples(self) -> list[Sample]:
        with self._lock:
            return [Sample.of(HEARTBEATS_REFUSED, n, reason=r) for r, n in self.refused.items()]


class ConnectionLimit:
    """A bound on a listener's open connections; what is over it is closed at accept and counted."""

    specs = (CONNECTIONS_REFUSED,)

    def __init__(self, max_connections: int, *,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.refused = 0
        self._monotonic = monotonic
        self._logged_at: float | None = None

    def refuse(self) -> None:
        self.refused += 1
        now = self._monotonic()
        if self._logged_at is None or now - self._logged_at >= 60:  # a flood logs once a minute
            self._logged_at = now
            log.warning("/metrics listener at its %d-connection bound: closing new connections "
                        "(%d so far, %s)", self.max_connections, self.refused, CONNECTIONS_REFUSED.name)

    def samples(self) -> list[Sample]:
        return [Sample.of(CONNECTIONS_REFUSED, self.refused)]


class _Refused(asyncio.Protocol):
    def __init__(self, limit: ConnectionLimit) -> None:
        self._limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]
        self._limit.refuse()


async def serve_bounded(runner: web.AppRunner, host: str, port: int, limit: ConnectionLimit) -> asyncio.Server:
    """Serve ``runner``'s application on host:port with at most ``limit.max_connections`` open.
    The caller closes the returned server before ``runner.cleanup()``."""
    handlers = runner.server
    assert handlers is not None, "runner.setup() first"

    def accept() -> asyncio.BaseProtocol:
        if len(handlers.connections) >= limit.max_connections:
            return _Refused(limit)
        return handlers()

    return await asyncio.get_running_loop().create_server(accept, host, port)


def make_app(
    *,
    snapshot: Snapshot,
    render_metrics: Callable[[], bytes],
    state_extra: Callable[[], dict[str, Any]],
    intake: HeartbeatIntake,
) -> web.Application:
    """The /metrics listener's application. It may listen on any address; it takes no heartbeat."""
    app = web.Application(client_max_size=1 << 16)

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
        intake.refuse("metrics_listener", _peer(request))
        return web.json_response(
            {"error": "metrics_listener",
             "detail": "heartbeats are taken only on the node-local heartbeat listener "
                       "(collectors.training.udp_listen, UDP or HTTP, or collectors.training.unix_socket)"},
            status=403)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/state", state)
    app.router.add_post(HEARTBEAT_PATH, heartbeat)
    return app


def make_heartbeat_app(intake: HeartbeatIntake) -> web.Application:
    """The HTTP heartbeat listener's application: ``POST /v1/heartbeat`` from local peers only."""
    app = web.Application(client_max_size=MAX_HEARTBEAT_BYTES + 1)

    async def heartbeat(request: web.Request) -> web.Response:
        peer = _peer(request)
        if not is_loopback_peer(peer):
            intake.refuse("not_local", peer)
            return web.json_response({"error": "not_local", "detail": "heartbeats are taken only from this node"},
                                     status=403)
        if intake.sink is None:
            return web.json_response({"error": "the training collector is disabled"}, status=404)
        try:
            async with asyncio.timeout(HEARTBEAT_READ_TIMEOUT_SECONDS):
                payload = await _read_body(request, MAX_HEARTBEAT_BYTES)
        except TimeoutError:
            return web.json_response({"error": "timeout", "detail": "body not received in time"}, status=408)
        reason = intake.ingest(payload)
        if reason is not None:
            return web.json_response({"error": reason}, status=413 if reason == "too_large" else 400)
        return web.json_response({"status": "accepted"}, status=202)

    app.router.add_post(HEARTBEAT_PATH, heartbeat)
    return app


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The whole body however many segments it arrives in, or its first ``limit + 1`` bytes."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await request.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _peer(request: web.Request) -> Any:
    return request.transport.get_extra_info("peername") if request.transport is not None else None


class _HeartbeatDatagrams(asyncio.DatagramProtocol):
    def __init__(self, intake: HeartbeatIntake, *, check_peer: bool) -> None:
        self._intake = intake
        self._check_peer = check_peer

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self._check_peer and not is_loopback_peer(addr):
            self._intake.refuse("not_local", addr)
            return
        if self._intake.sink is not None:
            self._intake.ingest(data)  # content rejections are counted by the collector

    def error_received(self, exc: Exception) -> None:
        log.debug("heartbeat socket error: %s", exc)


async def start_udp(intake: HeartbeatIntake, host: str, port: int) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _HeartbeatDatagrams(intake, check_peer=True), local_addr=(host, port))
    return transport


async def start_unix(intake: HeartbeatIntake, path: str, mode: int = 0o666) -> asyncio.DatagramTransport:
    """A datagram socket at ``path``: only processes that can open the path (this node's, or pods
    given the directory by a hostPath volume) can send. A stale socket from a previous run is
    replaced; any other file there stops start-up rather than being deleted."""
    target = Path(path)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise OSError(f"{path} exists and is not a socket; refusing to replace it")
        target.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)  # senders need write permission; the directory bounds who reaches it
    except OSError:
        sock.close()
        raise
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _HeartbeatDatagrams(intake, check_peer=False), sock=sock)
    return transport


def split_hostport(value: str, what: str) -> tuple[str, int]:
    try:
        return split_host_port(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}, got {value!r}") from None


def is_loopback_host(host: str) -> bool:
    return is_loopback_peer((host, 0)) or host == "localhost"
