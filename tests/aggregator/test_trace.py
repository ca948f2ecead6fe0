"""The trace of accepted traffic (aggregator/trace.py): what it records and from where in the service,
its bounds (size, age), a refusing disk or a writer that is behind (counted, never an error to the
sender), and a corrupt or truncated segment read back with the rest intact."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import IO, Any

import pytest
from prometheus_client import generate_latest

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.gate import GateConfig
from vigil.aggregator.service import Accepted, AggregatorService, Refused
from vigil.aggregator.trace import (
    ALERTS,
    EVALUATION,
    REPORT,
    TraceConfig,
    TraceWriter,
    read_trace,
    segments,
)
from vigil.contract.version import __version__


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def config(tmp_path: Path, **over: Any) -> TraceConfig:
    return TraceConfig(enabled=True, directory=str(tmp_path / "trace"), **over)


def alert(i: int, reason: str = "r") -> Decision:
    return Decision(id=f"d{i}", ts=0.0, node=f"node-{i % 7}", action=Action.DRAIN, reason=reason,
                    detector="alertmanager")


def noise(i: int, n: int) -> str:
    """``n`` characters zlib cannot shrink much (a block of them stays near ``n`` bytes)."""
    import hashlib

    out = b""
    seed = str(i).encode()
    while len(out) < n:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return out.hex()[:n]


def test_records_read_back_in_order_with_the_header(tmp_path: Path) -> None:
    node = FakeNode("node-1")
    reports = [node.report(100.0 + i) for i in range(3)]
    w = TraceWriter(config(tmp_path), {"config_hash": "abc", "started": 5.0}, background=False)
    w.report(reports[0], 10.0)
    w.evaluation(11.0)
    w.alerts([alert(1)], 12.0)
    w.report(reports[1], 13.0)
    w.close()
    got = read_trace(tmp_path / "trace")
    assert not got.problems
    assert got.headers[0]["vigil_version"] == __version__ and got.headers[0]["config_hash"] == "abc"
    assert [(r.kind, r.t) for r in got.records] == [(REPORT, 10.0), (EVALUATION, 11.0), (ALERTS, 12.0),
                                                     (REPORT, 13.0)]
    assert got.records[0].report() == reports[0] and got.records[3].report() == reports[1]
    assert got.records[2].alerts()[0]["id"] == "d1"
    assert w.records == {REPORT: 2, ALERTS: 1, EVALUATION: 1}


def test_the_service_records_accepted_reports_and_evaluations_only(tmp_path: Path) -> None:
    clock = Clock()
    agg = parse_config({"trace": {"enabled": True, "directory": str(tmp_path / "trace")}})
    writer = TraceWriter(agg.trace, {}, background=False)
    service = AggregatorService.in_memory(agg, GateConfig(), clock=clock, trace=writer)
    node = FakeNode("node-1")
    first = node.report(clock.now)
    assert isinstance(service.take(first), Accepted)
    assert isinstance(service.take(node.report(clock.now), speaker="node-2"), Refused)  # another's credential
    clock.now += 2.5
    service.evaluate_now()
    service.alert_sink.submit([alert(1)], clock.now, 1)
    writer.close()
    got = read_trace(tmp_path / "trace")
    assert [(r.kind, r.t) for r in got.records] == [(REPORT, 1_000_000.0), (EVALUATION, 1_000_002.5),
                                                     (ALERTS, 1_000_002.5)]
    assert got.records[0].report() == first
    assert "vigil_aggregator_trace_records_total{kind=\"report\"} 1.0" in generate_latest(
        service.metrics.registry).decode()


def test_off_by_default_the_service_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default directory is relative: nothing may appear here
    service = AggregatorService.in_memory(parse_config({}), GateConfig(), clock=Clock())
    assert service.trace is None and service.alert_sink is service.ledger
    assert isinstance(service.take(FakeNode("node-1").report(0.0)), Accepted)
    assert list(tmp_path.iterdir()) == []


def test_size_bound_removes_the_oldest_segments(tmp_path: Path) -> None:
    cfg = config(tmp_path, max_bytes=1 << 20, segment_bytes=256 << 10, block_bytes=16 << 10)
    w = TraceWriter(cfg, {}, background=False)
    for i in range(400):  # ~3.2 MB of records that compress to about half
        w.alerts([alert(i, noise(i, 8000))], float(i))
    w.close()
    on_disk = sum(p.stat().st_size for p in segments(tmp_path / "trace"))
    assert on_disk <= cfg.max_bytes
    assert w.bytes_on_disk() == on_disk
    assert w.removed["size"] > 0 and w.removed["age"] == 0
    got = read_trace(tmp_path / "trace")
    assert not got.problems
    assert got.records[-1].t == 399.0  # the newest kept, the oldest gone
    assert got.records[0].t > 0.0
    assert all(p.stat().st_size <= cfg.segment_bytes for p in segments(tmp_path / "trace"))


def test_age_bound_removes_old_segments(tmp_path: Path) -> None:
    wall = Clock(0.0)
    cfg = config(tmp_path, max_age_seconds=800.0, block_bytes=4096, flush_seconds=1.0)
    w = TraceWriter(cfg, {}, background=False, wall=wall)
    for t in range(0, 3000, 10):
        wall.now = float(t)
        w.evaluation(float(t))
    w.close()
    got = read_trace(tmp_path / "trace")
    assert w.removed["age"] > 0
    # nothing older than the bound, and two slices (the last segment opened up to a slice before the end)
    assert got.records[0].t >= 2990 - 800 - 2 * 800 / 8 - 10
    assert got.records[-1].t == 2990.0


class FullDisk:
    """A file on a full disk: the header fits, every block after it is refused."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "xb")  # noqa: SIM115 - closed by close()
        self.writes = 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def test_a_full_disk_is_counted_and_intake_goes_on(tmp_path: Path) -> None:
    clock = Clock()
    agg = parse_config({"trace": {"enabled": True, "directory": str(tmp_path / "trace"), "block_bytes": 4096}})
    writer = TraceWriter(agg.trace, {}, background=False, opener=lambda p: FullDisk(p))  # type: ignore[arg-type,return-value]
    service = AggregatorService.in_memory(agg, GateConfig(), clock=clock, trace=writer)
    node = FakeNode("node-1")
    for _ in range(20):
        clock.now += 2.5
        assert isinstance(service.take(node.report(clock.now)), Accepted)
    writer.close()
    assert writer.write_errors["disk_full"] >= 1
    assert writer.dropped["write_error"] >= 1
    text = generate_latest(service.metrics.registry).decode()
    assert 'vigil_aggregator_trace_write_errors_total{reason="disk_full"}' in text
    assert 'vigil_aggregator_trace_dropped_records_total{reason="write_error"}' in text


def test_a_writer_behind_drops_whole_blocks_counted(tmp_path: Path) -> None:
    release = threading.Event()
    opening = threading.Event()

    def slow_open(path: Path) -> IO[bytes]:
        opening.set()
        release.wait(timeout=30)
        return open(path, "xb")

    w = TraceWriter(config(tmp_path, block_bytes=4096, queue_blocks=1), {}, opener=slow_open)
    w.alerts([alert(0, noise(0, 5000))], 0.0)  # a block: the writer thread takes it and waits in open
    assert opening.wait(timeout=30)
    w.alerts([alert(1, noise(1, 5000))], 1.0)  # queued (the one place)
    w.alerts([alert(2, noise(2, 5000))], 2.0)  # no place: dropped, counted
    assert w.dropped == {"queue_full": 1}
    release.set()
    w.close()
    assert [r.t for r in read_trace(tmp_path / "trace").records] == [0.0, 1.0]


def test_corrupt_and_truncated_blocks_are_named_and_the_rest_read(tmp_path: Path) -> None:
    cfg = config(tmp_path, block_bytes=4096, segment_bytes=64 << 10)
    w = TraceWriter(cfg, {}, background=False)
    for i in range(150):
        w.alerts([alert(i, noise(i, 3000))], float(i))
    w.close()
    segs = segments(tmp_path / "trace")
    assert len(segs) >= 3
    data = bytearray(segs[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a block
    segs[0].write_bytes(bytes(data))
    segs[-1].write_bytes(segs[-1].read_bytes()[:-100])  # the writer stopped mid-block
    segs[1].write_bytes(b"not a trace")
    got = read_trace(tmp_path / "trace")
    reasons = [p.reason for p in got.problems]
    assert any("CRC mismatch" in r for r in reasons)
    assert any("truncated block" in r for r in reasons)
    assert any("bad magic" in r for r in reasons)
    assert all(p.segment in {s.name for s in segs} for p in got.problems)
    times = [r.t for r in got.records]
    assert times == sorted(times) and 0 < len(times) < 150
    assert 149.0 not in times and 0.0 in times


def test_segment_bytes_must_fit_the_total() -> None:
    with pytest.raises(ValueError, match="segment_bytes"):
        TraceConfig(max_bytes=1 << 20, segment_bytes=2 << 20)
