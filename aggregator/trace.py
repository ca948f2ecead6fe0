"""The trace of what the aggregator took: every accepted report as decoded, every accepted batch of
Alertmanager proposals and every evaluation, each with the service's receive time, so that
``vigil replay`` can run the same traffic through another configuration (docs/replay.md).

It reads what the service hands it and writes rotating, bounded segment files (compressed blocks,
each checked by a CRC) through one writer thread; it never blocks intake and never fails a report:
a full queue or disk drops the block, counted and logged. It judges nothing and holds no credential.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from pydantic import BaseModel, Field, model_validator

from vigil.contract.validation import StrictModel
from vigil.contract.version import __version__
from vigil.contract.wire import Report

log = logging.getLogger("vigil.aggregator.trace")

MAGIC = b"VIGILTRC"
FORMAT_VERSION = 1
SEGMENT_SUFFIX = ".vtr"
# A frame: payload length, CRC-32 of the payload, the payload (the header, then compressed blocks).
_FRAME = struct.Struct(">II")
# No block is larger than this once compressed (a block holds at most ``block_bytes`` of records,
# at most 16 MiB, and zlib never grows data by more than a few bytes per 16 KiB): a length beyond
# it is a corrupt frame, not a reason to read gigabytes.
MAX_FRAME_BYTES = 32 << 20
# Record kinds.
REPORT = "report"
ALERTS = "alerts"
EVALUATION = "evaluation"
KINDS = (REPORT, ALERTS, EVALUATION)
# A segment is also closed once it is this fraction of ``max_age_seconds`` old, so that the age
# bound removes whole segments at most an eighth late even when a quiet fleet fills none.
AGE_SLICES = 8
# A failing disk is logged at most this often (every dropped record is counted).
ERROR_LOG_SECONDS = 60.0

_RECORDS = msgspec.msgpack.Decoder(list[tuple[str, float, bytes]])
_REPORT = msgspec.msgpack.Decoder(Report)
_encode = msgspec.msgpack.Encoder().encode


class TraceConfig(StrictModel):
    """The trace of accepted traffic ``vigil replay`` reads (docs/replay.md). Off by default: it holds
    node names, job ids and each node's GPU, port and host facts (no token, no credential). Bounded
    by size and by age, both enforced on every segment opened."""

    enabled: bool = False
    # Where the segments go (created if missing); nothing else may be written there.
    directory: str = "vigil-trace"
    # The whole trace on disk; the oldest segments go first. At ~3 MiB per node-day (bench_replay:
    # compact reports every 2.5 s) 1 GiB keeps ~2.5 days of 100 nodes, or 40 min of 12,500.
    max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # Segments whose last record is older than this are removed (a week).
    max_age_seconds: float = Field(default=7 * 86400.0, gt=0)
    # A segment is closed and a new one opened at this size.
    segment_bytes: int = Field(default=64 << 20, ge=64 << 10)
    # Records are buffered and compressed together up to this many bytes (a block: the unit written,
    # checked and, when the disk or the queue refuses it, lost).
    block_bytes: int = Field(default=256 << 10, ge=4 << 10, le=16 << 20)
    # Blocks waiting for the writer thread; a block beyond them is dropped and counted (queue_full).
    queue_blocks: int = Field(default=64, ge=1)
    # A block waiting longer than this is written anyway (a quiet fleet's records reach the disk).
    flush_seconds: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _segment_within_total(self) -> TraceConfig:
        if self.segment_bytes > self.max_bytes:
            raise ValueError(f"segment_bytes ({self.segment_bytes}) must not exceed max_bytes ({self.max_bytes})")
        return self


def config_digest(config: BaseModel) -> str:
    """A short hash of a configuration as loaded (which one a trace was recorded under)."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Record:
    kind: str
    t: float  # the service's clock when it took the record
    body: bytes

    def report(self) -> Report:
        return _REPORT.decode(self.body)

    def alerts(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = msgspec.json.decode(self.body)
        return out


@dataclass(frozen=True)
class Problem:
    """A part of a trace that could not be read: which segment, where, and why."""

    segment: str
    offset: int
    reason: str

    def __str__(self) -> str:
        return f"{self.segment} at byte {self.offset}: {self.reason}"


@dataclass
class TraceReading:
    """A trace read back: each segment's header, its records in order, what could not be read."""

    headers: list[dict[str, Any]] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def segments(directory: Path) -> list[Path]:
    """The trace's segment files, oldest first (their names sort by opening time)."""
    return sorted(p for p in directory.glob(f"trace-*{SEGMENT_SUFFIX}") if p.is_file())


def read_trace(directory: str | Path) -> TraceReading:
    """Every readable record of the trace in ``directory``, in order. A bad segment start, a block
    whose CRC or compression fails, or a truncated tail is a ``Problem``; reading goes on with the
    next block (or, when the length itself is unreadable, the next segment)."""
    out = TraceReading()
    for path in segments(Path(directory)):
        _read_segment(path, out)
    return out


def _read_segment(path: Path, out: TraceReading) -> None:
    data = path.read_bytes()
    name = path.name
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 1:
        out.problems.append(Problem(name, 0, "not a vigil trace segment (bad magic)"))
        return
    if data[len(MAGIC)] != FORMAT_VERSION:
        out.problems.append(Problem(name, len(MAGIC), f"trace format {data[len(MAGIC)]}, this vigil reads "
                                                      f"{FORMAT_VERSION}"))
        return
    pos = len(MAGIC) + 1
    first = True
    while pos < len(data):
        if pos + _FRAME.size > len(data):
            out.problems.append(Problem(name, pos, "truncated frame header (the writer stopped mid-block)"))
            return
        length, crc = _FRAME.unpack_from(data, pos)
        start = pos + _FRAME.size
        if length > MAX_FRAME_BYTES:
            out.problems.append(Problem(name, pos, f"frame length {length} is impossible: the rest of this "
                                                   "segment is unreadable"))
            return
        if start + length > len(data):
            out.problems.append(Problem(name, pos, f"truncated block ({len(data) - start} of {length} bytes)"))
            return
        payload = data[start:start + length]
        pos = start + length
        if zlib.crc32(payload) != crc:
            out.problems.append(Problem(name, start - _FRAME.size, "corrupt block (CRC mismatch): skipped"))
            first = False
            continue
        try:
            if first:
                out.headers.append(msgspec.msgpack.decode(payload))
            else:
                out.records.extend(Record(*r) for r in _RECORDS.decode(zlib.decompress(payload)))
        except (zlib.error, msgspec.DecodeError) as exc:
            out.problems.append(Problem(name, start - _FRAME.size, f"undecodable block: {exc}"))
        first = False


Opener = Callable[[Path], IO[bytes]]


def _open_exclusive(path: Path) -> IO[bytes]:
    return open(path, "xb")


@dataclass
class _Segment:
    path: Path
    size: int
    last_write: float  # wall seconds
    opened: float  # wall seconds


class TraceWriter:
    """Appends records to the trace. ``report``, ``alerts`` and ``evaluation`` encode the record on
    the caller's thread (microseconds) and buffer it; a full block goes to the writer thread
    (``background``; else it is written at once, the simulator's way, which must lose nothing).
    ``header``: what each segment states about the run (vigil's version is added); ``wall``: the
    clock segment ages are judged on; ``opener``: how a segment file is created (a test's full disk)."""

    def __init__(self, config: TraceConfig, header: dict[str, Any], *, background: bool = True,
                 wall: Callable[[], float] = time.time, opener: Opener = _open_exclusive) -> None:
        self.config = config
        self.directory = Path(config.directory)
        self.header = {"vigil_version": __version__, "format": FORMAT_VERSION, **header}
        self.wall = wall
        self.opener = opener
        self.records = dict.fromkeys(KINDS, 0)  # taken into a block, by kind
        self.dropped: dict[str, int] = {}  # records lost, by reason
        self.removed: dict[str, int] = {"size": 0, "age": 0}  # segments removed, by reason
        self.write_errors: dict[str, int] = {}  # by reason: disk_full, io
        self._lock = threading.Lock()
        self._block: list[tuple[str, float, bytes]] = []
        self._block_bytes = 0
        self._block_started = 0.0
        self._file: IO[bytes] | None = None
        self._segments: list[_Segment] = []
        self._opened = 0
        self._error_logged = float("-inf")
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in segments(self.directory):  # a previous run's segments count against the bounds
            st = path.stat()
            self._segments.append(_Segment(path, st.st_size, st.st_mtime, st.st_mtime))
        self._queue: queue.Queue[list[tuple[str, float, bytes]] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=config.queue_blocks)
            self._thread = threading.Thread(target=self._drain, name="vigil-trace", daemon=True)
            self._thread.start()

    # -- what the service hands it --------------------------------------------------------------

    def report(self, report: Report, now: float) -> None:
        self._add(REPORT, now, _encode(report))

    def alerts(self, decisions: Sequence[BaseModel], now: float) -> None:
        self._add(ALERTS, now, msgspec.json.encode([d.model_dump(mode="json") for d in decisions]))

    def evaluation(self, now: float) -> None:
        self._add(EVALUATION, now, b"")

    def _add(self, kind: str, now: float, body: bytes) -> None:
        full = None
        with self._lock:
            if not self._block:
                self._block_started = self.wall()
            self._block.append((kind, now, body))
            self.records[kind] += 1
            self._block_bytes += len(body) + 16
            if (self._block_bytes >= self.config.block_bytes
                    or self.wall() - self._block_started >= self.config.flush_seconds):
                full = self._take_block()
        if full:
            self._hand_over(full)

    def _take_block(self) -> list[tuple[str, float, bytes]]:
        block, self._block, self._block_bytes = self._block, [], 0
        return block

    def _hand_over(self, block: list[tuple[str, float, bytes]]) -> None:
        if self._queue is None:
            self._write(block)
            return
        try:
            self._queue.put_nowait(block)
        except queue.Full:
            self._drop("queue_full", len(block), "the trace writer is behind (a slow disk): a block was dropped")

    def flush(self) -> None:
        """The records buffered so far, written (waits for the writer thread)."""
        with self._lock:
            block = self._take_block()
        if block:
            self._hand_over(block)
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the writer's side ----------------------------------------------------------------------

    def _drain(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            block = q.get()
            try:
                if block is None:
                    return
                self._write(block)
            except Exception:
                log.exception("trace: writing a block failed")
                self._drop("write_error", len(block or ()), "")
            finally:
                q.task_done()

    def _drop(self, reason: str, n: int, why: str) -> None:
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
        now = self.wall()
        if why and now - self._error_logged >= ERROR_LOG_SECONDS:
            self._error_logged = now
            log.error("trace: %s (%d records; all counted in vigil_aggregator_trace_dropped_records_total)", why, n)

    def _write(self, block: list[tuple[str, float, bytes]]) -> None:
        payload = zlib.compress(_encode(block), 6)
        frame = _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
        try:
            seg = self._segment_for(len(frame))
            assert self._file is not None
            self._file.write(frame)
            self._file.flush()
        except OSError as exc:
            reason = "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
            self.write_errors[reason] = self.write_errors.get(reason, 0) + 1
            self._close_current()  # a partly written segment stays readable up to its last whole block
            self._drop("write_error", len(block), f"writing to {self.directory} failed ({reason}): {exc}")
            return
        seg.size += len(frame)
        seg.last_write = self.wall()

    def _segment_for(self, frame_bytes: int) -> _Segment:
        current = self._segments[-1] if self._file is not None else None
        if (current is not None and current.size + frame_bytes <= self.config.segment_bytes
                and self.wall() - current.opened < self.config.max_age_seconds / AGE_SLICES):
            return current
        self._close_current()
        self._enforce_bounds(incoming=self.config.segment_bytes)
        now = self.wall()
        self._opened += 1
        path = self.directory / f"trace-{int(now * 1000):014d}-{os.getpid()}-{self._opened:06d}{SEGMENT_SUFFIX}"
        header = _encode({**self.header, "opened_wall": now})
        start = MAGIC + bytes([FORMAT_VERSION]) + _FRAME.pack(len(header), zlib.crc32(header)) + header
        f = self.opener(path)
        try:
            f.write(start)
        except OSError:
            f.close()
            path.unlink(missing_ok=True)
            raise
        self._file = f
        seg = _Segment(path, len(start), now, now)
        self._segments.append(seg)
        return seg

    def _close_current(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _enforce_bounds(self, incoming: int) -> None:
        """Before a segment is opened: segments past the age bound go, then the oldest until the
        total with the new one fits ``max_bytes``."""
        now = self.wall()
        keep: list[_Segment] = []
        for seg in self._segments:
            if now - seg.last_write > self.config.max_age_seconds:
                self._remove(seg, "age")
            else:
                keep.append(seg)
        while keep and sum(s.size for s in keep) + incoming > self.config.max_bytes:
            self._remove(keep.pop(0), "size")
        self._segments = keep

    def _remove(self, seg: _Segment, reason: str) -> None:
        try:
            seg.path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("trace: could not remove %s: %s", seg.path, exc)
        self.removed[reason] += 1

    def bytes_on_disk(self) -> int:
        return sum(s.size for s in self._segments)

    def collector(self) -> PromCollector:
        return _TraceMetrics(self)


class _TraceMetrics(PromCollector):
    def __init__(self, writer: TraceWriter) -> None:
        self._writer = writer

    def collect(self) -> Iterator[Metric]:
        w = self._writer
        records = CounterMetricFamily("vigil_aggregator_trace_records", "Records taken into the trace, by kind "
                                      "(report, alerts, evaluation).", labels=["kind"])
        for kind, n in w.records.items():
            records.add_metric([kind], n)
        yield records
        dropped = CounterMetricFamily("vigil_aggregator_trace_dropped_records", "Trace records lost, by reason "
                                      "(queue_full: the writer was behind; write_error: the disk refused).",
                                      labels=["reason"])
        for reason in ("queue_full", "write_error"):
            dropped.add_metric([reason], w.dropped.get(reason, 0))
        yield dropped
        errors = CounterMetricFamily("vigil_aggregator_trace_write_errors", "Trace blocks the disk refused, by "
                                     "reason (disk_full, io).", labels=["reason"])
        for reason in ("disk_full", "io"):
            errors.add_metric([reason], w.write_errors.get(reason, 0))
        yield errors
        removed = CounterMetricFamily("vigil_aggregator_trace_segments_removed", "Trace segments removed to keep "
                                      "the bounds, by reason (size, age).", labels=["reason"])
        for reason, n in w.removed.items():
            removed.add_metric([reason], n)
        yield removed
        yield GaugeMetricFamily("vigil_aggregator_trace_bytes", "Bytes of trace segments on disk.",
                                value=w.bytes_on_disk())


class TracedSink:
    """The decision sink Alertmanager's route submits to, recording each batch it is handed (after
    the route's checks) before the ledger judges it."""

    def __init__(self, sink: Any, trace: TraceWriter) -> None:
        self._sink = sink
        self._trace = trace

    def submit(self, decisions: Sequence[Any], now: float, fleet_nodes: int) -> list[Any]:
        self._trace.alerts(decisions, now)
        admitted: list[Any] = self._sink.submit(decisions, now, fleet_nodes)
        return admitted

    def problem(self) -> str | None:
        problem: str | None = self._sink.problem()
        return problem
