"""Fleet state: the aggregator's bounded, windowed memory of every node, GPU, port and job.

It reads validated ``Report``s and keeps, per node, the latest state plus ring buffers of recent
states, counter deltas (computed between consecutive reports of one boot, so a reboot resets the
baseline instead of looking like an error burst), de-duplicated Xid occurrences, and job
membership from the rank summaries, and the node-action requests and results the outbox hands it.
A compact report (wire.COMPACT_VERSIONS, 2 or 3) carries only what changed since the node's
previous accepted report; ingest completes each of its GPUs, ports and ranks from that report's
state (``_completer``, ``_sparse_completer``), so what is stored and judged is the same whichever
version the agent sent.
It judges nothing; detectors read it through ``FleetView``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from copy import copy
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec
from pydantic import Field

from vigil.aggregator.decision import Action
from vigil.contract.validation import StrictModel
from vigil.contract.wire import (
    DELTA_VERSION,
    SPARSE_VERSION,
    CollectiveState,
    Event,
    GpuState,
    HostFacts,
    NodeActionRequest,
    NodeActionResult,
    NodeConfig,
    PcieDevice,
    PortState,
    RankSummary,
    Report,
    field_defaults,
    kernel_boot_id,
    optional_fields,
)

if TYPE_CHECKING:
    from vigil.aggregator.detectors.probe_verdict import IsolationOutcome
    from vigil.aggregator.prober import ProbesConfig

_V = TypeVar("_V")
_M = TypeVar("_M", GpuState, PortState, RankSummary)


class FleetConfig(StrictModel):
    # Non-zero counter increases kept per series (zero increases are not stored: a healthy
    # counter costs nothing). 240 is 10 minutes of a counter that moves every 2.5 s report.
    history_reports: int = Field(default=240, ge=4, le=100_000)
    # Compact per-report GPU and port samples (flags, clocks, state) for persistence checks:
    # 32 reports is 80 s at 2.5 s, enough for the thermal detector's 60 s persistence. The
    # whole fleet state measures ~0.25 MB per 8-GPU node (~3 GB for 12,500 nodes).
    state_history_reports: int = Field(default=32, ge=4, le=10_000)
    # Per-rank summary windows kept for the straggler's consecutive-window test (one entry per
    # agent window, not per report: 16 is 80 s of 5 s windows; the detector judges each window
    # once, within a reporting interval of its end, and keeps only its verdicts after that).
    rank_history_reports: int = Field(default=16, ge=2, le=10_000)
    event_history: int = Field(default=256, ge=8)
    # An Xid seen by the kernel log and by NVML's event API is one fault; both readers timestamp
    # it within a second or two of each other.
    xid_dedup_seconds: float = Field(default=5.0, ge=0)
    # A job none of whose ranks reported for this long is forgotten (bounded memory).
    job_forget_seconds: float = Field(default=3600.0, gt=0)
    # Membership. A node silent this long has left the fleet: it is forgotten (its summary is
    # handed to the store's archive), decisions may no longer name it, and it no longer counts
    # toward the breaker's budget. A day: far beyond any reboot or network blip (minutes), and
    # beyond the silence detector's own action (minutes), so nothing still being judged is
    # dropped; a node back from a multi-day repair re-joins as new with a fresh baseline.
    forget_after_seconds: float = Field(default=86400.0, ge=60)
    # A node whose clock is further than this from the aggregator's is reported as skewed (its
    # node state, vigil_aggregator_nodes_clock_skewed, VigilNodeClockSkewed); its reports and
    # events are still taken, their times placed on the aggregator's clock. NTP keeps a cluster
    # within milliseconds; two minutes is far beyond any drift, so only a step or a dead time
    # source shows.
    max_clock_skew_seconds: float = Field(default=120.0, gt=0)
    # A report's own time minus its receive time is the node's clock offset less the report's
    # delay (the agent stamps a report just before sending it; its POST times out after 5 s). An
    # offset within this of the one held is that delay, not a new offset: the held one (0 for a
    # node within it of the aggregator: nothing is moved) places event and window times.
    clock_offset_tolerance_seconds: float = Field(default=5.0, gt=0)
    # State one node's credential can make the aggregator keep, over time and not only per report
    # (the wire bounds a report: 256 GPUs, 256 ports, 1,024 ranks). What is over a cap is refused
    # and counted (vigil_aggregator_refusals_total{door="reports"}, reason too_many_gpus,
    # too_many_ports, too_many_counters, too_many_ranks, too_many_jobs; too_many_pcie_devices
    # below); ports, ranks and jobs
    # not in the node's latest report are evicted first, oldest first, so only a report listing
    # more than a cap at once is refused. GPUs are never evicted: one that left the reports is
    # the evidence of a GPU fallen off the bus. The largest nodes have 8 to 16 GPUs and as many
    # RDMA ports (HGX/DGX: 8 ConnectX plus 2 BlueField ports of two each); 64 of each is four
    # times that.
    max_gpus_per_node: int = Field(default=64, ge=1, le=1 << 20)
    max_ports_per_node: int = Field(default=64, ge=1, le=1 << 20)
    # Counter names kept per port (a compact entry merges the ones that moved into the port's):
    # mlx5 exposes ~30 port counters and ~60 hw_counters; a report entry carries at most 256.
    max_counters_per_port: int = Field(default=256, ge=1, le=1 << 20)
    # The agent holds at most 256 ranks and 16 jobs (training.max_ranks, training.max_jobs) and
    # reports each while it lives and 15 minutes after: twice that here, so a site that raises the
    # agent's limits has room before anything is refused. Raise these with them.
    max_ranks_per_node: int = Field(default=512, ge=1, le=1 << 20)
    max_jobs_per_node: int = Field(default=32, ge=1, le=1 << 20)
    # A (job, rank) a node reported live (running or hung) within this long is that node's: another
    # node's report naming it is refused for that entry (rank_owner_conflict) until the hold lapses.
    # A rank that really moved (a requeued job on new nodes) ended on its old node first: its agent
    # reports it "exited" within a collector cycle, which ends the hold at once; 30 s is twelve
    # reports at 2.5 s, beyond a lost report or two of a node that still claims it.
    rank_hold_seconds: float = Field(default=30.0, gt=0)
    # The sequence number of a boot may advance by at most this many reports per second since
    # the node's last accepted report, plus ``max_seq_jump``: enough for urgent pushes between
    # periodic ones, never the 2**62 jump that would make every real report look replayed.
    max_reports_per_second: float = Field(default=20.0, gt=0)
    max_seq_jump: int = Field(default=1000, ge=1)
    # PCIe devices kept per node from a report's ``pcie`` section (GPUs and HCAs: 16 + 16 on the
    # largest nodes; the wire allows 256). Over it, the rest of a section is refused and counted
    # (reason too_many_pcie_devices).
    max_pcie_devices_per_node: int = Field(default=64, ge=1, le=1 << 20)


# Node-action requests and results kept per node (the recovery detector reads the one for the
# removal it follows): far above one request per GPU in flight; the oldest go first.
MAX_NODE_ACTIONS_KEPT = 64

# The GPU fields a node's hardware class is read from (detectors/peer_class.py): a change to one
# moves NodeState.gpu_class_revision.
_CLASS_FIELDS = frozenset({"name", "sm_clock_max_hertz", "power_limit_watts"})

# A GPU sample the thermal detector may act on is marked on ingest (NodeState.gpu_watch_revision),
# so that it passes over a node none of whose samples it could act on in O(1). Watched: a clock-event
# reason by which the hardware protects itself (NVML nvmlClocksEventReasons, agent/nvml/backend.py:
# HW slowdown, SW and HW thermal slowdown, HW power brake; not SwPowerCap, the usual state of a GPU at
# full load, nor idle, clock settings or sync boost), or HBM within HBM_WATCH_BELOW_LIMIT_CELSIUS of
# its limit (memory_max_temperature, else the 95 C of an H100 SXM's "Memory Max Operating Temp"). The
# thermal detector trusts the marker only where its configuration acts within these
# (ThermalDetector._watched).
WATCHED_CLOCK_EVENTS = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                  "hw_power_brake_slowdown"})
HBM_DEFAULT_LIMIT_CELSIUS = 95.0
HBM_WATCH_BELOW_LIMIT_CELSIUS = 10.0

# A PCIe device's AER counters (wire.PcieDevice), in the order PcieHistory reads them.
AER_COUNTERS = ("aer_correctable_total", "aer_nonfatal_total", "aer_fatal_total")


def normal_bus_id(bus_id: str) -> str:
    """A PCI bus id in sysfs's form, lower case, 4-digit domain (``0000:18:00.0``): NVML writes
    the domain with 8 digits (``00000000:18:00.0``), sysfs with 4, so the two name one device."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if sep and len(domain) > 4 and domain[:-4].strip("0") == "":
        return domain[-4:] + ":" + rest
    return bus_id


def link_below_max(generation: int | None, generation_max: int | None, width: int | None,
                   width_max: int | None) -> bool:
    """Whether a PCIe link trained below what it and its slot allow (unknown parts are not)."""
    return ((generation is not None and generation_max is not None and generation < generation_max)
            or (width is not None and width_max is not None and width < width_max))


# GPU counters whose increases detectors judge, in the order GpuHistory reads them.
GPU_COUNTERS = ("ecc_corrected_volatile", "ecc_uncorrected_volatile", "pcie_replay_total",
                "nvlink_crc_errors_total", "nvlink_replay_errors_total", "nvlink_recovery_errors_total")


def _values_of(names: Sequence[str]) -> Callable[[Any], tuple[Any, ...]]:
    """The values of fields ``names`` of a Struct as a tuple, in one C-level call: ``attrgetter``
    of one name returns the bare value, which a tuple comparison or ``zip`` would misread (a rank
    summary's one defaulted field, ``state``, would be zipped letter by letter). Generic, for the
    version-2 completion (older agents); each name costs a generic attribute lookup, ~10 times
    the interpreter's own read, so the version-3 hot paths read their fields by name."""
    if len(names) == 1:
        get_one = attrgetter(names[0])
        return lambda struct: (get_one(struct),)
    return attrgetter(*names)


def _completer(model: type[_M], merged: str | None = None,
               structs: tuple[str, ...] = ()) -> Callable[[_M, _M], _M]:
    """How a version-2 entry of ``model`` completes its base: ``complete(base, sent)`` returns
    the new state. The entry carries its required fields, its
    fields with a not-None default as they are (health, state words, lists, dicts: absent means
    the default), and each optional field (default None) that changed to a value. ``merged``: a
    dict field merged by name into the base's instead (a port's counters: a version-2 port lists
    only those that moved); ``structs``: defaulted fields holding Structs, which ``to_builtins``
    would turn into dicts. Both states were validated, so the result is a valid state.

    This runs for every entry of every report, so it is C-level work: ``to_builtins`` lists the
    fields ``sent`` has away from their defaults (the required and optional ones are scalars,
    the same objects), one tuple comparison tells whether a defaulted field moved, and
    ``structs.replace`` builds the state; with ``merged``, an entry whose only change is in that
    dict is one dict update of the base (returned itself)."""
    fields = msgspec.structs.fields(model)
    defaulted = tuple(f.name for f in fields if not f.required and f.default is not None and f.name != merged)
    get_defaulted = _values_of(defaulted)
    optional = optional_fields(model)
    get_optional = _values_of(optional)
    unchanged = (None,) * len(optional)
    to_builtins, replace = msgspec.to_builtins, msgspec.structs.replace

    def complete(base: _M, sent: _M) -> _M:
        now = get_defaulted(sent)
        if merged is not None:
            into: dict[str, Any] = getattr(base, merged)
            into.update(getattr(sent, merged))
            if get_optional(sent) == unchanged and now == get_defaulted(base):
                return base
        taken: dict[str, Any] = to_builtins(sent)
        if now != get_defaulted(base) or (structs and not taken.keys().isdisjoint(structs)):
            taken.update(zip(defaulted, now, strict=True))
        if merged is not None:
            taken[merged] = into
        return replace(base, **taken)

    return complete


def _sparse_completer(model: type[_M], merged: str | None = None, *, in_place: bool = False) -> Callable[[_M, _M], _M]:
    """How a version-3 entry of ``model`` completes its base: every field it has away from its
    default changed (a required field may or may not have), so the new state is the base with
    each of them set from ``sent`` as decoded (tuples, Structs): a copy of the base, or with
    ``in_place`` the base itself, which must then be a state the fleet made and owns (``_copy_struct``).
    ``merged``: a field merged into the base's own already, which the copy keeps (a port's
    counters, ``_complete_sparse_port``).

    This runs for every GPU and rank of every report, so it is code generated from the model's
    fields (a field added to the model is completed with no change here): a test of each field read
    by name, where the interpreter's slot reads and ``is not None`` are cheap. It replaced listing
    the fields with ``to_builtins`` and building the state with ``structs.replace(base, **taken)``,
    which build a dict and parse it back as keywords; updating in place spares copying the base's
    fields (a GPU has 53) and freeing the state it replaced (bench/bench_ingest_instructions, the
    fleet update of a steady compact report: 332k instructions before, 233k now: ~67k the generated
    completion, ~25k updating in place, ~13k the ports' own changes)."""
    lines = ["def complete(base, sent):", "    new = base" if in_place else "    new = copy_struct(base)"]
    constants: dict[str, Any] = {"copy_struct": msgspec.structs.replace}  # with no changes: a copy
    defaults = field_defaults(model)  # a mutable default ({}) as the value it starts at, compared only
    for f in msgspec.structs.fields(model):
        if f.name == merged:
            continue
        if not f.name.isidentifier():  # pragma: no cover - a Struct's field names are identifiers
            raise ValueError(f"{model.__name__}.{f.name} is not an identifier")
        if f.required:
            changed = f"sent.{f.name} != new.{f.name}"
        elif defaults[f.name] is None:
            changed = f"sent.{f.name} is not None"
        else:
            constants[f"default_{f.name}"] = defaults[f.name]
            changed = f"sent.{f.name} != default_{f.name}"
        # Most fields are absent: one read and one test each; a field present is read again.
        lines += [f"    if {changed}:", f"        new.{f.name} = sent.{f.name}"]
    lines.append("    return new")
    exec("\n".join(lines), constants)  # the source is built above from the model's field names only
    complete: Callable[[_M, _M], _M] = constants["complete"]
    complete.__qualname__ = complete.__name__ = f"complete_{model.__name__}"
    return complete


_complete_sparse_port_fields = _sparse_completer(PortState, merged="counters")


def _complete_sparse_port(base: PortState, sent: PortState) -> PortState:
    """A version-3 port entry completes its base: its counters (those that moved) merge into the
    base's dict, and the usual entry, which carries nothing else but its identity (its link
    state, rate and flags did not change), is the base itself. The fields are read by name: an
    attribute read in the interpreter costs a tenth of one through ``attrgetter`` or
    ``to_builtins``, and this runs for every port of every report (a test sets each of
    PortState's other fields in turn). Any other change makes a new state: PortHistory tells an
    entry that moved only counters by its state being the last one."""
    base.counters.update(sent.counters)
    if (sent.state is None and sent.phys_state is None and sent.rate_bits_per_second is None
            and sent.link_layer is None and sent.netdev is None and not sent.deltas
            and not sent.rates_per_second and not sent.flags):
        return base
    return _complete_sparse_port_fields(base, sent)


# Per compact version (wire.COMPACT_VERSIONS): how an entry of each section completes its base.
# ``in_place``: the GPU and rank completers update their base, which the fleet must own (``_copy_struct``).
class _Completers(NamedTuple):
    gpu: Callable[[GpuState, GpuState], GpuState]
    port: Callable[[PortState, PortState], PortState]
    rank: Callable[[RankSummary, RankSummary], RankSummary]
    in_place: bool


_COMPLETERS = {
    DELTA_VERSION: _Completers(_completer(GpuState, structs=("processes",)), _completer(PortState, merged="counters"),
                               _completer(RankSummary), in_place=False),
    SPARSE_VERSION: _Completers(_sparse_completer(GpuState, in_place=True), _complete_sparse_port,
                                _sparse_completer(RankSummary, in_place=True), in_place=True),
}
# With no changes: a copy. The fleet completes in place only a copy of its own: a state taken
# whole from a report is the report's (the simulator's agent, a test, keep theirs), so it is copied
# once, the first time a compact entry completes it (GpuHistory.owned, RankHistory.owned, and
# PortHistory.owned, whose counters every compact version merges into); from then on each compact
# entry updates that copy, which nothing outside the fleet holds (detectors read the fleet while no
# report is ingested).
_copy_struct = msgspec.structs.replace


# What a field named in ``cleared`` becomes (version 2 names only fields whose default is None).
_DEFAULTS: dict[type[Any], dict[str, Any]] = {model: field_defaults(model)
                                              for model in (GpuState, PortState, RankSummary)}


def _complete_cleared(complete: Callable[[_M, _M], _M], base: _M, sent: _M, cleared: Collection[str]) -> _M:
    """``complete(base, sent)`` with ``sent``'s ``cleared`` fields at their defaults: the fields
    that became absent (rare; a report lists them in ``cleared``). A mutable default is a fresh
    copy for each state."""
    state = complete(base, sent)
    if not cleared:
        return state
    defaults = _DEFAULTS[type(sent)]
    return msgspec.structs.replace(state, **{name: copy(defaults[name]) for name in cleared})


def port_is_active(state: PortState) -> bool:
    """sysfs writes "4: ACTIVE"; agents may send just "ACTIVE"."""
    return state.state is not None and state.state.upper().endswith("ACTIVE")


class Series:
    """A ring of (ts, value) pairs, oldest first."""

    __slots__ = ("_ring",)

    def __init__(self, maxlen: int) -> None:
        self._ring: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def append(self, ts: float, value: float) -> None:
        self._ring.append((ts, value))

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[tuple[float, float]]:
        return iter(self._ring)

    def since(self, t0: float) -> list[tuple[float, float]]:
        out = []
        for item in reversed(self._ring):
            if item[0] < t0:
                break
            out.append(item)
        out.reverse()
        return out

    def sum_since(self, t0: float) -> float:
        total = 0.0
        for ts, value in reversed(self._ring):
            if ts < t0:
                break
            total += value
        return total

    def first_ts(self) -> float | None:
        return self._ring[0][0] if self._ring else None


@dataclass(slots=True)
class XidRecord:
    code: int
    ts: float
    count: int
    message: str
    sources: set[str]


class CounterBaseline:
    """Turns cumulative counters into increases; a counter going backwards is a reset, not an
    error. Only non-zero increases are stored, with when each counter's baseline began and when
    the counters were last read, so a rate over a window is exact without a point per report."""

    __slots__ = ("_deltas", "_last_names", "_last_values", "_maxlen", "_prev", "_start", "last_increase_ts",
                 "last_ts", "resets")

    def __init__(self, maxlen: int) -> None:
        self._maxlen = maxlen
        self._prev: dict[str, int] = {}
        self._deltas: dict[str, Series] = {}
        self._start: dict[str, float] = {}
        self._last_names: tuple[str, ...] | None = None
        self._last_values: tuple[int | None, ...] | None = None
        self.last_ts = 0.0
        # When any counter last increased: detectors skip a quiet GPU or port in O(1).
        self.last_increase_ts = -math.inf
        self.resets = 0

    def observe(self, name: str, ts: float, value: int | None) -> None:
        self.observe_values(ts, (name,), (value,))

    def observe_values(self, ts: float, names: tuple[str, ...], values: tuple[int | None, ...]) -> bool:
        """Counters ``names`` read together at ``ts`` (None: not read this time); whether one
        increased. The ingest hot path: most reports change none of the judged counters, which
        costs one comparison."""
        self.last_ts = ts
        if values == self._last_values and names is self._last_names:
            return False
        increased = False
        self._last_names, self._last_values = names, values
        prev_values = self._prev
        for name, value in zip(names, values, strict=True):
            if value is None:
                continue
            prev = prev_values.get(name)
            if prev == value:
                continue
            prev_values[name] = value
            if prev is None or value < prev:
                if prev is not None:
                    self.resets += 1
                self._start[name] = ts
                continue
            series = self._deltas.get(name)
            if series is None:
                series = self._deltas[name] = Series(self._maxlen)
            series._ring.append((ts, float(value - prev)))
            self.last_increase_ts = ts
            increased = True
        return increased

    def still(self, ts: float) -> bool:
        """A read at ``ts`` known to leave every counter as the last read had it (a compact
        report moved none): recorded without comparing values. False when there is no last read
        to stand for it (the values must go through ``observe_values``)."""
        if self._last_values is None:
            return False
        self.last_ts = ts
        return True

    def forget_baseline(self) -> None:
        self._prev.clear()
        self._start.clear()
        self._last_values = None

    def increases_since(self, name: str, t0: float) -> list[tuple[float, float]]:
        """Non-zero increases reported at or after ``t0``."""
        series = self._deltas.get(name)
        return series.since(t0) if series is not None else []

    def sum_since(self, name: str, t0: float) -> float:
        series = self._deltas.get(name)
        return series.sum_since(t0) if series is not None else 0.0

    def covered_seconds(self, name: str, t0: float) -> float:
        """Seconds since ``t0`` over which ``name``'s increases are known (0: no baseline)."""
        start = self._start.get(name)
        if start is None:
            return 0.0
        return max(0.0, self.last_ts - max(t0, start))

    def baseline_since(self, name: str) -> float | None:
        """From when increases of ``name`` are completely known: the baseline start, or the
        oldest increase still held once the ring has dropped older ones."""
        start = self._start.get(name)
        if start is None:
            return None
        series = self._deltas.get(name)
        if series is not None and len(series) == self._maxlen:
            oldest = series.first_ts()
            if oldest is not None:
                return max(start, oldest)
        return start


class GpuSample(msgspec.Struct, frozen=True, gc=False):
    """What persistence checks need from one report of one GPU (the full state is ``last``); the
    state's lists become tuples.

    Samples are most of what the fleet keeps (32 per GPU and per port: ~500 per node), so they
    stay out of the cyclic garbage collector (``gc=False``; they hold only scalars and tuples of
    scalars, no cycle): a collection's pause grows with the objects it walks, and as NamedTuples
    holding the states' lists they made a full one ~0.6 s at 2,000 nodes, every intake stalled
    meanwhile (docs/reports.md, "Garbage collection")."""

    ts: float
    health: str
    utilization_gpu_ratio: float | None
    sm_clock_hertz: float | None
    sm_clock_max_hertz: float | None
    clock_event_reasons: tuple[str, ...]
    memory_temperature_celsius: float | None
    memory_max_temperature_celsius: float | None
    remap_pending: bool | None
    remap_failure: bool | None
    retired_pages_pending: bool | None
    nvlink_links_down: tuple[int, ...]
    recovery_action: str | None


class PortSample(msgspec.Struct, frozen=True, gc=False):
    """A port's link state in one report; out of the garbage collector's walks, as GpuSample."""

    ts: float
    active: bool
    rate_bits_per_second: float | None


class LoadedRun:
    """A run of consecutive reports in which a GPU's PCIe link stayed below its maximum, with the
    GPU's utilization in each, kept as a monotonic stack: each entry is a report whose utilization
    is below every later one's (with the time of the report after it). The latest report below any
    threshold is then the last entry below it, so "loaded (at or above a threshold) since when" is
    answered for any threshold, at O(1) amortised per report and a handful of entries (one for an
    idle GPU, whose utilization stays 0)."""

    __slots__ = ("lows", "since")

    # Entries kept at most; beyond, the oldest (lowest) goes and the run is taken to start after
    # it: the loaded time is then under-, never over-stated.
    MAX_ENTRIES = 64

    def __init__(self, ts: float) -> None:
        self.since = ts
        self.lows: list[tuple[float, float, float | None]] = []  # (ts, utilization, ts of the next report)

    def observe(self, ts: float, utilization: float | None) -> None:
        lows = self.lows
        u = -1.0 if utilization is None else utilization  # unknown: not loaded
        if lows:
            top = lows[-1]
            lows[-1] = (top[0], top[1], ts)
            while lows and lows[-1][1] >= u:
                lows.pop()
        lows.append((ts, u, None))
        if len(lows) > self.MAX_ENTRIES:
            dropped = lows.pop(0)
            self.since = dropped[2] if dropped[2] is not None else ts

    def loaded_since(self, threshold: float) -> float | None:
        """Since when every report of the run had utilization at or above ``threshold`` (the link
        below its maximum all along); None: the latest report did not."""
        for _, utilization, after in reversed(self.lows):
            if utilization < threshold:
                return after
        return self.since


class GpuHistory:
    __slots__ = ("counters", "first_seen", "index", "last", "last_seen", "link_below", "owned", "samples", "uuid")

    def __init__(self, state: GpuState, ts: float, maxlen: int, state_maxlen: int) -> None:
        self.index = state.index
        self.uuid = state.uuid
        self.first_seen = ts
        self.last_seen = ts
        self.last = state
        # The copy of a state the fleet made to complete in place (``_copy_struct``): ``last`` while compact
        # reports complete it, else stale (``last`` then came whole from a report).
        self.owned: GpuState | None = None
        self.samples: deque[GpuSample] = deque(maxlen=state_maxlen)
        self.counters = CounterBaseline(maxlen)
        # The run of reports in which its PCIe link was below its maximum (None: at it, or unknown).
        self.link_below: LoadedRun | None = None

    def observe(self, s: GpuState, ts: float) -> bool:
        """``s``: the GPU's whole state (of this GPU: the fleet starts a new history for a new
        uuid at this index); whether a judged counter increased. Most reports move none of the
        judged counters: one comparison."""
        self.last = s
        self.last_seen = ts
        # The state's sequences are tuples already (wire.GpuState; most the empty one), shared with
        # the sample: a list would be tracked by the collector, a tuple of scalars is not. Fields
        # are read by name: an attribute read in the interpreter costs a tenth of one through
        # attrgetter (a test keeps these to GpuSample's fields and GPU_COUNTERS, in order).
        self.samples.append(GpuSample(ts, s.health, s.utilization_gpu_ratio, s.sm_clock_hertz, s.sm_clock_max_hertz,
                                      s.clock_event_reasons, s.memory_temperature_celsius,
                                      s.memory_max_temperature_celsius, s.remap_pending, s.remap_failure,
                                      s.retired_pages_pending, s.nvlink_links_down, s.recovery_action))
        return self.counters.observe_values(ts, GPU_COUNTERS, (
            s.ecc_corrected_volatile, s.ecc_uncorrected_volatile, s.pcie_replay_total, s.nvlink_crc_errors_total,
            s.nvlink_replay_errors_total, s.nvlink_recovery_errors_total))


# What PortHistory.observe says changed (flags; 0: only counters nobody judges, or none, moved).
PORT_LINK_CHANGED = 1
PORT_COUNTERS_ROSE = 2


class PortHistory:
    __slots__ = ("_flags", "_judged", "_names", "_names_for", "active_this_boot", "counters", "device", "ever_active",
                 "first_seen", "last", "last_seen", "max_rate_bits_per_second", "owned", "port", "samples", "tracked")

    def __init__(self, state: PortState, ts: float, maxlen: int, state_maxlen: int,
                 tracked: frozenset[str] | None) -> None:
        self.device = state.device
        self.port = state.port
        self.first_seen = ts
        self.last_seen = ts
        self.last = state
        # As GpuHistory.owned: the copy (its counters too) into which compact entries merge.
        self.owned: PortState | None = None
        self.samples: deque[PortSample] = deque(maxlen=state_maxlen)
        self.counters = CounterBaseline(maxlen)
        # Counters some detector judges (None: all). A port carries ~30 counters, most of them
        # traffic volumes nobody judges here; skipping them is most of the ingest cost saved.
        self.tracked = tracked
        self._names: tuple[str, ...] = ()
        self._judged: frozenset[str] = frozenset()
        self._names_for = -1
        self._flags: dict[str, str] = {}
        # The best rate this link trained at in this boot: a later, lower rate is a degraded link.
        self.max_rate_bits_per_second: float | None = None
        # Only a port that was up in this boot can go down (a cabled-off second port never was).
        self.active_this_boot = False
        # Whether it was ever up, across boots: a port that was up before a reboot must come up
        # again before the node is given back (the recovery detector); one never cabled is not.
        self.ever_active = False

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    def observe(self, state: PortState, ts: float, sent: PortState | None = None) -> int:
        """``state``: the port's whole state; ``sent``: the compact entry it was completed from
        (None: the report was whole), whose counters are only those that moved (its flags are
        whole). A compact entry that moved only counters leaves ``last`` itself, its counters
        updated in place: its link state, rate and flags are the last sample's. Returns what
        changed: ``PORT_LINK_CHANGED`` (its link state, rate or flags may have), ``PORT_COUNTERS_ROSE``
        (a judged counter increased), or 0 (the usual entry)."""
        counters, flags = state.counters, state.flags
        if sent is not None and state is self.last:
            # Only counters moved (the usual compact entry): the link state and rate are the last
            # sample's, already counted in active_this_boot, ever_active and the best rate.
            last_sample = self.samples[-1]
            self.last_seen = ts
            self.samples.append(PortSample(ts, last_sample.active, last_sample.rate_bits_per_second))
            if not (len(counters) == self._names_for and self._judged.isdisjoint(sent.counters)
                    and self.counters.still(ts)):  # else: none of the judged counters moved
                return self._observe_counters(ts, counters, flags)
            return 0
        self.last = state
        active = port_is_active(state)
        rate = state.rate_bits_per_second
        self.last_seen = ts
        self.samples.append(PortSample(ts, active, rate))
        changed = PORT_LINK_CHANGED
        if not (sent is not None and len(counters) == self._names_for and flags == self._flags
                and self._judged.isdisjoint(sent.counters) and self.counters.still(ts)):
            changed |= self._observe_counters(ts, counters, flags)
        if active:
            self.active_this_boot = True
            self.ever_active = True
        if rate is not None and (self.max_rate_bits_per_second is None or rate > self.max_rate_bits_per_second):
            self.max_rate_bits_per_second = rate
        return changed

    def _observe_counters(self, ts: float, counters: dict[str, int], flags: dict[str, str]) -> int:
        if len(counters) != self._names_for or flags != self._flags:
            # The judged counters this port has, less the saturated ones (a saturated counter no
            # longer moves: its delta would read as "no errors"). A port's counter set does not
            # change between reports, so this is recomputed only when its size or the flags do
            # (a missing one reads None).
            names = counters if self.tracked is None else self.tracked.intersection(counters)
            self._names = tuple(name for name in names if flags.get(name) != "saturated")
            # The same names as a set: whether a compact entry moved any of them is then one C
            # call walking the entry's few counters (a dict view's isdisjoint walks the names).
            self._judged = frozenset(self._names)
            self._names_for = len(counters)
            self._flags = dict(flags)
        return PORT_COUNTERS_ROSE if self.counters.observe_values(
            ts, self._names, tuple(map(counters.get, self._names))) else 0


class PcieHistory:
    """One PCIe device of a node's ``pcie`` section (a GPU or an HCA, by sysfs bus id): its latest
    entry, its AER counters' increases, and since when its link has been below its maximum (the
    aggregator's clock; None: at it, or unknown). The section comes only when it changed, so an
    unchanged link is held, and its time below counts on while the node keeps reporting."""

    __slots__ = ("bus_id", "counters", "last", "link_below_since")

    def __init__(self, device: PcieDevice, bus_id: str, maxlen: int) -> None:
        self.bus_id = bus_id
        self.last = device
        self.counters = CounterBaseline(maxlen)
        self.link_below_since: float | None = None

    def observe(self, device: PcieDevice, ts: float) -> tuple[bool, bool]:
        """Take ``device``'s entry at ``ts``: (whether its link changed, whether an AER counter rose)."""
        last, self.last = self.last, device
        changed = (device.link_generation, device.link_generation_max, device.link_width, device.link_width_max) != (
            last.link_generation, last.link_generation_max, last.link_width, last.link_width_max)
        if link_below_max(device.link_generation, device.link_generation_max, device.link_width,
                          device.link_width_max):
            if self.link_below_since is None:
                self.link_below_since = ts
                changed = True
        elif self.link_below_since is not None:
            self.link_below_since = None
            changed = True
        rose = self.counters.observe_values(ts, AER_COUNTERS, (
            device.aer_correctable_total, device.aer_nonfatal_total, device.aer_fatal_total))
        return changed, rose


class RankHistory:
    __slots__ = ("gpu", "job", "last", "last_seen", "node", "owned", "rank", "report_ts", "window_count", "windows")

    def __init__(self, summary: RankSummary, node: str, ts: float, maxlen: int) -> None:
        self.job = summary.job
        self.rank = summary.rank
        self.node = node
        self.gpu = summary.gpu
        self.last = summary
        self.owned: RankSummary | None = None  # as GpuHistory.owned
        self.last_seen = ts
        self.report_ts = ts
        # (window end, compute p50 (step p50 when phases are not reported), comm p50, steps,
        # data p50), one entry per summary window in which the rank made steps. The window end is the agent's
        # (its summaries of one window repeat it and are stored once, so a window is one piece of
        # evidence however many reports carry it); an agent without one gives the arrival time.
        self.windows: deque[tuple[float, float, float | None, int, float | None]] = deque(maxlen=maxlen)
        # Change marker (docs/detectors.md, "change markers"): how many windows were ever appended (the newest
        # ``window_count - seen`` of ``windows`` are new to a reader that saw ``seen``).
        self.window_count = 0

    def observe(self, s: RankSummary, node: str, ts: float, report_ts: float, offset: float = 0.0) -> None:
        """``offset``: the node's clock minus the aggregator's (NodeState.clock_offset_seconds): a
        window's end is placed on the aggregator's clock, so a skewed node's windows line up with
        its peers'."""
        self.node = node
        self.gpu = s.gpu
        self.last = s
        self.last_seen = ts
        # The agent's clock: compare with the summary's last_progress_ts, never with ours.
        self.report_ts = report_ts
        compute = s.compute_seconds_p50 if s.compute_seconds_p50 is not None else s.step_seconds_p50
        if s.steps > 0 and compute is not None:
            end = s.window_end_ts - offset if s.window_end_ts is not None else ts
            if not self.windows or self.windows[-1][0] < end:
                self.windows.append((end, compute, s.comm_seconds_p50, s.steps, s.data_seconds_p50))
                self.window_count += 1


@dataclass(slots=True)
class JobState:
    name: str
    ranks: dict[int, RankHistory] = field(default_factory=dict)
    last_seen: float = 0.0
    # Change marker (docs/detectors.md, "change markers"): the fleet revision of the latest change to its membership (a
    # rank joined, left, or moved to another node). Its ranks' summaries change every report.
    members_revision: int = 0

    def nodes(self) -> set[str]:
        return {r.node for r in self.ranks.values()}


class NodeState:
    """One node as the aggregator knows it. ``last_seen`` is arrival time on the aggregator's
    clock (``now`` at ingest), so a node with a skewed clock cannot look alive or dead."""

    def __init__(self, report: Report, now: float, config: FleetConfig) -> None:
        self.name = report.node
        # The node's clock minus the aggregator's, as its latest report showed it (less that
        # report's delay), and the offset that places its event and window times on the
        # aggregator's clock: 0 within ``clock_offset_tolerance_seconds``, replaced only by an
        # offset further than that from it (a step), so one window's end is placed the same in
        # every report that repeats it.
        self.clock_skew_seconds = report.ts - now
        self.clock_offset_seconds = 0.0
        self.first_seen = now
        self.last_seen = now
        # When the state it holds was last reported (a replayed report refreshes last_seen only).
        self.state_seen = now
        self.last_report_ts = report.ts
        self.boot_id = report.boot_id
        self.boot_started = now  # this agent start (a new boot id: counters restarted)
        # The machine's boot (wire.kernel_boot_id): only a change of it is a reboot, the evidence
        # the recovery detector waits for; an agent restart alone changes boot_id, not this.
        self.kernel_boot_id = kernel_boot_id(report.boot_id)
        self.kernel_boot_started = now
        self.kernel_reboots = 0
        self.seq = report.seq
        self.interval_seconds = report.interval_seconds
        self.topology: dict[str, str] = dict(report.topology)
        self.nvml_available = report.nvml_available
        self.nvml_down_since: float | None = None
        self.failed_collectors: list[str] = []
        self.reports = 0
        # The fleet revision of the latest change to this node's state, and of the latest change
        # to what names its hardware class (docs/detectors.md, "change markers"): a GPU's model, maximum SM clock or
        # power limit (``_CLASS_FIELDS``), or its GPU histories.
        self.revision = 0
        self.gpu_class_revision = 0
        # What the GPU and port detectors read of it, kept on ingest so that they pass over a quiet
        # node in O(1) (docs/detectors.md, "change markers"): the newest time a judged counter of one of its GPUs or
        # ports increased (CounterBaseline.last_increase_ts, the largest of its GPUs' or ports'),
        # and the revision of the latest report that changed a GPU's memory or NVLink fault state
        # (``_GPU_FAULT_FIELDS``) or a port's link state, rate or flags, or took one of them whole
        # (a new GPU or port, one back in the reports, a whole report, a reboot).
        self.gpu_counters_moved_ts = -math.inf
        self.port_counters_moved_ts = -math.inf
        self.gpu_faults_revision = 0
        self.ports_revision = 0
        # The revision of the latest report with a GPU sample the thermal detector may act on
        # (WATCHED_CLOCK_EVENTS), and how many GPUs its latest report had (of len(gpus)).
        self.gpu_watch_revision = 0
        self.gpus_reported = 0
        # The GPUs whose latest state's health is not "ok" (the silence detector reads only these).
        self.unhealthy_gpus: set[int] = set()
        self.seq_gaps = 0
        self.reboots = 0
        self.gpus: dict[int, GpuHistory] = {}
        self.ports: dict[tuple[str, int], PortHistory] = {}
        # GPU index -> when it went missing from the reports of this boot (fell off the bus).
        self.missing_gpus: dict[int, float] = {}
        self.gpus_this_boot: set[int] = set()
        self.events: deque[tuple[float, Event]] = deque(maxlen=config.event_history)
        # GPU index (None: not attributable to one GPU) -> recent de-duplicated Xids.
        self.xids: dict[int | None, deque[XidRecord]] = {}
        self.ranks: dict[tuple[str, int], RankHistory] = {}
        self.host = report.host
        # When the machine booted, on the aggregator's clock: its report time less the uptime its
        # host facts gave, else when its first report of this kernel boot arrived.
        self.booted_at = now
        # Since when its Fabric Manager has been in a state other than active (None: active, or
        # not expected here), as its host facts said.
        self.fabric_manager_down_since: float | None = None
        # GPUs whose NVLink fabric is not registered and healthy (a state other than completed, a
        # registration error, an unhealthy condition) -> since when (this run of reports).
        self.fabric_suspect_gpus: dict[int, float] = {}
        # GPUs whose PCIe link is below its maximum now (GpuHistory.link_below holds the run).
        self.gpu_links_below: set[int] = set()
        # Its configuration facts (wire.NodeConfig; kept when a report leaves them out), since when
        # they are as held, and the fleet revision of their latest change (a change marker).
        self.config: NodeConfig | None = None
        self.config_since = now
        self.config_revision = 0
        # Its PCIe devices by sysfs bus id (the latest ``pcie`` section; kept when left out), the
        # revision of the latest change to a device's link or to which devices it has, and the
        # newest time an AER counter of one of them rose.
        self.pcie: dict[str, PcieHistory] = {}
        self.pcie_revision = 0
        self.pcie_aer_moved_ts = -math.inf
        self.pcie_links_below: set[str] = set()  # bus ids of those whose link is below its maximum
        # The Flight Recorder progress of its ranks (wire.CollectiveState), as its latest report
        # carried it; dump_ts is on the node's clock (clock_offset_seconds places it on ours).
        self.collectives: tuple[CollectiveState, ...] = tuple(report.collectives)
        # Node actions (aggregator/outbox.py): request id -> its expiry, and -> the latest result
        # the agent reported with when the report carrying it arrived (the aggregator's clock).
        self.action_expiry: dict[str, float] = {}
        self.action_results: dict[str, ActionOutcome] = {}

    def summary(self) -> dict[str, object]:
        """What is kept of a node once the fleet forgets it (the store's archive)."""
        return {"node": self.name, "first_seen": self.first_seen, "last_seen": self.last_seen,
                "boot_id": self.boot_id, "seq": self.seq, "reports": self.reports, "reboots": self.reboots,
                "topology": self.topology, "gpus": sorted(self.gpus), "ports": [f"{d}/{p}" for d, p in self.ports]}


class Fleet:
    """Mutable fleet state. ``ingest`` is the only writer; detectors get ``view()``."""

    def __init__(self, config: FleetConfig | None = None, *, port_counters: Collection[str] | None = None,
                 agent_resets: bool = False) -> None:
        """``port_counters``: the RDMA counters detectors judge (None: keep deltas of all);
        ``agent_resets``: reset_gpu decisions become requests to the agents (FleetView says so)."""
        self.config = config or FleetConfig()
        self.agent_resets = agent_resets
        self._port_counters = frozenset(port_counters) if port_counters is not None else None
        self._nodes: dict[str, NodeState] = {}
        self._jobs: dict[str, JobState] = {}
        # Change markers (docs/detectors.md, "change markers"): counts every change to the state detectors read; each
        # node, job and rank records the revision of its own latest change. ``identity`` tells
        # one fleet from another (a detector's cache holds for the fleet it was built over).
        self.revision = 0
        self.identity = object()
        # The revision of the latest change to which GPUs the fleet holds (a node joined or was
        # forgotten, a GPU history began) or to any GPU's job attribution (GpuState.job).
        self.gpu_jobs_revision = 0
        # The revision of the latest change to any node's configuration facts, or to which nodes
        # the fleet holds (config_drift's fleet-wide value counts).
        self.config_revision = 0
        # Entries dropped to keep a node within its caps, by kind (ports, ranks, jobs): the oldest
        # of those its latest report no longer named (vigil_aggregator_fleet_evictions_total).
        self.evicted: dict[str, int] = dict.fromkeys(EVICTION_KINDS, 0)
        # Active validation (aggregator/prober.py owns both and sets them; the view hands them to the
        # detectors): the ``probes`` settings when probing is on (the recovery detector then resumes
        # only after a probe run passes), and the fleet's learned probe figures per (hardware class,
        # probe), replaced whole by the prober (never changed in place: a judge reading it sees one).
        self.probes: ProbesConfig | None = None
        self.learned_probes: Mapping[tuple[str, str], tuple[float, int]] = MappingProxyType({})
        # Group-testing isolations, running and the latest finished (replaced whole by the prober).
        self.isolations: tuple[IsolationOutcome, ...] = ()

    def refusal(self, report: Report, now: float, pending: tuple[str, int] | None = None) -> tuple[str, str] | None:
        """Why ``report`` must be refused against the node's last report, as (reason, detail);
        None: it may be ingested. Reads state, changes nothing, so a refused report leaves the
        fleet exactly as it was. ``pending``: the (boot id, seq) of this node's latest accepted
        report not ingested yet (held while the detectors read). The report's own time is never
        a reason: a node's clock may be off (it is measured at ingest, and reported), and ``now``
        is the aggregator's step-free clock (aggregator/clock.py), so the seq bound below is a
        difference of two of its readings."""
        cfg = self.config
        node = self._nodes.get(report.node)
        if report.base_seq is not None:
            last = pending if pending is not None else (node.boot_id, node.seq) if node is not None else None
            if last is None or last != (report.boot_id, report.base_seq):
                held = "nothing of this node" if last is None else f"boot {last[0]!r} seq {last[1]}"
                return "delta_base", (f"the report is relative to seq {report.base_seq} of boot {report.boot_id!r}, "
                                      f"but the aggregator's last accepted report is {held}: send it whole")
        if node is not None and report.boot_id == node.boot_id:
            allowed = node.seq + cfg.max_seq_jump + int(max(0.0, now - node.last_seen) * cfg.max_reports_per_second)
            if report.seq > allowed:
                return "seq_jump", f"seq {report.seq} jumps past {allowed} (last accepted {node.seq})"
        return None

    def reporting_since(self, ts: float) -> int:
        """Nodes whose last accepted report arrived at or after ``ts`` (the breaker's budget base)."""
        return sum(1 for n in self._nodes.values() if n.last_seen >= ts)

    def clock_offsets(self, since: float) -> dict[str, float]:
        """Each node heard from at or after ``since``: its clock minus the aggregator's, as held
        (0 within ``clock_offset_tolerance_seconds``)."""
        return {n.name: n.clock_offset_seconds for n in self._nodes.values() if n.last_seen >= since}

    def clock_offset(self, name: str) -> float:
        """Node ``name``'s clock minus the aggregator's, as held (0 for a node not in the fleet)."""
        node = self._nodes.get(name)
        return node.clock_offset_seconds if node is not None else 0.0

    def is_skewed(self, node: NodeState) -> bool:
        return abs(node.clock_offset_seconds) > self.config.max_clock_skew_seconds

    def is_member(self, name: str, now: float) -> bool:
        """Whether decisions may name ``name``: it reported within ``forget_after_seconds``."""
        node = self._nodes.get(name)
        return node is not None and now - node.last_seen < self.config.forget_after_seconds

    def forget_departed(self, now: float,
                        after_seconds: Callable[[NodeState], float] | None = None) -> list[NodeState]:
        """Drop the nodes silent longer than ``forget_after_seconds`` (or ``after_seconds(node)``)
        and return them (for the archive); their ranks leave their jobs."""
        after = after_seconds or (lambda _: self.config.forget_after_seconds)
        gone = [n for n in self._nodes.values() if n.last_seen < now - after(n)]
        if gone:
            self.revision += 1
            self.gpu_jobs_revision = self.config_revision = self.revision
        for node in gone:
            del self._nodes[node.name]
            for job_name, rank in node.ranks:
                job = self._jobs.get(job_name)
                if job is not None and job.ranks.get(rank) is not None and job.ranks[rank].node == node.name:
                    del job.ranks[rank]
                    job.members_revision = self.revision
        return gone

    def ingest(self, report: Report, now: float) -> dict[str, int]:
        """Fold ``report``, received at ``now`` (the aggregator's step-free clock), into the fleet.
        Returns the entries refused to keep the node within its caps or off another node's ranks,
        by reason (empty: none); the report itself is always taken, its events whatever its entries."""
        cfg = self.config
        node = self._nodes.get(report.node)
        refused: dict[str, int] = {}
        # A compact report's entries complete the state its base report left (refusal checked
        # the base; an entry with none, which no agent sends, is taken as it came).
        base_seen = node.state_seen if report.base_seq is not None and node is not None \
            and node.boot_id == report.boot_id else None
        fresh = node is None
        if node is None:
            node = self._nodes[report.node] = NodeState(report, now, cfg)
        elif report.boot_id == node.boot_id and report.seq <= node.seq:
            # A replayed or reordered report of this boot (the seq alone says so: the node's clock
            # may have stepped back): its counters are older than what we hold, so applying them
            # would fake a reset. Keep its events, which dedup absorbs; its clock says nothing new.
            self._ingest_events(node, report, now, refused)
            node.last_seen = max(node.last_seen, now)
            self.revision += 1
            node.revision = self.revision
            return refused
        self.revision += 1
        revision = node.revision = self.revision
        if fresh:
            self.gpu_jobs_revision = self.config_revision = revision
        self._measure_clock(node, report, now)
        if fresh:
            pass
        elif report.boot_id != node.boot_id:
            node.reboots += 1
            node.boot_id = report.boot_id
            node.boot_started = now
            if kernel_boot_id(report.boot_id) != node.kernel_boot_id:
                node.kernel_boot_id = kernel_boot_id(report.boot_id)
                node.kernel_boot_started = node.booted_at = now
                node.kernel_reboots += 1
            # The GPUs of the last boot are still expected: one that does not come back after
            # a reboot is missing (a new episode, counted from this boot), not forgotten.
            node.gpus_this_boot.update(node.gpus)
            node.missing_gpus.clear()
            for gpu in node.gpus.values():
                gpu.counters.forget_baseline()
            for port in node.ports.values():
                port.counters.forget_baseline()
                port.max_rate_bits_per_second = None
                port.active_this_boot = False
            node.ports_revision = revision
            for device in node.pcie.values():
                device.counters.forget_baseline()
        elif report.seq != node.seq + 1:
            node.seq_gaps += 1
        node.seq = report.seq
        node.last_seen = node.state_seen = now
        node.last_report_ts = report.ts
        node.interval_seconds = report.interval_seconds
        node.reports += 1
        if report.topology:
            node.topology = dict(report.topology)
        if not report.nvml_available and node.nvml_down_since is None:
            node.nvml_down_since = now
        elif report.nvml_available:
            node.nvml_down_since = None
        node.nvml_available = report.nvml_available
        node.failed_collectors = list(report.failed_collectors)
        if report.host is not None:
            self._ingest_host(node, report.host, now)
        if report.config is not None and report.config != node.config:
            node.config = report.config
            node.config_since = now
            node.config_revision = self.config_revision = revision
        if report.pcie is not None:
            self._ingest_pcie(node, report.pcie, now, revision, refused)
        # Whole in every report while the dumps are fresh (not a section): each report replaces it.
        node.collectives = tuple(report.collectives)
        ts = now
        maxlen = cfg.history_reports
        # Versions 2 and 3: (section, entry) -> the fields that became absent (rare: usually empty).
        complete = _COMPLETERS.get(report.version, _COMPLETERS[DELTA_VERSION])
        in_place = complete.in_place
        cleared: dict[tuple[str, int], list[str]] = {}
        for section, i, name in report.cleared:
            cleared.setdefault((section, i), []).append(name)
        state_maxlen = cfg.state_history_reports
        # An entry completes its history's last state when that state is the base's (its history
        # was observed when the base report was ingested, base_seen; never when base_seen is None).
        gpus = node.gpus
        seen: set[int] = set()
        braking, hbm_limit, hbm_watch = WATCHED_CLOCK_EVENTS, HBM_DEFAULT_LIMIT_CELSIUS, HBM_WATCH_BELOW_LIMIT_CELSIUS
        suspect, links_below = node.fabric_suspect_gpus, node.gpu_links_below
        for i, state in enumerate(report.gpus):
            index = state.index
            hist = gpus.get(index)
            if hist is None and len(gpus) >= cfg.max_gpus_per_node:
                _count(refused, "too_many_gpus")  # never evicted: a GPU gone from the reports is evidence
                continue
            seen.add(index)
            if hist is not None and hist.last_seen == base_seen and hist.uuid == state.uuid:
                # A compact entry carries a field that changed (or lists it as cleared).
                if (state.remap_pending is not None or state.remap_failure is not None
                        or state.retired_pages_pending is not None or state.retired_pages_sbe is not None
                        or state.retired_pages_dbe is not None or state.nvlink_links_down != hist.last.nvlink_links_down
                        or (cleared and ("gpus", i) in cleared)):
                    node.gpu_faults_revision = revision
                if state.name is not None or state.sm_clock_max_hertz is not None \
                        or state.power_limit_watts is not None \
                        or (cleared and not _CLASS_FIELDS.isdisjoint(cleared.get(("gpus", i), ()))):
                    node.gpu_class_revision = revision
                if state.job is not None or (cleared and "job" in cleared.get(("gpus", i), ())):
                    self.gpu_jobs_revision = revision
                base = hist.last
                if in_place and base is not hist.owned:  # the fleet's own copy, made once (``owned``)
                    base = hist.owned = _copy_struct(base)
                state = _complete_cleared(complete.gpu, base, state, cleared.get(("gpus", i), ())) \
                    if cleared else complete.gpu(base, state)
            elif hist is None or hist.uuid != state.uuid:
                hist = gpus[index] = GpuHistory(state, ts, maxlen, state_maxlen)
                node.gpu_class_revision = node.gpu_faults_revision = self.gpu_jobs_revision = revision
            else:
                node.gpu_faults_revision = revision  # taken whole
                last = hist.last
                if (state.name != last.name or state.sm_clock_max_hertz != last.sm_clock_max_hertz
                        or state.power_limit_watts != last.power_limit_watts):
                    node.gpu_class_revision = revision
                if state.job != last.job:
                    self.gpu_jobs_revision = revision
            if hist.observe(state, ts):
                node.gpu_counters_moved_ts = ts
            reasons, hbm = state.clock_event_reasons, state.memory_temperature_celsius
            if (reasons and not braking.isdisjoint(reasons)) or (hbm is not None and hbm >= (
                    state.memory_max_temperature_celsius or hbm_limit) - hbm_watch):
                node.gpu_watch_revision = revision
            if state.health != "ok":
                node.unhealthy_gpus.add(index)
            elif node.unhealthy_gpus:
                node.unhealthy_gpus.discard(index)
            # The fabric and PCIe link markers: a few reads per GPU (none without an NVSwitch
            # fabric or a link reading). The slow path only for a GPU whose fabric is not registered
            # and healthy (a state other than completed, a registration error, an unhealthy
            # condition) or whose link is below its maximum, or while the node has any such GPU (an
            # empty dict or set is false: one test).
            fabric = state.fabric_state
            if fabric is not None or suspect:
                if (fabric is not None and fabric != "completed") or state.fabric_status is not None \
                        or state.fabric_health:
                    suspect.setdefault(index, ts)
                elif suspect:
                    suspect.pop(index, None)
            if state.pcie_link_generation != state.pcie_link_generation_max \
                    or state.pcie_link_width != state.pcie_link_width_max or links_below:
                self._observe_gpu_link(node, hist, state, ts)
        node.gpus_reported = len(seen)
        # A GPU that was in this boot's reports and is now absent fell off the bus, unless the
        # reader itself failed (then the report says so and "no data" is not "no GPU").
        gpu_reader_ok = report.nvml_available and "gpu" not in report.failed_collectors
        if gpu_reader_ok:
            known = node.gpus_this_boot
            if not known <= seen:
                for index in known - seen:
                    node.missing_gpus.setdefault(index, ts)
            if node.missing_gpus:
                for index in seen:
                    node.missing_gpus.pop(index, None)
            if not seen <= known:
                known |= seen
        ports = node.ports
        max_counters = cfg.max_counters_per_port
        idle_ports: list[PortHistory] | None = None  # those this report does not name, oldest last
        for i, pstate in enumerate(report.ports):
            key = (pstate.device, pstate.port)
            phist = ports.get(key)
            psent = None
            if phist is None:
                if len(ports) >= cfg.max_ports_per_node:
                    if idle_ports is None:
                        named = {(p.device, p.port) for p in report.ports}
                        idle_ports = sorted((p for k, p in ports.items() if k not in named),
                                            key=attrgetter("last_seen"), reverse=True)
                    if not idle_ports:
                        _count(refused, "too_many_ports")
                        continue
                    oldest = idle_ports.pop()
                    del ports[(oldest.device, oldest.port)]
                    self.evicted["ports"] += 1
                    node.ports_revision = revision
                if len(pstate.counters) > max_counters:
                    pstate = _within(pstate, {}, max_counters, refused)
                phist = ports[key] = PortHistory(pstate, ts, maxlen, state_maxlen, self._port_counters)
            elif phist.last_seen == base_seen:
                psent = pstate
                # Both compact versions merge the moved counters into the base's own dict.
                pbase = phist.last
                if pbase is not phist.owned:
                    pbase = phist.owned = _copy_struct(pbase, counters=dict(pbase.counters))
                if len(pbase.counters) + len(pstate.counters) > max_counters:
                    pstate = psent = _within(pstate, pbase.counters, max_counters, refused)
                pstate = _complete_cleared(complete.port, pbase, pstate, cleared.get(("ports", i), ())) \
                    if cleared else complete.port(pbase, pstate)
            changed = phist.observe(pstate, ts, psent)
            if changed:
                if changed & PORT_LINK_CHANGED:
                    node.ports_revision = revision
                if changed & PORT_COUNTERS_ROSE:
                    node.port_counters_moved_ts = ts
        jobs = self._jobs
        job: JobState | None = None
        room: _RankRoom | None = None  # built at the first rank new to this node
        offset = node.clock_offset_seconds
        for i, summary in enumerate(report.ranks):
            if job is None or job.name != summary.job:
                job = jobs.get(summary.job)
            rhist = job.ranks.get(summary.rank) if job is not None else None
            if rhist is None or rhist.node != node.name:
                # New to this node: another node's live rank stays its own, and the node's caps hold.
                if rhist is not None:
                    if summary.state == "exited":
                        continue  # the tail of a rank that moved away: it claims nothing
                    if (rhist.last.state != "exited" and now - rhist.last_seen < cfg.rank_hold_seconds
                            and rhist.node in self._nodes):
                        _count(refused, "rank_owner_conflict")
                        continue
                if room is None:
                    room = _RankRoom(node, report)
                why = self._make_room(node, room, summary.job)
                if why is not None:
                    _count(refused, why)
                    continue
                if job is None:
                    job = jobs[summary.job] = JobState(summary.job)
                if rhist is None:
                    rhist = job.ranks[summary.rank] = RankHistory(summary, node.name, ts, cfg.rank_history_reports)
                else:
                    old = self._nodes.get(rhist.node)
                    if old is not None and old.ranks.pop((summary.job, summary.rank), None) is not None:
                        old.revision = revision  # a rank forgotten off it is a change to it
                job.members_revision = revision
                node.ranks[(summary.job, summary.rank)] = rhist
                room.jobs[summary.job] = room.jobs.get(summary.job, 0) + 1
            elif rhist.last_seen == base_seen:
                rbase = rhist.last
                if in_place and rbase is not rhist.owned:
                    rbase = rhist.owned = _copy_struct(rbase)
                summary = _complete_cleared(complete.rank, rbase, summary, cleared.get(("ranks", i), ())) \
                    if cleared else complete.rank(rbase, summary)
            job.last_seen = ts  # type: ignore[union-attr]  # rhist is one of its ranks
            rhist.observe(summary, node.name, ts, report.ts, offset)
        self._ingest_events(node, report, now, refused)
        return refused

    @staticmethod
    def _ingest_host(node: NodeState, host: HostFacts, now: float) -> None:
        node.host = host
        if host.uptime_seconds is not None:  # the earliest reading: a held (stale) uptime cannot move it later
            node.booted_at = min(node.booted_at, now - host.uptime_seconds)
        fm = host.fabric_manager_state
        # "unknown": the agent could not ask systemd (no D-Bus in its container, a timeout): not down.
        if fm is None or fm in ("active", "unknown"):
            node.fabric_manager_down_since = None
        elif node.fabric_manager_down_since is None:
            node.fabric_manager_down_since = now

    @staticmethod
    def _observe_gpu_link(node: NodeState, hist: GpuHistory, state: GpuState, ts: float) -> None:
        """A GPU whose link may be below its maximum: extend its run, or end it."""
        if link_below_max(state.pcie_link_generation, state.pcie_link_generation_max, state.pcie_link_width,
                          state.pcie_link_width_max):
            if hist.link_below is None:
                hist.link_below = LoadedRun(ts)
                node.gpu_links_below.add(hist.index)
            hist.link_below.observe(ts, state.utilization_gpu_ratio)
        else:
            hist.link_below = None
            node.gpu_links_below.discard(hist.index)

    def _ingest_pcie(self, node: NodeState, section: list[PcieDevice], now: float, revision: int,
                     refused: dict[str, int]) -> None:
        """A node's whole ``pcie`` section: devices it no longer lists are let go."""
        held = node.pcie
        taken: dict[str, PcieHistory] = {}
        limit, maxlen = self.config.max_pcie_devices_per_node, self.config.history_reports
        for device in section:
            bus_id = normal_bus_id(device.pci_bus_id)
            if bus_id in taken:
                _count(refused, "duplicate_pcie_device")
                continue
            if len(taken) >= limit:
                _count(refused, "too_many_pcie_devices")
                continue
            hist = held.get(bus_id)
            if hist is None or hist.last.kind != device.kind:
                hist = PcieHistory(device, bus_id, maxlen)
                node.pcie_revision = revision
            changed, rose = hist.observe(device, now)
            if changed:
                node.pcie_revision = revision
            if rose:
                node.pcie_aer_moved_ts = now
            taken[bus_id] = hist
        if taken.keys() != held.keys():
            node.pcie_revision = revision
        node.pcie = taken
        node.pcie_links_below = {bus_id for bus_id, hist in taken.items() if hist.link_below_since is not None}

    def _measure_clock(self, node: NodeState, report: Report, now: float) -> None:
        """The node's clock against the aggregator's, from a report newer than any before it."""
        skew = node.clock_skew_seconds = report.ts - now
        tolerance = self.config.clock_offset_tolerance_seconds
        if abs(skew - node.clock_offset_seconds) > tolerance:
            node.clock_offset_seconds = skew if abs(skew) > tolerance else 0.0

    def _make_room(self, node: NodeState, room: _RankRoom, job_name: str) -> str | None:
        """Room on ``node`` for one more rank of ``job_name``, evicting the oldest of the ranks and
        jobs its report does not name; the refusal's reason when there is none."""
        cfg = self.config
        if job_name not in room.jobs and len(room.jobs) >= cfg.max_jobs_per_node:
            idle = room.oldest_idle_job()
            if idle is None:
                return "too_many_jobs"
            for key in [k for k in node.ranks if k[0] == idle]:
                self._evict_rank(node, room, key)
            self.evicted["jobs"] += 1
        while len(node.ranks) >= cfg.max_ranks_per_node:
            oldest = room.oldest_idle_rank()
            if oldest is None:
                return "too_many_ranks"
            self._evict_rank(node, room, oldest)
        return None

    def _evict_rank(self, node: NodeState, room: _RankRoom, key: tuple[str, int]) -> None:
        rhist = node.ranks.pop(key, None)
        if rhist is None:
            return
        self.evicted["ranks"] += 1
        job_name, rank = key
        left = room.jobs[job_name] = room.jobs[job_name] - 1
        if not left:
            del room.jobs[job_name]
        job = self._jobs.get(job_name)
        if job is not None and job.ranks.get(rank) is rhist:
            del job.ranks[rank]
            job.members_revision = self.revision
            if not job.ranks and job_name not in room.named_jobs:
                del self._jobs[job_name]

    def _ingest_events(self, node: NodeState, report: Report, now: float, refused: dict[str, int]) -> None:
        """The report's events, their times placed on the aggregator's clock (the node's held
        offset; never after the report's arrival)."""
        offset = node.clock_offset_seconds
        for event in report.events:
            ts = event.ts - offset if offset else event.ts
            if ts > now and offset:
                ts = now
            node.events.append((ts, event))
            if event.kind == "xid" and event.code is not None:
                self._record_xid(node, event, ts, refused)

    def _record_xid(self, node: NodeState, event: Event, ts: float, refused: dict[str, int]) -> None:
        """``event`` (an Xid) at ``ts`` on the aggregator's clock into its GPU's ring, de-duplicated."""
        gpu = event.gpu
        if gpu is not None and gpu not in node.xids and len(node.xids) >= self.config.max_gpus_per_node:
            # Beyond the node's GPUs: kept for the node as a whole (never dropped), counted.
            _count(refused, "too_many_gpus")
            gpu = None
        if gpu is None:
            for hist in node.gpus.values():
                if (event.pci_bus_id and hist.last.pci_bus_id
                        and hist.last.pci_bus_id.lower() == event.pci_bus_id.lower()) or (
                        event.uuid and hist.uuid == event.uuid):
                    gpu = hist.index
                    break
        ring = node.xids.get(gpu)
        if ring is None:
            ring = node.xids[gpu] = deque(maxlen=self.config.event_history)
        window = self.config.xid_dedup_seconds
        for rec in reversed(ring):
            if rec.code == event.code and abs(rec.ts - ts) <= window:
                rec.count = max(rec.count, event.count)
                rec.sources.add(event.source)
                return
            if ts - rec.ts > window:
                break
        ring.append(XidRecord(event.code or 0, ts, event.count, event.message, {event.source}))

    def note_action_request(self, request: NodeActionRequest) -> None:
        """A request the outbox made for ``request.node`` (its expiry is what the detector waits to)."""
        node = self._nodes.get(request.node)
        if node is not None:
            _keep(node.action_expiry, request.id, request.expires_at)
            self.revision += 1
            node.revision = self.revision

    def record_action_results(self, name: str, results: list[NodeActionResult], now: float) -> None:
        """Results the outbox matched to its requests for node ``name``, received at ``now``."""
        node = self._nodes.get(name)
        if node is not None:
            for result in results:
                _keep(node.action_results, result.id, ActionOutcome(result, now))
            self.revision += 1
            node.revision = self.revision

    def forget_idle_jobs(self, now: float) -> None:
        horizon = now - self.config.job_forget_seconds
        for name in [n for n, j in self._jobs.items() if j.last_seen < horizon]:
            self.revision += 1
            job = self._jobs.pop(name)
            for rank in job.ranks.values():
                node = self._nodes.get(rank.node)
                if node is not None:
                    node.ranks.pop((name, rank.rank), None)
                    node.revision = self.revision

    def view(self, removed: Mapping[str, Removal] | None = None) -> FleetView:
        return FleetView(self._nodes, self._jobs, removed, agent_resets=self.agent_resets, probes=self.probes,
                         learned_probes=self.learned_probes, isolations=self.isolations, revision=self.revision,
                         fleet=self.identity, gpu_jobs_revision=self.gpu_jobs_revision,
                         config_revision=self.config_revision)


EVICTION_KINDS = ("ports", "ranks", "jobs")


def _count(refused: dict[str, int], reason: str) -> None:
    refused[reason] = refused.get(reason, 0) + 1


def _within(sent: PortState, held: Mapping[str, int], limit: int, refused: dict[str, int]) -> PortState:
    """``sent`` with the counters it names beyond ``limit`` names (with those already ``held``)
    left out, each counted: a port cannot grow the aggregator one counter name a report."""
    room = limit - len(held)
    counters: dict[str, int] = {}
    for name, value in sent.counters.items():
        if name in held:
            counters[name] = value
        elif room > 0:
            counters[name] = value
            room -= 1
        else:
            _count(refused, "too_many_counters")
    return msgspec.structs.replace(sent, counters=counters)


class _RankRoom:
    """A node's ranks and jobs as one report changes them: how many ranks each job has there, and
    those the report does not name, oldest first: the ones evicted when a cap is reached. Built
    once per report, at its first rank new to the node."""

    __slots__ = ("_idle_jobs", "_idle_ranks", "_ranks", "jobs", "named_jobs")

    def __init__(self, node: NodeState, report: Report) -> None:
        named = {(s.job, s.rank) for s in report.ranks}
        self.named_jobs = {job for job, _ in named}
        self._ranks = node.ranks
        self.jobs: dict[str, int] = {}
        newest: dict[str, float] = {}
        for (job, _), rhist in node.ranks.items():
            self.jobs[job] = self.jobs.get(job, 0) + 1
            if job not in self.named_jobs:
                newest[job] = max(newest.get(job, -math.inf), rhist.last_seen)
        # Newest first: the oldest is popped from the end.
        self._idle_ranks = sorted((k for k in node.ranks if k not in named),
                                  key=lambda k: node.ranks[k].last_seen, reverse=True)
        self._idle_jobs = sorted(newest, key=newest.__getitem__, reverse=True)

    def oldest_idle_rank(self) -> tuple[str, int] | None:
        while self._idle_ranks:
            key = self._idle_ranks.pop()
            if key in self._ranks:
                return key
        return None

    def oldest_idle_job(self) -> str | None:
        while self._idle_jobs:
            job = self._idle_jobs.pop()
            if job in self.jobs:
                return job
        return None


def _keep(table: dict[str, _V], key: str, value: _V) -> None:
    """Insert or refresh ``key``, dropping the oldest entries beyond ``MAX_NODE_ACTIONS_KEPT``."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_NODE_ACTIONS_KEPT:
        del table[next(iter(table))]


class ActionOutcome(NamedTuple):
    """The latest result of one node-action request, and when the report carrying it arrived."""

    result: NodeActionResult
    received: float


class Removal(NamedTuple):
    """A node vigil took out of service and has not given back: the gate's record (the engine
    copies it from the ledger's gate state), read by the recovery detector. ``ts`` is when the
    removal was admitted on the aggregator's clock; ``held``: an operator holds the node."""

    action: Action
    ts: float
    decision: str
    gpu: int | None
    held: bool


class FleetView:
    """What detectors see: read-only mappings over the fleet (detectors must not mutate state),
    and the nodes vigil removed (empty unless the engine was asked for them)."""

    __slots__ = ("agent_resets", "config_revision", "fleet", "gpu_jobs_revision", "isolations", "jobs",
                 "learned_probes", "nodes", "probes", "removed", "revision")

    def __init__(self, nodes: dict[str, NodeState], jobs: dict[str, JobState],
                 removed: Mapping[str, Removal] | None = None, *, agent_resets: bool = False,
                 probes: ProbesConfig | None = None,
                 learned_probes: Mapping[tuple[str, str], tuple[float, int]] | None = None,
                 isolations: Sequence[IsolationOutcome] = (), revision: int | None = None,
                 fleet: object | None = None, gpu_jobs_revision: int = 0, config_revision: int = 0) -> None:
        self.nodes: Mapping[str, NodeState] = MappingProxyType(nodes)
        # Change markers (docs/detectors.md, "change markers"): the fleet's revision when the view was taken, and the
        # fleet's identity. A view built by hand (tests) has neither: ``revision`` None tells a
        # detector to trust no marker and judge from scratch.
        self.revision = revision
        self.fleet = fleet
        self.gpu_jobs_revision = gpu_jobs_revision  # Fleet.gpu_jobs_revision
        self.config_revision = config_revision  # Fleet.config_revision
        self.jobs: Mapping[str, JobState] = MappingProxyType(jobs)
        self.removed: Mapping[str, Removal] = MappingProxyType(dict(removed or {}))
        # An admitted reset_gpu is carried out by the node's agent on a signed request, and its
        # result arrives in the reports (NodeState.action_results).
        self.agent_resets = agent_resets
        # Probing on (aggregator/prober.py): its settings, and the learned figures per (hardware
        # class, probe) -> (median value, passing samples), both owned by the prober.
        self.probes = probes
        self.learned_probes: Mapping[tuple[str, str], tuple[float, int]] = learned_probes or MappingProxyType({})
        # Group-testing isolations (the prober's): the probe verdict detector acts on finished ones.
        self.isolations: tuple[IsolationOutcome, ...] = tuple(isolations)

    def without_markers(self) -> FleetView:
        """The same fleet with no change markers: detectors judge it the long way, from scratch
        (the reference the incremental paths are tested against)."""
        return FleetView(dict(self.nodes), dict(self.jobs), self.removed, agent_resets=self.agent_resets,
                         probes=self.probes, learned_probes=self.learned_probes, isolations=self.isolations)

    def members(self, label: str, value: str) -> list[str]:
        """Nodes whose topology label ``label`` (e.g. leaf_switch) equals ``value``."""
        return [n.name for n in self.nodes.values() if n.topology.get(label) == value]
