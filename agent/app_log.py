"""Application signals in training logs: NCCL collective timeouts, CUDA errors, NCCL warnings and RAS reports.

Reads the lines the training collector's log followers hand it (any log format: these lines come
from PyTorch, CUDA and NCCL, not from the framework's progress printer), matches them against one
table of real error formats (each row cites where its format was seen), and emits report
``Event``s with the log's job, the rank and the peer host a line names (NCCL RAS reports in the same
log: agent.nccl_ras), counted in full but
forwarded collapsed and rate-limited, so a log repeating one line cannot flood reports. It does not
judge what a signal means or whom it blames: the aggregator does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from vigil.agent.nccl_ras import RasReportReader
from vigil.contract.wire import Event

# The event kinds, and whether each makes the reporter push at once: a collective timeout or a
# CUDA error ends the job (PyTorch's watchdog tears the process group down; a sticky CUDA error
# poisons the context), while an NCCL warning may precede a failure or be survived, and a RAS
# report is a snapshot a sidecar may print every minute (the hang detector weighs it).
KINDS = ("nccl_timeout", "cuda_error", "nccl_warn", "nccl_ras")
URGENT = frozenset(("nccl_timeout", "cuda_error"))


@dataclass(frozen=True, slots=True)
class SignalPattern:
    kind: str
    # A literal every matching line contains: checked first, so an ordinary line costs a few
    # substring searches and no regex.
    needle: str
    regex: re.Pattern[str]


# First match wins. Formats, with the real lines they were checked against (tests/fixtures/
# app-signals/PROVENANCE.md names each line's source):
PATTERNS: tuple[SignalPattern, ...] = (
    # PyTorch ProcessGroupNCCL's watchdog (ProcessGroupNCCL.cpp, WorkNCCL::checkTimeout):
    #   "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE,
    #    NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before
    #    timing out." (torch 2.x, hiyouga/LlamaFactory#7396, XPixelGroup/BasicSR#737; torch 1.x has no
    #    Numel fields, OFA-Sys/OFA#271).
    SignalPattern("nccl_timeout", "Watchdog caught collective operation timeout",
                  re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=\d+, "
                             r"OpType=\w+.*?\) ran for \d+ milliseconds before timing out")),
    # c10's CUDA check (c10/cuda/CUDAException.cpp) raises "CUDA error: <cudaGetErrorString>":
    #   "RuntimeError: CUDA error: an illegal memory access was encountered" (evo-design/evo#136),
    #   "RuntimeError: CUDA error: uncorrectable ECC error encountered" (vllm-project/vllm#5222), and
    #   the watchdog's "[Rank 1] NCCL watchdog thread terminated with exception: CUDA error: ..."
    #   (kohya-ss/sd-scripts#1434). A word "error" alone, or PyTorch's "CUDA out of memory. Tried to
    #   allocate" (the job's own allocation), is not this.
    SignalPattern("cuda_error", "CUDA error: ", re.compile(r"\bCUDA error: (?P<what>\S.*)")),
    # The pre-1.0 PyTorch spelling (THC): "RuntimeError: cuda runtime error (39) : uncorrectable ECC
    # error encountered at /pytorch/aten/src/THC/THCCachingHostAllocator.cpp:265"
    # (NVIDIA/semantic-segmentation#33).
    SignalPattern("cuda_error", "cuda runtime error (", re.compile(r"\bcuda runtime error \(\d+\) : (?P<what>\S.*)")),
    # NCCL's debug printer (src/debug.cc): "<host>:<pid>:<tid> [<cudaDev>] <file>:<line> NCCL WARN <msg>",
    # the file:line since NCCL 2.8; a launcher may cut the host part ("[0] misc/socket.cc:71 NCCL WARN
    # socketProgress: Connection closed by remote peer 10.10.1.3<36138>", NVIDIA/nccl#1612). "NCCL
    # INFO" lines and a user's own "NCCL WARN" text without the device tag are not this.
    SignalPattern("nccl_warn", " NCCL WARN ", re.compile(r"\[\d+\] (?:\S+:\d+ )?NCCL WARN (?P<what>\S.*)")),
)

# The rank a line names: torch's per-rank prefix "[rank3]:" (TORCH_DISTRIBUTED log prefix) or the
# watchdog's "[Rank 3]" / "[PG 1 Rank 3]" / "[PG ID 0 PG GUID 0(default_pg) Rank 1]".
_RANK = re.compile(r"\[(?:PG [^\]]*?)?[Rr]ank ?(\d{1,6})\]")
_RANK_MAX = 1 << 20  # wire Index
# The peer a line names, as NCCL's ncclSocketToString prints an address: "<host or ip><<port>>":
# "Got completion from peer 10.216.210.236<54862>" (NVIDIA/nccl#1405), "peer fe80::966d:ae03:8b:df54%ib0<33397>"
# (NVIDIA/nccl#928), "Connection closed by remote peer node2<42830>" (NVIDIA/nccl#1232).
# NCCL's socket connects name it too: "socketStartConnect: Connect to 10.0.0.2<45763> failed"
# (NVIDIA/nccl-tests#166).
_PEER = re.compile(r"\b(?:peer|[Cc]onnect to) ([^\s<>]+)<\d+>")
# A line's identity for collapsing repeats: its text from the match on, digits folded (sequence
# numbers, milliseconds, opcodes and lengths differ from one repeat to the next).
_DIGITS = re.compile(r"\d+")
_KEY_CHARS = 160
MESSAGE_MAX_CHARS = 512
# One forward per (kind, rank, peer, line shape) per this many seconds; repeats in between are
# counted into the next forward (the Xid collector's forward_interval_seconds default, 10 s).
FORWARD_INTERVAL_SECONDS = 10.0
# Distinct (kind, rank, peer, line shape) waiting per log: a spew of ever-different lines folds
# into one key per kind beyond this, still counted.
MAX_PENDING = 64


@dataclass(frozen=True, slots=True)
class Signal:
    """One matched line: its kind, the rank and peer it names, its text and its repeat key."""

    kind: str
    rank: int | None
    peer: str | None
    message: str
    shape: str


def match_line(line: str) -> Signal | None:
    """The application signal ``line`` carries, or None."""
    for pattern in PATTERNS:
        if pattern.needle not in line:
            continue
        m = pattern.regex.search(line)
        if m is None:
            continue
        rank_m = _RANK.search(line)
        rank = int(rank_m.group(1)) if rank_m is not None else None
        peer_m = _PEER.search(line, m.start())
        text = line.strip()
        return Signal(kind=pattern.kind, rank=rank if rank is not None and rank <= _RANK_MAX else None,
                      peer=peer_m.group(1)[:256] if peer_m is not None else None,
                      message=text[:MESSAGE_MAX_CHARS],
                      shape=_DIGITS.sub("#", line[m.start():m.start() + 2 * _KEY_CHARS])[:_KEY_CHARS])
    return None


@dataclass(slots=True)
class _Pending:
    signal: Signal
    first_ts: float
    last_ts: float
    count: int


class AppLogSignals:
    """The signals of one followed log: ``feed`` each line, ``drain`` the events due."""

    def __init__(self, job: str, *, forward_interval_seconds: float = FORWARD_INTERVAL_SECONDS,
                 max_pending: int = MAX_PENDING) -> None:
        self.job = job
        self._interval = forward_interval_seconds
        self._max_pending = max_pending
        self._pending: dict[tuple[str, int | None, str | None, str], _Pending] = {}
        self._last_forward: dict[tuple[str, int | None, str | None, str], float] = {}
        self.matched = dict.fromkeys(KINDS, 0)  # every matched line, forwarded or folded
        self._ras = RasReportReader()

    @property
    def refused(self) -> dict[str, int]:
        """Lines of RAS reports refused, by reason (agent.nccl_ras.REFUSALS)."""
        return self._ras.refused

    def feed(self, line: str, now: float) -> str | None:
        """Take one line; the kind it matched, or None."""
        in_ras, ras = self._ras.feed(line)
        if ras is not None:
            signal: Signal | None = Signal(kind="nccl_ras", rank=ras.rank, peer=ras.host,
                                           message=ras.message[:MESSAGE_MAX_CHARS], shape=ras.section)
        else:
            signal = None if in_ras else match_line(line)
        if signal is None:
            return None
        self.matched[signal.kind] += 1
        key = (signal.kind, signal.rank, signal.peer, signal.shape)
        pending = self._pending.get(key)
        if pending is None and len(self._pending) >= self._max_pending:
            key = (signal.kind, None, None, "")  # the overflow of this kind: counted, one event
            pending = self._pending.get(key)
            signal = replace(signal, rank=None, peer=None)  # it speaks for lines of other ranks and peers
        if pending is None:
            self._pending[key] = _Pending(signal, now, now, 1)
        else:
            pending.count += 1
            pending.last_ts = now
        return signal.kind

    def drain(self, now: float) -> list[Event]:
        """Events for what is pending and not forwarded within the interval; the rest waits."""
        events: list[Event] = []
        for key in list(self._pending):
            last = self._last_forward.get(key)
            if last is not None and now - last < self._interval:
                continue
            p = self._pending.pop(key)
            self._last_forward[key] = now
            sig = p.signal
            events.append(Event(kind=sig.kind, ts=p.first_ts, urgent=sig.kind in URGENT, message=sig.message,
                                job=self.job, rank=sig.rank, peer=sig.peer, count=p.count,
                                last_ts=p.last_ts if p.count > 1 else None, source="training_log"))
        for key, at in list(self._last_forward.items()):
            if now - at >= self._interval and key not in self._pending:
                del self._last_forward[key]  # nothing folded since: the next one goes out at once
        return events
