"""The job-recovery planner: when to restart a running job without a node that slows or threatens it.

It reads an evaluation's findings and the view's jobs (ranks, step times, announced checkpoints) and decides
per (job, node), by expected GPU-seconds lost, to restart now, at the next checkpoint or never, emitting a
``restart_job`` finding only at the moment it chose and recording each plan's outcome. It does no I/O, never
reads the clock, removes no node and judges no job-level finding (docs/goodput.md, "The planner").
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from pydantic import Field

from vigil.aggregator.decision import REMOVING_ACTIONS, WHOLE_JOB, Action, Finding
from vigil.aggregator.fleet import FleetView, JobState
from vigil.contract.validation import StrictModel

NAME = "job_recovery"
Option = Literal["now", "checkpoint", "job_end"]
OPTIONS: tuple[Option, ...] = ("now", "checkpoint", "job_end")
# How a plan ended: improved (the job's step time fell by at least half the slowdown the finding
# named), unchanged, job_gone (the job never reported again after the restart), not_restarted (the
# job still ran on the node outcome_wait_seconds after the decision), job_left (never emitted: the
# job ended or left the node before the chosen moment).
OUTCOMES = ("improved", "unchanged", "job_gone", "not_restarted", "job_left")
# Detectors whose evidence names the node's slowdown as ``excess_ratio`` (its share above its peers).
SLOWDOWN_DETECTORS = ("straggler", "gpu_straggler")
# At most this many checkpoints are kept per job (the cadence is their intervals' median).
CHECKPOINTS_KEPT = 8
MAX_PLANS = 10_000


class JobRecoveryConfig(StrictModel):
    # Off by default: vigil's node findings act as before (drain keeps new work off the node).
    enabled: bool = False
    # Requeue to training again: scheduling, container start, NCCL init and checkpoint load. The
    # cluster guide issue 40 follows puts a whole recovery at "5-10 minutes"; 300 s is its low end.
    restart_cost_seconds: float = Field(default=300.0, ge=0)
    # How long a job keeps running when nobody knows its end: the time "never restart" pays the
    # slowdown for. Llama 3 (Meta, 2024): 419 interruptions in 54 days of a 16,384-GPU job, one
    # per 3.1 h; by then the job restarts anyway (for another cause) and leaves the node behind.
    horizon_seconds: float = Field(default=10800.0, gt=0)
    # A job that announced fewer than two checkpoints is assumed to save this often (the cadence
    # many large runs use: 30 min); the e2e test with a ~25 s cadence sets it to 30.
    default_checkpoint_interval_seconds: float = Field(default=1800.0, gt=0)
    # A checkpoint later than this many cadences is not coming soon: "checkpoint" is no option.
    checkpoint_overdue_factor: float = Field(default=2.0, gt=1)
    # A restart without a spare cannot keep the job's size: it waits in the queue for a node. A
    # stated figure (no public one): half an hour. Not charged while the pool is unknown (no
    # spares section): the site's scheduler is then assumed to find a node.
    no_spare_wait_seconds: float = Field(default=1800.0, ge=0)
    # Risk of a crash per hour of a node with failing hardware (a drain, reset, reboot or
    # inspection that is not a straggler's). A stated assumption: no public figure per finding;
    # tune it from vigil_aggregator_job_recovery_outcomes_total.
    failing_hazard_per_hour: float = Field(default=0.1, ge=0)
    # Detectors whose finding means the node no longer takes part (the job is blocked): restart
    # now, with or without a spare.
    dead_detectors: list[str] = Field(default_factory=lambda: ["silence"])
    # The chance a finding is right, by detector (a finding's evidence "confidence" wins). The
    # stragglers' designed false-drain rates are under 1e-6 per node-day; 0.99 leaves room for a
    # lookalike the tests do not know.
    confidence_by_detector: dict[str, float] = Field(default_factory=lambda: {"straggler": 0.99,
                                                                              "gpu_straggler": 0.99})
    default_confidence: float = Field(default=0.9, ge=0, le=1)
    # Restarting is final, waiting can still be revised (the plan is estimated again every
    # evaluation): "now" is chosen only when it loses at least this share less than the best wait.
    now_margin_ratio: float = Field(default=0.1, ge=0, lt=1)
    # A job's rank counts while the job reported within this (several report intervals).
    rank_fresh_seconds: float = Field(default=60.0, gt=0)
    # An emitted restart is proposed again (the gate may have refused it) for at most this long.
    emit_seconds: float = Field(default=600.0, gt=0)
    # A plan whose trigger finding has not been seen for this long is dropped (a transient).
    trigger_memory_seconds: float = Field(default=900.0, gt=0)
    # The outcome is waited for at most this long after the decision.
    outcome_wait_seconds: float = Field(default=1800.0, gt=0)


@dataclass(slots=True)
class _Figures:
    gpus: int
    nodes: int
    slowdown: float
    hazard_per_hour: float
    dead: bool
    confidence: float
    checkpoint_step: int | None
    checkpoint_age_seconds: float | None
    cadence_seconds: float
    spares_available: int | None


@dataclass(slots=True)
class _Plan:
    job: str
    node: str
    since: float
    trigger: dict[str, str]
    last_trigger: float
    figures: _Figures
    estimate: dict[str, float | None] = field(default_factory=dict)
    chosen: Option = "job_end"
    emitted: float | None = None
    finding: Finding | None = None
    before_step_seconds: float | None = None
    restarted: float | None = None


def _step_seconds(job: JobState, fresh_after: float, since: float | None = None) -> float | None:
    """The job's median step time (its fresh ranks' latest p50), from ranks heard after ``since``."""
    values = [r.last.step_seconds_p50 for r in job.ranks.values()
              if r.last_seen >= fresh_after and (since is None or r.last_seen > since)
              and r.last.step_seconds_p50 is not None and r.last.steps > 0]
    return statistics.median(values) if values else None


class JobRecoveryPlanner:
    def __init__(self, config: JobRecoveryConfig) -> None:
        self.config = config
        self._plans: dict[tuple[str, str], _Plan] = {}
        # job -> the distinct checkpoints it announced, (step, end on the aggregator's clock).
        self._checkpoints: dict[str, deque[tuple[int, float]]] = {}
        self.plans_made: Counter[str] = Counter()  # chosen option at emission
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.estimated_saved_gpu_seconds = 0.0
        self.realised_saved_gpu_seconds = 0.0
        self.pending = 0

    # -- reading the view -------------------------------------------------------------------

    def _observe_checkpoints(self, view: FleetView) -> None:
        for name, job in view.jobs.items():
            latest: tuple[int, float] | None = None
            for r in job.ranks.values():
                s = r.last
                if s.checkpoint_step is None or s.checkpoint_ts is None:
                    continue
                node = view.nodes.get(r.node)
                ts = s.checkpoint_ts - (node.clock_offset_seconds if node is not None else 0.0)
                if latest is None or ts > latest[1]:
                    latest = (s.checkpoint_step, ts)
            if latest is None:
                continue
            seen = self._checkpoints.setdefault(name, deque(maxlen=CHECKPOINTS_KEPT))
            # One checkpoint is one step: its ranks' ends differ by their save times and clocks.
            if not seen or latest[0] > seen[-1][0]:
                seen.append(latest)
        for name in [n for n in self._checkpoints if n not in view.jobs]:
            del self._checkpoints[name]

    def _cadence(self, job: str) -> float:
        seen = self._checkpoints.get(job)
        if not seen or len(seen) < 2:
            return self.config.default_checkpoint_interval_seconds
        return statistics.median(b[1] - a[1] for a, b in zip(seen, list(seen)[1:], strict=False))

    def _figures(self, view: FleetView, job: JobState, now: float, triggers: list[Finding],
                 spares: int | None) -> _Figures:
        cfg = self.config
        fresh = now - cfg.rank_fresh_seconds
        ranks = [r for r in job.ranks.values() if r.last_seen >= fresh]
        slowdown = 0.0
        hazard = 0.0
        dead = False
        confidence = 0.0
        for f in triggers:
            given = f.evidence.get("confidence")
            c = float(given) if isinstance(given, int | float) and 0 <= given <= 1 else \
                cfg.confidence_by_detector.get(f.detector, cfg.default_confidence)
            confidence = max(confidence, c)
            if f.detector in cfg.dead_detectors:
                dead = True
            elif f.detector in SLOWDOWN_DETECTORS:
                ratio = f.evidence.get("excess_ratio")
                if isinstance(ratio, int | float) and math.isfinite(ratio) and ratio > 0:
                    slowdown = max(slowdown, min(float(ratio), 1.0))
            else:
                hazard = max(hazard, cfg.failing_hazard_per_hour)
        seen = self._checkpoints.get(job.name)
        step, age = (seen[-1][0], max(0.0, now - seen[-1][1])) if seen else (None, None)
        return _Figures(gpus=max(len(ranks), 1), nodes=len({r.node for r in ranks}), slowdown=slowdown,
                        hazard_per_hour=hazard, dead=dead, confidence=confidence, checkpoint_step=step,
                        checkpoint_age_seconds=age, cadence_seconds=self._cadence(job.name),
                        spares_available=spares)

    # -- the estimate -----------------------------------------------------------------------

    def estimate(self, f: _Figures) -> dict[str, float | None]:
        """Expected GPU-seconds lost per option (None: the option is not open)."""
        cfg = self.config
        cadence = f.cadence_seconds
        age = f.checkpoint_age_seconds if f.checkpoint_age_seconds is not None else cadence / 2
        restart = cfg.restart_cost_seconds
        if f.spares_available == 0:
            restart += cfg.no_spare_wait_seconds
        c = f.confidence
        h = f.hazard_per_hour / 3600.0

        def crash(t: float) -> float:
            return 1.0 - math.exp(-h * t)

        now_loss = (age + restart) * f.gpus
        if f.dead:
            return {"now": now_loss, "checkpoint": None, "job_end": None}
        overdue = f.checkpoint_age_seconds is not None and age > cfg.checkpoint_overdue_factor * cadence
        ckpt: float | None = None
        if not overdue:
            t = max(cadence - age, 0.0)
            # Slow (or at risk of a crash that loses the work since the checkpoint) until it, then restart.
            ckpt = (c * (f.slowdown * t + crash(t) * (age + t / 2)) + restart) * f.gpus
        horizon = cfg.horizon_seconds
        end = c * (f.slowdown * horizon + crash(horizon) * (cadence / 2 + cfg.restart_cost_seconds)) * f.gpus
        return {"now": now_loss, "checkpoint": ckpt, "job_end": end}

    def choose(self, estimate: dict[str, float | None]) -> Option:
        waits = [(v, k) for k, v in estimate.items() if k != "now" and v is not None]
        now = estimate["now"]
        if not waits:
            return "now"
        best_wait, option = min(waits)
        if now is not None and now < (1 - self.config.now_margin_ratio) * best_wait:
            return "now"
        return "checkpoint" if option == "checkpoint" else "job_end"

    # -- one evaluation ---------------------------------------------------------------------

    def evaluate(self, view: FleetView, now: float, findings: list[Finding],
                 spares_available: int | None = None) -> list[Finding]:
        """The restart_job findings due now (the emitted plans' findings, again each evaluation
        until the job left the node or ``emit_seconds`` passed)."""
        cfg = self.config
        self._observe_checkpoints(view)
        fresh = now - cfg.rank_fresh_seconds
        triggers: dict[tuple[str, str], list[Finding]] = {}
        for f in findings:
            if (f.node == WHOLE_JOB or f.component is not None or f.action not in REMOVING_ACTIONS
                    or f.detector == NAME):
                continue
            jobs = [f.job] if f.job is not None else sorted(
                n for n, j in view.jobs.items() if any(r.node == f.node for r in j.ranks.values()))
            for name in jobs:
                triggers.setdefault((name, f.node), []).append(f)
        out: list[Finding] = []
        for key, found in triggers.items():
            job = view.jobs.get(key[0])
            if job is None or job.last_seen < fresh or key[1] not in job.nodes():
                continue  # the job left the node (or ended): nothing to restart
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) >= MAX_PLANS:
                    continue
                first = min(found, key=lambda f: (f.detector, f.action.value))
                plan = self._plans[key] = _Plan(key[0], key[1], now, {"detector": first.detector,
                                                                     "action": first.action.value},
                                                now, self._figures(view, job, now, found, spares_available))
            plan.last_trigger = now
            if plan.emitted is None:
                plan.figures = self._figures(view, job, now, found, spares_available)
        for plan in list(self._plans.values()):
            finding = self._step(plan, view, now, spares_available)
            if finding is not None:
                out.append(finding)
        self.pending = sum(1 for p in self._plans.values() if p.emitted is None)
        return out

    def _step(self, plan: _Plan, view: FleetView, now: float, spares: int | None) -> Finding | None:
        cfg = self.config
        key = (plan.job, plan.node)
        job = view.jobs.get(plan.job)
        fresh = now - cfg.rank_fresh_seconds
        on_node = job is not None and plan.node in job.nodes()
        if plan.emitted is None:
            if job is None or not on_node or job.last_seen < fresh:
                self._end(key, plan, "job_left")
                return None
            if now - plan.last_trigger > cfg.trigger_memory_seconds:
                del self._plans[key]  # the trigger went away: a transient, nothing decided
                return None
            seen = self._checkpoints.get(plan.job)
            if plan.chosen == "checkpoint" and seen is not None and seen[-1][1] > plan.since:
                # The checkpoint it waited for: emitted with the estimate that chose to wait.
                plan.figures.checkpoint_step = seen[-1][0]
            else:
                plan.figures.spares_available = spares
                plan.estimate = self.estimate(plan.figures)
                plan.chosen = self.choose(plan.estimate)
                if plan.chosen != "now":
                    return None
            plan.emitted = now
            plan.before_step_seconds = _step_seconds(job, fresh)
            plan.finding = self._finding(plan)
            self.plans_made[plan.chosen] += 1
            return plan.finding
        # Emitted: follow the outcome.
        if on_node and job is not None:
            if now - plan.emitted > cfg.outcome_wait_seconds:
                self._end(key, plan, "not_restarted")
                return None
            return plan.finding if now - plan.emitted <= cfg.emit_seconds else None
        if plan.restarted is None:
            plan.restarted = now
        after = _step_seconds(job, fresh, since=plan.restarted) if job is not None else None
        if after is None:
            if now - plan.emitted > cfg.outcome_wait_seconds:
                self._end(key, plan, "job_gone")
            return None
        before = plan.before_step_seconds
        improved = before is not None and after <= before * (1 - plan.figures.slowdown / 2)
        if before is not None and after > 0:
            saved = (plan.estimate["job_end"] or 0.0) - (plan.estimate[plan.chosen] or 0.0)
            self.estimated_saved_gpu_seconds += saved
            gain = max(before - after, 0.0) / after * cfg.horizon_seconds
            self.realised_saved_gpu_seconds += (gain - (plan.restarted - plan.emitted)) * plan.figures.gpus
        self._end(key, plan, "improved" if improved else "unchanged")
        return None

    def _end(self, key: tuple[str, str], plan: _Plan, outcome: str) -> None:
        self.outcomes[(plan.chosen, outcome)] += 1
        del self._plans[key]

    def _finding(self, plan: _Plan) -> Finding:
        f = plan.figures
        estimate = {k: (round(v, 1) if v is not None else None) for k, v in plan.estimate.items()}
        spare_note = "" if f.spares_available != 0 else "; no spare: the job waits for a node"
        reason = (f"restart job {plan.job} without {plan.node} ({plan.chosen}): {plan.trigger['detector']} "
                  f"{plan.trigger['action']}, expected GPU-seconds lost {estimate}{spare_note}")
        return Finding(
            detector=NAME, node=plan.node, job=plan.job, action=Action.RESTART_JOB, since=plan.since,
            key=f"{NAME}:{plan.job}", reason=reason,
            evidence={"signal": NAME, "when": plan.chosen, "exclude": [plan.node], "estimate": estimate,
                      "chosen": plan.chosen, "checkpoint_step": f.checkpoint_step,
                      "spares_available": f.spares_available, "trigger": dict(plan.trigger),
                      "figures": {"gpus": f.gpus, "nodes": f.nodes, "slowdown": round(f.slowdown, 4),
                                  "hazard_per_hour": f.hazard_per_hour, "dead": f.dead,
                                  "confidence": f.confidence,
                                  "checkpoint_age_seconds": None if f.checkpoint_age_seconds is None
                                  else round(f.checkpoint_age_seconds, 1),
                                  "checkpoint_cadence_seconds": round(f.cadence_seconds, 1),
                                  "restart_cost_seconds": self.config.restart_cost_seconds,
                                  "horizon_seconds": self.config.horizon_seconds}})

    def collector(self) -> PromCollector:
        return _PlannerMetrics(self)


class _PlannerMetrics(PromCollector):
    def __init__(self, planner: JobRecoveryPlanner) -> None:
        self._planner = planner

    def collect(self) -> Iterator[Metric]:
        p = self._planner
        outcomes = CounterMetricFamily("vigil_aggregator_job_recovery_outcomes",
            "Job-recovery plans ended, by the option "
            "chosen (now, checkpoint, job_end) and outcome (improved, unchanged, "
            "job_gone, not_restarted, job_left).", labels=["chosen", "outcome"])
        for chosen in OPTIONS:
            for outcome in OUTCOMES:
                outcomes.add_metric([chosen, outcome], p.outcomes.get((chosen, outcome), 0))
        yield outcomes
        made = CounterMetricFamily("vigil_aggregator_job_recovery_restarts",
            "restart_job decisions the planner emitted, "
            "by the moment it chose (now, checkpoint).", labels=["chosen"])
        for chosen in ("now", "checkpoint"):
            made.add_metric([chosen], p.plans_made.get(chosen, 0))
        yield made
        # Over the same plans (those whose step time after the restart was measured), so the two
        # sums compare: their ratio is how far the estimates can be trusted.
        yield GaugeMetricFamily("vigil_aggregator_job_recovery_estimated_saved_gpu_seconds",
            "Sum over measured restarts of the GPU-seconds they were expected to save against "
            "leaving the node in the job to its end (estimate job_end minus the chosen).",
            value=p.estimated_saved_gpu_seconds)
        yield GaugeMetricFamily("vigil_aggregator_job_recovery_realised_saved_gpu_seconds",
            "Sum over the same restarts of the GPU-seconds saved as measured: the job's step "
            "time before vs after over the planner's horizon, less the time until it ran "
            "again (negative when restarts cost more than they saved).",
            value=p.realised_saved_gpu_seconds)
        yield GaugeMetricFamily("vigil_aggregator_job_recovery_pending_plans", "Plans waiting for their chosen moment "
                                "(a checkpoint) or the job's end.", value=p.pending)
