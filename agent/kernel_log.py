"""Kernel-log faults: NVRM Xid, NVSwitch SXid, "fallen off the bus", mlx5 and amdgpu driver errors.

Reads kernel-log lines (their transport prefixes stripped by ``agent.kernel_log_prefix``) and
turns the ones we care about into ``KernelEvent``s, one per fault: companion and detail lines
fold into the fault they belong to. It does not read sources, map bus ids to GPUs or judge
severity: ``agent.kernel_log_readers`` reads, the ``xid`` collector maps, the aggregator's catalogs judge.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from typing import Literal

from vigil.agent.kernel_log_prefix import KMSG_RE, split_line, timestamp_seconds

EventKind = Literal["xid", "sxid", "gpu_lost", "mlx5_error", "amdgpu"]

# NVRM Xid, every driver generation: "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=x, text"
# (R470+ adds name=; R535+ writes pid='<unknown>'); old drivers may omit pid/name or "PCI:", and
# some print the function (".0"). GB200-class drivers use PCI domains such as 0018.
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\):\s*"
    r"(?P<code>\d+)(?:,\s*|\s+)(?P<rest>.*)$"
)
_PID_RE = re.compile(r"^pid=(?P<pid>'<unknown>'|<unknown>|\d+),\s*")
_NAME_RE = re.compile(r"^name=(?P<name>.*?),\s*")
# NVSwitch SXid: "nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 28006, Non-fatal, Link 46 ..."
_SXID_RE = re.compile(
    r"(?P<switch>nvidia-nvswitch\d+): SXid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
    r"(?:\.[0-7])?\):\s*(?P<code>\d+)(?:,\s*|\s+)(?P<rest>.*)$"
)
# The NVSwitch driver follows an SXid's headline with detail lines of the same switch and code
# (open-gpu-kernel-modules, nvswitch's error reporting; real lines: NVIDIA/nvtrust issue 124):
#   "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Severity 0 Engine instance 44 Sub-engine instance 00"
#   "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Data {0x0000002c, 0x0000002c, ...}"
_SXID_DETAIL_RE = re.compile(r"^(?:Severity \d+ Engine instance|Data \{)")
# "NVRM: The NVIDIA GPU 0000:b3:00.0" opens the driver's three-line fallen-off-the-bus notice;
# "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus." is the one-line form of newer drivers.
_FALLEN_HEAD_RE = re.compile(r"NVRM: The NVIDIA GPU (?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")
_FALLEN_ONE_RE = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?(?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?:?\s.*"
    r"fallen off the bus"
)
_FALLEN_RE = re.compile(r"fallen off the bus", re.IGNORECASE)
# The head line and the "fallen off the bus" line are at most this many lines apart.
_FALLEN_SPAN_LINES = 3
# Xid 79 is ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (NVIDIA Xid catalog); newer drivers print
# the one-line notice right after it for the same GPU: one fault, carried by the Xid.
XID_FALLEN_OFF_BUS = 79
# mlx5_core lines: "mlx5_core 0000:03:00.0: <function>:<line>:(pid N): <text>" or "...: <text>".
_MLX5_RE = re.compile(
    r"mlx5_core (?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]):?\s+(?P<rest>.*)$"
)
# mlx5 messages that report a fault, as (error name, pattern). The driver logs far more
# informational lines (firmware version, link modes, "Cable plugged"), which are not errors.
# Sources: NVIDIA NVSentinel syslog-health-monitor nicdriver patterns (handler_test.go) and the
# messages in Linux drivers/net/ethernet/mellanox/mlx5/core/{cmd,health,events,pci_irq}.c.
MLX5_ERROR_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("command_timeout", re.compile(r"\btimeout\b.*(?:leak of a command resource|command)|"
                                   r"\(0x[0-9a-f]+\) timeout", re.IGNORECASE)),
    ("health_compromised", re.compile(r"health compromised|health poll failed", re.IGNORECASE)),
    # "poll_health: Fatal error 1 detected": the health poll read a fatal firmware state.
    ("firmware_fatal", re.compile(r"(?:fw|firmware) (?:fatal|crashed|syndrome)|assert_var|"
                                  r"unrecoverable|internal error|Fatal error \d* ?detected", re.IGNORECASE)),
    ("pcie_power", re.compile(r"insufficient power", re.IGNORECASE)),
    ("module_error", re.compile(r"Port module event\[error\]", re.IGNORECASE)),
    ("cable_unplugged", re.compile(r"Cable unplugged", re.IGNORECASE)),
    ("pci_error", re.compile(r"PCI (?:channel|slot) .*(?:failure|frozen)|pci_err_detected|AER",
                             re.IGNORECASE)),
    ("cqe_error", re.compile(r"CQE error|error cqe", re.IGNORECASE)),
)
# amdgpu (AMD Instinct) driver lines, as the real driver prints them (tests/fixtures/kernel-log/
# amdgpu/PROVENANCE.md): "amdgpu 0000:dd:00.0: [amdgpu: ][{N}]<message>" where {N} is the RAS event
# id of newer drivers (RAS_EVENT_LOG), or a "[drm:amdgpu_job_timedout [amdgpu]] *ERROR* ..." line
# that names no device, or "amdgpu: <message>" without one.
_AMDGPU_RE = re.compile(
    r"^amdgpu (?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]):\s*(?:\{\d+\})?(?:amdgpu:\s*)?"
    r"(?:\{\d+\})?(?P<rest>.*)$"
)
_AMDGPU_NODEV_RE = re.compile(r"^(?:\[drm:amdgpu_\w+ \[amdgpu\]\] \*ERROR\*|amdgpu:)\s*(?P<rest>.*)$")
# RAS error counts (amdgpu_ras.c, amdgpu_ras_error_print_error_data / amdgpu_ras_log_on_err_counter):
# "[socket: S, die: D, ]N [new ]uncorrectable|correctable|deferred hardware errors detected[ in total]
# in <block> block"; "no ..." and a count of 0 are the driver saying the GPU is fine.
_AMDGPU_RAS_COUNT_RE = re.compile(
    r"(?:socket: \d+, die: \d+, )?(?P<count>\d+|no) (?P<new>new )?(?P<sev>uncorrectable|correctable|deferred) "
    r"hardware errors detected(?P<total> in total)? in (?P<block>\w+) block", re.IGNORECASE)
# The driver's fatal-error interrupt: "uncorrectable hardware error(ERREVENT_ATHUB_INTERRUPT) detected!"
_AMDGPU_RAS_FATAL_RE = re.compile(r"uncorrectable hardware error\((?P<what>\w+)\) detected")
# Ring timeouts (amdgpu_job.c, amdgpu_job_timedout): "ring gfx_0.0.0 timeout, signaled seq=.., emitted
# seq=.." (the job did not finish: the driver resets), or "ring gfx timeout, but soft recovered".
_AMDGPU_RING_RE = re.compile(r"^ring (?P<ring>\S+) timeout(?P<soft>, but soft recovered)?")
# (event name, pattern) of the other amdgpu lines that are events; every other amdgpu line (init,
# page-fault detail, "GPU reset succeeded, trying to resume", the ACA register dump) is not one.
AMDGPU_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("poison_consumed", re.compile(r"^poison is consumed by client \d+", re.IGNORECASE)),
    ("poison_created", re.compile(r"^Poison is created", re.IGNORECASE)),
    ("bad_page_threshold", re.compile(r"^Saved bad pages \d+ reaches threshold value \d+")),
    ("gpu_reset_begin", re.compile(r"^GPU reset begin!")),
    ("gpu_reset_succeeded", re.compile(r"^GPU reset\(\d+\) succeeded!")),
    ("gpu_reset_failed", re.compile(r"^GPU reset(?:\(\d+\))? failed")),
)
# AMD's RAS blocks by their number (Linux drivers/gpu/drm/amd/amdgpu/amdgpu_ras.h, enum
# amdgpu_ras_block; the names as amdgpu_ras.c's ras_block_string prints them): the event's ``code``.
AMDGPU_RAS_BLOCKS: dict[str, int] = {
    "umc": 0, "sdma": 1, "gfx": 2, "mmhub": 3, "athub": 4, "pcie_bif": 5, "hdp": 6, "xgmi_wafl": 7,
    "df": 8, "smn": 9, "sem": 10, "mp0": 11, "mp1": 12, "fuse": 13, "mca": 14, "vcn": 15, "jpeg": 16,
    "ih": 17, "mpio": 18,
}

# An mlx5 health event (the poll's "health compromised", a firmware assert) is followed by the
# driver's dump of the health buffer, one register per line (Linux mlx5/core/health.c,
# print_health_info): assert_var[0..4], assert_exit_ptr, ..., synd ("firmware internal error").
# The dump's lines that read as errors themselves (assert_var, synd) belong to the health event.
_MLX5_HEALTH_ERRORS = frozenset({"health_compromised", "firmware_fatal"})

# Folding: a line that only continues or details a fault already reported (the fallen-off
# notice after its Xid 79, an SXid's detail lines, an mlx5 health dump) belongs to that fault.
# The driver prints them in the same interrupt or work item: within 5 ms in the real logs of
# tests/fixtures/kernel-log (nvtrust issue 124: 2-5 ms; Xid 79 and its notice share a second).
# Syslog stamps whole seconds, so two lines of one fault can straddle a second boundary: 2 s.
FOLD_WINDOW_SECONDS = 2.0
# Lines without a usable timestamp fold by distance instead: the companion follows within this
# many lines of the same host (an mlx5 health dump is 19 lines, its last error line the 17th).
FOLD_SPAN_LINES = 24
# Per-host folding state is kept for at most this many hosts (a collected log names each host;
# hostile input must not grow the parser without bound): the least recently seen is dropped.
MAX_HOSTS = 4096

# Why a line was counted as unparsed (the `reason` label of the unparsed-lines counter).
REASON_KMSG_RECORD = "malformed_kmsg_record"
REASON_XID = "malformed_xid"
REASON_SXID = "malformed_sxid"
REASON_UNDECODABLE = "undecodable"


@functools.lru_cache(maxsize=4096)  # a node has a few dozen devices; a flood repeats them
def normalize_bus_id(bus: str) -> str:
    """Any PCI bus id form ("0000:3B:00", "00000000:3B:00.0", "3b:00.0") -> "0000:3b:00"."""
    text = bus.strip().lower()
    if text.startswith("pci:"):
        text = text[4:]
    text = text.split(".", 1)[0]
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    if len(parts) != 3:
        raise ValueError(f"not a PCI bus id: {bus!r}")
    domain, bus_no, device = parts
    # NVML writes an 8-digit domain ("00000000"); the kernel writes 4 digits.
    domain = f"{int(domain, 16):04x}"
    return f"{domain}:{int(bus_no, 16):02x}:{int(device, 16):02x}"



@dataclass(frozen=True, slots=True)
class KernelEvent:
    """One fault. ``pci_bus_id`` is normalised ("0000:3b:00"); ``device`` is what the line names
    the device by (the NVSwitch instance, the mlx5 PCI function); ``text`` is the driver's
    description after the code, pid and name; ``host`` is the host a collected or syslog line
    names (None for a node's own log)."""

    kind: EventKind
    pci_bus_id: str | None
    code: int | None
    text: str
    ts_text: str = ""
    seq: int | None = None
    device: str | None = None
    pid: str | None = None
    process: str | None = None
    severity: str | None = None  # SXid "Fatal"/"Non-fatal" as the line says it
    error: str | None = None  # mlx5 error name from MLX5_ERROR_PATTERNS
    line: str = ""
    host: str | None = None


@dataclass(frozen=True, slots=True)
class ParsedLine:
    """The result of feeding one line: at most one event, or the reason it was unparsable.
    ``seq`` is the /dev/kmsg sequence number when the line was a raw record. ``folded`` names
    the kind of the earlier event this line continues (it is part of that fault, not a new one)."""

    event: KernelEvent | None = None
    unparsed: str | None = None
    seq: int | None = None
    continuation: bool = False
    folded: EventKind | None = None



@dataclass(frozen=True, slots=True)
class _Open:
    """A reported fault that later lines may still continue: where and when it was seen."""

    line_no: int
    at: float | None


@dataclass(slots=True)
class _HostState:
    """One host's folding memory (a collected log interleaves hosts; each folds on its own)."""

    line_no: int = 0
    fallen_bus: str | None = None
    fallen_age: int = 0
    # (kind, device, code) of a fault that may still be continued -> where it was seen.
    open: dict[tuple[str, str, int], _Open] = field(default_factory=dict)


class KernelLogParser:
    """Stateful line parser: the fallen-off-the-bus notice spans lines, and a fault's companion
    and detail lines are folded into the fault (``ParsedLine.folded``) instead of being reported
    again. Feed lines in log order; a collected log's hosts are followed separately."""

    def __init__(self, *, raw_kmsg: bool = False) -> None:
        # raw_kmsg: every line must be a /dev/kmsg record; one that is not is counted as malformed.
        self._raw_kmsg = raw_kmsg
        self._hosts: dict[str | None, _HostState] = {}

    def feed(self, line: str) -> ParsedLine:
        line = line.rstrip("\r\n")
        if line.startswith(" ") and _looks_like_kmsg_dict(line):
            return ParsedLine(continuation=True)
        if "\ufffd" in line:
            # Bytes that were not UTF-8: a corrupt record; the rest of the log is still read.
            return ParsedLine(unparsed=REASON_UNDECODABLE)
        if self._raw_kmsg and not KMSG_RE.match(line):
            return ParsedLine(unparsed=REASON_KMSG_RECORD)
        ts_text, msg, seq, host = split_line(line)
        state = self._state(host)
        state.line_no += 1
        event, reason = self._classify(state, msg.strip(), ts_text, seq, line)
        if event is None:
            return ParsedLine(unparsed=reason, seq=seq)
        if event.host != host:
            event = replace(event, host=host)
        folded = self._fold(state, event)
        if folded is not None:
            return ParsedLine(seq=seq, folded=folded)
        return ParsedLine(event=event, seq=seq)

    def _state(self, host: str | None) -> _HostState:
        state = self._hosts.get(host)
        if state is None:
            if len(self._hosts) >= MAX_HOSTS:
                del self._hosts[next(iter(self._hosts))]
            state = self._hosts[host] = _HostState()
        elif len(self._hosts) > 1 and next(reversed(self._hosts)) != host:
            self._hosts[host] = self._hosts.pop(host)  # most recently seen last
        return state

    def _classify(self, state: _HostState, msg: str, ts_text: str, seq: int | None,
                  line: str) -> tuple[KernelEvent | None, str | None]:
        if state.fallen_bus is not None:
            state.fallen_age += 1
            if state.fallen_age > _FALLEN_SPAN_LINES:
                state.fallen_bus = None
        if "NVRM: Xid" in msg:
            return _parse_xid(msg, ts_text, seq, line)
        if "SXid" in msg and "nvswitch" in msg:
            return _parse_sxid(msg, ts_text, seq, line)
        if msg.startswith("mlx5_core"):
            return _parse_mlx5(msg, ts_text, seq, line), None
        if "amdgpu" in msg:
            return _parse_amdgpu(msg, ts_text, seq, line), None
        head = _FALLEN_HEAD_RE.search(msg)
        if head:
            state.fallen_bus = normalize_bus_id(head.group("bus"))
            state.fallen_age = 0
            if not _FALLEN_RE.search(msg):
                return None, None
        if _FALLEN_RE.search(msg):
            one = _FALLEN_ONE_RE.search(msg)
            bus = normalize_bus_id(one.group("bus")) if one else state.fallen_bus
            state.fallen_bus = None
            lost = KernelEvent("gpu_lost", bus, None, "GPU has fallen off the bus", ts_text, seq, line=line)
            return lost, None
        return None, None

    def _fold(self, state: _HostState, ev: KernelEvent) -> EventKind | None:
        """The kind of the open fault this event continues, or None after opening ``ev`` as one."""
        if ev.kind == "xid" and ev.code != XID_FALLEN_OFF_BUS:
            return None  # nothing folds into other Xids, and a flood of them must stay cheap
        if ev.kind == "mlx5_error" and ev.error not in _MLX5_HEALTH_ERRORS:
            return None
        if ev.kind == "amdgpu":
            # A RAS count "in total" repeats the "new" line before it as a running total: one fault.
            return "amdgpu" if ev.error == AMDGPU_RAS_TOTAL else None
        at = timestamp_seconds(ev.ts_text)
        if ev.kind == "gpu_lost":
            # The notice after the Xid 79 of the same GPU (or a repeat of the notice): one fault.
            bus = ev.pci_bus_id or ""
            if self._near(state, ("xid", bus, XID_FALLEN_OFF_BUS), at):
                return "xid"
            if self._near(state, ("gpu_lost", bus, -1), at):
                return "gpu_lost"
            self._open(state, ("gpu_lost", ev.pci_bus_id or "", -1), at)
            return None
        if ev.kind == "sxid":
            assert ev.code is not None
            key = ("sxid", f"{ev.device}/{ev.pci_bus_id}", ev.code)
            if _SXID_DETAIL_RE.match(ev.text) and self._near(state, key, at):
                return "sxid"
            if not _SXID_DETAIL_RE.match(ev.text):
                self._open(state, key, at)  # a headline: its details follow
            return None
        if ev.kind == "mlx5_error":
            # "health compromised" always starts a fault; the dump's error-looking lines after it
            # (or after a first firmware-fatal line) belong to it.
            key = ("mlx5_error", ev.device or "", -1)
            if ev.error != "health_compromised" and self._near(state, key, at):
                return "mlx5_error"
            self._open(state, key, at)
            return None
        self._open(state, ("xid", ev.pci_bus_id or "", XID_FALLEN_OFF_BUS), at)  # an Xid 79
        return None

    @staticmethod
    def _open(state: _HostState, key: tuple[str, str, int], at: float | None) -> None:
        if len(state.open) >= 256:
            state.open.pop(next(iter(state.open)))
        state.open.pop(key, None)
        state.open[key] = _Open(state.line_no, at)

    @staticmethod
    def _near(state: _HostState, key: tuple[str, str, int], at: float | None) -> bool:
        """Whether the open fault ``key`` was seen close enough before this line to own it. The
        window is anchored at the fault's first line, so a device that repeats a fault every
        second is not folded into one event forever."""
        seen = state.open.get(key)
        if seen is None:
            return False
        if seen.at is not None and at is not None:
            return abs(at - seen.at) <= FOLD_WINDOW_SECONDS
        return state.line_no - seen.line_no <= FOLD_SPAN_LINES


def _looks_like_kmsg_dict(line: str) -> bool:
    # /dev/kmsg continuation: " SUBSYSTEM=pci" / " DEVICE=+pci:0000:3b:00.0"
    return re.match(r"^ [A-Z_]+=", line) is not None


def _parse_xid(msg: str, ts_text: str, seq: int | None, line: str) -> tuple[KernelEvent | None, str | None]:
    m = _XID_RE.search(msg)
    if not m:
        return None, REASON_XID
    rest = m.group("rest")
    pid = process = None
    pm = _PID_RE.match(rest)
    if pm:
        pid = pm.group("pid").strip("'")
        rest = rest[pm.end():]
        nm = _NAME_RE.match(rest)
        if nm:
            process = nm.group("name")
            rest = rest[nm.end():]
    event = KernelEvent("xid", normalize_bus_id(m.group("bus")), int(m.group("code")), rest.strip(), ts_text,
                        seq, pid=pid, process=process, line=line)
    return event, None


def _parse_sxid(msg: str, ts_text: str, seq: int | None, line: str) -> tuple[KernelEvent | None, str | None]:
    m = _SXID_RE.search(msg)
    if not m:
        return None, REASON_SXID
    rest = m.group("rest").strip()
    severity = None
    sm = re.match(r"^(Fatal|Non-fatal),\s*", rest, re.IGNORECASE)
    if sm:
        severity = sm.group(1)
        rest = rest[sm.end():]
    event = KernelEvent("sxid", normalize_bus_id(m.group("bus")), int(m.group("code")), rest, ts_text, seq,
                        device=m.group("switch"), severity=severity, line=line)
    return event, None


def _parse_mlx5(msg: str, ts_text: str, seq: int | None, line: str) -> KernelEvent | None:
    m = _MLX5_RE.match(msg)
    if not m:
        return None
    rest = m.group("rest").strip()
    for error, pattern in MLX5_ERROR_PATTERNS:
        if pattern.search(rest):
            bus = m.group("bus").lower()
            return KernelEvent("mlx5_error", normalize_bus_id(bus), None, rest, ts_text, seq, device=bus,
                               error=error, line=line)
    return None


# The event name of a RAS running-total line (folded into the "new" count line it follows).
AMDGPU_RAS_TOTAL = "ras_total"


def _parse_amdgpu(msg: str, ts_text: str, seq: int | None, line: str) -> KernelEvent | None:
    """An amdgpu driver line -> its event (``error``: the event's name, ``code``: the RAS block's
    number where the line names one), or None for the driver's many lines that are no fault."""
    m = _AMDGPU_RE.match(msg)
    bus = device = None
    if m:
        device = m.group("bus").lower()
        bus = normalize_bus_id(device)
        rest = m.group("rest").strip()
    else:
        nm = _AMDGPU_NODEV_RE.match(msg)
        if nm is None:
            return None
        rest = nm.group("rest").strip()
    error: str | None = None
    code: int | None = None
    rm = _AMDGPU_RAS_COUNT_RE.search(rest)
    if rm:
        if rm.group("count").lower() == "no" or int(rm.group("count")) == 0:
            return None
        block = rm.group("block").lower()
        code = AMDGPU_RAS_BLOCKS.get(block)
        error = AMDGPU_RAS_TOTAL if rm.group("total") else f"ras_{rm.group('sev').lower()}"
    elif _AMDGPU_RAS_FATAL_RE.search(rest):
        error = "ras_fatal"
    else:
        ring = _AMDGPU_RING_RE.match(rest)
        if ring:
            error = "ring_timeout_recovered" if ring.group("soft") else "ring_timeout"
        else:
            error = next((name for name, pattern in AMDGPU_PATTERNS if pattern.match(rest)), None)
    if error is None:
        return None
    return KernelEvent("amdgpu", bus, code, rest, ts_text, seq, device=device, error=error, line=line)
