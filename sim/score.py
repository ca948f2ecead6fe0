"""Scoring a simulation against its scenario's expectations: was each fault answered, how fast,
and was anything else drained.

An expectation is met by the first admitted decision on its node (or on its component, or on a
node under it) with one of its actions, within its time limit after the fault. An admitted
decision that removes capacity (DESIGN.md section 3: drain, reset, reboot, inspect) is a false
drain unless it answers an expectation or hits a node that had a fault of its own injected by
then (a node-level fault, not a job-wide stall or a fault of the switch above it). Precision and
recall are over those decisions and expectations. It runs nothing; it reads a ``SimResult``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aggregator.decision import REMOVING_ACTIONS
from sim.run import SimDecision, SimResult
from sim.scenario import Expectation, Scenario

_REMOVING = frozenset(a.value for a in REMOVING_ACTIONS)
# Acting on the job rather than the node also costs the job its progress since the checkpoint.
_ACTING = _REMOVING | {"restart_job"}


@dataclass(frozen=True)
class ExpectationResult:
    expectation: Expectation
    fault_t: float | None
    met: bool
    decision: SimDecision | None
    latency_seconds: float | None

    def to_json(self) -> dict[str, Any]:
        e = self.expectation
        return {
            "subject": e.subject,
            "kind": "node" if e.node is not None else "job" if e.job is not None else "component",
            "action": list(e.actions), "within_seconds": e.within_seconds, "fault_at_seconds": self.fault_t,
            "met": self.met, "latency_seconds": self.latency_seconds,
            "decision": self.decision.to_json() if self.decision else None,
        }


@dataclass(frozen=True)
class Score:
    expectations: list[ExpectationResult]
    false_drains: list[SimDecision]
    true_decisions: int
    breaker_ok: bool

    @property
    def met(self) -> int:
        return sum(1 for e in self.expectations if e.met)

    @property
    def recall(self) -> float | None:
        return self.met / len(self.expectations) if self.expectations else None

    @property
    def precision(self) -> float | None:
        acted = self.true_decisions + len(self.false_drains)
        return self.true_decisions / acted if acted else None

    @property
    def latencies(self) -> list[float]:
        return sorted(e.latency_seconds for e in self.expectations if e.latency_seconds is not None)

    @property
    def passed(self) -> bool:
        return self.met == len(self.expectations) and not self.false_drains and self.breaker_ok


def _subjects(scenario: Scenario, exp: Expectation) -> set[str]:
    """Names a decision may carry to answer ``exp``: the node, or the component and its nodes."""
    if exp.node is not None:
        return {exp.node}
    if exp.job is not None:
        return {f"job:{exp.job}"}
    assert exp.component is not None
    return {exp.component, *scenario.components().get(exp.component, [])}


def _decision_subjects(d: SimDecision) -> set[str]:
    return {d.node} | ({d.component} if d.component else set()) | ({f"job:{d.job}"} if d.job else set())


def _node_fault_times(scenario: Scenario) -> dict[str, float]:
    """Nodes with a fault of their own (targeted by node or nodes), and when it began."""
    out: dict[str, float] = {}
    for fault in scenario.faults:
        if (fault.node is None and fault.nodes is None) or fault.kind == "data_stall":
            continue
        for n in scenario.fault_nodes(fault):
            out[n] = min(out.get(n, fault.at_seconds), fault.at_seconds)
    return out


def score(result: SimResult) -> Score:
    scenario = result.scenario
    admitted = [d for d in result.decisions if d.admitted]
    answered: set[int] = set()  # indexes into `admitted` that answer some expectation
    outcomes: list[ExpectationResult] = []
    for exp in scenario.expect:
        fault_t = scenario.subject_fault_time(exp)
        subjects = _subjects(scenario, exp)
        start = fault_t if fault_t is not None else 0.0
        hit: SimDecision | None = None
        for i, d in enumerate(admitted):
            if d.action not in exp.actions or not (_decision_subjects(d) & subjects) or d.t < start:
                continue
            answered.add(i)
            if hit is None:
                hit = d
        # Later repeats and escalations on the same subject answer the same fault: not false drains.
        for i, d in enumerate(admitted):
            if exp.job is None and _decision_subjects(d) & subjects and d.t >= start and d.action in _ACTING:
                answered.add(i)
        latency = None if hit is None else round(hit.t - start, 3)
        met = hit is not None and latency is not None and latency <= exp.within_seconds
        outcomes.append(ExpectationResult(exp, fault_t, met, hit, latency))
    broken = _node_fault_times(scenario)
    for i, d in enumerate(admitted):
        if d.action in _ACTING and d.node in broken and d.t >= broken[d.node]:
            answered.add(i)
    false_drains = [d for i, d in enumerate(admitted) if d.action in _REMOVING and i not in answered]
    true_decisions = sum(1 for i in answered if admitted[i].action in _ACTING)
    wanted = scenario.expect_breaker
    breaker_ok = wanted == "any" or (wanted == "tripped") == result.breaker_tripped
    return Score(outcomes, false_drains, true_decisions, breaker_ok)


def _quantile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(result: SimResult, s: Score) -> dict[str, Any]:
    """The ``vigil sim --json`` object."""
    lat = s.latencies
    return {
        "scenario": result.scenario.name,
        "seed": result.seed,
        "pass": s.passed,
        "decisions": [d.to_json() for d in result.decisions],
        "expectations": [e.to_json() for e in s.expectations],
        "precision": s.precision,
        "recall": s.recall,
        "false_drains": len(s.false_drains),
        "false_drain_decisions": [d.to_json() for d in s.false_drains],
        "detection_latency_seconds": {
            "p50": _quantile(lat, 0.5) if lat else None,
            "p95": _quantile(lat, 0.95) if lat else None,
            "max": lat[-1] if lat else None,
        },
        "breaker": {"expected": result.scenario.expect_breaker, "tripped": result.breaker_tripped,
                    "ok": s.breaker_ok},
        "nodes": result.scenario.fleet.nodes,
        "simulated_seconds": result.simulated_seconds,
        "wall_seconds": round(result.wall_seconds, 3),
        "reports": result.reports,
        "heartbeats": result.heartbeats,
        "heartbeats_rejected": result.heartbeats_rejected,
        "collectors": result.collectors,
    }
