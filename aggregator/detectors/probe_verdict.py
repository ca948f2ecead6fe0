"""Probe verdict detector: a suspect node whose probe failed is removed; the verdict on a probe run.

It reads the signed probe results the fleet holds (``NodeState.action_results``), the baselines of
the node's hardware class (``probes.baselines``), the fleet's learned figures
(``FleetView.learned_probes``) and the prober's finished isolations (``FleetView.isolations``), and
judges a run with the per-probe verdict both services share (``agent/probe_baselines.judge``;
``judge_run`` is also the recovery detector's). It drains a suspect whose latest suspect run failed
and each node an isolation named faulty (one alert on the leaf where they crowd one leaf); it runs
nothing, requests nothing and learns nothing. Window, threshold, persistence, the designed
false-removal rate and lookalikes: docs/detectors.md, "probe_verdict".
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, field_validator

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.peer_class import describe, hardware_class
from vigil.aggregator.fleet import ActionOutcome, FleetView, NodeState
from vigil.contract.probe_baselines import ProbeBaselines, judge
from vigil.contract.validation import StrictModel
from vigil.contract.wire import NodeActionResult, ProbeName

NAME = "probe_verdict"

# Why a probe run was made: the request id says so (the detectors find a run's result by its id).
Trigger = Literal["recovery", "suspect", "group"]
TRIGGERS: tuple[Trigger, ...] = ("recovery", "suspect", "group")
# (hardware class as peer_class.describe writes it, probe) -> (median value, passing samples).
Learned = Mapping[tuple[str, str], tuple[float, int]]
RunOutcome = Literal["pass", "fail", "error"]


@dataclass(frozen=True)
class IsolationTest:
    """One collective test of an isolation as run: its members, the known-healthy partner of a
    test alone, whether it passed."""

    members: tuple[str, ...]
    partner: str | None
    passed: bool

    def evidence(self) -> dict[str, object]:
        return {"members": list(self.members), "partner": self.partner, "passed": self.passed}


@dataclass(frozen=True)
class IsolationOutcome:
    """A group-testing isolation as the prober reports it (running, done or aborted), with every
    test recorded so far. ``leaf_of``: each tested node's leaf (topology), for the leaf rule."""

    name: str
    source: str  # operator, auto (idle suspects) or sim
    note: str
    nodes: tuple[str, ...]
    d_hint: int
    started: float
    state: Literal["running", "done", "aborted"] = "running"
    finished: float | None = None
    faulty: tuple[str, ...] = ()
    cleared: tuple[str, ...] = ()
    tests_used: int = 0
    information_bound: float = 0.0
    tests: tuple[IsolationTest, ...] = ()
    leaf_of: Mapping[str, str] = field(default_factory=dict)
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "source": self.source, "note": self.note, "nodes": list(self.nodes),
                "d_hint": self.d_hint, "started": self.started, "state": self.state, "finished": self.finished,
                "faulty": list(self.faulty), "cleared": len(self.cleared), "tests_used": self.tests_used,
                "information_bound": round(self.information_bound, 2), "detail": self.detail}


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
    """Off by default: drains a suspect whose probe run failed (needs probes.enabled; docs/probes.md)."""

    enabled: bool = False
    # drain takes the node out (the operator or the recovery path brings it back); alert only tells.
    action: Action = Action.DRAIN
    # A suspect run's result counts this long after it arrived: an hour, the prober's suspect
    # cooldown, so the gate sees the same finding until it decides (a refused drain is proposed again).
    window_seconds: float = Field(default=3600.0, gt=0)
    # A finished isolation naming at least this many nodes of one leaf (topology), more than
    # ``leaf_suspicion_share`` of that leaf's nodes it tested, is one alert on the leaf and drains
    # none of them (a shared switch, not independent node faults; see the module's docstring).
    leaf_suspicion_min_nodes: int = Field(default=3, ge=2)
    leaf_suspicion_share: float = Field(default=0.5, gt=0, lt=1)

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
        for iso in view.isolations:
            if iso.state == "done" and iso.finished is not None and now - iso.finished <= self.config.window_seconds:
                out.extend(self._isolation(view, iso))
        return out

    def _isolation(self, view: FleetView, iso: IsolationOutcome) -> list[Finding]:
        assert iso.finished is not None
        bound = round(iso.information_bound, 2)
        tested: dict[str, list[str]] = {}
        for n in iso.nodes:
            tested.setdefault(iso.leaf_of.get(n, ""), []).append(n)
        out: list[Finding] = []
        switch: set[str] = set()
        for leaf, members in tested.items():
            named = [n for n in members if n in iso.faulty]
            if (leaf and len(named) >= self.config.leaf_suspicion_min_nodes
                    and len(named) > self.config.leaf_suspicion_share * len(members)):
                switch.update(named)
                out.append(Finding(
                    detector=NAME, node=leaf, component=leaf, action=Action.ALERT, since=iso.finished,
                    key=f"isolation:{iso.name}:leaf",
                    reason=(f"isolation {iso.name} named {len(named)} of the {len(members)} nodes of leaf {leaf} it "
                            "tested: a shared switch, not node faults; none is drained"),
                    evidence={"signal": "isolation_leaf", "isolation": iso.name, "leaf": leaf, "faulty": named,
                              "tested": members, "tests_used": iso.tests_used, "information_bound": bound}))
        for node in iso.faulty:
            if node in switch or node in view.removed or node not in view.nodes:
                continue
            failed = [t for t in iso.tests if node in t.members and not t.passed]
            alone = [t for t in failed if t.members == (node,)]
            partner = alone[-1].partner if alone else None
            out.append(Finding(
                detector=NAME, node=node, action=self.config.action, since=iso.finished,
                key=f"isolation:{iso.name}",
                reason=(f"{node} failed its collective alone with the known-healthy partner {partner} in isolation "
                        f"{iso.name} ({iso.tests_used} tests for {len(iso.nodes)} nodes, information bound "
                        f"{bound})"),
                evidence={"signal": "isolation_faulty", "isolation": iso.name, "partner": partner,
                          "failed_tests": [t.evidence() for t in failed], "tests_used": iso.tests_used,
                          "information_bound": bound, "nodes": len(iso.nodes)}))
        return out
