"""Straggler detector: the node that slows a synchronous training job down.

It reads every rank's per-window step summaries and compares, window by window, each rank's
compute time with its job's peers by median and MAD; in synchronous training the culprit is the
rank with the longest compute and the shortest collective wait. A node flagged in several
consecutive windows is drained. A slowdown shared by the whole job (data loader, checkpoint,
every rank slower) moves the median, not the outliers, and drains nobody.
"""

from __future__ import annotations

import math
from statistics import median

from pydantic import Field

from agent.collectors.collector import StrictModel
from aggregator.decision import Action, Finding
from aggregator.fleet import FleetView, JobState

NAME = "straggler"

# 1.4826 * MAD estimates the standard deviation of normally distributed noise (Rousseeuw & Croux,
# "Alternatives to the median absolute deviation", JASA 1993).
_MAD_TO_SIGMA = 1.4826


class StragglerConfig(StrictModel):
    enabled: bool = True
    # Windows are aligned on the aggregator's clock; each rank contributes its latest summary.
    window_seconds: float = Field(default=5.0, gt=0)
    # Three consecutive windows (15 s): a single slow window is a GC pause or a checkpoint shard.
    persistence_windows: int = Field(default=3, ge=1)
    # Robust z-score of a rank's compute time against its job's ranks in the same window. At 4
    # sigma the chance of a healthy rank crossing in three independent windows is ~3e-14, which
    # keeps a 1,000-node fleet under one false drain per 1,000 node-days (DESIGN.md section 9).
    z_threshold: float = Field(default=4.0, gt=0)
    # ... and a slowdown large enough to matter: a node 5% slow costs a synchronous job 5%.
    min_excess_ratio: float = Field(default=0.05, ge=0)
    # MAD is 0 when ranks are identical; the spread never counts as less than this share of the
    # median, so measurement quantisation cannot make a 0.1% difference look infinite.
    min_spread_ratio: float = Field(default=0.005, gt=0)
    min_ranks: int = Field(default=8, ge=3)
    # More outlier nodes than this share of the job's nodes is a job-wide effect, not a node.
    max_outlier_node_share: float = Field(default=0.05, gt=0, le=1)
    action: Action = Action.DRAIN


class _Window:
    __slots__ = ("comm", "compute", "node")

    def __init__(self, node: str, compute: float, comm: float | None) -> None:
        self.node = node
        self.compute = compute
        self.comm = comm


# Per window index: (node -> evidence of its worst outlier rank, nodes with data in the window).
_Judged = tuple[dict[str, dict[str, float | None]], set[str]]


class _JobMemo:
    """Judgements of a job's complete windows. A complete window's data never changes (reports
    land in the window of their arrival), so each is judged once instead of every evaluation."""

    __slots__ = ("job", "width", "windows")

    def __init__(self, job: JobState, width: float) -> None:
        self.job = job
        self.width = width
        self.windows: dict[int, _Judged] = {}


class StragglerDetector:
    name = NAME

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._memo: dict[str, _JobMemo] = {}

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        for job in view.jobs.values():
            out.extend(self._judge(view, job, now))
        for name in [n for n, m in self._memo.items() if view.jobs.get(n) is not m.job]:
            del self._memo[name]
        return out

    def _judge(self, view: FleetView, job: JobState, now: float) -> list[Finding]:
        cfg = self.config
        if len(job.ranks) < cfg.min_ranks:
            return []
        nodes = {r.node: view.nodes[r.node] for r in job.ranks.values() if r.node in view.nodes}
        # At least one report per rank per window: the job's slowest reporting interval.
        width = max([cfg.window_seconds] + [n.interval_seconds for n in nodes.values()])
        # The window holding `now` is still filling; judge the complete ones before it. One
        # window more than the persistence is read so that one late report does not reset a run.
        spans = cfg.persistence_windows + 1
        last = math.floor(now / width) - 1
        first = last - spans + 1
        memo = self._memo.get(job.name)
        if memo is None or memo.job is not job or memo.width != width:
            memo = self._memo[job.name] = _JobMemo(job, width)
        for index in [i for i in memo.windows if i < first or i > last]:
            del memo.windows[index]
        allowed = max(1, math.floor(cfg.max_outlier_node_share * len(nodes)))
        judged: list[_Judged] = []
        for index in range(first, last + 1):
            done = memo.windows.get(index)
            if done is None:
                slot = self._window(job, index * width, (index + 1) * width)
                flagged = self._outliers(slot)
                if len(flagged) > allowed:
                    flagged = {}  # a job-wide effect: nobody is the culprit
                done = memo.windows[index] = (flagged, {w.node for w in slot.values()})
            judged.append(done)
        persistent = []
        for node in set().union(*(flagged for flagged, _ in judged)):
            # The run of flagged windows ending now; a window without the node's data (a late
            # report) neither breaks nor extends it.
            run = 0
            for flagged, present in reversed(judged):
                if node in flagged:
                    run += 1
                elif node in present:
                    break
            if run >= cfg.persistence_windows:
                persistent.append(node)
        t0 = first * width
        out = []
        for node in sorted(persistent):
            ev = next(f[node] for f, _ in reversed(judged) if node in f)
            out.append(Finding(
                detector=NAME, node=node, job=job.name, action=cfg.action, since=t0, key=job.name,
                reason=(f"job {job.name}: compute time {ev['excess_ratio'] or 0.0:.1%} above the job median for "
                        f"{cfg.persistence_windows}+ consecutive {width:g} s windows, with the shortest "
                        f"collective wait"),
                evidence={"signal": "compute_seconds_p50", **ev, "windows": cfg.persistence_windows}))
        return out

    @staticmethod
    def _window(job: JobState, start: float, end: float) -> dict[int, _Window]:
        """Each rank's latest summary that arrived in [start, end)."""
        slot: dict[int, _Window] = {}
        for rank in job.ranks.values():
            for ts, compute, comm in reversed(rank.windows):
                if ts < start:
                    break
                if ts < end:
                    slot[rank.rank] = _Window(rank.node, compute, comm)
                    break
        return slot

    def _outliers(self, slot: dict[int, _Window]) -> dict[str, dict[str, float | None]]:
        """Nodes with at least one outlier rank in this window, with the worst rank's evidence."""
        cfg = self.config
        if len(slot) < cfg.min_ranks:
            return {}
        computes = [w.compute for w in slot.values()]
        med = median(computes)
        if med <= 0:
            return {}
        mad = median(abs(c - med) for c in computes)
        sigma = max(_MAD_TO_SIGMA * mad, cfg.min_spread_ratio * med)
        comms = [w.comm for w in slot.values() if w.comm is not None]
        comm_med = median(comms) if len(comms) >= cfg.min_ranks else None
        out: dict[str, dict[str, float | None]] = {}
        for rank, w in slot.items():
            excess = w.compute - med
            if excess < cfg.min_excess_ratio * med or excess < cfg.z_threshold * sigma:
                continue
            # The straggler waits least in the collective: everyone else waits for it.
            if comm_med is not None and (w.comm is None or w.comm > comm_med):
                continue
            z = excess / sigma
            prev = out.get(w.node)
            if prev is None or z > (prev["z"] or 0.0):
                out[w.node] = {
                    "rank": rank, "compute_seconds_p50": w.compute, "job_median_compute_seconds": med,
                    "excess_ratio": round(excess / med, 4), "z": round(z, 2),
                    "comm_seconds_p50": w.comm,
                    "job_median_comm_seconds": comm_med,
                }
        return out
