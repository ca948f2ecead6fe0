"""GPU peer detector: the likely straggler of a job that sends no per-rank timing, from its GPUs.

It reads busy GPUs grouped by the job that uses them and by hardware class, and compares each GPU's
median SM clock and enforced power limit with its group's. A GPU clocked or capped well below its peers
gives its node one finding per job (alert by default, drain by policy), and a job that sends step
counts but no phase times is named once; it does not judge absolute thermal limits (thermal) or ranks'
timings (straggler). Grouping, thresholds, the designed rate and what it carries between passes:
docs/detectors.md, "gpu_peer".
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from statistics import median

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.peer_class import UNKNOWN, HardwareClass, HardwareClasses, describe
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.fleet import FleetView, GpuHistory, GpuSample, NodeState
from vigil.aggregator.fleet.history import ClockWatch
from vigil.contract.validation import StrictModel

NAME = "gpu_peer"
# A rank last reported this many of its node's intervals ago no longer places its GPU in its job
# (the hang detector's rank_gone_intervals).
_RANK_FRESH_INTERVALS = 4.0


class GpuPeerConfig(StrictModel):
    enabled: bool = True
    # Compared over one minute, as the thermal detector's persistence: a transient brake or a
    # clock dip between kernels clears within seconds.
    persistence_seconds: float = Field(default=60.0, gt=0)
    min_reports: int = Field(default=4, ge=2)
    # Only busy GPUs are compared: an idle GPU drops its clocks by design.
    min_utilization_ratio: float = Field(default=0.5, ge=0, le=1)
    # 15% below the job's median SM clock: GPUs of one model under the same load sit within about
    # a tenth of each other (the 2 GHz boost clock moves in 15 MHz bins; SwPowerCap holds a real
    # H100 at 1.35-1.58 GHz and a real H200 at 1.38-1.46 GHz under one bf16 load, read to read,
    # tests/fixtures/nvml-real*/); a 15% slower GPU costs a synchronous job 15% of every step.
    # Designed false-positive rate: a healthy GPU's one-minute median clock would need to sit
    # further under the job's median than the whole real spread (11% on the H100) for the whole
    # window: ~0 in practice (that spread laid across a job's GPUs flags nothing,
    # test_fake_vs_real.py; a ratio of 0.93 would page for the H100's); the action is an alert by
    # default, so a miss-set limit costs a page, never a node.
    clock_ratio: float = Field(default=0.85, gt=0, lt=1)
    # An enforced power limit 15% under the job's median: a GPU capped by hand or by a power
    # brake policy (nvidia-smi -pl), where its peers run at the board's default.
    power_limit_ratio: float = Field(default=0.85, gt=0, lt=1)
    # Fewer GPUs than this in a job: no stable median.
    min_gpus: int = Field(default=4, ge=3)
    # Flagged GPUs must be a minority (the median is then set by healthy peers); more is a job-wide
    # difference (mixed GPU models, a site power policy), not a straggler.
    max_outlier_share: float = Field(default=0.34, gt=0, lt=0.5)
    action: Action = Action.ALERT
    # Say once per job that its ranks send no phase times (observe: recorded, delivered to nobody).
    report_untimed_jobs: bool = True
    # Peers by hardware class: a GPU is compared only with the job's GPUs on nodes of the same
    # GPU model and max SM clock (peer_class.hardware_class without the power limit). Models differ
    # in clocks under one load by design (an H100 among H200s is the scheduler's choice); the
    # enforced power limit stays out of the class because this detector judges a lowered limit
    # itself (power_limit_ratio): a capped node would otherwise be a class of its own and never be
    # compared. A class with fewer than min_gpus busy GPUs in a job is not judged. False: the whole
    # job is one class.
    by_hardware_class: bool = True


class _Gpu:
    __slots__ = ("clock", "hist", "node", "power_limit")

    def __init__(self, node: NodeState, hist: GpuHistory, clock: float, power_limit: float | None) -> None:
        self.node = node
        self.hist = hist
        self.clock = clock
        self.power_limit = power_limit


def _sorted_median(values: list[float]) -> float:
    """``statistics.median`` of ``values``, already sorted."""
    n = len(values)
    middle = n // 2
    return values[middle] if n % 2 else (values[middle - 1] + values[middle]) / 2


class _Group:
    """The busy GPUs of one job and one hardware class, as columns: their window clocks, their
    enforced power limits and (node, history); a ``_Gpu`` is made only for a group that may
    hold a straggler (``GpuPeerDetector._judge``)."""

    __slots__ = ("clocks", "limits", "members")

    def __init__(self) -> None:
        self.clocks: list[float] = []
        self.limits: list[float | None] = []
        self.members: list[tuple[NodeState, GpuHistory]] = []


class _NodeGpus:
    """A node's GPUs that may be judged (key, history, job, enforced power limit: healthy, with a
    job) and its hardware class, as its state was when they were read. They hold while what they
    were read from stays: a GPU's health (``NodeState.unhealthy_gpus``), job attribution
    (``FleetView.gpu_jobs_revision``) and power limit (``NodeState.gpu_class_revision``), and
    where a GPU's job came from its node's ranks (``by_ranks``), which of them are fresh and the
    GPUs they name (``NodeState.ranks_revision``). Whether a GPU was in the node's latest report
    is read each pass."""

    __slots__ = ("by_ranks", "class_revision", "cls", "gpus", "jobs_revision", "node", "unhealthy")

    def __init__(self, node: NodeState, jobs_revision: int, cls: HardwareClass,
                 gpus: list[tuple[tuple[str, int], GpuHistory, str, float | None]],
                 by_ranks: int | None) -> None:
        self.node = node
        self.jobs_revision = jobs_revision
        self.class_revision = node.gpu_class_revision
        self.unhealthy = frozenset(node.unhealthy_gpus)
        self.cls = cls
        self.gpus = gpus
        self.by_ranks = by_ranks

    def holds(self, node: NodeState, jobs_revision: int) -> bool:
        return (self.node is node and self.jobs_revision == jobs_revision
                and self.class_revision == node.gpu_class_revision and self.unhealthy == node.unhealthy_gpus
                and (self.by_ranks is None or self.by_ranks == node.ranks_revision))


class _ClockWindow:
    """One GPU's samples inside the persistence window, carried from pass to pass: a pass takes
    in the samples that arrived since the last one and lets go of those that left the window,
    instead of re-reading every sample of every busy GPU of the fleet (that was over half of a
    judging pass). Valid while the GPU's history is the same object and its timestamps and the
    passes' window starts do not go backwards; otherwise it is rebuilt."""

    __slots__ = ("bad", "clocks", "hist", "last", "samples", "start")

    def __init__(self, hist: GpuHistory) -> None:
        self.hist = hist
        self.samples: deque[GpuSample] = deque()  # the window's, oldest first
        self.clocks: list[float] = []  # their SM clocks, sorted
        self.bad = 0  # those without a clock or a utilization, or idle
        self.last: GpuSample | None = None  # the newest sample taken in (in the window or not)
        self.start = -math.inf

    def advance(self, hist: GpuHistory, start: float, min_utilization: float) -> bool:
        """The window from ``start`` on, with the samples the history holds now; False when
        that cannot be done from what was taken in before (rebuild it)."""
        if hist is not self.hist or start < self.start:
            return False
        ring = hist.samples
        last = self.last
        if ring:
            newest = ring[-1]
            if newest is not last:
                if last is not None and len(ring) > 1 and ring[-2] is last and newest.ts >= last.ts:
                    self._take(newest, min_utilization)  # the usual pass: one report since the last
                    self.last = newest
                elif not self._take_fresh(ring, min_utilization):
                    return False
        elif last is not None:
            return False  # the ring no longer holds the last one taken in
        self.start = start
        samples = self.samples
        # What left: older than the window, or no longer in the ring (the window is its newest part).
        kept = len(ring)
        while samples and (samples[0].ts < start or len(samples) > kept):
            gone = samples.popleft()  # this runs for every busy GPU each pass: no call
            clock, utilization = gone.sm_clock_hertz, gone.utilization_gpu_ratio
            if clock is not None:
                del self.clocks[bisect_left(self.clocks, clock)]
            if clock is None or utilization is None or utilization < min_utilization:
                self.bad -= 1
        return True

    def _take_fresh(self, ring: deque[GpuSample], min_utilization: float) -> bool:
        """Take in every sample of ``ring`` after the last one taken in; False when that cannot be
        done (the ring no longer holds it, or timestamps go backwards)."""
        fresh: list[GpuSample] = []  # newest first
        if self.last is None:
            fresh.extend(reversed(ring))
        else:
            for sample in reversed(ring):
                if sample is self.last:
                    break
                fresh.append(sample)
            else:
                return False  # the ring no longer holds the last one taken in: more arrived than it keeps
        previous = self.last.ts if self.last is not None else -math.inf
        for sample in reversed(fresh):  # oldest first
            if sample.ts < previous:
                return False  # the aggregator's clock went backwards between two reports
            previous = sample.ts
            self._take(sample, min_utilization)  # those older than the window leave below
        if fresh:
            self.last = fresh[0]
        return True

    def _take(self, sample: GpuSample, min_utilization: float) -> None:
        self.samples.append(sample)
        clock, utilization = sample.sm_clock_hertz, sample.utilization_gpu_ratio
        if clock is not None:
            insort(self.clocks, clock)
        if clock is None or utilization is None or utilization < min_utilization:
            self.bad += 1

    def median_clock(self, start: float, min_reports: int, slack: float) -> float | None:
        """As ``GpuPeerDetector.window_clock`` reads the same window."""
        count = len(self.samples)
        if self.bad or count < min_reports or self.samples[0].ts - start > slack:
            return None
        clocks, middle = self.clocks, count // 2
        return clocks[middle] if count % 2 else (clocks[middle - 1] + clocks[middle]) / 2


class _PeerGroup:
    """One job's GPUs of one hardware class as the fleet holds them: the node entries that have
    GPUs of the job (those judged are a subset: in the node's latest report, with a covered window),
    and the band of clocks watched on all of them (``ClockWatch``, None: none yet). While no busy
    sample in the persistence window left the band, and the band's low end is above ``clock_ratio``
    times its high end, every judged window clock (a median of samples in the band) and the group's
    median of them lie in the band, so no GPU is at or under ``clock_ratio`` of the median; with
    the entries' power limits within ``power_limit_ratio`` of each other (``limits_quiet``) none is
    flagged at all, and the group is passed over in O(1). The band is sqrt(clock_ratio) below and
    above the median (92-108% at 0.85): GPUs of one model under one load sit within it, and a GPU
    leaving it (a dip, a wander, a straggler) has its group judged GPU by GPU again until the
    sample that left has left the window. Before, every busy GPU's window was carried each pass:
    579 ms a pass at 12,500 nodes (100,000 GPUs), now 21 ms (bench fleet, medians of 6 passes
    side by side), the per-GPU cost moved to a few comparisons in ``GpuHistory.observe``."""

    __slots__ = ("changed", "limits_quiet", "nodes", "watch")

    def __init__(self) -> None:
        self.nodes: dict[str, _NodeGpus] = {}
        self.watch: ClockWatch | None = None
        self.limits_quiet = False
        self.changed = True  # its entries changed since ``limits_quiet`` was read


class GpuPeerDetector:
    name = NAME

    def __init__(self, config: GpuPeerConfig) -> None:
        self.config = config
        # Each busy GPU's window as the last pass left it (GPUs not judged in a pass are let go).
        self._windows: dict[tuple[str, int], _ClockWindow] = {}
        # Each node's judged GPUs as its state was at the last pass (nodes gone are let go), and
        # its class, read again only when what names it changed.
        self._nodes: dict[str, _NodeGpus] = {}
        self._classes = HardwareClasses(power_limit=False)
        # The nodes whose entry is read again (docs/detectors.md, "change markers"): those whose
        # GPUs' health, class or job attribution changed since the last pass, or which of whose
        # ranks are fresh or the GPUs they name (the journals). Until the fifth round a node whose
        # GPUs' jobs came from its ranks was read again every pass: 1,000 a pass in the simulator.
        self._walk = ChangedNodes("gpu_health", "gpu_class", "gpu_jobs", "rank_gpus")
        # (job, hardware class) -> its GPUs and their watched band, kept while the views carry
        # change markers (a view built by hand holds histories the fleet did not observe).
        self._groups: dict[tuple[str, HardwareClass], _PeerGroup] = {}
        # A band's ends: the low one above clock_ratio times the high one, with room for rounding.
        ratio = config.clock_ratio
        self._band = (math.sqrt(ratio) * (1 + 1e-9), (1 - 1e-9) / math.sqrt(ratio))

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        self._classes.start(view)
        marked = view.revision is not None  # a view built by hand: no state is carried over
        if marked:
            judged = self._refresh(view, now)
        else:
            self._forget_groups()
            self._nodes = {}
            self._walk.reset()
            judged = self._fresh_groups(view)
        windows: dict[tuple[str, int], _ClockWindow] = {}
        out: list[Finding] = []
        for (job, cls), group in sorted(judged, key=lambda kv: (kv[0][0], describe(kv[0][1]))):
            out.extend(self._judge_group(job, cls, group, now, windows, marked))
        self._windows = windows
        if self.config.report_untimed_jobs:
            out.extend(self._untimed(view))
        return out

    def _refresh(self, view: FleetView, now: float) -> list[tuple[tuple[str, HardwareClass], _PeerGroup]]:
        """Bring the groups to the nodes' state (a node's entry is read again only when what it
        was read from changed: the nodes the journals name) and return those that may hold a
        straggler: all but the quiet ones."""
        start = now - self.config.persistence_seconds
        held = self._nodes
        jobs_revision = view.gpu_jobs_revision
        walk = self._walk
        nodes = walk.start(view, now)
        # Nodes gone from the view leave their groups.
        gone = [n for n in held if n not in view.nodes] if walk.every else [n for n in walk.gone if n in held]
        for name in gone:
            self._leave(held.pop(name))
        for node in nodes:
            entry = held.get(node.name)
            if entry is not None and entry.holds(node, jobs_revision):
                continue
            fresh = self._node_gpus(node, jobs_revision)
            if entry is not None and entry.node is node and entry.cls == fresh.cls and entry.gpus == fresh.gpus:
                for job in {job for _, _, job, _ in fresh.gpus}:  # the same GPUs: the same groups
                    self._groups[(job, fresh.cls)].nodes[node.name] = fresh
            else:
                if entry is not None:
                    self._leave(entry)
                self._join(fresh)
            held[node.name] = fresh
        cfg = self.config
        judged = []
        for key, group in self._groups.items():
            if group.changed:
                group.changed = False
                limits = [limit for entry in group.nodes.values() for _, _, job, limit in entry.gpus
                          if job == key[0] and limit is not None]
                low = min(limits, default=0.0)
                group.limits_quiet = len(limits) < cfg.min_gpus or (
                    low > 0 and low > cfg.power_limit_ratio * max(limits) * (1 + 1e-12))
            watch = group.watch
            if not (group.limits_quiet and watch is not None and watch.out_ts < start):
                judged.append((key, group))
        return judged

    def _fresh_groups(self, view: FleetView) -> list[tuple[tuple[str, HardwareClass], _PeerGroup]]:
        """Every node's entry read afresh, in groups of their own (nothing carried, nothing watched)."""
        groups: dict[tuple[str, HardwareClass], _PeerGroup] = {}
        for node in view.nodes.values():
            entry = self._node_gpus(node, view.gpu_jobs_revision)
            for job in {job for _, _, job, _ in entry.gpus}:
                groups.setdefault((job, entry.cls), _PeerGroup()).nodes[node.name] = entry
        return list(groups.items())

    def _join(self, entry: _NodeGpus) -> None:
        """The entry's GPUs join their groups, watched from now on where the group has a band."""
        name = entry.node.name
        for job in {job for _, _, job, _ in entry.gpus}:
            group = self._groups.get((job, entry.cls))
            if group is None:
                group = self._groups[(job, entry.cls)] = _PeerGroup()
            group.nodes[name] = entry
            group.changed = True
            if group.watch is not None:
                for _, hist, gpu_job, _ in entry.gpus:
                    if gpu_job == job:
                        hist.watch_clocks(group.watch)

    def _leave(self, entry: _NodeGpus) -> None:
        name = entry.node.name
        for job in {job for _, _, job, _ in entry.gpus}:
            key = (job, entry.cls)
            group = self._groups.get(key)
            if group is None or group.nodes.get(name) is not entry:
                continue
            del group.nodes[name]
            group.changed = True
            if group.watch is not None:
                for _, hist, gpu_job, _ in entry.gpus:
                    if gpu_job == job:
                        hist.unwatch_clocks(group.watch)
            if not group.nodes:
                del self._groups[key]

    def _forget_groups(self) -> None:
        for entry in self._nodes.values():
            self._leave(entry)
        self._groups.clear()

    def _judge_group(self, job: str, cls: HardwareClass, members: _PeerGroup, now: float,
                     windows: dict[tuple[str, int], _ClockWindow], marked: bool) -> list[Finding]:
        """Each judged GPU's window clock (carried from the last pass where it can be), then the
        group judged; a group of a carried fleet whose clocks fit a band is watched from then on."""
        cfg = self.config
        start = now - cfg.persistence_seconds
        min_utilization, min_reports = cfg.min_utilization_ratio, cfg.min_reports
        slack = cfg.persistence_seconds / cfg.min_reports
        carried = self._windows
        group = _Group()
        for entry in members.nodes.values():
            node = entry.node
            node_seen = node.last_seen
            for key, hist, gpu_job, power_limit in entry.gpus:
                if gpu_job != job or hist.last_seen < node_seen:
                    continue  # another job's, or not in the node's latest report
                window = carried.get(key)
                if window is not None and window.advance(hist, start, min_utilization):
                    windows[key] = window
                    clock = window.median_clock(start, min_reports, slack)
                else:
                    clock = self._carried_window_clock(windows, key, hist, now)
                if clock is None:
                    continue
                group.clocks.append(clock)
                group.limits.append(power_limit)
                group.members.append((node, hist))
        if marked and group.clocks:
            self._watch(job, members, group)
        return self._judge(job, cls, group)

    def _watch(self, job: str, members: _PeerGroup, group: _Group) -> None:
        """A band around the group's median clock watched on all its GPUs, where its judged
        clocks fit it and do not fit the band watched now (a band kept where it still fits: each
        new one reads every sample the group's GPUs hold)."""
        clocks = sorted(group.clocks)
        median_clock = _sorted_median(clocks)
        low, high = median_clock * self._band[0], median_clock * self._band[1]
        if not (median_clock > 0 and low > self.config.clock_ratio * high and low <= clocks[0]
                and clocks[-1] <= high):
            return
        watch = members.watch
        if (watch is not None and watch.out_ts != math.inf and watch.low_hertz <= clocks[0]
                and clocks[-1] <= watch.high_hertz):
            return
        watch = members.watch = ClockWatch(low, high, self.config.min_utilization_ratio)
        for entry in members.nodes.values():
            for _, hist, gpu_job, _ in entry.gpus:
                if gpu_job == job:
                    hist.watch_clocks(watch)

    def _node_gpus(self, node: NodeState, jobs_revision: int) -> _NodeGpus:
        """The node's healthy GPUs that run a job, each with that job, as its state is now."""
        cls = self._classes.of(node) if self.config.by_hardware_class else UNKNOWN
        # Ranks this node's agent still reports (an ended job's ranks linger in the fleet for
        # a while; their GPUs may already run another job).
        fresh = node.last_seen - _RANK_FRESH_INTERVALS * node.interval_seconds
        rank_gpus: dict[int | None, str] | None = None  # read at the first GPU without a job of its own
        gpus = []
        for hist in node.gpus.values():
            if hist.last.health != "ok":
                continue
            job = hist.last.job
            if not job:
                if rank_gpus is None:
                    rank_gpus = {r.gpu: job for (job, _), r in node.ranks.items()
                                 if r.gpu is not None and r.last_seen >= fresh}
                job = rank_gpus.get(hist.index)
            if job is None:
                continue
            gpus.append(((node.name, hist.index), hist, job, hist.last.power_limit_watts))
        by_ranks = None if rank_gpus is None else node.ranks_revision
        return _NodeGpus(node, jobs_revision, cls, gpus, by_ranks)

    def _carried_window_clock(self, windows: dict[tuple[str, int], _ClockWindow], key: tuple[str, int],
                              hist: GpuHistory, now: float) -> float | None:
        """``window_clock(hist, now)`` from the GPU's window as the last pass left it (kept in
        ``windows`` for the next), or from the whole history when it cannot be carried."""
        cfg = self.config
        start = now - cfg.persistence_seconds
        window = self._windows.get(key)
        if window is None or not window.advance(hist, start, cfg.min_utilization_ratio):
            window = _ClockWindow(hist)
            if not window.advance(hist, start, cfg.min_utilization_ratio):
                return self.window_clock(hist, now)  # its timestamps go backwards: read it whole
        windows[key] = window
        return window.median_clock(start, cfg.min_reports, cfg.persistence_seconds / cfg.min_reports)

    def window_clock(self, hist: GpuHistory, now: float) -> float | None:
        """The GPU's median SM clock over the persistence window while busy, or None when the
        window is not covered by enough busy samples, read from the whole history (a window that
        cannot be carried; the reference the carried one is tested against)."""
        cfg = self.config
        start = now - cfg.persistence_seconds
        clocks = []
        oldest = None
        for s in reversed(hist.samples):
            if s.ts < start:
                break
            if s.sm_clock_hertz is None or s.utilization_gpu_ratio is None:
                return None
            if s.utilization_gpu_ratio < cfg.min_utilization_ratio:
                return None  # idle or between phases in this window: nothing to compare
            clocks.append(s.sm_clock_hertz)
            oldest = s.ts
        # Covered: enough reports, the oldest near the window's start (the GPU was busy all along).
        slack = cfg.persistence_seconds / cfg.min_reports
        if len(clocks) < cfg.min_reports or oldest is None or oldest - start > slack:
            return None
        return median(clocks)

    def _judge(self, job: str, cls: HardwareClass, group: _Group) -> list[Finding]:
        """Flag the GPUs of one hardware class of one job against that class's medians."""
        cfg = self.config
        if len(group.clocks) < cfg.min_gpus:
            return []
        clocks = sorted(group.clocks)
        clock_med = _sorted_median(clocks)
        limits = sorted([limit for limit in group.limits if limit is not None])
        limit_med = _sorted_median(limits) if len(limits) >= cfg.min_gpus else None
        # Division by one median keeps order (reverses it for a negative one), so the lowest and
        # the highest clock and limit tell whether any GPU is flagged: most groups have none,
        # judged without a loop over their GPUs.
        if not ((clock_med > 0 and clocks[0] / clock_med <= cfg.clock_ratio)
                or (limit_med and min(limits[0] / limit_med, limits[-1] / limit_med) <= cfg.power_limit_ratio)):
            return []
        gpus = [_Gpu(node, hist, clock, limit)
                for (node, hist), clock, limit in zip(group.members, group.clocks, group.limits, strict=True)]
        flagged: list[tuple[_Gpu, float, float | None]] = []
        for g in gpus:
            clock_ratio = g.clock / clock_med if clock_med > 0 else 1.0
            limit_ratio = (g.power_limit / limit_med) if limit_med and g.power_limit is not None else None
            if clock_ratio <= cfg.clock_ratio or (limit_ratio is not None and limit_ratio <= cfg.power_limit_ratio):
                flagged.append((g, clock_ratio, limit_ratio))
        if not flagged or len(flagged) > cfg.max_outlier_share * len(gpus):
            return []  # nothing, or a job-wide difference: nobody is the straggler
        out: list[Finding] = []
        for node_name in sorted({g.node.name for g, _, _ in flagged}):
            mine = [(g, c, p) for g, c, p in flagged if g.node.name == node_name]
            first = min(g.hist.samples[0].ts for g, _, _ in mine if g.hist.samples)
            worst = min(mine, key=lambda m: m[1])
            g, clock_ratio, limit_ratio = worst
            last = g.hist.last
            signal = "power_limit_watts" if limit_ratio is not None and limit_ratio <= cfg.power_limit_ratio \
                else "sm_clock_hertz"
            indices = sorted(x.hist.index for x, _, _ in mine)
            out.append(Finding(
                detector=NAME, node=node_name, job=job, gpu=indices[0] if len(indices) == 1 else None,
                action=cfg.action, since=first, key=job,
                reason=(f"job {job}: GPUs {indices} run at {clock_ratio:.0%} of the median SM clock of the job's "
                        f"{describe(cls)} GPUs"
                        + (f", power limit {limit_ratio:.0%} of theirs" if limit_ratio is not None else "")
                        + f" ({', '.join(last.clock_event_reasons) or 'no clock-event reason'}): the likely "
                          "straggler of a job without per-rank timing"),
                evidence={"signal": signal, "gpus": indices, "uuid": g.hist.uuid,
                          "sm_clock_hertz": g.clock, "job_median_sm_clock_hertz": clock_med,
                          "sm_clock_ratio": round(clock_ratio, 3),
                          "power_limit_watts": g.power_limit, "job_median_power_limit_watts": limit_med,
                          "power_watts": last.power_watts, "utilization_gpu_ratio": last.utilization_gpu_ratio,
                          "clock_event_reasons": list(last.clock_event_reasons), "job_gpus": len(gpus),
                          "hardware_class": describe(cls),
                          "window_seconds": cfg.persistence_seconds}))
        return out

    @staticmethod
    def _untimed(view: FleetView) -> list[Finding]:
        """One observation per job whose ranks step but send no phase times."""
        out = []
        for job in view.jobs.values():
            ranks = job.ranks  # read in place: a timed job is told by its first ranks (100,000 a pass)
            if len(ranks) < 2 or not any(r.last.steps > 0 for r in ranks.values()):
                continue
            if any(r.last.compute_seconds_p50 is not None for r in ranks.values()):
                continue
            # Said once, on rank 0's node: a job seen partially first must not be said twice.
            first = job.ranks.get(0)
            if first is None:
                continue
            out.append(Finding(
                detector=NAME, node=WHOLE_JOB, job=job.name, action=Action.OBSERVE, since=0.0, key="untimed",
                reason=(f"job {job.name}: no per-rank timing (its ranks send step counts only); in synchronous "
                        "training every rank's step time is the same, so vigil cannot rank its ranks. Send "
                        "compute and comm times (vigil_heartbeat.pytorch.StepTimer); until then stragglers are "
                        "found only from GPU clocks, power limits and throttling"),
                evidence={"signal": "rank_phase_times", "ranks": len(ranks), "timed_ranks": 0}))
        return out
