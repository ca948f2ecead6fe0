"""Telemetry straggler detector: the slow node of a job that sends no heartbeats, from its GPUs alone.

It reads, for every job that has no rank summaries (the heartbeat straggler detectors judge those),
the latest utilization of each GPU the agents attribute to the job (``GpuState.job``), groups the
job's nodes by hardware class (peer_class.py), and flags a node whose GPUs' utilization is a robust
outlier below its peers' while those peers busy-wait, in every evaluation over a stated window. It emits
an ``alert`` naming the node (never a drain: see "Corroboration"), and judges no hang, no whole-job
slowdown, no throttled GPU (thermal.py and gpu_peer.py read clocks and throttle reasons).

The physics. In a synchronous data-parallel job every step ends in a collective (all-reduce of the
gradients) that no rank leaves before the slowest has entered it, so the whole job runs at the
pace of its slowest node; what the nodes differ in is how they spend the step. Each waiting rank
has launched the NCCL kernel, which occupies a few SMs (one block per channel) polling flags in
device memory: NVML's ``utilization.gpu``, the share of time at least one kernel runs, stays near
100% while the wait lasts, whereas GPM's SM activity (``NVML_GPM_METRIC_SM_UTIL``,
``DCGM_FI_PROF_SM_ACTIVE``: the share of cycles with a warp resident, averaged over all SMs) falls
to the few SMs the NCCL channels hold, and DRAM activity to nearly nothing: the peers busy-spin.
The slow node's GPUs differ by the slowdown's cause:
- starved from the host (a contended or throttled CPU, a slow data loader or local cache, page
  cache thrash, a noisy neighbour): the GPU sits with no kernel while the host prepares the next
  batch, so both its utilization and its SM activity are the job's lowest, while its peers wait
  in the collective with utilization pinned high. This is what this detector finds.
- slow at compute (a throttled or degraded GPU): its kernels run longer, so its SM activity is the
  job's HIGHEST (the others spend part of each step spinning on a few SMs) and its SM clock or
  throttle reasons show why; the thermal and GPU peer detectors judge those signals, not this one.
Falcon/Greyhound (Wu et al., USENIX ATC '25, arXiv:2410.12588) find fail-slows in a 10,000-GPU
cluster caused by CPU contention, GPU degradation and network congestion, lasting from tens of
seconds to hours; ByteDance's what-if study (Lin et al., OSDI '25, arXiv:2505.05713) finds that
stragglers often come from the host and the job, not failed hardware (CPU contention, GC pauses,
data imbalance): hence an alert for a person, not a removal. Mycroft (Deng et al., SOSP '25,
arXiv:2509.03018) localises from the collective layer's own state, which needs the job's NCCL
instrumented; this detector is the fallback for jobs that carry none.

Signal: utilization.gpu, not GPM's SM activity, for two reasons. The project's rule: SM activity
is telemetry (wire.GPU_TELEMETRY_FIELDS) that compact reports carry at most every 30 s and that no
detector may read (tests/aggregator/detectors/test_telemetry_unjudged.py); utilization is in every
report and already judged (thermal, gpu_peer). And the physics: for a host-starved node it is the
stronger contrast. Take a step of 1 s compute (SM activity ~0.8), a 0.2 s all-reduce and a 1 s host
stall on one node, the NCCL spin holding ~0.2 of the SMs: the waiting peers read utilization 1.0
and SM activity (0.8 + 0.2 x 1.2) / 2.2 = 0.47, the starved node utilization 1.2 / 2.2 = 0.55 and
SM activity (0.8 + 0.2 x 0.2) / 2.2 = 0.38: a 45% gap against a 19% one. Its blind spot: a job
that keeps a kernel resident through the host stall (a persistent kernel, an overlapping comm
stream) reads ~1 everywhere and is not found.

Decision rule (each evaluation, per job and hardware class): at least ``min_nodes`` nodes with
fresh telemetry and the job's full GPU count each (a node with fewer of the job's GPUs is partial
attribution and is not judged); the peers busy (their median utilization at or above
``peers_busy_utilization``: an eval, checkpoint or data phase idles every node and is not judged);
a node whose median utilization (over its GPUs, then over its last ``smoothing_reports`` reports)
is at least ``min_drop_ratio`` below the class median and more than
``z_threshold`` robust sigma below it (MAD x 1.4826, floored at ``min_spread_ratio`` of the
median), with at most ``max_outlier_share`` of the nodes so flagged (else the job is bimodal: a
pipeline's stages, not a straggler). Persistence: flagged in every evaluation for
``persistence_seconds`` spanning at least ``min_samples`` distinct reports; an evaluation that does
not flag it (or does not judge the job) ends the run. Four nodes at least: with three, a median of
two peers is no baseline and one node is a third of the job; with four, the outlier is a quarter at
most and three peers set the median.

Designed false-alert rate. Sampling noise: a node's figure is a median of its 8 GPUs' readings;
per-GPU sampling noise of +-10% (uniform) moves it at most 10%, never the 15% floor: zero alerts
from that noise model. Gaussian noise at the floor's spread (2% of the median): 15% is 7.5 sigma,
p = 3e-14 per smoothed figure; ten independent minutes in a row: p^10, nil. The designed rate is thus governed by
persistent, non-fault differences between nodes of one class (a pipeline stage, a node hosting an
evaluation or logging rank): those are why the action is an alert and not a drain.

Corroboration. The detector ships alert-only: escalating to drain when another detector's finding
on the same node corroborates needs a pass over all detectors' findings (the engine's, after the
detectors), and those detectors (thermal, gpu_peer, xid, pcie_nvlink) already act on such a node
on their own evidence. The alert carries the node's and the class's figures for a person to judge.
RDMA send rates are not judged: in a synchronous collective every node sends the same bytes per
step, so over a report interval their send rates are equal whoever is slow; a node off its RDMA
path (fallback to sockets, a port down) is the network detector's.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import median

from pydantic import Field

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.peer_class import HardwareClass, HardwareClasses, describe
from vigil.aggregator.fleet import FleetView, NodeState
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
        for node in view.nodes.values():
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
