"""Scoring a simulation against its scenario: was each fault answered, how fast, and was every
removal justified.

An expectation is met by the first admitted decision on its subject with one of its actions,
within its time limit after the fault. Every admitted removal (drain, reset_gpu, reboot_node,
inspect_hardware, restart_job: each a class of its own) is judged on its own: it is justified
only by an expectation or an allowance on its own subject (the node itself; a component's own
decision, or its nodes where the expectation says ``include_nodes``; a job's restart for a
job-wide fault), of one of the classes that expectation names, at or after the fault it answers.
A ``forbid`` entry fails the run whatever justified it, and ``max_removals`` caps the run's
distinct removals. Alerts are counted apart: they cost nobody a node. It runs nothing; it reads
a ``SimResult``.

Return to service (``return_to_service``, measured, never part of the verdict): each time a node
is taken out (an admitted drain, reset_gpu, reboot_node or inspect_hardware while it is not out
already), from the injection of the node's latest fault before that removal to the admitted
``resume`` that gives it back; a node not given back by the end is "not returned", with its
final state: ``inspect_hardware`` (sent to a technician) or ``still_out``. Grouped by the action
that took the node out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vigil.aggregator.job_recovery import NAME as JOB_RECOVERY
from vigil.sim.run import SimDecision, SimResult
from vigil.sim.scenario import REMOVAL_ACTIONS, Allow, Expectation, Forbid, Scenario

_REMOVAL = frozenset(REMOVAL_ACTIONS)
# The removals that take a node out of service until a resume (restart_job removes no node).
NODE_REMOVALS = ("drain", "reset_gpu", "reboot_node", "inspect_hardware")
# Faults that are no fault of the node's own to return from: a job's data stall, a reboot.
_NOT_A_NODE_FAULT = ("data_stall", "reboot")


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
class Removal:
    """One admitted removal and the verdict on it: ``justified_by`` names the expectation or
    allowance that answers it; otherwise ``why`` says what is wrong with it."""

    decision: SimDecision
    justified_by: str | None
    why: str
    # A job restarted without a node vigil removed (the job-recovery planner): judged with that
    # removal, and no node taken out of its own (not counted against ``max_removals``).
    follows: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**self.decision.to_json(), "justified_by": self.justified_by, "why": self.why}


@dataclass(frozen=True)
class Violation:
    forbid: Forbid
    decision: SimDecision

    def to_json(self) -> dict[str, Any]:
        return {"forbid": self.forbid.model_dump(exclude_none=True), "decision": self.decision.to_json()}


@dataclass(frozen=True)
class Score:
    expectations: list[ExpectationResult]
    removals: list[Removal]
    violations: list[Violation]
    alerts: list[SimDecision]
    max_removals: int | None
    breaker_ok: bool
    # The scenario's ``isolations`` that were refused, aborted or still running at the end (each
    # must be started and finish, for its drains and its clears to mean anything).
    isolation_problems: tuple[str, ...] = ()

    @property
    def met(self) -> int:
        return sum(1 for e in self.expectations if e.met)

    @property
    def false_removals(self) -> list[SimDecision]:
        return [r.decision for r in self.removals if r.justified_by is None]

    # The name the bench and the command line print: every unjustified removal, drains or not.
    false_drains = false_removals

    @property
    def removal_count(self) -> int:
        """Distinct removals: a subject and an action class (a re-proposal is the same removal)."""
        return len({removal_key(r.decision) for r in self.removals if not r.follows})

    @property
    def over_cap(self) -> bool:
        return self.max_removals is not None and self.removal_count > self.max_removals

    @property
    def recall(self) -> float | None:
        return self.met / len(self.expectations) if self.expectations else None

    @property
    def precision(self) -> float | None:
        """Justified removals over all removals (None when nothing was removed)."""
        if not self.removals:
            return None
        return sum(1 for r in self.removals if r.justified_by is not None) / len(self.removals)

    @property
    def latencies(self) -> list[float]:
        return sorted(e.latency_seconds for e in self.expectations if e.latency_seconds is not None)

    @property
    def passed(self) -> bool:
        return (self.met == len(self.expectations) and not self.false_removals and not self.violations
                and not self.over_cap and self.breaker_ok and not self.isolation_problems)


@dataclass(frozen=True)
class OutOfService:
    """One spell out of service of a node: taken out by ``action`` at ``removed_t``, given back
    at ``resumed_t`` (None: not by the end of the run; ``final_state`` says where it is)."""

    node: str
    action: str  # the removal that took it out
    fault_t: float | None  # the latest injected fault of the node at or before the removal
    removed_t: float
    resumed_t: float | None
    final_state: str  # "resumed", "inspect_hardware" or "still_out"

    @property
    def returned(self) -> bool:
        return self.resumed_t is not None

    @property
    def seconds(self) -> float | None:
        """Fault to resume (the removal, where the node had no fault of its own)."""
        if self.resumed_t is None:
            return None
        start = self.fault_t if self.fault_t is not None else self.removed_t
        return round(self.resumed_t - start, 3)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "action": self.action, "fault_at_seconds": self.fault_t,
                "removed_at_seconds": self.removed_t, "resumed_at_seconds": self.resumed_t,
                "returned": self.returned, "seconds": self.seconds, "final_state": self.final_state}


def out_of_service(result: SimResult) -> list[OutOfService]:
    """Every spell out of service in the run, in the order they began."""
    scenario = result.scenario
    names = set(scenario.node_names())
    fault_times: dict[str, list[float]] = {}
    for f in scenario.faults:
        if f.kind in _NOT_A_NODE_FAULT or (f.node is None and f.nodes is None and f.component is None):
            continue
        for n in scenario.fault_nodes(f):
            fault_times.setdefault(n, []).append(f.at_seconds)
    open_spells: dict[str, tuple[str, float, bool]] = {}  # node -> (action, removed at, inspected)
    spells: list[tuple[float, OutOfService]] = []

    def close(node: str, resumed_t: float | None) -> None:
        action, removed_t, inspected = open_spells.pop(node)
        before = [t for t in fault_times.get(node, []) if t <= removed_t]
        state = "resumed" if resumed_t is not None else "inspect_hardware" if inspected else "still_out"
        spells.append((removed_t, OutOfService(node, action, max(before) if before else None, removed_t,
                                               resumed_t, state)))

    for d in result.decisions:
        if not d.admitted or d.component is not None or d.node not in names:
            continue
        if d.action in NODE_REMOVALS:
            if d.node not in open_spells:
                open_spells[d.node] = (d.action, d.t, d.action == "inspect_hardware")
            elif d.action == "inspect_hardware":
                action, removed_t, _ = open_spells[d.node]
                open_spells[d.node] = (action, removed_t, True)
        elif d.action == "resume" and d.node in open_spells:
            close(d.node, d.t)
    for node in list(open_spells):
        close(node, None)
    return [s for _, s in sorted(spells, key=lambda x: x[0])]


def return_to_service(result: SimResult) -> dict[str, Any]:
    """The summary's ``return_to_service``: every spell, and per action that took a node out how
    many came back and how long from the fault that took (p50, max), how many did not and why."""
    spells = out_of_service(result)
    by_action: dict[str, Any] = {}
    for action in NODE_REMOVALS:
        mine = [s for s in spells if s.action == action]
        if not mine:
            continue
        secs = sorted(s.seconds for s in mine if s.seconds is not None)
        by_action[action] = {
            "removed": len(mine), "returned": len(secs),
            "not_returned": {state: sum(1 for s in mine if s.final_state == state)
                             for state in ("inspect_hardware", "still_out")},
            "seconds": {"p50": _quantile(secs, 0.5) if secs else None, "max": secs[-1] if secs else None},
        }
    return {"by_action": by_action, "spells": [s.to_json() for s in spells],
            "remediations": [r.to_json() for r in result.remediations]}


def removal_key(d: SimDecision) -> tuple[str, str, int | None, str | None]:
    if d.action == "restart_job" or d.node is None:
        return ("job", d.action, None, d.job)
    return (d.node, d.action, d.gpu if d.action == "reset_gpu" else None, None)


def _answers(scenario: Scenario, exp: Expectation, d: SimDecision) -> bool:
    """Whether ``d`` is about ``exp``'s subject (its action and time aside)."""
    if exp.node is not None:
        if d.node != exp.node or d.component is not None:
            return False
        return exp.gpu is None or d.gpu is None or d.gpu == exp.gpu
    if exp.job is not None:
        return d.job == exp.job and d.action in ("restart_job", "alert", "observe")
    assert exp.component is not None
    if d.component == exp.component:
        return True
    return exp.include_nodes and d.component is None and d.node in scenario.components().get(exp.component, [])


def _forbids(scenario: Scenario, f: Forbid, d: SimDecision) -> bool:
    if d.action not in f.actions:
        return False
    if f.nodes is not None:
        return d.component is None and d.node in scenario.resolve_nodes(f.nodes)
    if f.component is not None:
        return d.component is None and d.node in scenario.components().get(f.component, [])
    if f.job is not None:
        return d.job == f.job or (d.component is None and d.node in scenario.job_nodes(f.job))
    return True


def _allows(scenario: Scenario, a: Allow, d: SimDecision) -> bool:
    if d.action not in a.actions or d.component is not None:
        return False
    if a.job is not None:
        owns = [t for n in scenario.job_nodes(a.job) if (t := scenario.own_fault_time(n)) is not None]
        return d.job == a.job and bool(owns) and d.t >= min(owns)
    assert a.nodes is not None
    if d.node is None:
        return False
    own = scenario.own_fault_time(d.node)
    return d.node in scenario.resolve_nodes(a.nodes) and own is not None and d.t >= own


def _why_not(scenario: Scenario, d: SimDecision) -> str:
    """What is wrong with a removal nothing justifies, in the words an operator would use."""
    if d.component is not None:
        return f"no expectation on component {d.component}"
    if d.node not in set(scenario.node_names()):
        return f"{d.node} is not a node of the fleet"
    own = scenario.own_fault_time(d.node)
    wanted = sorted({a for e in scenario.expect if e.node == d.node for a in e.actions})
    if own is None:
        shared = [f for f in scenario.faults if d.node in scenario.fault_nodes(f)]
        if shared:
            f = shared[0]
            whose = f"component {f.component}" if f.component else f"job {getattr(f, 'job', '?')}"
            return f"{d.node} has no fault of its own; the {f.kind} is its {whose}'s"
        return f"{d.node} is healthy: no fault injected"
    if d.t < own:
        return f"before {d.node}'s fault at {own:g} s"
    if wanted:
        return f"wrong action class: {d.action}, expected one of {wanted}"
    return f"{d.action} on {d.node} answers no expectation"


def score(result: SimResult) -> Score:
    scenario = result.scenario
    admitted = [d for d in result.decisions if d.admitted]
    outcomes: list[ExpectationResult] = []
    starts: list[float] = []
    for exp in scenario.expect:
        fault_t = scenario.subject_fault_time(exp)
        start = fault_t if fault_t is not None else 0.0
        starts.append(start)
        hit = next((d for d in admitted if d.action in exp.actions and d.t >= start and _answers(scenario, exp, d)),
                   None)
        latency = None if hit is None else round(hit.t - start, 3)
        met = hit is not None and latency is not None and latency <= exp.within_seconds
        outcomes.append(ExpectationResult(exp, fault_t, met, hit, latency))
    removals: list[Removal] = []
    for d in admitted:
        if d.action not in _REMOVAL:
            continue
        if d.detector == JOB_RECOVERY and d.node is not None:
            # The planner's restart of a job without a node (aggregator/job_recovery.py) answers
            # the node's own removal: as right as that removal was, and no removal of its own.
            trigger = next((r for r in removals if r.decision.node == d.node and r.decision.t <= d.t
                            and r.decision.detector != JOB_RECOVERY), None)
            if trigger is not None and trigger.justified_by is not None:
                removals.append(Removal(d, f"follows {trigger.justified_by}", "", follows=True))
            else:
                removals.append(Removal(d, None, f"restarts job {d.job} without {d.node}, whose removal "
                                        f"{'is itself unjustified' if trigger else 'never happened'}", follows=True))
            continue
        by = next((f"expect.{i}" for i, exp in enumerate(scenario.expect)
                   if d.action in exp.actions and d.t >= starts[i] and _answers(scenario, exp, d)), None)
        if by is None:
            by = next((f"allow.{i}" for i, a in enumerate(scenario.allow) if _allows(scenario, a, d)), None)
        removals.append(Removal(d, by, "" if by is not None else _why_not(scenario, d)))
    violations = [Violation(f, d) for d in admitted for f in scenario.forbid if _forbids(scenario, f, d)]
    alerts = [d for d in admitted if d.action == "alert"]
    wanted = scenario.expect_breaker
    breaker_ok = wanted == "any" or (wanted == "tripped") == result.breaker_tripped
    problems = [f"refused at {t:g} s: {reason}: {detail}" for t, reason, detail in result.isolations_refused]
    problems += [f"{i.name} {i.state}{': ' + i.detail if i.detail else ''}" for i in result.isolations
                 if i.source == "sim" and i.state != "done"]
    return Score(outcomes, removals, violations, alerts, scenario.max_removals, breaker_ok, tuple(problems))


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
        "false_drains": len(s.false_removals),
        "false_drain_decisions": [r.to_json() for r in s.removals if r.justified_by is None],
        "removals": s.removal_count,
        "max_removals": s.max_removals,
        "removal_decisions": [r.to_json() for r in s.removals],
        "forbid_violations": [v.to_json() for v in s.violations],
        "alerts": len(s.alerts),
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
        "return_to_service": return_to_service(result),
        "isolations": [i.as_dict() for i in result.isolations],
        "isolation_problems": list(s.isolation_problems),
    }
