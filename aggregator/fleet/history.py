"""Per-node histories: what the fleet keeps of each GPU, port, PCIe device and rank between reports.

Each history reads the whole (completed) state of its entry at every report and keeps the latest
state, a ring of compact samples for persistence checks and the non-zero increases of its judged
counters (a counter going backwards is a reset, not an error). It judges nothing and never reads
a report itself: Fleet.ingest hands it each entry.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Callable, Iterator, MutableSequence
from operator import attrgetter
from typing import Any

import msgspec
from msgspec.structs import replace

from vigil.contract.wire import GpuState, PcieDevice, PortState, RankSummary

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


# The spellings of an active port that agents send: a set lookup answers for them where the
# general test makes an upper-cased copy of the text (PortHistory.observe and the network detector
# ask for every port of every whole report: 480,000 calls in a 300 s slice of a 1,000-node simulation).
ACTIVE_PORT_STATES = frozenset(("4: ACTIVE", "ACTIVE"))


def port_is_active(state: PortState) -> bool:
    """sysfs writes "4: ACTIVE"; agents may send just "ACTIVE"."""
    text = state.state
    return text in ACTIVE_PORT_STATES or (text is not None and text.upper().endswith("ACTIVE"))


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


class ClockWatch:
    """A band of SM clocks a reader watches over the GPUs it is attached to (``GpuHistory.watch_clocks``):
    the time of the newest busy sample (a clock read, utilization read and at least
    ``min_utilization_ratio``) whose clock lies outside [``low_hertz``, ``high_hertz``], over the
    samples the histories held when it was attached and every one they took in since. A reader then
    knows in O(1) that none of a group's busy samples since a time left the band (gpu_peer passes
    over a job's GPUs so, docs/detectors.md). ``out_ts`` infinite: it no longer holds (another
    watch replaced it on one of its GPUs)."""

    __slots__ = ("high_hertz", "low_hertz", "min_utilization_ratio", "out_ts")

    def __init__(self, low_hertz: float, high_hertz: float, min_utilization_ratio: float) -> None:
        self.low_hertz = low_hertz
        self.high_hertz = high_hertz
        self.min_utilization_ratio = min_utilization_ratio
        self.out_ts = -math.inf

    def out(self, sample: GpuSample) -> bool:
        """Whether ``sample`` is busy and outside the band."""
        clock, utilization = sample.sm_clock_hertz, sample.utilization_gpu_ratio
        return (clock is not None and utilization is not None and utilization >= self.min_utilization_ratio
                and not self.low_hertz <= clock <= self.high_hertz)


class GpuHistory:
    __slots__ = ("clock_watch", "counters", "first_seen", "index", "last", "last_seen", "link_below", "owned",
                 "samples", "uuid")

    def __init__(self, state: GpuState, ts: float, maxlen: int, state_maxlen: int) -> None:
        self.index = state.index
        self.uuid = state.uuid
        self.first_seen = ts
        self.last_seen = ts
        self.last = state
        # The copy of a state the fleet made to complete in place (completion.copy_struct): ``last`` while compact
        # reports complete it, else stale (``last`` then came whole from a report).
        self.owned: GpuState | None = None
        self.samples: deque[GpuSample] = deque(maxlen=state_maxlen)
        self.counters = CounterBaseline(maxlen)
        # The run of reports in which its PCIe link was below its maximum (None: at it, or unknown).
        self.link_below: LoadedRun | None = None
        # The band of SM clocks a reader watches on this GPU (ClockWatch; None: none).
        self.clock_watch: ClockWatch | None = None

    def watch_clocks(self, watch: ClockWatch) -> None:
        """Watch ``watch``'s band from now on: the samples held now are checked here, later ones
        as they come (``observe``). A watch this replaces no longer holds."""
        old = self.clock_watch
        if old is not watch:
            if old is not None:
                old.out_ts = math.inf
            self.clock_watch = watch
        out_ts = watch.out_ts
        for sample in self.samples:
            if sample.ts > out_ts and watch.out(sample):
                out_ts = sample.ts
        watch.out_ts = out_ts

    def unwatch_clocks(self, watch: ClockWatch) -> None:
        """Stop watching ``watch`` (if it is the one watched)."""
        if self.clock_watch is watch:
            self.clock_watch = None

    def observe(self, s: GpuState, ts: float, held: bool = False) -> bool:
        """``s``: the GPU's whole state (of this GPU: the fleet starts a new history for a new
        uuid at this index); whether a judged counter increased. Most reports move none of the
        judged counters: one comparison. ``held``: the caller vouches that ``s`` is the very
        state observed last, unchanged (Fleet.ingest: a whole report holding the object it took
        before; the simulator hands the service its agents' objects, the same ones until a GPU is
        read again: 119 reports in 120 of a quiet node at 2.5 s): its sample is the last one at
        this time, its counters those compared last."""
        samples = self.samples
        same = held and s is self.last and samples
        if same:
            samples.append(replace(samples[-1], ts=ts))
        else:
            self.last = s
            # The state's sequences are tuples already (wire.GpuState; most the empty one), shared
            # with the sample: a list would be tracked by the collector, a tuple of scalars is not.
            # Fields are read by name: an attribute read in the interpreter costs a tenth of one
            # through attrgetter (a test keeps these to GpuSample's fields and GPU_COUNTERS, in order).
            samples.append(GpuSample(ts, s.health, s.utilization_gpu_ratio, s.sm_clock_hertz, s.sm_clock_max_hertz,
                                     s.clock_event_reasons, s.memory_temperature_celsius,
                                     s.memory_max_temperature_celsius, s.remap_pending, s.remap_failure,
                                     s.retired_pages_pending, s.nvlink_links_down, s.recovery_action))
        self.last_seen = ts
        watch = self.clock_watch
        if watch is not None:  # ClockWatch.out written out: a few comparisons, only on a watched GPU
            clock, utilization = s.sm_clock_hertz, s.utilization_gpu_ratio
            if (clock is not None and utilization is not None and utilization >= watch.min_utilization_ratio
                    and not watch.low_hertz <= clock <= watch.high_hertz and ts > watch.out_ts):
                watch.out_ts = ts
        counters = self.counters
        if same and counters._last_values is not None:
            counters.last_ts = ts  # CounterBaseline.still, without its call
            return False
        values = (s.ecc_corrected_volatile, s.ecc_uncorrected_volatile, s.pcie_replay_total, s.nvlink_crc_errors_total,
                  s.nvlink_replay_errors_total, s.nvlink_recovery_errors_total)
        if values == counters._last_values and counters._last_names is GPU_COUNTERS:
            counters.last_ts = ts  # CounterBaseline.observe_values's first test, without its call
            return False
        return counters.observe_values(ts, GPU_COUNTERS, values)


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

    def observe(self, state: PortState, ts: float, sent: PortState | None = None, held: bool = False) -> int:
        """``state``: the port's whole state; ``sent``: the compact entry it was completed from
        (None: the report was whole), whose counters are only those that moved (its flags are
        whole). A compact entry that moved only counters leaves ``last`` itself, its counters
        updated in place: its link state, rate and flags are the last sample's. ``held``: as
        GpuHistory.observe's (a whole entry that is the very state observed last). Returns what
        changed: ``PORT_LINK_CHANGED`` (its link state, rate or flags may have: a compact entry
        carrying one of them, a whole one where one differs from the state held, or the port up
        for the first time in this boot or at a better rate), ``PORT_COUNTERS_ROSE`` (a judged
        counter increased), or 0 (the usual entry)."""
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
        last, samples = self.last, self.samples
        prev = samples[-1] if samples else None  # None: its first state (``last`` is ``state``)
        if held and state is last and prev is not None and len(counters) == self._names_for \
                and self.counters.still(ts):
            # Its link, rate and flags were taken with it, its counters compared.
            self.last_seen = ts
            samples.append(PortSample(ts, prev.active, prev.rate_bits_per_second))
            return 0
        self.last = state
        active = state.state in ACTIVE_PORT_STATES or port_is_active(state)  # the usual answer without a call
        rate = state.rate_bits_per_second
        self.last_seen = ts
        samples.append(PortSample(ts, active, rate))
        # A whole entry whose link state, rate and flags are those held (a whole report's usual
        # port: its activity, rate and flags are compared with the last sample's and flags taken)
        # changes nothing the link is judged on; anything else may have.
        changed = 0 if (sent is None and prev is not None and active == prev.active
                        and rate == prev.rate_bits_per_second and flags == self._flags
                        and (last is state or (state.state == last.state and state.phys_state == last.phys_state
                                               and state.link_layer == last.link_layer
                                               and state.netdev == last.netdev))) else PORT_LINK_CHANGED
        if not (sent is not None and len(counters) == self._names_for and flags == self._flags
                and self._judged.isdisjoint(sent.counters) and self.counters.still(ts)):
            changed |= self._observe_counters(ts, counters, flags)
        if active and not (self.active_this_boot and self.ever_active):
            self.active_this_boot = True
            self.ever_active = True
            changed |= PORT_LINK_CHANGED
        if rate is not None and (self.max_rate_bits_per_second is None or rate > self.max_rate_bits_per_second):
            self.max_rate_bits_per_second = rate
            changed |= PORT_LINK_CHANGED
        return changed

    def observe_moved(self, sent: PortState, ts: float) -> int | None:
        """A compact entry of this port: when the state held is the fleet's own copy (``owned``) and
        the entry carries nothing but counters (the usual entry: its link state, rate and flags as
        held), they merge into the held state's and the read is taken as ``observe``'s fast path
        takes it, returning what changed; None otherwise (the caller completes the entry and calls
        ``observe``). One call a port where completing and observing made two and tested the entry
        twice (bench_ingest_instructions)."""
        if (self.last is not self.owned or sent.state is not None or sent.phys_state is not None
                or sent.rate_bits_per_second is not None or sent.link_layer is not None or sent.netdev is not None
                or sent.deltas or sent.rates_per_second or sent.flags):
            return None
        moved = sent.counters
        counters = self.last.counters
        counters.update(moved)
        last_sample = self.samples[-1]
        self.last_seen = ts
        self.samples.append(PortSample(ts, last_sample.active, last_sample.rate_bits_per_second))
        if len(counters) == self._names_for and self._judged.isdisjoint(moved):
            baseline = self.counters
            if baseline._last_values is not None:  # CounterBaseline.still, without its call
                baseline.last_ts = ts
                return 0  # none of the judged counters moved
        return self._observe_counters(ts, counters, self.last.flags)

    def _observe_counters(self, ts: float, counters: dict[str, int], flags: dict[str, str]) -> int:
        if len(counters) != self._names_for or flags != self._flags:
            # The judged counters this port has, less the saturated ones (a saturated counter no
            # longer moves: its delta would read as "no errors"). A port's counter set does not
            # change between reports, so this is recomputed only when its size or the flags do
            # (a missing one reads None).
            tracked = counters if self.tracked is None else self.tracked.intersection(counters)
            self._names = tuple(name for name in tracked if flags.get(name) != "saturated")
            # The same names as a set: whether a compact entry moved any of them is then one C
            # call walking the entry's few counters (a dict view's isdisjoint walks the names).
            self._judged = frozenset(self._names)
            self._names_for = len(counters)
            self._flags = dict(flags)
        judged = self._names
        values = tuple(map(counters.get, judged))
        baseline = self.counters
        if values == baseline._last_values and baseline._last_names is judged:
            baseline.last_ts = ts  # CounterBaseline.observe_values's first test, without its call
            return 0
        return PORT_COUNTERS_ROSE if baseline.observe_values(ts, judged, values) else 0


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


# A summary's flags in RankColumns.flags, one byte a rank: a reader tests a whole job's with
# ``bytes.translate`` and ``in`` (C-level, ~0.1 ms over 100,000 ranks).
STEPLESS = 1  # steps == 0
NONFINITE = 2  # nonfinite_steps != 0
NONFINITE_LOSS = 4  # nonfinite_loss_steps != 0
LOSS_UNKNOWN = 8  # loss_p50 is None
BUSY = 16  # state != "running" or a phase announced (phase is not None)
# The columns' "none" figures, as globals: one read where ``-math.inf`` is two and a negation.
NO_END = -math.inf
NAN = math.nan


def summary_flags(s: RankSummary) -> int:
    """``s``'s flags (STEPLESS, NONFINITE, NONFINITE_LOSS, LOSS_UNKNOWN, BUSY) as one byte."""
    return ((s.steps == 0) | (s.nonfinite_steps != 0) << 1 | (s.nonfinite_loss_steps != 0) << 2
            | (s.loss_p50 is None) << 3 | (s.state != "running" or s.phase is not None) << 4)


def flag_table(test: Callable[[int], bool]) -> bytes:
    """A ``bytes.translate`` table: each flags byte to 1 where ``test`` holds of it, else 0."""
    return bytes(1 if test(b) else 0 for b in range(256))


class RankColumns:
    """One job's ranks' newest summary windows as columns, one slot per rank (docs/detectors.md,
    "change markers"): the fleet gives a rank a slot as it joins the job (``take``) and takes it back
    as it leaves (``release``: the last slot's rank moves into it, so the columns hold exactly the
    job's ranks, no gaps), and ``RankHistory.observe`` writes a rank's slot as its summary brings a
    newly ended window. A judging pass then reads a job's windows with C-level calls over lists
    (min, max, slices, sorted) instead of reading 100,000 rank objects (issue 47). It judges nothing.

    The figures are ``array('d')``: contiguous doubles, where a list would point at float objects
    scattered over the heap (made report by report): a min over 100,000 of them took ~9 ms from a
    list and ~2 ms from an array (busy 2-core machine), and an array is no object for the garbage
    collector to walk."""

    __slots__ = ("comms", "computes", "ends", "flags", "last_steps", "losses", "marks", "no_comm", "owns", "progress",
                 "ranks", "report_ts", "seen", "steps", "window_seconds_changes")

    def __init__(self) -> None:
        self.ranks: list[RankHistory] = []  # the rank in each slot
        # Its newest entry of ``windows`` (RankHistory.windows: end, compute, comm, steps), and
        # ``owns``: compute + (data or 0.0), the straggler's own time. ``ends``: -inf while it has
        # none, and for an end that is not a number (a reader takes the long way for either).
        self.ends = array("d")
        self.owns = array("d")
        self.computes = array("d")
        self.comms = array("d")  # NaN where it has none (and no_comm says so)
        self.no_comm = bytearray()  # 1: its newest window has no collective wait (comm None)
        self.steps: list[int] = []
        self.seen = array("d")  # its last_seen
        # Its latest summary, every summary (the heartbeat-side detectors' reads: app_signals, hang):
        # ``marks``: its window_end_ts as sent (the agent's clock; -inf for None and for an end that
        # is not a number: a reader takes the long way), ``losses``: loss_p50 (NaN for None: the
        # LOSS_UNKNOWN flag tells the two apart), ``progress``: last_progress_ts, ``report_ts``:
        # the report's own time (RankHistory.report_ts), ``flags``: summary_flags, ``last_steps``:
        # last_step (a list: a count may exceed what an array of integers holds).
        self.marks = array("d")
        self.losses = array("d")
        self.progress = array("d")
        self.report_ts = array("d")
        self.flags = bytearray()
        self.last_steps: list[int] = []
        # Change marker: how many summaries of the job's ranks came with a window_seconds other
        # than their rank's previous one. A reader that saw the same count and the same
        # JobState.members_revision knows no rank of the job changed its summary window.
        self.window_seconds_changes = 0

    def take(self, rank: RankHistory) -> None:
        """``rank`` joins: a slot at the end, written from its newest window (none: -inf)."""
        rank.columns, rank.slot = self, len(self.ranks)
        self.ranks.append(rank)
        entry = rank.windows[-1] if rank.windows else None
        if entry is None:
            self.ends.append(-math.inf)
            self.owns.append(0.0)
            self.computes.append(0.0)
            self.comms.append(math.nan)
            self.no_comm.append(1)
            self.steps.append(0)
        else:
            end, comm = entry[0], entry[2]
            self.ends.append(end if end == end else -math.inf)
            self.owns.append(entry[1] + (entry[4] or 0.0))
            self.computes.append(entry[1])
            self.comms.append(math.nan if comm is None else comm)
            self.no_comm.append(comm is None)
            self.steps.append(entry[3])
        self.seen.append(rank.last_seen)
        s = rank.last
        mark, loss = s.window_end_ts, s.loss_p50
        self.marks.append(mark if mark is not None and mark == mark else -math.inf)
        self.losses.append(math.nan if loss is None else loss)
        self.progress.append(s.last_progress_ts)
        self.report_ts.append(rank.report_ts)
        self.flags.append(summary_flags(s))
        self.last_steps.append(s.last_step)

    def release(self, rank: RankHistory) -> None:
        """``rank`` leaves: the last slot's rank takes its slot."""
        if rank.columns is not self:
            return
        slot, last = rank.slot, len(self.ranks) - 1
        columns: tuple[MutableSequence[Any], ...] = (self.ranks, self.ends, self.owns, self.computes, self.comms,
                                                     self.no_comm, self.steps, self.seen, self.marks, self.losses,
                                                     self.progress, self.report_ts, self.flags, self.last_steps)
        for column in columns:
            column[slot] = column[last]
            del column[last]
        if slot != last:
            self.ranks[slot].slot = slot
        rank.columns, rank.slot = None, -1


class RankHistory:
    __slots__ = ("columns", "gpu", "job", "last", "last_seen", "node", "owned", "rank", "report_ts", "slot",
                 "window_count", "window_seconds", "windows")

    def __init__(self, summary: RankSummary, node: str, ts: float, maxlen: int) -> None:
        self.job = summary.job
        self.rank = summary.rank
        self.node = node
        self.gpu = summary.gpu
        self.last = summary
        self.owned: RankSummary | None = None  # as GpuHistory.owned
        self.last_seen = ts
        self.report_ts = ts
        # Its latest summary's window_seconds (``last``'s, kept apart: see ``observe``).
        self.window_seconds = summary.window_seconds
        # (window end, compute p50 (step p50 when phases are not reported), comm p50, steps,
        # data p50), one entry per summary window in which the rank made steps. The window end is the agent's
        # (its summaries of one window repeat it and are stored once, so a window is one piece of
        # evidence however many reports carry it); an agent without one gives the arrival time.
        self.windows: deque[tuple[float, float, float | None, int, float | None]] = deque(maxlen=maxlen)
        # Change marker (docs/detectors.md, "change markers"): how many windows were ever appended (the newest
        # ``window_count - seen`` of ``windows`` are new to a reader that saw ``seen``).
        self.window_count = 0
        # Its job's columns and its slot in them (RankColumns.take; None, -1: in no job's columns).
        self.columns: RankColumns | None = None
        self.slot = -1

    def observe(self, s: RankSummary, node: str, ts: float, report_ts: float, offset: float = 0.0) -> None:
        """``offset``: the node's clock minus the aggregator's (NodeState.clock_offset_seconds): a
        window's end is placed on the aggregator's clock, so a skewed node's windows line up with
        its peers'. The rank's slot of its job's columns (``RankColumns``) follows: its last_seen and
        latest summary's figures every summary (seven stores), its newest window's figures when
        one is appended (a handful more every other report at 2.5 s reports and 5 s windows)."""
        self.node = node
        self.gpu = s.gpu
        self.last = s
        self.last_seen = ts
        # The agent's clock: compare with the summary's last_progress_ts, never with ours.
        self.report_ts = report_ts
        columns = self.columns
        # Against the rank's own copy, not ``last``'s: a compact summary is completed into the
        # held state in place (completion.complete_rank), so ``s`` is ``last`` and the two agree.
        window_seconds = s.window_seconds
        if window_seconds != self.window_seconds:
            self.window_seconds = window_seconds
            if columns is not None:
                columns.window_seconds_changes += 1
        steps, end, loss = s.steps, s.window_end_ts, s.loss_p50
        if columns is not None:
            slot = self.slot
            columns.seen[slot] = ts
            columns.progress[slot] = s.last_progress_ts
            columns.report_ts[slot] = report_ts
            columns.last_steps[slot] = s.last_step
            if end is not None and end == end:
                columns.marks[slot] = end
            else:
                columns.marks[slot] = NO_END
            if loss is None:
                columns.losses[slot] = NAN
            else:
                columns.losses[slot] = loss
            # summary_flags written out for its usual values (no flag but LOSS_UNKNOWN: a job that
            # reports no loss) by a chain of tests: no call and no arithmetic per summary.
            if (steps and not s.nonfinite_steps and not s.nonfinite_loss_steps and s.phase is None
                    and s.state == "running"):
                columns.flags[slot] = LOSS_UNKNOWN if loss is None else 0
            else:
                columns.flags[slot] = summary_flags(s)
        if steps > 0:
            compute = s.compute_seconds_p50
            if compute is None:
                compute = s.step_seconds_p50
                if compute is None:
                    return
            end = end - offset if end is not None else ts
            windows = self.windows
            if not windows or windows[-1][0] < end:
                comm, data = s.comm_seconds_p50, s.data_seconds_p50
                windows.append((end, compute, comm, steps, data))
                self.window_count += 1
                if columns is not None:
                    columns.ends[slot] = end if end == end else NO_END
                    columns.owns[slot] = compute + (data or 0.0)  # the straggler's own time, as it adds it
                    columns.computes[slot] = compute
                    if comm is None:
                        columns.comms[slot] = NAN
                        columns.no_comm[slot] = 1
                    else:
                        columns.comms[slot] = comm
                        columns.no_comm[slot] = 0
                    columns.steps[slot] = steps


# Readers of a RankHistory for C-level bulk reads over a job's ranks (``list(map(RANK_LAST, ranks))``,
# ~40 ns a rank where a Python loop spends ~1 us): its latest summary, when that arrived (aggregator
# clock), the report's own time (agent clock); and the summary's state (wire.RankSummary.state).
RANK_LAST = attrgetter("last")
RANK_LAST_SEEN = attrgetter("last_seen")
RANK_REPORT_TS = attrgetter("report_ts")
RANK_STATE = attrgetter("state")
