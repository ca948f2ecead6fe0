"""The agent's listeners: the peer check, a heartbeat body in several TCP segments, the Unix
socket's start-up rules and sender credentials, UDP/HTTP refused unless the site opts in, and the
refusal counter. The network-namespace test (test_heartbeat_netns.py) proves the same across a
real network boundary; test_heartbeat_identity.py against a real agent process."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import pytest
from aiohttp import web

from tests.agent.proc_table import in_slurm_job
from tests.loopback import free_port
from vigil.agent.attribution import ProcessIdentities
from vigil.agent.collectors.training import TrainingCollector, TrainingConfig
from vigil.agent.server import (
    REFUSE_REASONS,
    ConnectionLimit,
    HeartbeatIntake,
    credentials_of,
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


def _intake(proc_root: Path | None = None, **options: object) -> tuple[HeartbeatIntake, TrainingCollector]:
    training = TrainingCollector(TrainingConfig(), pid_alive=lambda pid: True)
    identities = ProcessIdentities(proc_root) if proc_root is not None else None
    return HeartbeatIntake(training, clock=lambda: 100.0, identities=identities, **options), training  # type: ignore[arg-type]


def _received(training: TrainingCollector) -> float:
    return sum(s.value for s in training.collect(100.0).samples if s.name == "vigil_training_heartbeats_received_total")


def _jobs(training: TrainingCollector) -> set[str]:
    return {r.job for r in training.collect(100.0).report["ranks"]}


def _refused(**counts: int) -> dict[str, int]:
    return {**dict.fromkeys(REFUSE_REASONS, 0), **counts}


async def test_a_body_in_several_segments_is_read_whole() -> None:
    """Issue 12: bodies arriving in more than one TCP segment were taken as malformed."""
    intake, training = _intake(accept_unverified=True)
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


async def test_unix_datagrams_are_keyed_by_the_senders_job_and_udp_only_where_opted_in(tmp_path: Path) -> None:
    """This test process sends on the Unix socket: the kernel names its pid, the (fake) process
    table puts that pid in Slurm job 4242, so its heartbeat naming "llm" is job 4242's. UDP, which
    carries no identity, is taken only with accept_unverified, and then keyed unverified/<name>."""
    in_slurm_job(tmp_path / "proc", os.getpid(), 4242)
    for accept in (False, True):
        intake, training = _intake(tmp_path / "proc", accept_unverified=accept)
        port = free_port()
        udp = await start_udp(intake, "127.0.0.1", port)
        path = str(tmp_path / f"hb-{accept}.sock")
        unix = await start_unix(intake, path)
        try:
            assert Path(path).stat().st_mode & 0o777 == 0o666
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(HB, ("127.0.0.1", port))
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(HB, path)
            async with asyncio.timeout(5):
                while _received(training) + intake.refused["unverified"] < 2:
                    await asyncio.sleep(0.01)
        finally:
            udp.close()
            unix.close()
        if accept:
            assert _jobs(training) == {"4242", "unverified/llm"} and intake.refused == _refused()
        else:
            assert _jobs(training) == {"4242"} and intake.refused == _refused(unverified=1)


async def test_a_udp_datagram_is_judged_by_its_peer_then_the_sites_opt_in() -> None:
    """The UDP protocol's branches: a peer off this node is refused as not_local whatever the
    opt-in, a loopback one (unverified) only where the site opted in, and an accepted one reaches
    the collector, keyed unverified; each refusal counted by its reason."""
    for accept in (False, True):
        intake, training = _intake(accept_unverified=accept)
        udp = await start_udp(intake, "127.0.0.1", free_port())
        try:
            protocol = udp.get_protocol()
            assert isinstance(protocol, asyncio.DatagramProtocol)
            for peer in [("10.0.0.7", 5000), ("::ffff:10.0.0.7", 5000, 0, 0), ("127.0.0.1", 5000),
                         ("127.8.9.10", 5000), ("::1", 5000, 0, 0)]:
                protocol.datagram_received(HB, peer)
        finally:
            udp.close()
        if accept:
            assert _received(training) == 3 and _jobs(training) == {"unverified/llm"}
            assert intake.refused == _refused(not_local=2)
        else:
            assert _received(training) == 0 and intake.refused == _refused(not_local=2, unverified=3)


async def test_http_heartbeats_are_refused_unverified_unless_opted_in() -> None:
    intake, training = _intake()
    runner = web.AppRunner(make_heartbeat_app(intake))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (len(HB), HB))
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()
    assert answer.startswith(b"HTTP/1.1 403") and b'"unverified"' in answer, answer
    assert intake.refused == _refused(unverified=1) and _received(training) == 0


def test_a_sender_the_agent_cannot_place_is_refused_by_reason(tmp_path: Path) -> None:
    """No credentials (a pid outside the agent's pid namespace reads as 0), a process already gone,
    and a process in no Slurm job or pod (unless the site keys those by uid)."""
    (tmp_path / "proc").mkdir()
    intake, training = _intake(tmp_path / "proc")
    assert intake.ingest_credentialed(HB, None) == "no_credentials"
    assert intake.ingest_credentialed(HB, (0, 1000, 1000)) == "no_credentials"
    assert intake.ingest_credentialed(HB, (os.getpid(), 1000, 1000)) == "sender_unknown"  # not in the table
    from tests.agent.proc_table import UNSCHEDULED, place

    place(tmp_path / "proc", os.getpid(), UNSCHEDULED)
    assert intake.ingest_credentialed(HB, (os.getpid(), 1000, 1000)) == "unscheduled"
    assert intake.refused == _refused(no_credentials=2, sender_unknown=1, unscheduled=1)
    assert _received(training) == 0
    by_uid, training = _intake(tmp_path / "proc", unscheduled="by_uid")
    assert by_uid.ingest_credentialed(HB, (os.getpid(), 1000, 1000)) is None
    assert _jobs(training) == {"uid/1000/llm"}


def test_file_descriptors_a_sender_passes_are_closed() -> None:
    """A sender may attach file descriptors (SCM_RIGHTS); the agent keeps none of them."""
    import array

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b, open(os.devnull) as passed:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        a.sendmsg([HB], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [passed.fileno()]))])
        _, ancillary, _, _ = b.recvmsg(4096, socket.CMSG_SPACE(12) + socket.CMSG_SPACE(4))
        fds = [fd for level, kind, data in ancillary if kind == socket.SCM_RIGHTS
               for fd in array.array("i", data)]
        assert fds and credentials_of(ancillary) == (os.getpid(), os.getuid(), os.getgid())
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)


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
    assert samples == _refused(not_local=2, metrics_listener=1)


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


async def test_the_socket_mode_and_group_are_the_sites_choice(tmp_path: Path) -> None:
    intake, _ = _intake()
    path = str(tmp_path / "hb.sock")
    narrow = await start_unix(intake, path, 0o660, str(os.getgid()))
    try:
        st = Path(path).stat()
        assert (st.st_mode & 0o777, st.st_gid) == (0o660, os.getgid())
    finally:
        narrow.close()
    with pytest.raises(OSError, match="no such group"):
        await start_unix(intake, path, 0o660, "no-such-group-vigil")
