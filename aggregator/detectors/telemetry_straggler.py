"""Telemetry straggler detector: the slow node of a job that sends no heartbeats, from its GPUs alone.

It reads, for every job with no rank summaries (the heartbeat straggler detectors judge those), the
utilization of each GPU the agents attribute to the job (``GpuState.job``), grouped by the job's nodes'
hardware class (``peer_class.py``). A node whose GPUs idle well below its busy-waiting peers' in every
evaluation over a stated window (a node starved from the host) gets an ``alert``, never a drain; it
judges no hang, no whole-job slowdown, no throttled GPU (thermal and gpu_peer read clocks and throttle
reasons) and no RDMA rate. The physics, the choice of signal, thresholds, persistence, the designed
false-alert rate and lookalikes: docs/detectors.md, "telemetry_straggler".
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import median

from pydantic import Field

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.peer_class import HardwareClass, HardwareClasses, describe
from vigil.aggregator.fleet import FleetView, NodeState
from vigil.aggregator.job_telemetry import JobNodes
from vigil.contract.validation import StrictModel

NAME = "telemetry_straggler"
# Median absolute deviation to a normal sigma (1 / Phi^-1(3/4)).
_MAD_TO_SIGMA = 1.4826
# One GPU's latest report: (when it arrived, utilization.gpu).
_Gpu = tuple[float, float]


class TelemetryStragglerConfig(StrictModel):
    """A slow node of a job with no heartbeats, from its GPUs' activity; alert only (docs/detectors.md)."""
    enabled: bool = True
    # Nodes of one hardware class in the job, each with fresh telemetry and the job's full GPU
    # count, for the class to be judged (module docstring: with three, two peers set no median).
    min_nodes: int = Field(default=4, ge=3)
    # The peers must be waiting: their median utilization.gpu at or above this. A rank blocked in
    # an NCCL collective keeps its kernel resident (NVML counts it busy); in an eval, checkpoint or
    # data phase every GPU idles and the job is not judged.
    peers_busy_utilization: float = Field(default=0.8, gt=0, le=1)
    # A node's utilization at least this far below its class median (relative): a node idling 15% of
    # each step costs its synchronous job that much. Above the +-10% sampling noise of one GPU,
    # which the median of a node's GPUs cannot exceed (module docstring).
    min_drop_ratio: float = Field(default=0.15, gt=0, lt=1)
    # ... and more than this many robust sigma (MAD x 1.4826) below it.
    z_threshold: float = Field(default=4.0, gt=0)
    # Spread floor as a share of the median: nodes of one class under one load read within ~2% of
    # each other, and a MAD of 0 (identical figures) must not make every small gap infinite sigma.
    min_spread_ratio: float = Field(default=0.02, gt=0)
    # More outliers than this share of the class's nodes (at least one is allowed): a bimodal job
    # (pipeline stages of unequal work), not one straggler; nobody is flagged.
    max_outlier_share: float = Field(default=0.25, gt=0, le=1)
    # Flagged in every evaluation for this long: ten minutes, longer than a job's phases (an eval
    # pass, a checkpoint write, a data-loader warm-up), so phase noise ends the run before it fires.
    persistence_seconds: float = Field(default=600.0, gt=0)
    # ... over at least this many distinct reports of the node (evaluations repeat a report).
    min_samples: int = Field(default=10, ge=1)
    # A node's figure is the median of its last this many distinct reports (a minute at the 10 s
    # report interval): one report's sampling noise (+-10% per GPU) must not end a run or start one.
    smoothing_reports: int = Field(default=6, ge=1)
    # A GPU state older than this many of its node's report intervals is stale: the node is not
    # judged (missing telemetry is no evidence either way).
    fresh_intervals: float = Field(default=3.0, gt=0)


@dataclass(slots=True)
class _NodeFigures:
    utilization: float  # median over the node's GPUs of the job (then over its recent reports)
    gpus: int
    sample_ts: float  # the newest report among those GPUs


# A flagged node's figures and its evidence.
_Flag = tuple[_NodeFigures, dict[str, object]]


@dataclass(slots=True)
class _Run:
    start: float
    last_sample_ts: float
    samples: int
    evidence: dict[str, object] = field(default_factory=dict)


class TelemetryStragglerDetector:
    name = NAME

    def __init__(self, config: TelemetryStragglerConfig) -> None:
        self.config = config
        # (job, node) -> its current run of flagged evaluations.
        self._runs: dict[tuple[str, str], _Run] = {}
        # (job, node) -> its figures in its latest distinct reports (``_smoothed``).
        self._recent: dict[tuple[str, str], deque[_NodeFigures]] = {}
        self._seen: set[tuple[str, str]] = set()
        self._classes = HardwareClasses()  # each node's, read again when what names it changed
        self._job_nodes = JobNodes()  # which nodes hold each job's GPUs, listed again when that changed

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        flagged: dict[tuple[str, str], _Flag] = {}
        self._seen = set()
        self._classes.start(view)
        for job, nodes in self._uninstrumented_jobs(view, now).items():
            for node, (figures, evidence) in self._judge(view, job, nodes).items():
                flagged[(job, node)] = (figures, evidence)
        runs: dict[tuple[str, str], _Run] = {}
        for key, (figures, evidence) in flagged.items():
            run = self._runs.get(key)
            if run is None:
                run = _Run(now, figures.sample_ts, 1)
            elif figures.sample_ts > run.last_sample_ts:
                run.last_sample_ts, run.samples = figures.sample_ts, run.samples + 1
            run.evidence = evidence
            runs[key] = run
        self._runs = runs  # a run not flagged in this evaluation ended
        if len(self._recent) > len(self._seen):
            self._recent = {k: v for k, v in self._recent.items() if k in self._seen}
        return [self._finding(job, node, run, now) for (job, node), run in sorted(runs.items())
                if now - run.start >= self.config.persistence_seconds and run.samples >= self.config.min_samples]

    def _uninstrumented_jobs(self, view: FleetView, now: float) -> dict[str, dict[str, list[_Gpu]]]:
        """job -> node -> (ts, utilization) of each fresh GPU attributed to the job, for
        the jobs no rank reports heartbeats for."""
        out: dict[str, dict[str, list[_Gpu]]] = {}
        instrumented = {name for name, job in view.jobs.items() if job.ranks}
        nodes: Iterable[NodeState] = view.nodes.values()
        if view.revision is not None:
            # Only the nodes holding a GPU of a job with no ranks, in the fleet's order (the first
            # node's job first, as the walk over every GPU: 100,000 GPUs cost 37 ms a pass, issue 47).
            listing = self._job_nodes.of(view)
            wanted = {name for job, per_node in listing.items() if job not in instrumented for name in per_node}
            if not wanted:
                return out
            nodes = [node for node in nodes if node.name in wanted]
        for node in nodes:
            oldest = now - self.config.fresh_intervals * node.interval_seconds
            for hist in node.gpus.values():
                s = hist.last
                if s.job is None or s.job in instrumented or hist.last_seen < oldest or s.health != "ok" \
                        or s.utilization_gpu_ratio is None:
                    continue  # a GPU without a reading is no evidence: its node then counts fewer GPUs
                out.setdefault(s.job, {}).setdefault(node.name, []).append((hist.last_seen, s.utilization_gpu_ratio))
        return out

    def _smoothed(self, key: tuple[str, str], figures: _NodeFigures) -> _NodeFigures:
        """The node's figures as the median of its last ``smoothing_reports`` distinct reports."""
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque(maxlen=self.config.smoothing_reports)
        if not recent or figures.sample_ts > recent[-1].sample_ts:
            recent.append(figures)
        self._seen.add(key)
        return _NodeFigures(median(f.utilization for f in recent), figures.gpus, figures.sample_ts)

    def _judge(self, view: FleetView, job: str, nodes: dict[str, list[_Gpu]]) -> dict[str, _Flag]:
        cfg = self.config
        classes: dict[HardwareClass, list[str]] = {}
        for name in nodes:
            state: NodeState = view.nodes[name]
            classes.setdefault(self._classes.of(state), []).append(name)
        out: dict[str, _Flag] = {}
        for cls, members in classes.items():
            # Partial attribution: only nodes with the class's usual count of the job's GPUs.
            full = Counter(len(nodes[n]) for n in members).most_common(1)[0][0]
            judged = [n for n in members if len(nodes[n]) == full]
            if len(judged) < cfg.min_nodes:
                continue
            figures = {n: self._smoothed((job, n), _NodeFigures(median(g[1] for g in nodes[n]), len(nodes[n]),
                                                                max(g[0] for g in nodes[n])))
                       for n in judged}
            med = median(f.utilization for f in figures.values())
            if med <= 0:
                continue
            mad = median(abs(f.utilization - med) for f in figures.values())
            sigma = max(mad * _MAD_TO_SIGMA, cfg.min_spread_ratio * med)
            floor = max(cfg.min_drop_ratio * med, cfg.z_threshold * sigma)
            outliers = [n for n, f in figures.items() if med - f.utilization >= floor]
            if not outliers or len(outliers) > max(1, int(cfg.max_outlier_share * len(figures))):
                continue
            peers_util = median(f.utilization for n, f in figures.items() if n not in outliers)
            if peers_util < cfg.peers_busy_utilization:
                continue  # the peers are not waiting in a collective: a phase of the job, not judged
            for n in outliers:
                f = figures[n]
                out[n] = (f, {
                    "signal": NAME, "node_utilization": round(f.utilization, 4),
                    "job_median_utilization": round(med, 4), "drop_ratio": round((med - f.utilization) / med, 4),
                    "z": round((f.utilization - med) / sigma, 2), "peers_median_utilization": round(peers_util, 4),
                    "node_gpus": f.gpus, "judged_nodes": len(figures), "hardware_class": describe(cls)})
        return out

    def _finding(self, job: str, node: str, run: _Run, now: float) -> Finding:
        ev = run.evidence
        return Finding(
            detector=NAME, node=node, job=job, action=Action.ALERT, since=run.start, key=f"{NAME}:{job}",
            reason=(f"job {job} (no heartbeats): {node}'s GPUs show utilization {ev['node_utilization']} against "
                    f"the job's median {ev['job_median_utilization']} ({ev['drop_ratio']:.0%} lower, z {ev['z']}) "
                    f"while its peers wait in the collective ({ev['peers_median_utilization']}), for "
                    f"{now - run.start:.0f} s: a straggler candidate "
                    "(host-starved: CPU, data loading), alert only"),
            evidence={**ev, "window_seconds": round(now - run.start, 1), "samples": run.samples,
                      "persistence_seconds": self.config.persistence_seconds})
