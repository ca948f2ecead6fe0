"""GPU straggler detector: the one slow GPU (rank) that a node's median hides.

It reads every rank's summaries of complete, non-overlapping windows (on the node straggler's
schedule) and compares each rank's compute time by median and MAD with the job's ranks on nodes of
the same hardware class. A rank far slower than them, waiting least in its collectives, in
consecutive windows and a minority of its node's ranks, names its node and GPU with that GPU's
telemetry as evidence (``reset_gpu`` where a reset clears the cause, else ``drain``); a node mostly
slow is the node straggler's, a whole-job slowdown flags nobody, and it judges neither the data phase
nor hangs. Thresholds, guards, persistence, false-removal rate: docs/detectors.md, "gpu_straggler".
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import MutableSequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from statistics import median
from typing import cast

from pydantic import Field

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.peer_class import UNKNOWN, HardwareClass, describe, hardware_class
from vigil.aggregator.detectors.straggler import (
    RANK_WINDOWS_MAX,
    SPREAD_MEMORY_WINDOWS,
    last_complete_window,
    mad_sigma,
)
from vigil.aggregator.detectors.straggler import sorted_mad as _sorted_mad
from vigil.aggregator.detectors.straggler import sorted_median as _sorted_median
from vigil.aggregator.fleet import FleetView, JobState, NodeState, RankHistory
from vigil.aggregator.fleet.history import RANK_LAST_SEEN
from vigil.contract.validation import StrictModel

NAME = "gpu_straggler"

# A rank's fields read in C for every rank of a job (map, min, zip): ~0.05 us a rank where a
# Python loop over the rank costs ~1 us (100,000 ranks at 12,500 nodes).
_WINDOW_SECONDS = attrgetter("last.window_seconds")  # a rank's summary window
_WINDOWS = attrgetter("windows")
_NODE = attrgetter("node")
_RANK_ID = attrgetter("rank")
_NEWEST = itemgetter(-1)  # a rank's newest window entry (end, compute, comm, steps, data)
_END, _COMPUTE, _COMM, _STEPS = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)
_HELD_CLASS, _HELD_AT = itemgetter(0), itemgetter(1)  # a node's class and when it was read (_classes)

# A run whose rank sent nothing for this many judged windows ends (the rank left the job).
_ABSENT_WINDOWS_MAX = 8
# A node's hardware class is read again after this long: it changes only when most of its GPUs'
# model, clocks or power limits do, and reading it for every node of a 1,024-node job at every
# judged window was a third of the detector's cost.
_CLASS_REFRESH_SECONDS = 30.0
# Throttle reasons that show a cause for a slow GPU (NVML clock-event reasons by the agent's
# short name, agent/nvml/backend.py); "sw_power_cap" is a loaded GPU's normal state.
_THROTTLE_CAUSES = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
# GPU-local states a GPU reset clears: a pending row remap and a pending page retirement take
# effect at the next reset (NVIDIA row remapping and dynamic page retirement guides; memory.py's
# remap_pending_action and retired_pending_action). Throttling (cooling, the board's power brake),
# NVLink links down (DCGM_FR_NVLINK_DOWN -> RESTART_VM, pcie_nvlink.py) and PCIe replays (the
# link's signal) are recorded as causes but a reset does not clear them: drain.
_RESET_CLEARS = ("remap_pending", "retired_pages_pending")


class GpuStragglerConfig(StrictModel):
    """One slow GPU (rank) that its node's median hides (docs/detectors.md)."""
    enabled: bool = True
    # The shortest judged window; the agents' summary window (collectors.training.window_seconds,
    # 5 s) when longer. Each agent window is one piece of independent evidence, judged once.
    window_seconds: float = Field(default=5.0, gt=0)
    # Four consecutive windows (20 s at 5 s): three hold the node statistic's budget, not the 8x
    # more tests of one statistic per rank (module docstring: 138,240 x p^4 = 1.8e-9 removals per
    # node-day at tails p = 3.4e-4; p^3 would be 5.4e-6). With the window in progress at the
    # onset and one report interval, a decision within ~30 s.
    persistence_windows: int = Field(default=4, ge=1)
    # Robust z of a rank's compute p50 against the job's ranks of its hardware class in the same
    # window. 6 sigma: p = 9.9e-10 per rank-window (Gaussian, one-sided); the module docstring
    # has the fleet-day rate. A 25%-slow GPU is 12-16 sigma out at the 2% step jitter of large jobs.
    z_threshold: float = Field(default=6.0, gt=0)
    # ... and a large excess: a GPU 10% slow costs its synchronous job 10% of every step (every
    # rank waits for it). 2.5x the node statistic's 4% floor: one rank's p50 of a few steps has
    # ~sqrt(8) = 2.8x the spread of a median over a node's 8 ranks.
    min_excess_ratio: float = Field(default=0.10, ge=0)
    # The spread never counts as less than this share of the median: ranks of one model in one
    # job step within 1-3% of each other (the node detector's jitter figure), never exactly alike.
    min_spread_ratio: float = Field(default=0.01, gt=0)
    # Fewer ranks than this in a class group: no median worth comparing with (no judgement).
    min_ranks: int = Field(default=8, ge=4)
    # The straggler waits least in the collective: its wait is at most this quantile of its
    # group's waits (the job's shortest tenth; everyone else waits for it).
    max_comm_quantile: float = Field(default=0.1, gt=0, le=0.5)
    # Flagged ranks must be fewer than this share of their node's ranks in the window: a node
    # most of whose ranks are slow moves its node median, and is the node straggler's to judge
    # (one fault is not decided twice). 0.5: 1-3 of 8, never 4.
    max_node_rank_share: float = Field(default=0.5, gt=0, le=1)
    # More outlier ranks than this share of a class group (at least one) in a window is a
    # job-wide effect (a bimodal job, a role that differs by rank), not a GPU: nobody is flagged.
    max_outlier_rank_share: float = Field(default=0.1, gt=0, le=1)
    # The action without a cause a GPU reset clears (and whenever the agents do not reset GPUs).
    action: Action = Action.DRAIN
    # Corroboration: the GPU's median SM clock over the run at or under this share of its node's
    # other GPUs' median is a cause recorded as "sm_clock_low" (gpu_peer.py's clock_ratio: GPUs
    # of one model under one load sit within about a tenth of each other).
    clock_ratio: float = Field(default=0.85, gt=0, lt=1)
    # A rank found a persistent straggler leaves its group's baseline for this long, and each
    # later finding on it keeps the start of its episode (straggler.py's removed_memory_seconds).
    removed_memory_seconds: float = Field(default=3600.0, gt=0)


@dataclass(slots=True)
class _Window:
    """One window's ranks and their p50s, as columns: floats in lists are no objects for the
    garbage collector to track (a tuple per rank of 8,192 made collections walk the fleet)."""

    ranks: list[RankHistory] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the ranks' numbers
    # Lists, or the job's columns themselves (JobState.columns' arrays), read within one pass.
    computes: MutableSequence[float] = field(default_factory=list)
    comms: MutableSequence[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Roster:
    """A job's ranks as of its membership revision, in the job's order, with their numbers and
    nodes (lists read, never changed, by a pass: a window's columns may be these very lists)."""

    job: JobState
    revision: int
    ranks: list[RankHistory]
    ids: list[int]
    nodes: list[str]
    distinct_nodes: list[str]  # in order of first appearance
    # Whether ``ranks`` are the job's columns' ranks in their slots' order (JobState.columns, kept by
    # the fleet): then the columns are read in place of the ranks' newest windows.
    columns: bool = False


@dataclass(slots=True)
class _Verdict:
    """One judged window: evidence per flagged rank, and the ranks judged (flagged or not; held
    only where some rank has a run, the only ranks _advance asks about)."""

    flagged: dict[int, _Flag]
    judged: set[int]


@dataclass(slots=True)
class _Flag:
    excess_ratio: float
    z: float
    evidence: dict[str, object]


@dataclass(slots=True)
class _Run:
    start: int
    last: int
    windows: int
    flag: _Flag


@dataclass(slots=True)
class _JobMemo:
    job: JobState
    width: float
    last_judged: int | None = None
    runs: dict[int, _Run] = field(default_factory=dict)
    removed: dict[int, float] = field(default_factory=dict)
    episode_since: dict[int, float] = field(default_factory=dict)
    spreads: dict[HardwareClass, deque[float]] = field(default_factory=dict)


class GpuStragglerDetector:
    name = NAME

    def __init__(self, config: GpuStragglerConfig) -> None:
        self.config = config
        self._memo: dict[str, _JobMemo] = {}
        # node -> its hardware class and when it was read (_CLASS_REFRESH_SECONDS).
        self._classes: dict[str, tuple[HardwareClass, float]] = {}
        # job -> the nodes its ranks report from, as of its membership revision (a fleet's view).
        self._job_nodes: dict[str, _Roster] = {}
        # job -> its judged window's width as of its membership revision and the ranks' window
        # changes (_width).
        self._widths: dict[str, tuple[JobState, int, int, float]] = {}

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        if len(self._classes) > len(view.nodes):
            self._classes = {n: c for n, c in self._classes.items() if n in view.nodes}
        for job in view.jobs.values():
            out.extend(self._judge(view, job, now))
        for name in [n for n, m in self._memo.items() if view.jobs.get(n) is not m.job]:
            del self._memo[name]
        if len(self._job_nodes) > len(view.jobs):
            self._job_nodes = {n: held for n, held in self._job_nodes.items() if view.jobs.get(n) is held.job}
        if len(self._widths) > len(view.jobs):
            self._widths = {n: held for n, held in self._widths.items() if view.jobs.get(n) is held[0]}
        return out

    def _roster(self, view: FleetView, job: JobState) -> _Roster:
        """``job``'s ranks, their numbers and nodes: a rank's node changes only as the job's
        membership does (JobState.members_revision), so they are listed again only then (reading
        them from 100,000 ranks on each judged window cost ~10 ms a list)."""
        held = self._job_nodes.get(job.name)
        if view.revision is None or held is None or held.job is not job or held.revision != job.members_revision:
            columns = job.columns
            # The columns hold exactly the job's ranks (a job the fleet keeps; not one built by hand).
            in_columns = view.revision is not None and len(columns.ranks) == len(job.ranks) and all(
                rank.columns is columns and columns.ranks[rank.slot] is rank for rank in job.ranks.values())
            ranks = list(columns.ranks if in_columns else job.ranks.values())
            nodes = list(map(_NODE, ranks))
            held = _Roster(job, job.members_revision, ranks, list(map(_RANK_ID, ranks)), nodes,
                           list(dict.fromkeys(nodes)), in_columns)
            if view.revision is not None:
                self._job_nodes[job.name] = held
        return held

    def _class_of(self, view: FleetView, node: str, now: float) -> HardwareClass:
        held = self._classes.get(node)
        if held is not None and 0 <= now - held[1] < _CLASS_REFRESH_SECONDS:
            return held[0]
        state = view.nodes.get(node)
        cls = hardware_class(state) if state is not None else UNKNOWN
        self._classes[node] = (cls, now)
        return cls

    def _judge(self, view: FleetView, job: JobState, now: float) -> list[Finding]:
        cfg = self.config
        if len(job.ranks) < cfg.min_ranks:
            return []
        width = self._width(view, job)
        memo = self._memo.get(job.name)
        if memo is None or memo.job is not job or memo.width != width:
            memo = self._memo[job.name] = _JobMemo(job, width)
        if not self._judged_up_to_date(memo, now):
            roster = self._roster(view, job)
            last = self._last_window(view, job, roster, width, now)
            first = last - cfg.persistence_windows - 1
            if memo.last_judged is not None:
                first = max(first, memo.last_judged + 1, last - RANK_WINDOWS_MAX)
            if first <= last:
                rows = self._rows(view, roster, first, last, width, now)
                for index in range(first, last + 1):
                    window = rows.get(index)
                    if window:
                        self._advance(memo, index, self._verdict(memo, window))
                    memo.last_judged = index
        for rank in [r for r, t in memo.removed.items() if now - t > cfg.removed_memory_seconds]:
            del memo.removed[rank]
            memo.episode_since.pop(rank, None)
        return self._findings(view, job, memo, now)

    def _width(self, view: FleetView, job: JobState) -> float:
        """The judged window: the configured one, or the job's longest summary window when longer.
        Read again only after the job's membership or some rank's summary window changed (the
        change markers JobState.members_revision and JobState.columns.window_seconds_changes): reading
        it from 100,000 ranks was most of a pass with nothing to judge (~20 ms at 12,500 nodes)."""
        changes = job.columns.window_seconds_changes
        held = self._widths.get(job.name)
        if (view.revision is not None and held is not None and held[0] is job and held[1] == job.members_revision
                and held[2] == changes):
            return held[3]
        width = max(chain((self.config.window_seconds,), map(_WINDOW_SECONDS, job.ranks.values())))
        if view.revision is not None:
            self._widths[job.name] = (job, job.members_revision, changes, width)
        return width

    def _judged_up_to_date(self, memo: _JobMemo, now: float) -> bool:
        """Whether the newest window that has ended is judged already: then no window can be
        judged (straggler.py's last_complete_window is never past it) and no rank is read (every
        other pass at 2.5 s reports and 5 s windows)."""
        return memo.last_judged is not None and memo.last_judged >= math.floor(now / memo.width + 1e-9)

    def _last_window(self, view: FleetView, job: JobState, roster: _Roster, width: float, now: float) -> int:
        """The newest window that can be judged (straggler.py's last_complete_window, the node
        straggler's schedule: both detectors judge the same windows at the same time), read in C
        over the job's columns (JobState.columns: two mins over lists where every rank is live and
        has a window), else over its ranks."""
        current = math.floor(now / width + 1e-9)
        ranks = roster.ranks
        columns = job.columns if roster.columns else None
        if min(columns.seen if columns is not None else map(RANK_LAST_SEEN, ranks)) < now - 2 * width:
            # A rank may have stopped reporting (its liveness is the nodes' interval's): the walk.
            return last_complete_window(ranks, self._interval(view, job), width, now)
        # Every rank is live whatever the interval: last_complete_window's reading of them all,
        # without the walk, and the nodes' interval read only where the deadline may decide.
        newest = min(columns.ends) if columns is not None else -math.inf  # -inf: no window, or not a number
        if newest == -math.inf:
            windows = list(map(_WINDOWS, ranks))
            if not all(windows):
                return math.floor((now - self._interval(view, job) - width) / width + 1e-9)
            newest = min(map(_END, map(_NEWEST, windows)))
        reached = min(current, math.ceil(newest / width - 1e-9))
        # The deadline falls as the interval grows: at interval 0 it is the highest it can be.
        if reached >= math.floor((now - width) / width + 1e-9):
            return reached
        return max(math.floor((now - self._interval(view, job) - width) / width + 1e-9), reached)

    def _interval(self, view: FleetView, job: JobState) -> float:
        """The longest reporting interval of the nodes ``job``'s ranks report from (straggler.py's
        schedule: a window waits for one more report from each)."""
        return max([0.0] + [view.nodes[n].interval_seconds for n in self._roster(view, job).distinct_nodes
                            if n in view.nodes])

    def _newest_columns(self, view: FleetView, roster: _Roster, index: int, width: float,
                        now: float) -> dict[HardwareClass, _Window] | None:
        """Window ``index`` as _rows gathers it where every rank's newest entry lies in it with a
        collective wait (the usual pass at the usual cadence): the columns cut in C from the
        newest entries, grouped by the hardware class of each node (one class a job: the columns
        whole). None where a rank's newest entry is elsewhere or lacks the wait (_rows walks)."""
        ranks = roster.ranks
        ceil = math.ceil
        computes: MutableSequence[float]
        comms_of: MutableSequence[float]
        if roster.columns:
            # The job's columns, slot by slot as the roster lists its ranks (read only here).
            columns = roster.job.columns
            ends = columns.ends
            least = min(ends)  # -inf: a rank with no window, or an end that is not a number
            if (1 in columns.no_comm or least == -math.inf or ceil(least / width - 1e-9) != index
                    or ceil(max(ends) / width - 1e-9) != index):
                return None
            computes, comms_of, steps = columns.computes, columns.comms, columns.steps
        else:
            windows = list(map(_WINDOWS, ranks))
            if not all(windows):
                return None
            newest = list(map(_NEWEST, windows))
            comms = list(map(_COMM, newest))
            # ceil is monotonic: the least and the greatest end in ``index`` put every end in it.
            if (None in comms or ceil(min(map(_END, newest)) / width - 1e-9) != index
                    or ceil(max(map(_END, newest)) / width - 1e-9) != index):
                return None
            # A column a map: zip(*newest) costs 5-7x as much for 100,000 entries (an iterator a row).
            computes, steps = list(map(_COMPUTE, newest)), list(map(_STEPS, newest))
            comms_of = cast("list[float]", comms)  # None is not in it
        nodes = roster.nodes
        # Each node's class as _class_of gives it: read in C where every node's is held and fresh.
        held_or_none = list(map(self._classes.get, roster.distinct_nodes))
        held_classes = cast("list[tuple[HardwareClass, float]]", held_or_none)  # where None is not in it
        if (None not in held_or_none and now - max(map(_HELD_AT, held_classes)) >= 0
                and now - min(map(_HELD_AT, held_classes)) < _CLASS_REFRESH_SECONDS):
            classes = list(map(_HELD_CLASS, held_classes))
        else:
            classes = [self._class_of(view, node, now) for node in roster.distinct_nodes]
        class_of = dict(zip(roster.distinct_nodes, classes, strict=True))
        if len(set(classes)) == 1:
            cls = classes[0]
            # The roster's lists, or the job's columns themselves: read only, within this pass.
            return {cls: _Window(ranks, roster.ids, computes, comms_of, steps)}
        out: dict[HardwareClass, _Window] = {}
        for i, rank in enumerate(ranks):
            window = out.get(class_of[nodes[i]])
            if window is None:
                window = out[class_of[nodes[i]]] = _Window()
            window.ranks.append(rank)
            window.ids.append(rank.rank)
            window.computes.append(computes[i])
            window.comms.append(comms_of[i])
            window.steps.append(steps[i])
        return out

    def _rows(self, view: FleetView, roster: _Roster, first: int, last: int, width: float,
              now: float) -> dict[int, dict[HardwareClass, _Window]]:
        """Each window from ``first`` to ``last``, with every rank's compute and comm p50 in it by
        the hardware class of the rank's node, in one pass over each rank's newest windows. A rank
        without a collective wait (no phase times: its compute is its step time, which a
        synchronous job shares) is not judged."""
        if first == last:
            columns = self._newest_columns(view, roster, first, width, now)
            if columns is not None:
                return {first: columns}
        ranks = roster.ranks
        out: dict[int, dict[HardwareClass, _Window]] = {}
        classes: dict[str, HardwareClass] = {}
        ceil = math.ceil
        single = first == last  # the usual pass: one window to judge, each rank's newest entry
        run_node: str | None = None  # a node's ranks come one after another: its window's columns
        unset = _Window()  # no node's yet: the first rank's node is not None
        add_rank, add_id, add_compute = unset.ranks.append, unset.ids.append, unset.computes.append
        add_comm, add_step = unset.comms.append, unset.steps.append
        for rank in ranks:
            windows = rank.windows
            if single and windows:
                entry = windows[-1]
                comm = entry[2]
                if comm is not None and ceil(entry[0] / width - 1e-9) == first:
                    # What the walk below takes, read without it (~2x cheaper for 100,000 ranks).
                    node = rank.node
                    if node is not run_node:
                        cls = classes.get(node)
                        if cls is None:
                            cls = classes[node] = self._class_of(view, node, now)
                        by_class = out.get(first)
                        if by_class is None:
                            by_class = out[first] = {}
                        window = by_class.get(cls)
                        if window is None:
                            window = by_class[cls] = _Window()
                        run_node = node
                        add_rank, add_id, add_compute = window.ranks.append, window.ids.append, window.computes.append
                        add_comm, add_step = window.comms.append, window.steps.append
                    add_rank(rank)
                    add_id(rank.rank)
                    add_compute(entry[1])
                    add_comm(comm)
                    add_step(entry[3])
                    continue
            seen = None
            for entry in reversed(windows):
                k = ceil(entry[0] / width - 1e-9)
                if k < first:
                    break
                comm = entry[2]
                if comm is None or k == seen or k > last:
                    continue  # the newest entry of a window stands (an agent sends one a window)
                seen = k
                cls = classes.get(rank.node)
                if cls is None:
                    cls = classes[rank.node] = self._class_of(view, rank.node, now)
                by_class = out.get(k)
                if by_class is None:
                    by_class = out[k] = {}
                window = by_class.get(cls)
                if window is None:
                    window = by_class[cls] = _Window()
                window.ranks.append(rank)
                window.ids.append(rank.rank)
                window.computes.append(entry[1])
                window.comms.append(comm)
                window.steps.append(entry[3])
        return out

    def _verdict(self, memo: _JobMemo, by_class: dict[HardwareClass, _Window]) -> _Verdict:
        cfg = self.config
        removed = memo.removed
        flagged: dict[int, _Flag] = {}
        nodes_of: dict[int, str] = {}
        judged: set[int] = set()
        for cls, window in by_class.items():
            ranks, ids, computes_of, comms_of = window.ranks, window.ids, window.computes, window.comms
            base_computes: MutableSequence[float]
            base_comms: MutableSequence[float]
            if removed and not removed.keys().isdisjoint(ids):
                baseline = [i for i, rank_id in enumerate(ids) if rank_id not in removed]
                base_computes, base_comms = [computes_of[i] for i in baseline], [comms_of[i] for i in baseline]
            else:
                base_computes, base_comms = computes_of, comms_of
            n = len(base_computes)
            if n < cfg.min_ranks:
                continue  # too few peers of this class: its ranks are not judged in this window
            if memo.runs:
                judged.update(ids)  # _advance asks only about ranks with a run
            computes = sorted(base_computes)
            med = _sorted_median(computes)
            if med <= 0:
                continue
            mad = _sorted_mad(computes, med)
            spreads = memo.spreads.setdefault(cls, deque(maxlen=SPREAD_MEMORY_WINDOWS))
            spreads.append(mad_sigma(mad, n) / med)
            sigma = max(spreads[-1], median(spreads), cfg.min_spread_ratio) * med
            floor = med + max(cfg.min_excess_ratio * med, cfg.z_threshold * sigma)
            if max(computes_of) < floor:
                continue  # the usual window: no rank is an outlier (nor more than allowed)
            comm_limit = sorted(base_comms)[int(cfg.max_comm_quantile * (n - 1))]
            outliers = [i for i, (compute, comm) in enumerate(zip(computes_of, comms_of, strict=True))
                        if compute >= floor and comm <= comm_limit]
            allowed = max(1, math.floor(cfg.max_outlier_rank_share * n))
            if sum(1 for i in outliers if ids[i] not in removed) > allowed:
                continue  # job-wide: judged, nobody flagged
            for i in outliers:
                compute = computes_of[i]
                excess, z = round((compute - med) / med, 4), round((compute - med) / sigma, 2)
                nodes_of[ids[i]] = ranks[i].node
                flagged[ids[i]] = _Flag(excess, z, {
                    "compute_seconds_p50": round(compute, 6), "group_median_compute_seconds": round(med, 6),
                    "excess_ratio": excess, "z": z, "comm_seconds_p50": round(comms_of[i], 6),
                    "group_comm_seconds_limit": round(comm_limit, 6), "steps": window.steps[i], "group_ranks": n,
                    "hardware_class": describe(cls)})
        if flagged:
            # A node most of whose ranks are slow is the node straggler's: leave it to it.
            slow = Counter(nodes_of.values())
            present_of = Counter(rank.node for window in by_class.values() for rank in window.ranks
                                 if rank.node in slow)
            for rank_id, node in nodes_of.items():
                if slow[node] >= cfg.max_node_rank_share * present_of[node]:
                    del flagged[rank_id]
                else:
                    flagged[rank_id].evidence.update(node_ranks_slow=slow[node], node_ranks=present_of[node])
        return _Verdict(flagged, judged)

    def _advance(self, memo: _JobMemo, index: int, verdict: _Verdict) -> None:
        """Fold one judged window into the runs: a flagged rank's run grows, a judged rank that
        is not flagged ends its run, and a window without the rank's data neither breaks nor
        extends it (until it has sent nothing for _ABSENT_WINDOWS_MAX windows)."""
        for rank in list(memo.runs):
            if rank in verdict.flagged:
                continue
            if rank in verdict.judged or index - memo.runs[rank].last > _ABSENT_WINDOWS_MAX:
                del memo.runs[rank]
        for rank, flag in verdict.flagged.items():
            run = memo.runs.get(rank)
            if run is None:
                memo.runs[rank] = _Run(index, index, 1, flag)
            else:
                run.last, run.windows, run.flag = index, run.windows + 1, flag

    def _findings(self, view: FleetView, job: JobState, memo: _JobMemo, now: float) -> list[Finding]:
        cfg = self.config
        width = memo.width
        out: list[Finding] = []
        for rank_id, run in sorted(memo.runs.items()):
            rank = job.ranks.get(rank_id)
            if run.windows < cfg.persistence_windows or rank is None:
                continue
            memo.removed[rank_id] = now
            since = memo.episode_since.setdefault(rank_id, (run.start - 1) * width)
            node = view.nodes.get(rank.node)
            gpu, source = _gpu_of(rank, node, job)
            causes, found = _telemetry(node, gpu, since, cfg.clock_ratio) if node is not None and gpu is not None \
                else ([], {})
            # A GPU only guessed from the rank's place on its node is named only when its own
            # telemetry shows the cause (never reset on a guess alone).
            named = gpu if source in ("reported", "process") or causes else None
            clears = [c for c in causes if c in _RESET_CLEARS]
            action = Action.RESET_GPU if view.agent_resets and named is not None and clears else cfg.action
            flag = run.flag
            where = f"GPU {gpu}" if gpu is not None else "its GPU"
            out.append(Finding(
                detector=NAME, node=rank.node, job=job.name, gpu=named, action=action, since=since,
                key=f"{job.name}:rank:{rank_id}",
                reason=(f"job {job.name}: rank {rank_id} ({where}) computes {flag.excess_ratio:.1%} slower than "
                        f"the job's {flag.evidence['group_ranks']} ranks of its hardware class (z {flag.z}) with the "
                        f"shortest collective wait, in {run.windows} consecutive {width:g} s windows; "
                        + (f"its telemetry shows {', '.join(causes)}" if causes else "no cause in its telemetry")),
                evidence={"signal": "compute_seconds_p50", "rank": rank_id, "gpu": gpu, "gpu_source": source,
                          **flag.evidence, "causes": causes, **found, "windows": run.windows, "window_seconds": width}))
        return out


def _gpu_of(rank: RankHistory, node: NodeState | None, job: JobState) -> tuple[int | None, str]:
    """The rank's GPU and how it is known: the index its heartbeats carry ("reported"), else the
    GPU whose compute processes list the rank's pid ("process"), else its place among the job's
    ranks on the node, the usual LOCAL_RANK -> cuda:LOCAL_RANK mapping ("local_rank", a guess)."""
    if rank.gpu is not None:
        return rank.gpu, "reported"
    if node is None:
        return None, "unknown"
    pid = rank.last.pid
    if pid is not None:
        for hist in node.gpus.values():
            if any(p.pid == pid for p in hist.last.processes):
                return hist.index, "process"
    local = sorted(r.rank for r in job.ranks.values() if r.node == rank.node).index(rank.rank)
    return (local, "local_rank") if local in node.gpus else (None, "unknown")


def _telemetry(node: NodeState, gpu: int, since: float, clock_ratio: float) -> tuple[list[str], dict[str, object]]:
    """What the GPU's own reports show since the run began: its throttle reasons (those present
    in at least half its samples are causes), its median SM clock against its node's other GPUs'
    median, pending remap or page retirement, NVLink links down, PCIe replays."""
    hist = node.gpus.get(gpu)
    if hist is None:
        return [], {"gpu_reported": False}
    samples = [s for s in hist.samples if s.ts >= since] or list(hist.samples)[-1:]
    causes: list[str] = []
    reasons = {r: sum(1 for s in samples if r in s.clock_event_reasons) for r in _THROTTLE_CAUSES}
    causes += [r for r, count in reasons.items() if count and 2 * count >= len(samples)]
    clocks = [s.sm_clock_hertz for s in samples if s.sm_clock_hertz is not None]
    others = [s.sm_clock_hertz for g in node.gpus.values() if g.index != gpu for s in g.samples
              if s.ts >= since and s.sm_clock_hertz is not None]
    ratio = median(clocks) / median(others) if clocks and others and median(others) > 0 else None
    if ratio is not None and ratio <= clock_ratio:
        causes.append("sm_clock_low")
    last = hist.last
    if last.remap_pending:
        causes.append("remap_pending")
    if last.retired_pages_pending:
        causes.append("retired_pages_pending")
    if last.nvlink_links_down:
        causes.append("nvlink_links_down")
    replays = hist.counters.sum_since("pcie_replay_total", since)
    if replays > 0:
        causes.append("pcie_replays")
    return causes, {"uuid": hist.uuid,
            "clock_event_reasons": {r: c for r, c in reasons.items() if c}, "samples": len(samples),
            "sm_clock_ratio_to_node": None if ratio is None else round(ratio, 3),
            "nvlink_links_down": list(last.nvlink_links_down), "pcie_replays": replays}
