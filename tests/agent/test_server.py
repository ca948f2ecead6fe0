"""The agent's listeners: the peer check, a heartbeat body in several TCP segments, the Unix
socket's start-up rules, and the refusal counter. The network-namespace test
(test_heartbeat_netns.py) proves the same across a real network boundary."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from aiohttp import web

from tests.loopback import free_port
from vigil.agent.collectors.training import TrainingCollector, TrainingConfig
from vigil.agent.server import (
    ConnectionLimit,
    HeartbeatIntake,
    is_loopback_peer,
    make_heartbeat_app,
    serve_bounded,
    start_udp,
    start_unix,
)

HB = json.dumps({"job": "llm", "rank": 1, "step": 5, "step_seconds": 1.0}).encode()


@pytest.mark.parametrize(("peer", "local"), [
    (("127.0.0.1", 5000), True),
    (("127.8.9.10", 5000), True),
    (("::1", 5000, 0, 0), True),
    (("::ffff:127.0.0.1", 5000, 0, 0), True),
    (("10.0.0.7", 5000), False),
    (("::ffff:10.0.0.7", 5000, 0, 0), False),
    (("fe80::1%eth0", 5000, 0, 2), False),
    (("0.0.0.0", 5000), False),
    (("localhost", 5000), False),  # a peer address is never a name
    ("", False), (None, False), ((), False),
])
def test_only_loopback_peers_are_local(peer: object, local: bool) -> None:
    assert is_loopback_peer(peer) is local


def _intake() -> tuple[HeartbeatIntake, TrainingCollector]:
    training = TrainingCollector(TrainingConfig(), pid_alive=lambda pid: True)
    return HeartbeatIntake(training, clock=lambda: 100.0), training


def _received(training: TrainingCollector) -> float:
    return sum(s.value for s in training.collect(100.0).samples if s.name == "vigil_training_heartbeats_received_total")


async def test_a_body_in_several_segments_is_read_whole() -> None:
    """Issue 12: bodies arriving in more than one TCP segment were taken as malformed."""
    intake, training = _intake()
    runner = web.AppRunner(make_heartbeat_app(intake))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(HB))
        for i in range(0, len(HB), 7):  # seven bytes a segment, each flushed on its own
            writer.write(HB[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()
    assert answer.startswith(b"HTTP/1.1 202"), answer
    assert _received(training) == 1


async def test_udp_and_unix_datagrams_reach_the_collector(tmp_path: Path) -> None:
    intake, training = _intake()
    port = free_port()
    udp = await start_udp(intake, "127.0.0.1", port)
    path = str(tmp_path / "hb.sock")
    unix = await start_unix(intake, path)
    try:
        assert Path(path).stat().st_mode & 0o777 == 0o666
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(HB, ("127.0.0.1", port))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(HB, path)
        async with asyncio.timeout(5):
            while _received(training) < 2:
                await asyncio.sleep(0.01)
    finally:
        udp.close()
        unix.close()
    assert intake.refused == {"not_local": 0, "metrics_listener": 0}


async def test_unix_socket_replaces_a_stale_socket_but_never_another_file(tmp_path: Path) -> None:
    intake, _ = _intake()
    path = tmp_path / "hb.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # what a killed agent leaves behind
    transport = await start_unix(intake, str(path))
    transport.close()
    other = tmp_path / "not-a-socket"
    other.write_text("keep me")
    with pytest.raises(OSError, match="not a socket"):
        await start_unix(intake, str(other))
    assert other.read_text() == "keep me"


def test_refusals_are_counted_by_reason() -> None:
    intake, _ = _intake()
    intake.refuse("not_local", ("10.0.0.7", 1))
    intake.refuse("not_local", ("10.0.0.7", 2))
    intake.refuse("metrics_listener", ("10.0.0.8", 3))
    samples = {s.label("reason"): s.value for s in intake.samples()}
    assert samples == {"not_local": 2, "metrics_listener": 1}


async def test_the_metrics_listener_bounds_open_connections() -> None:
    """A flood of idle connections is closed at accept past the bound, counted, and /metrics
    still answers once one closes; what is admitted is closed after the idle timeout."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=30)
    await runner.setup()
    limit = ConnectionLimit(3)
    port = free_port()
    server = await serve_bounded(runner, "127.0.0.1", port, limit)
    idle = []
    try:
        for _ in range(3):
            idle.append(await asyncio.open_connection("127.0.0.1", port))
        async with asyncio.timeout(5):
            while runner.server is not None and len(runner.server.connections) < 3:
                await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once, no request served
        writer.close()
        assert limit.refused == 1
        assert [s.value for s in limit.samples()] == [1]
        _, first = idle.pop(0)
        first.close()
        async with asyncio.timeout(5):
            while runner.server is not None and len(runner.server.connections) >= 3:
                await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        for _, w in idle:
            w.close()
        server.close()
        await runner.cleanup()
