"""Xid collector: follows the kernel log (/dev/kmsg, journalctl or a file) for GPU, NVSwitch and NIC faults.

Counts NVRM Xid, NVSwitch SXid, "fallen off the bus", mlx5 and amdgpu error faults per device (a
fault's companion and detail lines are folded into it by the parser and counted apart), maps the PCI
bus id to the GPU index and uuid through the GPU backend's identity, and forwards each new fault as an urgent
``Event`` (a flood is counted in full but forwarded collapsed and rate-limited per device and
code). It does not judge what a code means: the aggregator's Xid catalog does.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

from pydantic import Field

from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.file_follower import FileFollower
from vigil.agent.kernel_log import AMDGPU_RAS_BLOCKS, KernelEvent, KernelLogParser, normalize_bus_id
from vigil.agent.kernel_log_readers import (
    JOURNAL_ARGV,
    JournalReader,
    KmsgReader,
    LineSource,
    Spawner,
    StreamReader,
    spawn_process,
)
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.contract.wire import Event

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

log = logging.getLogger(__name__)

DEFAULT_KMSG = "/dev/kmsg"
DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
STATE_FILE = "xid_cursor.json"


class XidConfig(CollectorConfig):
    # 0.5 s: a fatal Xid must reach the aggregator within a second (issue 3), and a cycle that
    # finds nothing new costs one non-blocking read. This is the cadence of a source that cannot
    # say when it has a line (a followed file, journalctl's pipe behind its reader thread), and the
    # shortest spacing of cycles on one that can (a flood is read at this pace either way).
    interval_seconds: float = Field(default=0.5, gt=0)
    # /dev/kmsg polls readable when a record is logged: the runner starts a cycle then, so a line
    # is read as soon as the kernel logs it, and otherwise only this often (the cycle without a
    # line forwards a flood's folded count when its forward_interval_seconds is up, sooner when
    # that comes first; it is never the first report of a fault, which went when its line was
    # read). An idle agent's 0.5 s cycles of an empty log were two wake-ups a second, ~0.5 ms of
    # its CPU a second on the 2-core test VM (docs/architecture.md section 9).
    wake_interval_seconds: float = Field(default=5.0, gt=0)
    # kmsg: /dev/kmsg (needs CAP_SYSLOG or dmesg_restrict=0); journal: `journalctl -k -f` where
    # kmsg is not readable; file: follow a log file (rotation and truncation are survived).
    source: Literal["kmsg", "journal", "file"] = "kmsg"
    path: str | None = None  # kmsg device or followed file; default /dev/kmsg for kmsg
    # Where a followed file is first read from when no saved cursor exists: its history may
    # predate this boot, so by default only new lines count.
    file_start: Literal["beginning", "end"] = "end"
    journal_command: tuple[str, ...] = JOURNAL_ARGV
    # One forwarded event per (device, code) per this many seconds; the rest are folded into
    # its count. A real node logged 800k Xid 95 lines with 29 distinct (issue 3).
    forward_interval_seconds: float = Field(default=10.0, ge=0)
    # Lines parsed per cycle; the rest wait for the next cycle, so one flood cannot starve it.
    max_lines_per_cycle: int = Field(default=50_000, ge=1)
    queue_max_lines: int = Field(default=100_000, ge=1)
    # NVML identity is re-read at most this often when a line names an unknown bus id.
    identity_refresh_seconds: float = Field(default=30.0, ge=0)
    boot_id_path: str = DEFAULT_BOOT_ID_PATH


# The Xid codes whose catalog action pages (aggregator/data/xid_catalog.csv: reset_gpu, reboot_node,
# inspect_hardware; the Vigil*Xid* alerts in rules/vigil-alerts.rules.yml; tests keep all three in
# step). Their series exist at 0 from the collector's start, per GPU: a counter born at 1 has no
# earlier sample, so increase() reads 0 and the page would wait for an `offset 5m` arm. 32 codes:
# 256 series on an 8-GPU node; the catalog's 140 alert/observe codes are left to appear at their
# first Xid to keep that bounded.
PAGED_XID_CODES: tuple[int, ...] = (
    46, 48, 54, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 144, 145, 146, 147, 148, 149, 150,
    151, 155, 156, 158, 165, 167, 168, 169, 171, 172)

_GPU = ("gpu", "uuid")
XID_ERRORS = MetricSpec("vigil_gpu_xid_errors_total", MetricKind.COUNTER,
                        "NVRM Xid lines in the kernel log, by GPU and Xid code.", labels=(*_GPU, "code"))
XID_LAST = MetricSpec("vigil_gpu_xid_last_timestamp_seconds", MetricKind.GAUGE,
                      "Unix time the last Xid line of this GPU was read.", labels=_GPU, unit="seconds")
FALLEN_OFF_BUS = MetricSpec("vigil_gpu_fallen_off_bus_total", MetricKind.COUNTER,
                            "'GPU has fallen off the bus' notices not carried by an Xid 79 line.", labels=_GPU)
SXID_ERRORS = MetricSpec("vigil_nvswitch_sxid_errors_total", MetricKind.COUNTER,
                         "NVSwitch SXid lines in the kernel log, by switch and SXid code.",
                         labels=("switch", "pci_bus_id", "code"))
AMDGPU_EVENTS = MetricSpec("vigil_amdgpu_events_total", MetricKind.COUNTER,
                           "amdgpu (AMD Instinct) driver events in the kernel log, by GPU, event and RAS block "
                           "(aggregator/amdgpu_catalog.py names them).", labels=(*_GPU, "event", "block"))
MLX5_ERRORS = MetricSpec("vigil_mlx5_errors_total", MetricKind.COUNTER,
                         "mlx5_core driver error lines, by PCI function and error.", labels=("device", "error"))
LINES_READ = MetricSpec("vigil_kernel_log_lines_read_total", MetricKind.COUNTER,
                        "Kernel-log lines read by the xid collector.")
LINES_FOLDED = MetricSpec("vigil_kernel_log_lines_folded_total", MetricKind.COUNTER,
                          "Kernel-log lines folded into a fault already counted (the fallen-off-the-bus notice "
                          "after its Xid 79, SXid detail lines, an mlx5 health dump), by the fault's kind.",
                          labels=("kind",))
LINES_UNPARSED = MetricSpec("vigil_kernel_log_lines_unparsed_total", MetricKind.COUNTER,
                            "Kernel-log lines skipped as unparsable, by reason.", labels=("reason",))
READ_ERRORS = MetricSpec("vigil_kernel_log_read_errors_total", MetricKind.COUNTER,
                         "Kernel-log read problems (kmsg records overwritten before read, rotations lost).",
                         labels=("reason",))
EVENTS_FORWARDED = MetricSpec("vigil_kernel_log_events_forwarded_total", MetricKind.COUNTER,
                              "Events handed to the reporter (collapsed floods count once).", labels=("kind",))

SPECS = (XID_ERRORS, XID_LAST, FALLEN_OFF_BUS, SXID_ERRORS, AMDGPU_EVENTS, MLX5_ERRORS, LINES_READ, LINES_FOLDED,
         LINES_UNPARSED, READ_ERRORS, EVENTS_FORWARDED)


class GpuIdentities(Protocol):
    """What the collector needs of the GPU backend: PynvmlBackend and AmdSmiBackend satisfy it; tests
    pass a small table.
    ``identity(i)`` returns an object with ``index``, ``uuid`` and ``pci_bus_id`` attributes."""

    def device_count(self) -> int: ...

    def identity(self, index: int) -> Any: ...


@dataclass(frozen=True, slots=True)
class _Gpu:
    index: int | None
    uuid: str | None


_NO_GPU = _Gpu(None, None)


class _IdentityMap:
    """PCI bus id -> GPU, read from NVML lazily; entries are kept when a GPU later stops
    answering (a GPU that fell off the bus is exactly the one whose Xids we must label)."""

    def __init__(self, nvml: GpuIdentities | None, refresh_seconds: float) -> None:
        self._nvml = nvml
        self._refresh_seconds = refresh_seconds
        self._by_bus: dict[str, _Gpu] = {}
        self._read_at: float | None = None

    def lookup(self, bus: str | None, now: float) -> _Gpu:
        if bus is None or self._nvml is None:
            return _NO_GPU
        if bus not in self._by_bus and (self._read_at is None or now - self._read_at >= self._refresh_seconds):
            self._read(now)
        return self._by_bus.get(bus, _NO_GPU)

    def known(self, now: float) -> list[_Gpu]:
        """Every GPU NVML names (read now), or the unnamed GPU where there is no NVML to ask."""
        if self._nvml is None:
            return [_NO_GPU]
        self._read(now)
        return sorted(set(self._by_bus.values()), key=lambda g: (g.index is None, g.index or 0)) or [_NO_GPU]

    def _read(self, now: float) -> None:
        assert self._nvml is not None
        self._read_at = now
        try:
            count = self._nvml.device_count()
        except Exception as exc:  # noqa: BLE001 - NVML errors vary by driver; labels stay empty
            log.warning("xid: NVML device count failed, Xids keep their bus id only: %s", exc)
            return
        for index in range(count):
            try:
                ident = self._nvml.identity(index)
                self._by_bus[normalize_bus_id(ident.pci_bus_id)] = _Gpu(int(ident.index), str(ident.uuid))
            except Exception as exc:  # noqa: BLE001 - one unreadable GPU must not hide the others
                log.warning("xid: NVML identity of GPU %d failed: %s", index, exc)


@dataclass(slots=True)
class _Pending:
    """Occurrences of one (kind, device, code) not yet forwarded."""

    first_ts: float
    last_ts: float
    count: int
    event: KernelEvent
    gpu: _Gpu


class XidCollector:
    name = "xid"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: XidConfig, *, open_source: Callable[[], LineSource],
                 nvml: GpuIdentities | None = None, state_dir: Path | None = None,
                 boot_id_path: str | Path | None = None) -> None:
        self._config = config
        self._open_source = open_source
        self._source: LineSource | None = None
        self._parser: KernelLogParser | None = None
        self._ids = _IdentityMap(nvml, config.identity_refresh_seconds)
        self._state_path = state_dir / STATE_FILE if state_dir is not None else None
        self._boot_id = _read_boot_id(Path(boot_id_path or config.boot_id_path))
        self._read_errors: dict[str, float] = {}
        self._saved = self._load_state()
        self._skip_seq: int | None = None
        self._last_seq: int | None = None
        self._xid: dict[tuple[int | None, str | None, int], float] = {}
        # ``_xid``'s samples as of the counts they were built from (``_samples``).
        self._xid_samples: tuple[dict[tuple[int | None, str | None, int], float], list[Sample]] | None = None
        # (what the samples after lines-read depend on, those samples): _samples' memo.
        self._rest_samples: tuple[tuple[object, ...], list[Sample]] | None = None
        self._xid_last: dict[tuple[int | None, str | None], float] = {}
        self._fallen: dict[tuple[int | None, str | None], float] = {}
        self._sxid: dict[tuple[str, str, int], float] = {}
        self._mlx5: dict[tuple[str, str], float] = {}
        self._amdgpu: dict[tuple[int | None, str | None, str, str], float] = {}
        self._unparsed: dict[str, float] = {}
        self._folded: dict[str, float] = {}
        self._forwarded: dict[str, float] = {}
        self._lines = 0
        self._pending: dict[tuple[str, str | None, str], _Pending] = {}
        self._last_forward: dict[tuple[str, str | None, str], float] = {}
        self._overruns_seen = 0

    # -- state -------------------------------------------------------------------------------

    def _load_state(self) -> dict[str, Any]:
        if self._state_path is None:
            return {}
        try:
            data = json.loads(self._state_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("xid: ignoring unreadable cursor %s: %s", self._state_path, exc)
            self._read_errors["bad_state_file"] = self._read_errors.get("bad_state_file", 0) + 1
            return {}
        return data if isinstance(data, dict) else {}

    def saved_cursor(self) -> dict[str, Any] | None:
        """The file cursor saved by a previous run, for a FileFollower to resume from."""
        cursor = self._saved.get("file")
        return cursor if isinstance(cursor, dict) else None

    def _save_state(self) -> None:
        if self._state_path is None or self._source is None:
            return
        state: dict[str, Any] = {"boot_id": self._boot_id}
        if self._last_seq is not None:
            state["kmsg_seq"] = self._last_seq
        cursor = self._source.cursor()
        if cursor:
            state["file"] = cursor
        if state == self._saved:
            return
        tmp = self._state_path.with_suffix(".tmp")
        try:
            self._state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self._state_path)
        except OSError as exc:
            log.warning("xid: cannot save cursor %s: %s", self._state_path, exc)
            self._read_errors["state_write"] = self._read_errors.get("state_write", 0) + 1
            return
        self._saved = state

    # -- collection --------------------------------------------------------------------------

    def collect(self, now: float) -> Collection:
        if self._source is None:
            source = self._open_source()  # raises OSError: the runner reports this collector failed
            self._source = source
            self._parser = KernelLogParser(raw_kmsg=source.raw_kmsg)
            for gpu in self._ids.known(now):  # before the first line: the paged counters start at 0
                self._fallen.setdefault((gpu.index, gpu.uuid), 0)
                for code in PAGED_XID_CODES:
                    self._xid.setdefault((gpu.index, gpu.uuid, code), 0)
            saved_seq = self._saved.get("kmsg_seq")
            if source.raw_kmsg and isinstance(saved_seq, int) and self._saved.get("boot_id") == self._boot_id:
                self._skip_seq = saved_seq  # same boot: the ring buffer replays what we counted
        assert self._parser is not None
        try:
            lines = self._source.read_lines(self._config.max_lines_per_cycle)
        except OSError:
            if not isinstance(self._source, FileFollower):
                self.close()  # a dead journalctl or kmsg descriptor: reopened next cycle
            raise
        self._lines += len(lines)
        for line in lines:
            parsed = self._parser.feed(line)
            if parsed.seq is not None:
                if self._skip_seq is not None and parsed.seq <= self._skip_seq:
                    continue
                self._last_seq = parsed.seq
            if parsed.unparsed is not None:
                self._unparsed[parsed.unparsed] = self._unparsed.get(parsed.unparsed, 0) + 1
            if parsed.folded is not None:
                self._folded[parsed.folded] = self._folded.get(parsed.folded, 0) + 1
            if parsed.event is not None:
                self._count(parsed.event, now)
        overruns = getattr(self._source, "overruns", 0)
        if overruns > self._overruns_seen:
            lost = overruns - self._overruns_seen
            self._read_errors["kmsg_overrun"] = self._read_errors.get("kmsg_overrun", 0) + lost
            self._overruns_seen = overruns
        events = self._forward(now)
        self._save_state()
        return Collection(samples=self._samples(), events=events)

    def wake(self, now: float) -> tuple[int, float] | None:
        """(the kernel log's descriptor, seconds to the next cycle without a line) while the
        source polls (/dev/kmsg; ``Wakeable``), else None: run at ``interval_seconds``."""
        fd = self._source.wake_fd() if self._source is not None else None
        if fd is None:
            return None
        seconds = self._config.wake_interval_seconds
        if self._pending:  # a folded count waits for its key's forward interval
            interval = self._config.forward_interval_seconds
            due = min(self._last_forward.get(key, now) + interval for key in self._pending)
            seconds = max(self._config.interval_seconds, min(seconds, due - now))
        return fd, seconds

    def _count(self, ev: KernelEvent, now: float) -> None:
        gpu = _NO_GPU
        if ev.kind == "xid":
            assert ev.code is not None
            gpu = self._ids.lookup(ev.pci_bus_id, now)
            key = (gpu.index, gpu.uuid, ev.code)
            self._xid[key] = self._xid.get(key, 0) + 1
            self._xid_last[(gpu.index, gpu.uuid)] = now
            fwd_key = ("xid", ev.pci_bus_id, str(ev.code))
        elif ev.kind == "gpu_lost":
            gpu = self._ids.lookup(ev.pci_bus_id, now)
            self._fallen[(gpu.index, gpu.uuid)] = self._fallen.get((gpu.index, gpu.uuid), 0) + 1
            fwd_key = ("gpu_lost", ev.pci_bus_id, "")
        elif ev.kind == "sxid":
            assert ev.code is not None
            skey = (ev.device or "", ev.pci_bus_id or "", ev.code)
            self._sxid[skey] = self._sxid.get(skey, 0) + 1
            fwd_key = ("sxid", ev.pci_bus_id, str(ev.code))
        elif ev.kind == "amdgpu":
            gpu = self._ids.lookup(ev.pci_bus_id, now)
            block = amdgpu_block_name(ev.code)
            akey = (gpu.index, gpu.uuid, ev.error or "", block)
            self._amdgpu[akey] = self._amdgpu.get(akey, 0) + 1
            fwd_key = (amdgpu_kind(ev), ev.pci_bus_id, block)
        else:
            mkey = (ev.device or "", ev.error or "")
            self._mlx5[mkey] = self._mlx5.get(mkey, 0) + 1
            fwd_key = ("mlx5_error", ev.device, ev.error or "")
        pending = self._pending.get(fwd_key)
        if pending is None:
            self._pending[fwd_key] = _Pending(now, now, 1, ev, gpu)
        else:
            pending.count += 1
            pending.last_ts = now
            pending.event = ev  # the latest text: a changed recovery action or register dump matters

    def _forward(self, now: float) -> list[Event]:
        interval = self._config.forward_interval_seconds
        events: list[Event] = []
        for key in list(self._pending):
            last = self._last_forward.get(key)
            if last is not None and now - last < interval:
                continue  # folded into the next forward of this key
            p = self._pending.pop(key)
            self._last_forward[key] = now
            ev = p.event
            kind = amdgpu_kind(ev) if ev.kind == "amdgpu" else ev.kind
            events.append(Event(
                kind=kind,
                ts=p.first_ts,
                urgent=True,
                message=_message(ev),
                code=ev.code,
                gpu=p.gpu.index,
                uuid=p.gpu.uuid,
                pci_bus_id=ev.pci_bus_id,
                device=ev.device,
                count=p.count,
                last_ts=p.last_ts if p.count > 1 else None,
                source="kmsg",
            ))
            self._forwarded[kind] = self._forwarded.get(kind, 0) + 1
        return events

    def _samples(self) -> list[Sample]:
        def lbl(v: object) -> str:
            return "" if v is None else str(v)

        samples = [Sample.of(LINES_READ, self._lines)]
        # Every count below moves only with a line read (or, for the paged Xid and fallen-off-bus
        # counters, a GPU first seen when the source opens), a read error or a forward: while none
        # of those changed, the samples built last time stand.
        key = (self._lines, len(self._xid), len(self._fallen), len(self._amdgpu), tuple(self._read_errors.items()),
               tuple(self._forwarded.items()))
        if self._rest_samples is not None and self._rest_samples[0] == key:
            return samples + self._rest_samples[1]
        # One counter a GPU and code (~250 on 8 GPUs), none of which moves on a healthy node: the
        # samples built last time stand while the counts are the same.
        if self._xid_samples is None or self._xid_samples[0] != self._xid:
            # Sample.of's pairs, written out (~250 a node, all rebuilt when one count moves).
            self._xid_samples = (dict(self._xid), [
                Sample(XID_ERRORS.name, float(n), (("gpu", lbl(g)), ("uuid", lbl(u)), ("code", str(c))))
                for (g, u, c), n in self._xid.items()])
        samples += self._xid_samples[1]
        samples += [Sample.of(XID_LAST, t, gpu=lbl(g), uuid=lbl(u)) for (g, u), t in self._xid_last.items()]
        samples += [Sample.of(FALLEN_OFF_BUS, n, gpu=lbl(g), uuid=lbl(u)) for (g, u), n in self._fallen.items()]
        samples += [Sample.of(SXID_ERRORS, n, switch=s, pci_bus_id=b, code=c) for (s, b, c), n in self._sxid.items()]
        samples += [Sample.of(AMDGPU_EVENTS, n, gpu=lbl(g), uuid=lbl(u), event=e, block=b)
                    for (g, u, e, b), n in self._amdgpu.items()]
        samples += [Sample.of(MLX5_ERRORS, n, device=d, error=e) for (d, e), n in self._mlx5.items()]
        samples += [Sample.of(LINES_FOLDED, n, kind=k) for k, n in self._folded.items()]
        samples += [Sample.of(LINES_UNPARSED, n, reason=r) for r, n in self._unparsed.items()]
        samples += [Sample.of(READ_ERRORS, n, reason=r) for r, n in self._read_errors.items()]
        samples += [Sample.of(EVENTS_FORWARDED, n, kind=k) for k, n in self._forwarded.items()]
        self._rest_samples = (key, samples[1:])
        return samples

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None


def _message(ev: KernelEvent) -> str:
    if ev.kind == "sxid" and ev.severity:
        return f"{ev.severity}, {ev.text}"
    if ev.kind == "mlx5_error":
        return f"{ev.error}: {ev.text}"
    return ev.text


def amdgpu_kind(ev: KernelEvent) -> str:
    """The wire kind of an amdgpu event: ``amdgpu_<event>`` (aggregator/amdgpu_catalog.py's names)."""
    return f"amdgpu_{ev.error}"


def amdgpu_block_name(code: int | None) -> str:
    """The RAS block a code numbers ("" for an event that names none)."""
    return _BLOCK_NAMES.get(code, "") if code is not None else ""


_BLOCK_NAMES = {number: name for name, number in AMDGPU_RAS_BLOCKS.items()}


def _read_boot_id(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""  # no boot id: a saved kmsg sequence is never trusted


def open_kernel_log(config: XidConfig, kmsg: str | Path | IO[str] | None, *, spawn: Spawner = spawn_process,
                    file_cursor: dict[str, Any] | None = None) -> LineSource:
    """Choose the reader: an injected source (``Seams.kmsg``) wins over the configured one."""
    if kmsg is not None and not isinstance(kmsg, (str, Path)):
        return StreamReader(kmsg, queue_max_lines=config.queue_max_lines)
    if kmsg is not None:
        path = Path(kmsg)
        try:
            source = "kmsg" if stat.S_ISCHR(path.stat().st_mode) else "file"
        except FileNotFoundError:  # not there yet: a file, read from its beginning once it appears
            source = "file"
    else:
        source = config.source
        path = Path(config.path or DEFAULT_KMSG)
    if source == "kmsg":
        return KmsgReader(path)
    if source == "journal":
        return JournalReader(config.journal_command, spawn=spawn, queue_max_lines=config.queue_max_lines)
    cursor = file_cursor if file_cursor and file_cursor.get("path") == str(path) else None
    return FileFollower(path, start=config.file_start, cursor=cursor)


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = XidConfig


def build(config: AgentConfig, seams: Seams) -> XidCollector:
    xid_config = config.collectors.section("xid", XidConfig)
    spawn = seams.extra.get("spawn", spawn_process)
    collector: XidCollector

    def open_source() -> LineSource:
        return open_kernel_log(xid_config, seams.kmsg, spawn=spawn, file_cursor=collector.saved_cursor())

    collector = XidCollector(xid_config, open_source=open_source, nvml=seams.nvml, state_dir=seams.state_dir)
    return collector
