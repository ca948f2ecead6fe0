"""Thermal detector: GPUs held slow by heat or a power brake while they have work, and hot HBM.

It reads each GPU's recent utilization, SM clock against its maximum, clock-event reasons and HBM
temperature against its limit. A busy GPU clocked down for a thermal or power-brake reason throughout
its persistence is drained and HBM near its limit alerts, while a job whose nodes are throttled at once
is one job alert with no drain; power capping alone is normal under load and ignored, and racks or
switches shared by throttled nodes are the topology pass's. Thresholds, horizons and the designed
false-drain rate: docs/detectors.md, "thermal".
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding, JobAction
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.detectors.topology import ONSET
from vigil.aggregator.fleet import (
    HBM_DEFAULT_LIMIT_CELSIUS,
    HBM_WATCH_BELOW_LIMIT_CELSIUS,
    WATCHED_CLOCK_EVENTS,
    FleetView,
    GpuHistory,
    GpuSample,
    NodeState,
)
from vigil.contract.validation import StrictModel

NAME = "thermal"


class ThermalConfig(StrictModel):
    enabled: bool = True
    # NVML clock-event reasons that mean the hardware is protecting itself (nvmlClocksEventReasons:
    # HwSlowdown, HwThermalSlowdown, SwThermalSlowdown, HwPowerBrakeSlowdown). SwPowerCap is
    # the normal state of a GPU at full load and is deliberately absent.
    reasons: list[str] = Field(default_factory=lambda: [
        "hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"])
    min_utilization_ratio: float = Field(default=0.5, ge=0, le=1)
    # H100 SXM boosts to 1980 MHz; a thermal slowdown drops it by a third or more.
    max_clock_ratio: float = Field(default=0.75, gt=0, le=1)
    # One minute: transient brakes (a PSU hiccup) clear within seconds.
    persistence_seconds: float = Field(default=60.0, gt=0)
    min_reports: int = Field(default=3, ge=1)
    action: Action = Action.DRAIN
    # Onset: a throttle run this long (and this many reports) that has not met the persistence yet
    # is reported as an `observe` that only the topology pass reads (never acted on), so a rack's
    # cooling or power failure is seen while its nodes turn bad, before any of them is removed.
    # 5 s and 3 reports (7.5 s at the agent's 2.5 s cadence): a power-brake transient lasts a
    # second or two. An onset alone removes nobody; the topology pass needs 3 erring nodes under
    # one component (docs/detectors.md, topology).
    onset_seconds: float = Field(default=5.0, ge=0)
    onset_reports: int = Field(default=3, ge=1)
    # nvidia-smi -q "Memory Max Operating Temp" is 95 C on H100 SXM; used when NVML omits it.
    memory_max_celsius_default: float = 95.0
    memory_margin_celsius: float = Field(default=3.0, ge=0)
    memory_action: Action = Action.ALERT
    # More than this share of a job's nodes throttled together is the job's or the facility's,
    # not each node's (jobs of at least min_job_nodes nodes; smaller ones are judged per GPU).
    max_job_node_share: float = Field(default=0.25, gt=0, le=1)
    min_job_nodes: int = Field(default=4, ge=2)
    job_action: JobAction = Action.ALERT
    # Long horizon: a GPU held down in bursts shorter than the persistence (30 s of every 2 min)
    # never makes 60 s in a row but slows its job as much. Throttled time over this horizon:
    # 10% alerts, 25% (7.5 of 30 min) drains. A healthy GPU's brakes last seconds (< 1%).
    long_horizon_seconds: float = Field(default=1800.0, gt=0)
    long_alert_ratio: float = Field(default=0.10, gt=0, le=1)
    long_drain_ratio: float = Field(default=0.25, gt=0, le=1)


class ThermalDetector:
    name = NAME

    def __init__(self, config: ThermalConfig) -> None:
        self.config = config
        self._reasons = frozenset(config.reasons)
        # (node, gpu) -> throttled samples (ts, seconds covered) over the long horizon; only GPUs
        # throttled within the horizon are held. And the newest sample counted per GPU, by node.
        self._throttled_time: dict[tuple[str, int], deque[tuple[float, float]]] = {}
        self._counted: dict[str, dict[int, float]] = {}  # node -> GPU index -> newest sample counted
        # Passing over a node (docs/detectors.md, "change markers"): where the fleet marks every
        # sample this configuration may act on (NodeState.gpu_watch_revision), a node whose GPUs'
        # newest samples were neither throttled nor hot when it was last walked, with every GPU
        # in its latest report, (the node, how many GPUs it had), is not visited until the
        # gpu_watch journal names it (a watched sample, a GPU left out of a report). What the
        # passes over it would have counted (each GPU's newest sample: the node's state_seen at the
        # last pass) is written when it is next walked, from each node's state_seen as the last
        # pass found it (a copy of the fleet's ReportTimes, by the node's slot, made at C speed).
        self._watched = (self._reasons <= WATCHED_CLOCK_EVENTS
                         and config.memory_margin_celsius <= HBM_WATCH_BELOW_LIMIT_CELSIUS
                         and config.memory_max_celsius_default - config.memory_margin_celsius
                         >= HBM_DEFAULT_LIMIT_CELSIUS - HBM_WATCH_BELOW_LIMIT_CELSIUS)
        self._walk = ChangedNodes("gpu_watch")
        self._clean: dict[str, tuple[NodeState, int]] = {}
        self._seen_then: list[float] = []

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        for node, gpu in self._take_samples(view, now):
            out.extend(self._judge(node, gpu, now))
        out.extend(self._long_horizon(view, out, now))
        throttled = {f.node for f in out if f.key in ("clock_throttle", "clock_throttle:intermittent")
                     and f.action is self.config.action}
        if not throttled:
            return out
        return self._job_relative(view, out, throttled)

    def _take_samples(self, view: FleetView, now: float) -> list[tuple[NodeState, GpuHistory]]:
        """One walk over the GPUs: the throttled samples not counted yet go into the long horizon's
        memory, and the GPUs to judge on the short horizon are returned (those in the node's latest
        report whose newest sample is throttled or hot: a run of either kind ends at the newest
        sample; most GPUs have none). The tests of ``_throttled`` and ``_hbm_hot`` are written out
        here: this runs for every GPU of the fleet each pass, most of them with one new sample."""
        cfg = self.config
        held = self._throttled_time
        seen = self._counted
        reasons = self._reasons
        min_utilization, max_ratio = cfg.min_utilization_ratio, cfg.max_clock_ratio
        hbm_default, hbm_margin = cfg.memory_max_celsius_default, cfg.memory_margin_celsius
        judge: list[tuple[NodeState, GpuHistory]] = []
        marked = view.journals is not None and view.report_times is not None and self._watched
        clean_nodes = self._clean
        if marked:
            walk = self._walk
            nodes = walk.start(view, now)
            every = walk.every
            for name in walk.gone:
                seen.pop(name, None)
                clean_nodes.pop(name, None)
        else:
            self._walk.reset()
            nodes, every = view.nodes.values(), True
        if every:  # nodes gone from the view are let go
            for name in [n for n in seen if n not in view.nodes]:
                del seen[name]
            for name in [n for n in clean_nodes if n not in view.nodes]:
                del clean_nodes[name]
        then = self._seen_then
        for node in nodes:
            name, node_seen = node.name, node.last_seen
            if clean_nodes:
                walked = clean_nodes.pop(name, None)
                if walked is not None:
                    self._settle(name, walked, then[walked[0].slot])
            counted_of = seen.get(name)
            if counted_of is None:
                counted_of = seen[name] = {}
            clean = marked
            for gpu in node.gpus.values():
                samples = gpu.samples
                if not samples:
                    continue
                newest = samples[-1]
                u, c, m = newest.utilization_gpu_ratio, newest.sm_clock_hertz, newest.sm_clock_max_hertz
                throttled = (u is not None and c is not None and m is not None and m != 0 and u >= min_utilization
                             and c / m <= max_ratio and not reasons.isdisjoint(newest.clock_event_reasons))
                if gpu.last_seen >= node_seen or clean:
                    t = newest.memory_temperature_celsius
                    if throttled or (t is not None
                                     and t >= (newest.memory_max_temperature_celsius or hbm_default) - hbm_margin):
                        clean = False
                        if gpu.last_seen >= node_seen:
                            judge.append((node, gpu))
                index = gpu.index
                counted = counted_of.get(index, -math.inf)
                latest = newest.ts
                if latest <= counted:
                    continue
                counted_of[index] = latest
                if len(samples) == 1 or samples[-2].ts <= counted:
                    # The usual pass: one sample since the last, tested above.
                    if throttled:
                        span = min(latest - counted, 4 * node.interval_seconds)
                        held.setdefault((name, index), deque()).append((latest, span))
                    continue
                # the samples since the last evaluation, newest first
                newer = []
                for sample in reversed(samples):
                    if sample.ts <= counted:
                        break
                    newer.append(sample)
                for i, sample in enumerate(newer):
                    if not self._throttled(sample):
                        continue
                    before = newer[i + 1].ts if i + 1 < len(newer) else counted
                    span = min(sample.ts - before, 4 * node.interval_seconds)
                    held.setdefault((name, index), deque()).append((sample.ts, span))
            if clean and node.gpus_reported == len(node.gpus):
                clean_nodes[name] = (node, len(node.gpus))
            elif marked:
                walk.again(node)
        if marked and view.report_times is not None:
            self._seen_then = view.report_times.times[:]
        else:
            clean_nodes.clear()
            self._seen_then = []
        return judge

    def _settle(self, name: str, walked: tuple[NodeState, int], state_seen: float) -> None:
        """What the passes over node ``name`` since it was last walked would have counted: each
        GPU it had then (in its latest report at each of those passes) up to the node's state at
        the last pass, ``state_seen`` (GPUs are never forgotten, so they are the first ones of its
        GPUs in order; a GPU replaced since keeps its index's count, as the walk keeps it). For a
        node walked at the last pass this writes what that walk counted."""
        node, gpus = walked
        counted_of = self._counted.setdefault(name, {})
        for index in islice(node.gpus, gpus):
            counted_of[index] = state_seen

    def _long_horizon(self, view: FleetView, short: list[Finding], now: float) -> list[Finding]:
        """Throttled time per GPU over the long horizon, from the samples counted (``_take_samples``)."""
        cfg = self.config
        held = self._throttled_time
        out: list[Finding] = []
        already = {(f.node, f.gpu) for f in short if f.key == "clock_throttle"}
        horizon = now - cfg.long_horizon_seconds
        for key in list(held):
            ring = held[key]
            while ring and ring[0][0] < horizon:
                ring.popleft()
            if not ring:
                del held[key]
                continue
            ratio = sum(span for _, span in ring) / cfg.long_horizon_seconds
            if key in already or ratio < cfg.long_alert_ratio:
                continue
            drain = ratio >= cfg.long_drain_ratio
            name, index = key
            out.append(Finding(
                detector=NAME, node=name, gpu=index, action=cfg.action if drain else Action.ALERT, since=ring[0][0],
                key="clock_throttle:intermittent",
                reason=(f"GPU {index}: held down by heat or power brakes {ratio:.0%} of the last "
                        f"{cfg.long_horizon_seconds:.0f} s, in bursts shorter than {cfg.persistence_seconds:.0f} s"),
                evidence={"signal": "clock_event_reasons", "throttled_ratio": round(ratio, 3),
                          "horizon_seconds": cfg.long_horizon_seconds, "horizon": "long"}))
        return out

    def _job_relative(self, view: FleetView, found: list[Finding], throttled: set[str]) -> list[Finding]:
        """Throttling on too many of one job's nodes at once is the job's: alert it, drain none."""
        cfg = self.config
        shared: dict[str, str] = {}  # node -> the job it shares the throttling with
        alerts: list[Finding] = []
        for job in view.jobs.values():
            nodes = job.nodes()
            hit = nodes & throttled
            if len(nodes) < cfg.min_job_nodes or len(hit) <= cfg.max_job_node_share * len(nodes):
                continue
            for n in hit:
                shared.setdefault(n, job.name)
            since = min(f.since for f in found if f.node in hit and f.key.startswith("clock_throttle"))
            alerts.append(Finding(
                detector=NAME, node=WHOLE_JOB, job=job.name, action=cfg.job_action, since=since,
                key="clock_throttle:job",
                reason=f"job {job.name}: GPUs held down by heat or power brakes on {len(hit)} of its {len(nodes)} "
                       f"nodes at once: the job's or the facility's, not a node's",
                evidence={"signal": "clock_event_reasons", "nodes": len(nodes), "nodes_throttled": len(hit)}))
        if not shared:
            return found
        out = [f.model_copy(update={"action": Action.OBSERVE, "key": f"{f.key}:shared",
                                    "reason": f"{f.reason}; shared by job {shared[f.node]}"})
               if f.key in ("clock_throttle", "clock_throttle:intermittent") and f.node in shared else f
               for f in found]
        return out + alerts

    def _throttled(self, s: GpuSample) -> bool:
        cfg = self.config
        if s.utilization_gpu_ratio is None or s.sm_clock_hertz is None or not s.sm_clock_max_hertz:
            return False
        return (s.utilization_gpu_ratio >= cfg.min_utilization_ratio
                and s.sm_clock_hertz / s.sm_clock_max_hertz <= cfg.max_clock_ratio
                and not self._reasons.isdisjoint(s.clock_event_reasons))

    def _hbm_hot(self, s: GpuSample) -> bool:
        if s.memory_temperature_celsius is None:
            return False
        limit = s.memory_max_temperature_celsius or self.config.memory_max_celsius_default
        return s.memory_temperature_celsius >= limit - self.config.memory_margin_celsius

    def _run(self, gpu: GpuHistory, test: str) -> tuple[float, int] | None:
        """Start and length of the current run of samples passing ``test``."""
        check = self._throttled if test == "throttle" else self._hbm_hot
        start: float | None = None
        n = 0
        for s in reversed(gpu.samples):
            if not check(s):
                break
            start, n = s.ts, n + 1
        if start is None:
            return None
        return start, n

    def _judge(self, node: NodeState, gpu: GpuHistory, now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        last = gpu.last
        for test in ("throttle", "hbm"):
            run = self._run(gpu, test)
            if run is None:
                continue
            start, n = run
            if n < cfg.min_reports or now - start < cfg.persistence_seconds:
                if test == "throttle" and n >= cfg.onset_reports and now - start >= cfg.onset_seconds:
                    out.append(Finding(
                        detector=NAME, node=node.name, gpu=gpu.index, action=Action.OBSERVE, since=start,
                        key="clock_throttle:onset",
                        reason=f"GPU {gpu.index}: held down by heat or a power brake for {now - start:.0f} s",
                        evidence={"signal": "clock_event_reasons", ONSET: True,
                                  "throttled_seconds": round(now - start, 1)}))
                continue
            if test == "throttle":
                ratio = (last.sm_clock_hertz or 0.0) / (last.sm_clock_max_hertz or 1.0)
                active = sorted(self._reasons.intersection(last.clock_event_reasons))
                out.append(Finding(
                    detector=NAME, node=node.name, gpu=gpu.index, action=cfg.action, since=start,
                    key="clock_throttle",
                    reason=(f"GPU {gpu.index}: SM clock at {ratio:.0%} of max for {now - start:.0f} s while "
                            f"{last.utilization_gpu_ratio:.0%} busy ({', '.join(active)})"),
                    evidence={"signal": "clock_event_reasons", "uuid": gpu.uuid, "reasons": active,
                              "sm_clock_ratio": round(ratio, 3), "utilization_gpu_ratio": last.utilization_gpu_ratio,
                              "temperature_celsius": last.temperature_celsius, "power_watts": last.power_watts}))
            else:
                limit = last.memory_max_temperature_celsius or cfg.memory_max_celsius_default
                out.append(Finding(
                    detector=NAME, node=node.name, gpu=gpu.index, action=cfg.memory_action, since=start,
                    key="hbm_temperature",
                    reason=f"GPU {gpu.index}: HBM at {last.memory_temperature_celsius:.0f} C, limit {limit:.0f} C",
                    evidence={"signal": "memory_temperature_celsius", "uuid": gpu.uuid,
                              "memory_temperature_celsius": last.memory_temperature_celsius,
                              "memory_max_temperature_celsius": limit}))
        return out
