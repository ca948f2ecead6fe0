"""Probe verdict detector: a suspect node whose probe failed is removed; the verdict on a probe run.

It reads the signed probe results the fleet holds (``NodeState.action_results``, verified by the
outbox before the fleet took them), the baselines of the node's hardware class
(``probes.baselines``) and the fleet's learned figures (``FleetView.learned_probes``, which the
prober owns), and judges a whole run with the one per-probe verdict both services share
(agent/probe_baselines.judge). ``judge_run`` is also the recovery detector's; the detector here
drains a suspect (a node found slow below the removal threshold, probed by the prober when idle)
whose latest probe run failed. It runs nothing, requests nothing and learns nothing.

Evidence window: the node's latest suspect run (``probes.suspect_probes``: one request, every GPU),
counted for ``window_seconds`` after its result arrived. Threshold: a probe the agent judged
``fail`` itself (errors, throttling under load, a failed diagnostic), or a value below its
class's configured ``min_value``, or, with none configured, more than ``learned_tolerance`` (10%)
below the class's learned median of at least ``learned_min_samples`` passing probes, or a figure
above its ``max_metrics`` bound. A probe that errored or was skipped is no evidence either way.
Persistence: one failed run; it is the second, independent signal (the suspicion that started it
is the first: an intermittent straggler or a GPU-peer alert), and the run itself is a sustained
burn of every GPU, not a sample.

Designed false-removal rate: a healthy GPU's matmul or copy figure repeats within ~2% across runs
on one hardware class (nccl-tests and burn tools report run-to-run spreads of 1-3%), so the 10%
learned floor is ~5 sigma below the median: p <= 3e-7 per figure (Gaussian, one-sided); a run
of 8 GPUs x 2 probes is 16 figures, p_run <= 5e-6. The prober probes a suspect at most once per
``probes.suspect_cooldown_seconds`` (1 h): even a node suspected all day long (24 runs) is
falsely drained at most 1.2e-4 times per node-day, and a healthy node is a suspect only when the
straggler detector alerts on it (its own budget: < 1e-6 per node-day), which gives < 1e-10 per
node-day. The lookalike that must not act: a slowdown of the whole job (every rank slower, the
straggler's class-level ``observe`` with no node) makes no suspect, and a probe that merely
errors (a peer that never joined) drains nobody.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from vigil.agent.probe_baselines import ProbeBaselines, judge
from vigil.agent.validation import StrictModel
from vigil.agent.wire import NodeActionResult, ProbeName
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.peer_class import describe, hardware_class
from vigil.aggregator.fleet import ActionOutcome, FleetView, NodeState

NAME = "probe_verdict"

# Why a probe run was made: the request id says so (the detectors find a run's result by its id).
Trigger = Literal["recovery", "suspect", "group"]
TRIGGERS: tuple[Trigger, ...] = ("recovery", "suspect", "group")
# (hardware class as peer_class.describe writes it, probe) -> (median value, passing samples).
Learned = Mapping[tuple[str, str], tuple[float, int]]
RunOutcome = Literal["pass", "fail", "error"]


def probe_request_id(trigger: Trigger, subject: str, attempt: int = 0) -> str:
    """The run_probes request id for ``subject`` (a removal's decision id, a suspect's node and
    episode, a group test), deterministic so a detector finds its result in the fleet: at most
    64 characters (wire.Id), the trigger readable in it."""
    digest = hashlib.sha256(f"probe\0{trigger}\0{subject}\0{attempt}".encode()).hexdigest()[:40]
    return f"probe-{trigger}-{digest}"


def trigger_of(request_id: str) -> Trigger | None:
    for trigger in TRIGGERS:
        if request_id.startswith(f"probe-{trigger}-"):
            return trigger
    return None


def learned_key(node: NodeState, probe: str) -> tuple[str, str]:
    """Where a node's passing figure for ``probe`` is learned: its full hardware class (model,
    clock and power limit: a capped class learns its own figure)."""
    return describe(hardware_class(node)), probe


@dataclass(frozen=True)
class ProbeJudgement:
    """One probe result (one GPU where per GPU) as judged."""

    probe: str
    gpu: int | None
    status: str
    passed: bool
    reason: str
    detail: str
    value: float | None
    unit: str
    floor: float | None

    def evidence(self) -> dict[str, object]:
        return {"probe": self.probe, "gpu": self.gpu, "status": self.status, "reason": self.reason,
                "value": self.value, "unit": self.unit, "floor": self.floor, "detail": self.detail}


@dataclass(frozen=True)
class RunVerdict:
    """A whole run: ``fail`` when any requested probe failed (the agent's own fail, or below its
    floor); else ``error`` when the run did not complete (refused, failed, a probe errored or is
    missing, or every probe skipped: no evidence); else ``pass``."""

    outcome: RunOutcome
    judged: tuple[ProbeJudgement, ...]
    detail: str

    @property
    def failed(self) -> list[ProbeJudgement]:
        return [j for j in self.judged if not j.passed and j.status != "error"]

    def evidence(self) -> list[dict[str, object]]:
        return [j.evidence() for j in self.judged]


def judge_run(result: NodeActionResult, node: NodeState, probes: Sequence[ProbeName], baselines: ProbeBaselines,
              learned: Learned) -> RunVerdict:
    """The verdict on one run_probes result for ``node``, counting only the ``probes`` requested."""
    if result.outcome != "done":
        return RunVerdict("error", (), f"the agent {result.outcome} the run ({result.reason}"
                                       f"{': ' + result.detail if result.detail else ''})")
    model = hardware_class(node)[0]
    judged: list[ProbeJudgement] = []
    for r in result.probes:
        if r.probe not in probes:
            continue
        median, samples = learned.get(learned_key(node, r.probe), (None, 0))
        v = judge(r, baselines, model or None, median, samples)
        judged.append(ProbeJudgement(r.probe, r.gpu, r.status, v.passed, v.reason, v.detail, r.value, r.unit,
                                     v.floor))
    verdict = tuple(judged)
    failed = [j for j in judged if not j.passed and j.status != "error"]
    if failed:
        return RunVerdict("fail", verdict, "; ".join(j.detail for j in failed))
    missing = [p for p in probes if not any(j.probe == p for j in judged)]
    errors = [j for j in judged if j.status == "error"]
    if errors or missing:
        return RunVerdict("error", verdict, "; ".join([j.detail for j in errors]
                                                      + [f"{p}: no result" for p in missing]))
    if not any(j.status == "pass" for j in judged):
        return RunVerdict("error", verdict, "every probe skipped: no evidence either way")
    return RunVerdict("pass", verdict, f"{sum(j.status == 'pass' for j in judged)} probe results passed")


def latest_run(node: NodeState, trigger: Trigger) -> tuple[str, ActionOutcome] | None:
    """The node's newest run_probes result of ``trigger`` (by arrival), with its request id."""
    runs = [(rid, o) for rid, o in node.action_results.items()
            if o.result.action == "run_probes" and trigger_of(rid) == trigger]
    return max(runs, key=lambda kv: kv[1].received, default=None)


class ProbeVerdictConfig(StrictModel):
    """``detectors.probe_verdict``: what a suspect's failed probe run proposes (needs ``probes.enabled``)."""

    enabled: bool = False
    # drain takes the node out (the operator or the recovery path brings it back); alert only tells.
    action: Action = Action.DRAIN
    # A suspect run's result counts this long after it arrived: an hour, the prober's suspect
    # cooldown, so the gate sees the same finding until it decides (a refused drain is proposed again).
    window_seconds: float = Field(default=3600.0, gt=0)

    @field_validator("action")
    @classmethod
    def _action(cls, action: Action) -> Action:
        if action not in (Action.DRAIN, Action.ALERT):
            raise ValueError(f"a failed suspect probe proposes drain or alert, not {action.value}")
        return action


class ProbeVerdictDetector:
    name = NAME

    def __init__(self, config: ProbeVerdictConfig) -> None:
        self.config = config

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        settings = view.probes
        if settings is None:
            return []
        out: list[Finding] = []
        for name, node in view.nodes.items():
            if name in view.removed:
                continue  # out of service already: the recovery detector follows it
            latest = latest_run(node, "suspect")
            if latest is None or now - latest[1].received > self.config.window_seconds:
                continue
            request_id, outcome = latest
            verdict = judge_run(outcome.result, node, settings.suspect_probes, settings.baselines,
                                view.learned_probes)
            if verdict.outcome != "fail":
                continue  # a pass clears the suspicion; an error is no evidence
            out.append(Finding(
                detector=NAME, node=name, action=self.config.action, since=outcome.received, key=request_id,
                reason=f"suspect {name} failed its probe run: {verdict.detail}",
                evidence={"signal": "probe_failed", "probe_request": request_id,
                          "failed": [j.evidence() for j in verdict.failed], "probes": verdict.evidence()}))
        return out
