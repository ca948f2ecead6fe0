"""Straggler detector: the node that slows a synchronous training job down.

It reads every rank's summaries of complete, non-overlapping windows (each judged once), reduces each
node to the median of its ranks' own time per step (compute plus data loading) and compares it by
median and MAD with its job's nodes of its hardware class (``peer_class.hardware_class``). A node
flagged in consecutive judged windows, or in many windows of the last half hour, is drained, while a
slowdown of the whole job or class drains nobody and a slower or too small class is only observed; it
never takes one rank's step times as a node's evidence and does not judge hangs. Thresholds,
persistence and the designed false-drain rate: docs/detectors.md, "straggler".
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, compress, repeat
from operator import add, attrgetter, ge, itemgetter, lt, not_, truediv
from statistics import median
from typing import cast

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.peer_class import UNKNOWN, HardwareClass, describe, hardware_class
from vigil.aggregator.fleet import FleetView, JobState, NodeState, RankHistory
from vigil.aggregator.fleet.history import RANK_LAST, RANK_LAST_SEEN
from vigil.contract.validation import StrictModel

NAME = "straggler"

# 1.4826 * MAD estimates the standard deviation of normally distributed noise (Rousseeuw & Croux,
# "Alternatives to the median absolute deviation", JASA 1993).
_MAD_TO_SIGMA = 1.4826
# Small-sample bias of the MAD: multiply 1.4826 * MAD of n values by b_n to estimate sigma
# (Croux & Rousseeuw, "Time-efficient algorithms for two highly robust estimators of scale", 1992,
# table of b_n for n <= 9; n / (n - 0.8) beyond).
_MAD_SMALL_N = {3: 1.495, 4: 1.363, 5: 1.206, 6: 1.200, 7: 1.140, 8: 1.129, 9: 1.107}
# The spread of one window of a few nodes is itself noisy (the MAD of 4 values can be near 0 by
# chance): sigma is never below the median of the class's last this-many window spreads.
SPREAD_MEMORY_WINDOWS = 24
# A window is judged within a few evaluations of its end; after a pause in evaluation, at most
# this many missed windows are caught up (ranks keep fleet.rank_history_reports, 16 by default).
RANK_WINDOWS_MAX = 64
# Windows beyond the persistence run whose judged nodes are kept, so late data can be skipped.
# The run itself spans persistence_windows x (report interval / window) windows: a report
# carries only its latest complete window, so at 10 s reports every other 5 s window has no data.
_PRESENCE_SPARE_WINDOWS = 8
_WINDOWS = attrgetter("windows")
_WINDOW_SECONDS = attrgetter("window_seconds")
_INTERVAL = attrgetter("interval_seconds")
_CLASS_REVISION = attrgetter("gpu_class_revision")
_NEWEST = itemgetter(-1)
# RankHistory.windows's entries: (end, compute p50, comm p50, steps, data p50).
_Entry = tuple[float, float, float | None, int, float | None]
_END, _COMPUTE, _COMM, _STEPS, _DATA = (itemgetter(i) for i in range(5))

class StragglerConfig(StrictModel):
    enabled: bool = True
    # The shortest judged window. The judged window is the agents' summary window
    # (collectors.training.window_seconds, 5 s by default) when that is longer: each agent
    # window is one piece of independent evidence, judged once.
    window_seconds: float = Field(default=5.0, gt=0)
    # Three consecutive judged windows (15 s at 5 s): a single slow window is a GC pause or a
    # checkpoint shard; with the window in progress and one report interval, a drain within 30 s.
    # A window that carries no data of the node (its report late or lost, or an agent reporting
    # less often than the window: at 10 s reports only every other 5 s window arrives) neither
    # breaks nor extends the run; each of the three is still one independent judged window.
    persistence_windows: int = Field(default=3, ge=1)
    # Robust z of a node's median own time (compute + data) against the other nodes of its job
    # and class in the same window. 4.5 sigma: p = 3.4e-6 per node-window (Gaussian), see the
    # module docstring for the fleet-day rate; a 10%-slow node is >= 10 sigma out at the 1-3% step jitter of real jobs.
    z_threshold: float = Field(default=4.5, gt=0)
    # ... and a slowdown large enough to matter: a node 4% slow in compute costs a synchronous
    # job ~3% (compute is ~75% of a step), 30 GPU-hours a day per 1,000 GPUs. Below 5% so that a
    # 5%-slow node (the budget's smallest) is not a coin toss around the floor in every window.
    min_excess_ratio: float = Field(default=0.04, ge=0)
    # MAD is 0 when nodes are identical; the spread never counts as less than this share of the
    # median, so measurement quantisation cannot make a 0.1% difference look infinite.
    min_spread_ratio: float = Field(default=0.005, gt=0)
    # Fewer nodes than this and "the job's median" is one or two nodes: no peer-relative judgement.
    min_nodes: int = Field(default=4, ge=3)
    # A node's statistic needs summaries from at least this share of its ranks and this many
    # steps in all: most of a node's ranks, never one rank, speak for the node.
    min_node_rank_share: float = Field(default=0.5, gt=0, le=1)
    min_node_steps: int = Field(default=2, ge=1)
    # More outlier nodes than this share of a class's nodes in the job (at least one) is a
    # class-wide effect (a bimodal job, hardware the class does not tell apart), not a node:
    # nobody of that class is flagged in that window.
    max_outlier_node_share: float = Field(default=0.1, gt=0, le=1)
    action: Action = Action.DRAIN
    # Long horizon: flagged windows counted over this much history. 6 of 360 windows (30 s of
    # slowness in 30 min) alerts, 18 (90 s) drains: an intermittent straggler (slow 10-20 s of
    # every few minutes) never makes three windows in a row but costs its job as much.
    # False-positive arithmetic, binomial tail over the N = 360 windows of the horizon with the
    # per-window rate p of z_threshold: P(>= 18 of 360) = 3.9e-69 at p = 3.4e-6 (Gaussian) and
    # 3.5e-33 at p = 3.4e-4 (100x heavier tails); x 17,280 horizon positions a day (an upper
    # bound: they overlap) <= 6e-29 false drains per node-day. The alert, P(>= 6 of 360):
    # 4.5e-21 (Gaussian), 4.0e-9 heavy-tailed, <= 7e-5 alerts per node-day. Both within the
    # short horizon's budget (7e-7 false drains per node-day heavy-tailed).
    long_horizon_seconds: float = Field(default=1800.0, gt=0)
    long_alert_windows: int = Field(default=6, ge=1)
    long_drain_windows: int = Field(default=18, ge=1)
    # A node found to be a persistent straggler (and so drained) leaves its job's baseline for
    # this long: its ranks keep reporting while the job runs, and must not count as "the job".
    # For as long, each later finding on it keeps the start of the episode that got it drained:
    # its next slow spell is the same fault, not a repeat for the gate's ladder to escalate.
    removed_memory_seconds: float = Field(default=3600.0, gt=0)
    # Peers by hardware class: a node is compared only with the nodes of its job of the same GPU
    # model, max SM clock and power limit (peer_class.hardware_class). An H100 node in an H200 job
    # is 6-12% slower by design (the scheduler's choice, not a fault): compared with the H200s it
    # would be drained. A class of fewer than min_nodes nodes in the job is not judged (its own
    # median would be its suspect's) and is recorded once (observe), as is a class slower than
    # the job's largest class by min_excess_ratio in persistence_windows judged windows in a row.
    # False: the whole job is one class (as before issue 38).
    by_hardware_class: bool = True


@dataclass(slots=True)
class _NodeWindow:
    own: float  # median over the node's ranks of compute p50 + data p50: the time it takes itself
    comm: float | None
    ranks: int
    steps: int
    rows: list[_Entry]  # its ranks' entries in the window

    # Read only for a class with a flagged node (its evidence): not worked out for every node.
    @property
    def compute(self) -> float:
        """The median of its ranks' compute p50."""
        return _median([r[1] for r in self.rows])

    @property
    def data(self) -> float | None:
        """The median of its ranks' data p50, None when they report no data phase."""
        datas = [r[4] for r in self.rows if r[4] is not None]
        return _median(datas) if datas else None


Evidence = dict[str, float | int | str | None]


@dataclass(slots=True)
class _Verdict:
    """One judged window: evidence per flagged node, the nodes that were judged in it (flagged or
    not: a run's windows), and each hardware class's median own time and nodes."""

    flagged: dict[str, Evidence]
    judged: set[str]
    # class -> (median own seconds of its baseline nodes, their names) in this window.
    classes: dict[HardwareClass, tuple[float, list[str]]] = field(default_factory=dict)
    reference: HardwareClass | None = None  # the class with the most nodes
    # Why a class's nodes were not flagged when it was not judgeable or was judged class-wide.
    notes: dict[HardwareClass, str] = field(default_factory=dict)
    # Older verdicts keep only their flagged nodes (a 30 min horizon of every node's presence
    # would cost 360 sets of the job's nodes); a run through a pruned window ends there.
    pruned: bool = False


@dataclass(slots=True)
class _Members:
    """A job's ranks by node, as of its membership revision (``StragglerDetector._membership``)."""

    nodes: set[str]
    ranks_of: dict[str, int]  # node -> how many of the job's ranks it holds
    order: list[RankHistory]  # the job's ranks, node by node
    spans: list[tuple[str, int, int]]  # (node, start, stop): its ranks are order[start:stop]
    slices: list[slice]  # slice(start, stop) of each span, in the same order
    names: list[str]  # each span's node, in the same order
    ranks_per_node: int | None  # how many ranks every node holds, None when they differ
    # Each of ``order``'s ranks' slot in the job's columns (JobState.columns), None where that is
    # slot i for rank i (the usual job: its ranks joined node by node); ``columns`` False where
    # the columns do not hold exactly the job's ranks (a job built by hand): they are not read.
    slots: list[int] | None = None
    columns: bool = False


@dataclass(slots=True)
class _ClassGroups:
    """A job's nodes (``_Members.names``) by hardware class, as of the node states and class
    revisions they were read from (``StragglerDetector._class_groups``)."""

    members: _Members
    states: list[NodeState]
    revisions: list[int]
    # class -> the positions of its nodes in ``_Members.names`` (None: all of them, in order).
    groups: dict[HardwareClass, list[int] | None]


@dataclass(slots=True)
class _JobMemo:
    job: JobState
    width: float
    last_judged: int | None = None
    windows: dict[int, _Verdict] = field(default_factory=dict)
    # node -> last time it was judged a persistent straggler (it leaves the baseline).
    removed: dict[str, float] = field(default_factory=dict)
    # node -> when the episode that got it judged a persistent straggler began. A drained node
    # keeps running this job (a drain only stops new work), and an intermittent one is flagged
    # again at its next slow spell: that is the same fault re-read, not a repeat after a failed
    # remediation, so every later finding on it carries this ``since`` (one decision id, and the
    # gate's ladder counts nothing admitted after the fault began). Forgotten with ``removed``.
    episode_since: dict[str, float] = field(default_factory=dict)
    # Each class's recent window spreads, relative to its median (robust sigma / median).
    spreads: dict[HardwareClass, deque[float]] = field(default_factory=dict)
    # class -> (consecutive windows it was slower than the reference class or too small to be
    # judged, the first of them); a class is recorded (observe) once per job.
    class_runs: dict[HardwareClass, tuple[int, int]] = field(default_factory=dict)
    class_said: set[HardwareClass] = field(default_factory=set)


def mad_sigma(mad: float, n: int) -> float:
    """The standard deviation that the MAD ``mad`` of ``n`` values estimates, small-sample bias
    corrected (both straggler statistics use it)."""
    return _MAD_TO_SIGMA * mad * _MAD_SMALL_N.get(n, n / (n - 0.8))


def _median(values: Iterable[float]) -> float:
    """``statistics.median`` of non-empty values, its arithmetic exactly, without its generality
    (it runs for every node of every judged window)."""
    data = sorted(values)
    n = len(data)
    i = n // 2
    return data[i] if n % 2 else (data[i - 1] + data[i]) / 2


def sorted_median(values: list[float]) -> float:
    """The median of non-empty sorted ``values`` (``_median`` without the sort)."""
    n = len(values)
    middle = n // 2
    return values[middle] if n % 2 else (values[middle - 1] + values[middle]) / 2


def sorted_mad(values: list[float], med: float) -> float:
    """The median of ``abs(v - med)`` over sorted ``values``, without building or sorting the
    deviations (100,000 new floats and their sort were ~20 ms of a judged window at 12,500
    nodes): those under ``med`` are ``med - v`` (exactly ``abs(v - med)``: rounding is
    symmetric) rising as ``v`` falls, the others ``v - med`` rising with ``v``; the middle of
    the two rising runs is found by bisection, O(log n)."""
    n = len(values)
    split = bisect_left(values, med)

    def below(i: int) -> float:  # the i-th smallest deviation of those under med
        return med - values[split - 1 - i]

    def above(j: int) -> float:  # the j-th smallest deviation of the others
        return values[split + j] - med

    def kth(k: int) -> float:  # the k-th smallest deviation (from 0)
        lo, hi = max(0, k + 1 - (n - split)), min(k + 1, split)  # how many of the k + 1 least lie below
        while lo < hi:
            i = (lo + hi) // 2
            if above(k - i) > below(i):
                lo = i + 1
            else:
                hi = i
        j = k + 1 - lo
        if lo == 0:
            return above(j - 1)
        return below(lo - 1) if j == 0 else max(below(lo - 1), above(j - 1))

    middle = n // 2
    return kth(middle) if n % 2 else (kth(middle - 1) + kth(middle)) / 2


def last_complete_window(ranks: list[RankHistory], interval: float, width: float, now: float) -> int:
    """The newest window that can be judged: as soon as every live rank has sent a summary of
    it or a later one, and at the latest one window plus one reporting interval after its end
    (an agent summarises at its own phase, then reports; a rank with no step in the window
    sends nothing for it)."""
    deadline = math.floor((now - interval - width) / width + 1e-9)
    current = math.floor(now / width + 1e-9)
    live_after = now - 2 * width - interval
    # A rank that stopped reporting (silent or drained node, ended rank) waits for nobody.
    if ranks and min(map(RANK_LAST_SEEN, ranks)) >= live_after:
        live = list(map(_WINDOWS, ranks))  # the usual job: every rank live (C-level reads)
    else:
        live = [rank.windows for rank in ranks if rank.last_seen >= live_after]
    if not live:
        return max(deadline, current)
    if not all(live):
        return deadline  # a live rank with no window yet
    # The window of the live rank furthest behind: ceil is monotonic, so the window of the
    # earliest end is the least of their windows.
    reached = min(current, math.ceil(min(map(_END, map(_NEWEST, live))) / width - 1e-9))
    return max(deadline, reached)


def _medians(column: Sequence[float], slices: list[slice], n: int) -> list[float]:
    """``_median`` of each slice of ``column`` (``n`` values each), its arithmetic exactly."""
    ordered = list(map(sorted, map(column.__getitem__, slices)))
    i = n // 2
    if n % 2:
        return list(map(itemgetter(i), ordered))
    return list(map(truediv, map(add, map(itemgetter(i - 1), ordered), map(itemgetter(i), ordered)), repeat(2)))


def _window_ends(index: int, width: float) -> tuple[float, float]:
    """(lo, hi): an entry's end ``e`` lies in window ``index`` (``index - 1 < e / width - 1e-9 <=
    index``, the long way's test) exactly when ``lo < e <= hi``. ``e / width - 1e-9`` never
    decreases as ``e`` grows (floating-point division and subtraction round monotonically), so
    each bound is the largest float passing its half of the test, found from its estimate a few
    ulps at a time."""
    def largest_at_or_below(k: float) -> float:
        e = (k + 1e-9) * width
        while e / width - 1e-9 > k:
            e = math.nextafter(e, -math.inf)
        while (up := math.nextafter(e, math.inf)) / width - 1e-9 <= k:
            e = up
        return e
    return largest_at_or_below(float(index - 1)), largest_at_or_below(float(index))


def _pick(windows: deque[_Entry], lo: float, hi: float) -> _Entry | None:
    """A rank's entry in the window ``_window_ends`` bounds, as the long way walks back to it."""
    for entry in reversed(windows):
        end = entry[0]
        if end <= lo:
            return None
        if end <= hi:
            return entry
    return None


class StragglerDetector:
    name = NAME

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._memo: dict[str, _JobMemo] = {}
        # Caches over the fleet ``_fleet`` (docs/detectors.md, "change markers"): each job's nodes as of its membership
        # revision, and each node's hardware class as of its class revision.
        self._fleet: object | None = None
        self._job_nodes: dict[str, tuple[JobState, int, _Members]] = {}
        self._classes: dict[str, tuple[NodeState, int, HardwareClass]] = {}
        # job -> its nodes by class (``_class_groups``), and its judged width as of its membership
        # revision and its ranks' summary window changes (JobState.columns.window_seconds_changes).
        self._groups: dict[str, _ClassGroups] = {}
        self._widths: dict[str, tuple[JobState, int, int, float]] = {}
        # Windows whose ranks' entries were picked in bulk (``_node_stats``); tests check the
        # shortcut they compare with the long way was taken.
        self.bulk_windows = 0
        # Windows judged from the job's columns (``_verdict_columns``), for the same tests.
        self.column_windows = 0

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        if view.revision is None or view.fleet is not self._fleet:
            self._fleet = view.fleet if view.revision is not None else None
            self._job_nodes.clear()
            self._classes.clear()
            self._groups.clear()
            self._widths.clear()
        for job in view.jobs.values():
            out.extend(self._judge(view, job, now))
        if self._fleet is not None:
            for name in [n for n in self._job_nodes if n not in view.jobs]:
                del self._job_nodes[name]
            for held in (self._groups, self._widths):
                for name in [n for n in held if n not in view.jobs]:
                    del held[name]
            if len(self._classes) > len(view.nodes):
                for name in [n for n in self._classes if n not in view.nodes]:
                    del self._classes[name]
        for name in [n for n, m in self._memo.items() if view.jobs.get(n) is not m.job]:
            del self._memo[name]
        return out

    def _judge(self, view: FleetView, job: JobState, now: float) -> list[Finding]:
        cfg = self.config
        if not job.ranks:
            return []
        members = self._membership(job)
        width = self._width(job, members)
        nodes = members.nodes
        # The same values in the same order as [0.0] + [view.nodes[n].interval_seconds for n in
        # nodes if n in view.nodes], read with C-level maps (a node state is never falsy).
        interval = max(chain((0.0,), map(_INTERVAL, filter(None, map(view.nodes.get, nodes)))))
        last = self._last_window(job, members, interval, width, now)
        memo = self._memo.get(job.name)
        if memo is None or memo.job is not job or memo.width != width:
            memo = self._memo[job.name] = _JobMemo(job, width)
        horizon = max(cfg.long_horizon_seconds, cfg.persistence_windows * width)
        keep_from = last - math.ceil(horizon / width)
        # Judge each complete window once, oldest first (at most what the ranks still hold).
        # ranks hold RANK_WINDOWS_MAX windows at most: older ones cannot be judged any more.
        first = last - cfg.persistence_windows - 1
        if memo.last_judged is not None:
            first = max(first, memo.last_judged + 1, last - RANK_WINDOWS_MAX)
        out: list[Finding] = []
        classes: dict[str, HardwareClass] | None = None
        for index in range(first, last + 1):
            verdict = self._verdict_columns(view, job, memo, index, members) if members.columns else None
            if verdict is None:
                if classes is None:
                    classes = self._classes_of(view, nodes)
                verdict = self._verdict(job, memo, index, classes)
            memo.windows[index] = verdict
            memo.last_judged = index
            out.extend(self._class_findings(job, memo, verdict, index))
        for index in [i for i in memo.windows if i < keep_from]:
            del memo.windows[index]
        # A run of persistence_windows judged windows spans this many windows when a report
        # carries one window of every ceil(interval / width).
        stride = max(1, math.ceil(interval / width - 1e-9))
        prune_before = last - cfg.persistence_windows * stride - _PRESENCE_SPARE_WINDOWS
        for index, verdict in memo.windows.items():
            if index < prune_before and not verdict.pruned:
                verdict.judged = set()
                verdict.classes = {}
                verdict.pruned = True
        for node in [n for n, t in memo.removed.items() if now - t > cfg.removed_memory_seconds]:
            del memo.removed[node]
            memo.episode_since.pop(node, None)
        return out + self._findings(job, memo, last, now)


    def _membership(self, job: JobState) -> _Members:
        """The nodes ``job``'s ranks report from, how many of its ranks each holds and its ranks
        node by node, cached while its membership stays (a rank's node changes, and a rank's
        history is replaced, only as its membership does: fleet.JobState.members_revision)."""
        cached = self._job_nodes.get(job.name) if self._fleet is not None else None
        if cached is not None and cached[0] is job and cached[1] == job.members_revision:
            return cached[2]
        by_node: dict[str, list[RankHistory]] = {}
        for rank in job.ranks.values():
            mine = by_node.get(rank.node)
            if mine is None:
                by_node[rank.node] = [rank]
            else:
                mine.append(rank)
        ranks_of = {node: len(mine) for node, mine in by_node.items()}
        order = [rank for mine in by_node.values() for rank in mine]
        spans: list[tuple[str, int, int]] = []
        start = 0
        for node, mine in by_node.items():
            spans.append((node, start, start + len(mine)))
            start += len(mine)
        counts = set(ranks_of.values())
        members = _Members(set(ranks_of), ranks_of, order, spans, [slice(a, b) for _, a, b in spans],
                           [node for node, _, _ in spans], counts.pop() if len(counts) == 1 else None)
        columns = job.columns
        if self._fleet is not None and len(columns.ranks) == len(order) and all(
                rank.columns is columns and columns.ranks[rank.slot] is rank for rank in order):
            slots = [rank.slot for rank in order]
            members.slots = None if slots == list(range(len(slots))) else slots
            members.columns = True
        if self._fleet is not None:
            self._job_nodes[job.name] = (job, job.members_revision, members)
        return members

    def _width(self, job: JobState, members: _Members) -> float:
        """The judged window: the configured one, or the job's longest summary window when longer.
        Read again only after the job's membership or a rank's summary window changed
        (JobState.members_revision, JobState.columns.window_seconds_changes): reading it from
        100,000 ranks cost ~5 ms a pass at 12,500 nodes."""
        changes = job.columns.window_seconds_changes
        held = self._widths.get(job.name) if members.columns else None
        if held is not None and held[0] is job and held[1] == job.members_revision and held[2] == changes:
            return held[3]
        width = max(self.config.window_seconds, max(map(_WINDOW_SECONDS, map(RANK_LAST, job.ranks.values()))))
        if members.columns:
            self._widths[job.name] = (job, job.members_revision, changes, width)
        return width

    def _last_window(self, job: JobState, members: _Members, interval: float, width: float, now: float) -> int:
        """``last_complete_window`` of the job's ranks, read from its columns where every rank is
        live and has a window (a C-level min over two lists, not a read of each rank object)."""
        columns = job.columns
        if members.columns and columns.ranks:
            newest = min(columns.ends)  # -inf: a rank with no window, or an end that is not a number
            if newest != -math.inf and min(columns.seen) >= now - 2 * width - interval:
                deadline = math.floor((now - interval - width) / width + 1e-9)
                current = math.floor(now / width + 1e-9)
                return max(deadline, min(current, math.ceil(newest / width - 1e-9)))
        return last_complete_window(list(job.ranks.values()), interval, width, now)

    def _class_groups(self, view: FleetView, job: JobState, members: _Members) -> dict[HardwareClass, list[int] | None]:
        """The job's nodes (positions in ``members.names``) by hardware class, as ``_classes_of``
        names them; read again only when a node state or its class revision changed (~0.1 us a node
        in C where ``_classes_of`` costs ~0.5 us a node in Python)."""
        states = list(map(view.nodes.get, members.names))
        revisions = list(map(_CLASS_REVISION, states)) if None not in states else None
        held = self._groups.get(job.name)
        if (held is not None and revisions is not None and held.members is members and held.states == states
                and held.revisions == revisions):
            return held.groups
        classes = self._classes_of(view, members.nodes)
        groups: dict[HardwareClass, list[int]] = {}
        for i, node in enumerate(members.names):
            groups.setdefault(classes[node], []).append(i)
        out: dict[HardwareClass, list[int] | None] = {cls: None for cls in groups} if len(groups) == 1 \
            else dict(groups)
        if revisions is not None:
            self._groups[job.name] = _ClassGroups(members, cast(list[NodeState], states), revisions, out)
        return out

    def _verdict_columns(self, view: FleetView, job: JobState, memo: _JobMemo, index: int,
                         members: _Members) -> _Verdict | None:
        """``_verdict`` of window ``index`` read from the job's columns (JobState.columns): where every
        rank's newest window lies in it and every node holds the same number of ranks (the usual
        window), each node's median own time is a sorted slice of one column, and a class with no
        node beyond its floor is judged from those medians alone (C-level sorts, min and max: no
        rank object read). None where the window is not the usual one: ``_verdict`` judges it the
        long way. A class with a node beyond its floor takes the long way's node statistics
        (``_node_stats_bulk``) for its flagging, so what is flagged is the long way's."""
        cfg = self.config
        n = members.ranks_per_node
        if n is None or n < cfg.min_node_steps:
            return None  # each rank's window has a step at least: n ranks make min_node_steps only when n does
        columns = job.columns
        lo, hi = _window_ends(index, memo.width)
        ends = columns.ends
        if not (lo < min(ends) and max(ends) <= hi):
            return None
        slots = members.slots
        owns: Sequence[float] = columns.owns if slots is None else [columns.owns[i] for i in slots]
        medians = _medians(owns, members.slices, n)
        names = members.names
        removed = memo.removed
        verdict = _Verdict({}, set())
        stats: dict[str, _NodeWindow] | None = None
        for cls, positions in self._class_groups(view, job, members).items():
            mine_names = names if positions is None else [names[i] for i in positions]
            mine_owns = medians if positions is None else [medians[i] for i in positions]
            if removed and not removed.keys().isdisjoint(mine_names):
                base_names = [node for node in mine_names if node not in removed]
                base_owns = [own for node, own in zip(mine_names, mine_owns, strict=True) if node not in removed]
            else:
                base_names, base_owns = mine_names, mine_owns
            ordered = sorted(base_owns)
            if base_names:
                verdict.classes[cls] = (sorted_median(ordered), base_names)
            if len(base_names) < cfg.min_nodes:
                verdict.notes[cls] = "too few nodes"
                continue
            med = verdict.classes[cls][0]
            if med <= 0:
                verdict.notes[cls] = "no compute time"
                continue
            verdict.judged.update(mine_names)
            sigma, floor = self._floor(memo, cls, med, sorted_mad(ordered, med), len(ordered))
            if max(mine_owns) - med < floor:
                continue  # the usual class: no node's excess reaches the floor (x - med rises with x)
            if stats is None:
                stats = self._node_stats_bulk(members, index, memo.width)
            mine = {node: stats[node] for node in mine_names}
            self._flag_class(memo, cls, mine, {node: stats[node] for node in base_names}, med, sigma, floor,
                             verdict, len(names))
        if verdict.classes:
            verdict.reference = min(verdict.classes, key=lambda c: (-len(verdict.classes[c][1]), describe(c)))
        self.column_windows += 1
        return verdict

    def _classes_of(self, view: FleetView, nodes: set[str]) -> dict[str, HardwareClass]:
        """Each node's hardware class (UNKNOWN when classes are not compared or the node is not in
        the fleet), cached while the node's class revision stays (NodeState.gpu_class_revision)."""
        if not self.config.by_hardware_class:
            return dict.fromkeys(nodes, UNKNOWN)
        out: dict[str, HardwareClass] = {}
        cache = self._classes if self._fleet is not None else None
        for n in nodes:
            node = view.nodes.get(n)
            if node is None:
                out[n] = UNKNOWN
                continue
            cached = cache.get(n) if cache is not None else None
            if cached is not None and cached[0] is node and cached[1] == node.gpu_class_revision:
                out[n] = cached[2]
                continue
            cls = out[n] = hardware_class(node)
            if cache is not None:
                cache[n] = (node, node.gpu_class_revision, cls)
        return out

    def _verdict(self, job: JobState, memo: _JobMemo, index: int, classes: dict[str, HardwareClass]) -> _Verdict:
        cfg = self.config
        stats = self._node_stats(job, index, memo.width)
        members: dict[HardwareClass, dict[str, _NodeWindow]] = {}
        for node, s in stats.items():
            members.setdefault(classes.get(node, UNKNOWN), {})[node] = s
        verdict = _Verdict({}, set())
        for cls, mine in members.items():
            baseline = {n: s for n, s in mine.items() if n not in memo.removed}
            if baseline:
                verdict.classes[cls] = (median(s.own for s in baseline.values()), list(baseline))
            if len(baseline) < cfg.min_nodes:
                verdict.notes[cls] = "too few nodes"  # not judged: its windows neither break nor extend a run
                continue
            self._judge_class(memo, cls, mine, baseline, verdict, len(stats))
        if verdict.classes:
            verdict.reference = min(verdict.classes, key=lambda c: (-len(verdict.classes[c][1]), describe(c)))
        return verdict

    def _judge_class(self, memo: _JobMemo, cls: HardwareClass, mine: dict[str, _NodeWindow],
                     baseline: dict[str, _NodeWindow], verdict: _Verdict, job_nodes: int) -> None:
        """Flag the nodes of one class of the job in one window against the class's baseline."""
        owns = [s.own for s in baseline.values()]
        med = median(owns)
        if med <= 0:
            verdict.notes[cls] = "no compute time"
            return
        verdict.judged.update(mine)
        sigma, floor = self._floor(memo, cls, med, median(abs(c - med) for c in owns), len(owns))
        self._flag_class(memo, cls, mine, baseline, med, sigma, floor, verdict, job_nodes)

    def _floor(self, memo: _JobMemo, cls: HardwareClass, med: float, mad: float, n: int) -> tuple[float, float]:
        """A class's spread in this window (``mad``: the MAD of its ``n`` baseline nodes' own times
        about their median ``med``) into its memory; (sigma, the excess over ``med`` that flags a node)."""
        cfg = self.config
        spread = mad_sigma(mad, n) / med
        spreads = memo.spreads.setdefault(cls, deque(maxlen=SPREAD_MEMORY_WINDOWS))
        spreads.append(spread)
        sigma = max(spread, median(spreads), cfg.min_spread_ratio) * med
        return sigma, max(cfg.min_excess_ratio * med, cfg.z_threshold * sigma)

    def _flag_class(self, memo: _JobMemo, cls: HardwareClass, mine: dict[str, _NodeWindow],
                    baseline: dict[str, _NodeWindow], med: float, sigma: float, floor: float, verdict: _Verdict,
                    job_nodes: int) -> None:
        """The nodes of ``mine`` whose excess over ``med`` reaches ``floor``, waiting least in the
        collective, into ``verdict`` (nobody when they are too many: class-wide)."""
        cfg = self.config
        comms = [s.comm for s in baseline.values() if s.comm is not None]
        comm_med = median(comms) if len(comms) >= cfg.min_nodes else None
        hits: list[tuple[str, _NodeWindow, float]] = []
        for node, s in mine.items():
            excess = s.own - med
            if excess < floor:
                continue
            # The straggler waits least in the collective: everyone else waits for it.
            if comm_med is not None and (s.comm is None or s.comm > comm_med):
                continue
            hits.append((node, s, excess))
        flagged: dict[str, Evidence] = {}
        if hits:
            node_datas = [s.data for s in baseline.values()]
            datas = [d for d in node_datas if d is not None]
            data_med = median(datas) if datas else None
            compute_med = median(s.compute for s in baseline.values())
        for node, s, excess in hits:
            compute, data = s.compute, s.data
            flagged[node] = {
                "own_seconds_node_median": round(s.own, 6), "class_median_own_seconds": round(med, 6),
                "compute_seconds_node_median": round(compute, 6),
                "class_median_compute_seconds": round(compute_med, 6),
                "data_seconds_node_median": None if data is None else round(data, 6),
                "class_median_data_seconds": None if data_med is None else round(data_med, 6),
                "compute_excess_seconds": round(compute - compute_med, 3),
                "data_excess_seconds": None if data is None or data_med is None else round(data - data_med, 3),
                "excess_ratio": round(excess / med, 4), "z": round(excess / sigma, 2),
                "comm_seconds_node_median": s.comm, "class_median_comm_seconds": comm_med,
                "ranks": s.ranks, "steps": s.steps, "class_nodes": len(baseline), "job_nodes": job_nodes,
                "hardware_class": describe(cls)}
        allowed = max(1, math.floor(cfg.max_outlier_node_share * len(baseline)))
        if sum(1 for n in flagged if n not in memo.removed) > allowed:
            verdict.notes[cls] = f"{len(flagged)} outlier nodes: class-wide"
            return
        verdict.flagged.update(flagged)

    def _node_stats(self, job: JobState, index: int, width: float) -> dict[str, _NodeWindow]:
        """Per node: the median over its ranks of each rank's own time (compute p50 + data p50),
        compute p50, data p50 and collective wait p50 in window ``index``."""
        members = self._membership(job)
        if self._fleet is not None and math.isfinite(width):
            return self._node_stats_bulk(members, index, width)
        per_node: dict[str, list[tuple[float, float, float | None, int, float | None]]] = {}
        ranks_of = members.ranks_of
        # An entry's window is ceil(end / width - 1e-9); for an integer index, ceil(x) == index
        # exactly when index - 1 < x <= index, and ceil(x) < index when x <= index - 1: the same
        # test with no call per entry (one or two entries per rank are read).
        top, below = float(index), float(index - 1)
        for rank in job.ranks.values():
            for entry in reversed(rank.windows):
                # (end, compute p50, comm p50, steps, data p50, ...): indexed, the tuple may grow.
                x = entry[0] / width - 1e-9
                if x <= below:
                    break
                if x <= top:
                    rows = per_node.get(rank.node)
                    if rows is None:
                        per_node[rank.node] = [entry]
                    else:
                        rows.append(entry)
                    break
        out: dict[str, _NodeWindow] = {}
        for node, rows in per_node.items():
            self._node_window(out, node, rows, ranks_of[node])
        return out

    def _node_stats_bulk(self, members: _Members, index: int, width: float) -> dict[str, _NodeWindow]:
        """``_node_stats`` (the long way, rank by rank in Python) with the ranks' entries read in
        bulk: each rank's newest entry, and where that one lies outside the window the entry the
        long way would pick, then each node's rows as a slice of the job's ranks node by node. The
        same rows, so the same medians. At 2,000 nodes (16,000 ranks) a pass that judges a window
        took a median 49 ms the long way and 43 ms so (the detector's CPU, 8 passes each, busy
        2-core machine): what is left is mostly reading each rank's objects at all (the newest
        entries, the per-node sorts), which only work done at ingest would take off the pass."""
        lo, hi = _window_ends(index, width)
        order = members.order
        wins = list(map(_WINDOWS, order))
        if not all(wins):
            picks: list[_Entry | None] = [_pick(w, lo, hi) for w in wins]
        else:
            picks = list(map(_NEWEST, wins))
            ends = list(map(_END, cast(list[_Entry], picks)))
            # Newest entries outside the window (beyond it: the rank's next window came in; at or
            # before its start: none in it) are picked the long way; a NaN end fails both tests.
            for test in (partial(ge, hi), partial(lt, lo)):
                for i in compress(range(len(picks)), map(not_, map(test, ends))):
                    picks[i] = _pick(wins[i], lo, hi)
        self.bulk_windows += 1
        cfg = self.config
        min_steps = cfg.min_node_steps
        out: dict[str, _NodeWindow] = {}
        if None in picks:  # a rank with no entry in the window: each node's rows filtered
            for node, start, stop in members.spans:
                rows = [r for r in picks[start:stop] if r is not None]
                if rows:
                    self._node_window(out, node, rows, stop - start)
            return out
        # Every rank has an entry (the usual window): columns over the job, each node's values a
        # slice of them (C-level reads: at 2,000 nodes of 8 ranks, ~1 us a rank less than rows).
        rows = cast(list[_Entry], picks)
        computes = list(map(_COMPUTE, rows))
        comms = list(map(_COMM, rows))
        datas = list(map(_DATA, rows))
        steps_all = list(map(_STEPS, rows))
        if datas.count(None) == len(datas):
            owns = list(map(add, computes, repeat(0.0)))  # r[1] + (None or 0.0), as the long way
            no_data = True
        else:
            owns = [c + (d or 0.0) for c, d in zip(computes, datas, strict=True)]
            no_data = False
        n = members.ranks_per_node
        if n is not None and comms.count(None) == 0 and (no_data or datas.count(None) == 0):
            # Every node has n rows with a collective wait, all with a data phase or none: each
            # statistic of all nodes in a few C-level passes (~1 us a node instead of ~6).
            slices = members.slices
            steps_of = list(map(sum, map(steps_all.__getitem__, slices)))
            windows = map(_NodeWindow, _medians(owns, slices, n), _medians(cast(list[float], comms), slices, n),
                          repeat(n), steps_of, map(rows.__getitem__, slices))
            return {node: w for node, w, steps in zip(members.names, windows, steps_of, strict=False)
                    if not steps < min_steps}
        for node, start, stop in members.spans:
            # Every rank of the node has a row: min_node_rank_share (at most 1) of them is met.
            steps = sum(steps_all[start:stop])
            if steps < min_steps:
                continue
            comm = comms[start:stop]
            out[node] = _NodeWindow(own=_median(owns[start:stop]),
                                    comm=None if None in comm else _median(cast(list[float], comm)),
                                    ranks=stop - start, steps=steps, rows=rows[start:stop])
        return out

    def _node_window(self, out: dict[str, _NodeWindow], node: str, rows: list[_Entry], ranks: int) -> None:
        """The long way's statistics of one node's ``rows`` (of its ``ranks``) into ``out``."""
        cfg = self.config
        steps = sum([r[3] for r in rows])
        if len(rows) < cfg.min_node_rank_share * ranks or steps < cfg.min_node_steps:
            return
        comms = [r[2] for r in rows if r[2] is not None]
        out[node] = _NodeWindow(own=_median([r[1] + (r[4] or 0.0) for r in rows]),
                                comm=_median(comms) if len(comms) == len(rows) else None, ranks=len(rows),
                                steps=steps, rows=rows)

    def _class_findings(self, job: JobState, memo: _JobMemo, verdict: _Verdict, index: int) -> list[Finding]:
        """A class of the job slower than its largest class, or too small to be judged, in
        persistence_windows judged windows in a row: recorded once (observe), never a removal."""
        cfg = self.config
        ref = verdict.reference
        if ref is None or len(verdict.classes) < 2:
            return []
        ref_med, ref_nodes = verdict.classes[ref]
        out: list[Finding] = []
        for cls, (med, names) in sorted(verdict.classes.items(), key=lambda kv: describe(kv[0])):
            if cls in memo.class_said:
                continue
            small = len(names) < cfg.min_nodes
            ratio = med / ref_med - 1.0 if ref_med > 0 else 0.0
            if cls == ref and not small:
                continue
            if not small and ratio < cfg.min_excess_ratio:
                memo.class_runs.pop(cls, None)
                continue
            count, start = memo.class_runs.get(cls, (0, index))
            memo.class_runs[cls] = (count + 1, start)
            if count + 1 < cfg.persistence_windows:
                continue
            memo.class_said.add(cls)
            memo.class_runs.pop(cls, None)
            judged = ("too few to be compared with each other, so the straggler detector does not judge them"
                      if small else "each is compared with its own class only")
            out.append(Finding(
                detector=NAME, node=WHOLE_JOB, job=job.name, action=Action.OBSERVE,
                since=(start - 1) * memo.width, key=f"{job.name}:class:{describe(cls)}",
                reason=(f"job {job.name}: its {len(names)} nodes of {describe(cls)} take {ratio:+.1%} per step "
                        f"against its {len(ref_nodes)} nodes of {describe(ref)} (median own time, "
                        f"{count + 1} {memo.width:g} s windows): a difference of hardware class, the "
                        f"scheduler's choice, not a fault; {judged}"),
                evidence={"signal": "own_seconds_p50", "hardware_class": describe(cls), "class_nodes": len(names),
                          "nodes": sorted(names)[:16], "class_median_own_seconds": round(med, 6),
                          "reference_class": describe(ref), "reference_nodes": len(ref_nodes),
                          "reference_median_own_seconds": round(ref_med, 6), "class_excess_ratio": round(ratio, 4),
                          "too_few_to_judge": small, "min_nodes": cfg.min_nodes,
                          "windows": count + 1, "window_seconds": memo.width}))
        return out

    def _findings(self, job: JobState, memo: _JobMemo, last: int, now: float) -> list[Finding]:
        cfg = self.config
        width = memo.width
        judged = [(i, memo.windows[i]) for i in sorted(memo.windows) if i <= last]
        if not judged:
            return []
        out: list[Finding] = []
        candidates: set[str] = set()
        for _, v in judged:
            candidates.update(v.flagged)
        for node in sorted(candidates):
            # The run of flagged windows ending with the latest window that judged the node; a
            # window that did not judge it (no data of it, or too few peers with data) neither
            # breaks nor extends the run.
            run = 0
            run_start = None
            for i, v in reversed(judged):
                if node in v.flagged:
                    run += 1
                    run_start = i
                elif node in v.judged or v.pruned:
                    break
            count = sum(1 for _, v in judged if node in v.flagged)
            ev = next(v.flagged[node] for _, v in reversed(judged) if node in v.flagged)
            first_flag = next(i for i, v in judged if node in v.flagged)
            excess = float(ev["excess_ratio"] or 0)
            if run >= cfg.persistence_windows and run_start is not None:
                memo.removed[node] = now
                since = memo.episode_since.setdefault(node, (run_start - 1) * width)
                out.append(self._finding(
                    job, node, cfg.action, since, job.name,
                    f"job {job.name}: the median own time per step (compute + data) of the node's ranks is "
                    f"{excess:.1%} above its class's node median (z {ev['z']}{self._phase_note(ev)}) in {run} "
                    f"judged {width:g} s windows in a row, with the shortest collective wait",
                    {**ev, "windows": run, "window_seconds": width, "horizon": "short"}))
            elif count >= cfg.long_drain_windows or count >= cfg.long_alert_windows:
                drain = count >= cfg.long_drain_windows
                if not drain and node in memo.episode_since:
                    continue  # already judged a persistent straggler of this job: an alert adds nothing
                since = memo.episode_since.get(node, (first_flag - 1) * width)
                if drain:
                    memo.removed[node] = now
                    memo.episode_since[node] = since
                out.append(self._finding(
                    job, node, cfg.action if drain else Action.ALERT, since,
                    f"{job.name}:intermittent",
                    f"job {job.name}: intermittent straggler, the node's ranks were slower than its class's "
                    f"nodes (latest {excess:.1%}, z {ev['z']}{self._phase_note(ev)}) in {count} {width:g} s "
                    f"windows of the last {cfg.long_horizon_seconds:g} s",
                    {**ev, "windows": count, "window_seconds": width, "horizon": "long",
                     "horizon_seconds": cfg.long_horizon_seconds}))
        return out

    @staticmethod
    def _phase_note(ev: Evidence) -> str:
        """Which phase carries the excess: a slow GPU computes longer, a slow data loader waits."""
        data, compute = ev.get("data_excess_seconds"), ev.get("compute_excess_seconds")
        if not isinstance(data, float) or not isinstance(compute, float):
            return ""
        return f"; compute {compute:+.3f} s, data {data:+.3f} s against the class's medians"

    @staticmethod
    def _finding(job: JobState, node: str, action: Action, since: float, key: str, reason: str,
                 evidence: dict[str, object]) -> Finding:
        signal = "compute_seconds_p50" if evidence.get("data_seconds_node_median") is None \
            else "compute_plus_data_seconds_p50"
        return Finding(detector=NAME, node=node, job=job.name, action=action, since=since, key=key,
                       reason=reason, evidence={"signal": signal, **evidence})
