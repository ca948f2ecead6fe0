"""The nvhcd health check ft_launcher asks: a real gRPC client over the Unix socket, hand-encoded
request bytes, the answers for a trusted, untrusted and unknown standing (fail open), malformed
requests refused with INVALID_ARGUMENT; the reporter keeps the aggregator's standing and lets it
go stale; the wire encoding against protobuf's rules."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")

from vigil.agent.launcher_health import (  # noqa: E402
    METHOD,
    SERVICE,
    Answer,
    LauncherHealth,
    LauncherHealthConfig,
    MalformedRequest,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from vigil.agent.reporter import Reporter, Standing  # noqa: E402
from vigil.agent.snapshot import Snapshot  # noqa: E402

# What ft_launcher sends (nvidia-resiliency-ext shared_utils/health_check.py, _DEFAULT_NODE_HEALTH_CHECK_ARGS).
LAUNCHER_ARGS = ["--no-slurm", "--group", "prolog", "epilog", "logs", "gpu"]


class Clock:
    def __init__(self, t: float = 5_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeSource:
    """A reporter's standing as the service reads it."""

    def __init__(self, standing: Standing | None = None) -> None:
        self.standing = standing

    def standing_at(self, now: float, stale_seconds: float) -> Standing | None:
        s = self.standing
        return s if s is not None and 0 <= now - s.received <= stale_seconds else None


def _call(path: Path, body: bytes) -> tuple[bool, int, str, str]:
    """ft_launcher's side: a blocking client on unix://path, raw bytes in and out."""
    with grpc.insecure_channel(f"unix://{path}") as channel:
        rpc = channel.unary_unary(f"/{SERVICE}/{METHOD}")
        return decode_response(rpc(body, timeout=10))


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[LauncherHealth, FakeSource, Clock, Path]]:
    clock = Clock()
    source = FakeSource()
    path = tmp_path / "nvhcd.sock"
    service = LauncherHealth(LauncherHealthConfig(enabled=True, socket=str(path), socket_mode=0o660),
                             [source], clock)
    await service.start()
    try:
        yield service, source, clock, path
    finally:
        await service.stop()


async def test_trusted_untrusted_and_unknown_over_a_real_grpc_channel(served) -> None:
    service, source, clock, path = served
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
    assert [p.name for p in path.parent.iterdir()] == ["nvhcd.sock"]  # the private staging dir is gone
    body = encode_request(LAUNCHER_ARGS)

    # Unknown (no answer from the aggregator yet): healthy, saying why: fail open.
    success, code, output, _ = await asyncio.to_thread(_call, path, body)
    assert (success, code) == (True, 0)
    assert json.loads(output)["fail_count"] == 0 and json.loads(output)["standing"] == "unknown"

    source.standing = Standing(True, "", "", None, received=clock.t - 2.0)
    success, code, output, _ = await asyncio.to_thread(_call, path, body)
    assert (success, code) == (True, 0)
    assert json.loads(output) == {"fail_count": 0, "failed_checks": [], "source": "vigil", "standing": "trusted",
                                  "age_seconds": 2.0}

    source.standing = Standing(False, "vigil has the node out (drain, straggler)", "d-42", 4_000.0,
                               received=clock.t - 1.0)
    success, code, output, error = await asyncio.to_thread(_call, path, body)
    assert (success, code) == (False, 1)
    got = json.loads(output)
    assert got["fail_count"] == 1 and got["decision"] == "d-42" and "straggler" in got["reason"]
    assert "drain" in error

    # The same untrusted standing, aged past stale_seconds: unknown again, healthy (fail open).
    clock.t += LauncherHealthConfig().stale_seconds + 1
    success, code, output, _ = await asyncio.to_thread(_call, path, body)
    assert (success, code) == (True, 0) and json.loads(output)["standing"] == "unknown"
    assert service.counts == {"trusted": 1, "untrusted": 1, "unknown": 2, "invalid": 0}


@pytest.mark.parametrize("body", [
    b"\x0a\x05abc",              # length past the end
    b"\x0a",                     # truncated length
    b"\x08\x01",                 # args as a varint
    b"\x0a\x02\xff\xfe",         # not UTF-8
    b"\x0b",                     # a group (wire type 3)
    b"\x0e\x00",                 # wire type 6
    b"\x02\x00",                 # field number 0
    b"\x0a" + b"\xff" * 11,      # a varint longer than ten bytes
    b"\x0a\x82\x08" + b"a" * 1026,  # one arg over its bound
    encode_request(["x"] * 65),  # more args than the bound
])
async def test_malformed_requests_are_invalid_argument_and_counted(served, body: bytes) -> None:
    service, _, _, path = served
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(_call, path, body)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert service.counts["invalid"] == 1
    # The service goes on answering.
    success, _, _, _ = await asyncio.to_thread(_call, path, encode_request(LAUNCHER_ARGS))
    assert success


async def test_an_oversized_request_is_refused_by_grpc_before_decoding(served) -> None:
    _, _, _, path = served
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(_call, path, encode_request(["y" * 1000] * 20))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_the_socket_is_removed_on_stop_and_another_file_is_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "nvhcd.sock"
    service = LauncherHealth(LauncherHealthConfig(enabled=True, socket=str(path)), [], Clock())
    await service.start()
    await service.stop()
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        await service.start()
    assert path.read_text() == "not a socket"


def test_wire_encoding_follows_protobuf() -> None:
    # Unknown fields (a newer proto) are skipped; the known ones decode.
    assert decode_request(b"") == []
    assert decode_request(b"\x10\x07" + encode_request(["--no-slurm"]) + b"\x1d\x00\x00\x00\x00") == ["--no-slurm"]
    # proto3 leaves defaults out; int32 negatives are ten-byte varints.
    assert encode_response(Answer(False, 0, "", "", "unknown")) == b""
    assert encode_response(Answer(True, 1, "o", "e", "x")) == b"\x08\x01\x10\x01\x1a\x01o\x22\x01e"
    assert decode_response(encode_response(Answer(False, -1, "", "", "x"))) == (False, -1, "", "")
    assert len(encode_response(Answer(False, -1, "", "", "x"))) == 11
    with pytest.raises(MalformedRequest):
        decode_request(b"\x0a\x01")


def test_the_reporter_keeps_the_standing_and_it_goes_stale() -> None:
    clock = Clock(100.0)
    reporter = Reporter(url=None, token=None, node="n1", boot_id="b", topology={}, snapshot=Snapshot(), clock=clock)
    assert reporter.standing_at(clock.t, 30.0) is None
    reporter.accepted({"status": "accepted", "report_versions": [1, 2, 3],
                       "standing": {"trusted": False, "reason": "out", "decision": "d-1", "since": 90.0}})
    assert reporter.standing_at(clock.t, 30.0) == Standing(False, "out", "d-1", 90.0, 100.0)
    # An answer without a standing (a standby's) keeps the last one, which ages.
    clock.t = 120.0
    reporter.accepted({"status": "accepted", "report_versions": [1, 2, 3]})
    assert reporter.standing_at(clock.t, 30.0) is not None
    clock.t = 131.0
    assert reporter.standing_at(clock.t, 30.0) is None
    # A clock stepped back past the standing: stale too, never fresher.
    assert reporter.standing_at(99.0, 30.0) is None
    # A malformed standing is ignored and counted; the last good one stays (and ages).
    for bad in ({"trusted": 1, "reason": "", "decision": "", "since": None}, "yes",
                {"trusted": True, "reason": "", "decision": "", "since": True}):
        reporter.accepted({"status": "accepted", "standing": bad})
    assert reporter.standing_malformed == 3 and reporter.standing is not None and not reporter.standing.trusted


async def test_the_agent_serves_it_from_its_reporters_and_removes_the_socket(tmp_path: Path) -> None:
    from vigil.agent.config import parse_config
    from vigil.agent.daemon import Agent
    from vigil.agent.nvml.backend import PynvmlBackend
    from vigil.agent.nvml.fake import FakeNvml
    from vigil.agent.nvml.scenario import load_node_scenario
    from vigil.contract.seams import Seams

    clock = Clock(1_700_000_000.0)
    path = tmp_path / "nvhcd.sock"
    (tmp_path / "kmsg.log").touch()
    config = parse_config({"node": "gpu-1", "listen": "127.0.0.1:0", "nvml": {"backend": "fake"},
                           "collectors": {"training": {"enabled": False}},
                           "launcher_health": {"enabled": True, "socket": str(path)}})
    backend = PynvmlBackend(FakeNvml(load_node_scenario("healthy-h100"), clock, start=clock.t))
    backend.init()
    agent = Agent(config, Seams(nvml=backend, clock=clock, kmsg=str(tmp_path / "kmsg.log"),
                                sysfs_root=tmp_path / "no-sysfs", state_dir=tmp_path))
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(agent.run(stop, on_ready=lambda _: ready.set()))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        body = encode_request(LAUNCHER_ARGS)
        assert json.loads((await asyncio.to_thread(_call, path, body))[2])["standing"] == "unknown"
        agent.reporter.accepted({"standing": {"trusted": False, "reason": "out", "decision": "d-9", "since": 1.0}})
        success, code, output, _ = await asyncio.to_thread(_call, path, body)
        assert (success, code, json.loads(output)["decision"]) == (False, 1, "d-9")
        metrics = agent.render_metrics().decode()
        assert 'vigil_agent_launcher_health_checks_total{answer="untrusted"} 1' in metrics
        assert 'vigil_agent_launcher_health_checks_total{answer="unknown"} 1' in metrics
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert not path.exists()
