"""The agent's listeners: /metrics, /healthz and /v1/state on ``listen``; heartbeats on node-local ones.

/metrics renders the cached snapshot (a scrape never touches hardware); /v1/state is the snapshot
and the last report as JSON. Heartbeats steer what vigil does to a job, so each is bound to who sent
it: on the Unix socket every datagram carries its sender's pid and uid as the kernel knows them
(SCM_CREDENTIALS), and the pid's cgroup names its Slurm job or pod (agent.attribution); UDP and HTTP
``POST /v1/heartbeat`` on loopback carry no such proof and are refused unless the site opts in.
Every heartbeat listener checks the socket's peer (never a header), and the /metrics listener takes
no heartbeat at all; refusals for who sent them are counted in
``vigil_agent_heartbeats_rejected_total{reason}``. Accepted payloads go, with their ``Sender``, to
the training collector's ``ingest``, which validates and counts them. This module collects nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import ipaddress
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from aiohttp import web

from vigil.agent.attribution import UNVERIFIED, ProcessIdentities, Sender, job_key
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.snapshot import Snapshot
from vigil.contract.scrape_encoding import encode_for_scraper
from vigil.contract.validation import split_host_port

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
# Datagrams read from the Unix socket per wake-up of the event loop: a flood waits its turn behind
# scrapes and reports instead of holding the loop (the rest stay in the socket's kernel queue).
MAX_DATAGRAMS_PER_WAKEUP = 64
# struct ucred (pid_t pid; uid_t uid; gid_t gid), as SCM_CREDENTIALS carries it (unix(7)).
_UCRED = struct.Struct("iII")
_ANCILLARY_BYTES = socket.CMSG_SPACE(_UCRED.size)
REFUSE_REASONS = ("not_local", "metrics_listener", "unverified", "no_credentials", "sender_unknown", "unscheduled")
HEARTBEATS_REFUSED = MetricSpec(
    "vigil_agent_heartbeats_rejected_total", MetricKind.COUNTER,
    "Heartbeats refused for who sent them: not_local (the socket's peer is not on this node), "
    "metrics_listener (sent to the /metrics listener, which takes none), unverified (UDP/HTTP, which "
    "carry no sender identity, while collectors.training.accept_unverified is off), no_credentials "
    "(a Unix datagram without a pid the agent can see), sender_unknown (the sending process was gone "
    "or unreadable), unscheduled (a sender in no Slurm job or pod).", labels=("reason",))
CONNECTIONS_REFUSED = MetricSpec(
    "vigil_agent_connections_refused_total", MetricKind.COUNTER,
    "Connections to the /metrics listener closed at accept because listen_max_connections were open.")
SERVER_SPECS = (HEARTBEATS_REFUSED, CONNECTIONS_REFUSED)


class HeartbeatSink(Protocol):
    def ingest(self, payload: bytes, now: float, sender: Sender) -> str | None: ...


Credentials = tuple[int, int, int]  # pid, uid, gid as the kernel gave them


# How the kernel spells the usual loopback peers (AF_INET, AF_INET6, IPv4-mapped): answered from
# this set; any other address is parsed (an ipaddress parse was ~3 us of each datagram's cost).
_LOOPBACK_LITERALS = frozenset(("127.0.0.1", "::1", "::ffff:127.0.0.1"))


def is_loopback_peer(peer: Any) -> bool:
    """True when an AF_INET/AF_INET6 peer address (as the socket reports it) is a loopback address.

    IPv4-mapped IPv6 (``::ffff:127.0.0.1``) counts as its IPv4 address. The kernel drops packets
    that arrive on another interface with a loopback source (martians), unless a site has turned
    on ``net.ipv4.conf.*.route_localnet``, so a loopback peer is a process on this node."""
    if not isinstance(peer, tuple) or not peer:
        return False
    if peer[0] in _LOOPBACK_LITERALS:  # the usual peer, without an ipaddress parse per datagram
        return True
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class HeartbeatIntake:
    """Where every heartbeat listener hands its payloads: decides who sent each (a ``Sender``),
    counts what it refuses for that, passes the rest on.

    ``identities`` maps a verified pid to its scheduler identity; ``accept_unverified`` lets UDP
    and HTTP heartbeats in (keyed apart, never as a scheduler's job); ``unscheduled`` says what a
    verified sender in no Slurm job or pod gets: refused, or keyed by its uid."""

    specs = SERVER_SPECS

    def __init__(self, sink: HeartbeatSink | None, clock: Callable[[], float], *,
                 identities: ProcessIdentities | None = None, accept_unverified: bool = False,
                 unscheduled: Literal["refuse", "by_uid"] = "refuse") -> None:
        self.sink = sink
        self._clock = clock
        self._identities = identities if identities is not None else ProcessIdentities()
        self.accept_unverified = accept_unverified
        self._unscheduled = unscheduled
        self._lock = threading.Lock()
        self.refused = dict.fromkeys(REFUSE_REASONS, 0)

    def refuse(self, reason: str, peer: Any) -> str:
        with self._lock:
            first = self.refused[reason] == 0
            self.refused[reason] += 1
        if first:  # once per reason per run: a flood of refusals must not become a flood of logs
            log.warning("heartbeat refused (%s) from %s; further refusals are only counted in %s",
                        reason, peer, HEARTBEATS_REFUSED.name)
        return reason

    def ingest_unverified(self, payload: bytes, peer: Any) -> str | None:
        """A heartbeat from a loopback UDP/HTTP peer: no identity, so only where the site opted in."""
        if not self.accept_unverified:
            return self.refuse("unverified", peer)
        assert self.sink is not None
        return self.sink.ingest(payload, self._clock(), UNVERIFIED)

    def ingest_credentialed(self, payload: bytes, credentials: Credentials | None) -> str | None:
        """A Unix datagram with the credentials the kernel attached: keyed by the sender's job."""
        if credentials is None or credentials[0] <= 0:  # pid 0: not visible in our pid namespace
            return self.refuse("no_credentials", "unix socket")
        pid, uid, _ = credentials
        identity = self._identities.lookup(pid)
        if identity is None:
            return self.refuse("sender_unknown", f"pid {pid} (uid {uid})")
        key = job_key(identity)
        if key is not None:
            sender = Sender("scheduler", job=key, pid=pid, uid=uid)
        elif self._unscheduled == "by_uid":
            sender = Sender("uid", pid=pid, uid=uid)
        else:
            return self.refuse("unscheduled", f"pid {pid} (uid {uid}), in no Slurm job or pod")
        assert self.sink is not None
        return self.sink.ingest(payload, self._clock(), sender)

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

    async def metrics(request: web.Request) -> web.Response:
        body, headers = encode_for_scraper(render_metrics(), request.headers.get("Accept-Encoding"))
        return web.Response(body=body, headers=headers)

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
        if not intake.accept_unverified:  # refused before the body is read
            intake.refuse("unverified", peer)
            return web.json_response(
                {"error": "unverified",
                 "detail": "HTTP carries no sender identity; send to the Unix socket "
                           "(collectors.training.unix_socket), or set collectors.training.accept_unverified"},
                status=403)
        try:
            async with asyncio.timeout(HEARTBEAT_READ_TIMEOUT_SECONDS):
                payload = await _read_body(request, MAX_HEARTBEAT_BYTES)
        except TimeoutError:
            return web.json_response({"error": "timeout", "detail": "body not received in time"}, status=408)
        reason = intake.ingest_unverified(payload, peer)
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
    """UDP heartbeats: from loopback peers only, and then as unverified senders."""

    def __init__(self, intake: HeartbeatIntake) -> None:
        self._intake = intake

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if addr[0] not in _LOOPBACK_LITERALS and not is_loopback_peer(addr):
            self._intake.refuse("not_local", addr)
            return
        if self._intake.sink is not None:
            self._intake.ingest_unverified(data, addr)  # content rejections are counted by the collector

    def error_received(self, exc: Exception) -> None:
        log.debug("heartbeat socket error: %s", exc)


async def start_udp(intake: HeartbeatIntake, host: str, port: int) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: _HeartbeatDatagrams(intake), local_addr=(host, port))
    return transport


def credentials_of(ancillary: list[tuple[int, int, bytes]]) -> Credentials | None:
    """The SCM_CREDENTIALS in a recvmsg's ancillary data, or None. File descriptors a sender passed
    (SCM_RIGHTS) are closed: the agent keeps nothing a sender hands it."""
    found = None
    for level, kind, data in ancillary:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            found = _UCRED.unpack_from(data)
        elif kind == socket.SCM_RIGHTS:
            for fd in struct.unpack(f"{len(data) // 4}i", data[:len(data) - len(data) % 4]):
                with contextlib.suppress(OSError):
                    os.close(fd)
    return found


class UnixHeartbeats:
    """The heartbeat Unix datagram socket, read with recvmsg so that each datagram comes with its
    sender's credentials (asyncio's datagram endpoint drops ancillary data). At most
    ``MAX_DATAGRAMS_PER_WAKEUP`` datagrams are handled per wake-up of the loop."""

    def __init__(self, sock: socket.socket, intake: HeartbeatIntake, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._intake = intake
        self._loop = loop
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        for _ in range(MAX_DATAGRAMS_PER_WAKEUP):
            try:
                data, ancillary, _, _ = self._sock.recvmsg(MAX_HEARTBEAT_BYTES + 1, _ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("heartbeat socket error: %s", exc)
                return
            credentials = credentials_of(ancillary)
            if self._intake.sink is not None:
                # A datagram over the limit arrives cut at MAX_HEARTBEAT_BYTES + 1: too_large.
                self._intake.ingest_credentialed(data, credentials)

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()


def _gid(group: str) -> int:
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def _socket_is_served(path: str) -> bool:
    """Whether a process has a datagram socket bound at ``path``: connect() reaches it, where a
    stale one left by a process that exited is refused (unix(7): ECONNREFUSED)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


async def start_unix(intake: HeartbeatIntake, path: str, mode: int = 0o666, group: str | None = None) -> UnixHeartbeats:
    """A datagram socket at ``path`` that receives its senders' credentials (SO_PASSCRED), mode
    ``mode`` and, if given, group ``group`` (a name or gid). A stale socket from a previous run is
    replaced; one another process still serves (a second agent on the host), or any other file
    there, stops start-up rather than being deleted."""
    target = Path(path)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise OSError(f"{path} exists and is not a socket; refusing to replace it")
        if _socket_is_served(path):  # another agent's: replacing it would take its heartbeats
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        target.unlink()
    try:
        gid = _gid(group) if group is not None else -1
    except KeyError:
        raise OSError(f"unix_socket_group {group!r}: no such group") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        # Before bind: every datagram queued from then on carries its sender's pid, uid and gid.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setblocking(False)
        sock.bind(path)
        if gid >= 0:
            os.chown(path, -1, gid)
        os.chmod(path, mode)  # senders need write permission; what each may claim is its own job
    except OSError:
        sock.close()
        raise
    return UnixHeartbeats(sock, intake, asyncio.get_running_loop())


def split_hostport(value: str, what: str) -> tuple[str, int]:
    try:
        return split_host_port(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}, got {value!r}") from None


def is_loopback_host(host: str) -> bool:
    return is_loopback_peer((host, 0)) or host == "localhost"
