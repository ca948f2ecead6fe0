"""The gate: decides which proposed decisions may act, given what has already been done.

It reads a ``GateState`` (node states, holds, the fault history, recent removals, the circuit
breaker; the store owns it and keeps it durable), the node's policy group (``Membership``) and a
proposed ``Decision`` and returns a ``Verdict``: admitted (possibly escalated along the ladder,
turned into an alert or a dry run by its group's mode) or refused with a reason code (a shadow
rule's always). It is pure: no I/O, no clock (``now`` is given), and it never delivers anything;
``GateState.apply`` says what a verdict changes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from vigil.aggregator.decision import JOB_RUN_ACTIONS, REMOVING_ACTIONS, Action, Decision
from vigil.aggregator.policy_groups import (
    DEFAULT_GROUP,
    MAX_GROUPS,
    GroupMode,
    Membership,
    PolicyGroup,
    check_groups,
    resolve,
    static_labels,
)
from vigil.contract.validation import StrictModel

NodeCondition = Literal["in_service", "removed", "awaiting_inspection"]

# Remediation ladder (DESIGN.md section 7): a node that fails again after a GPU reset is
# rebooted; after a reboot it goes to hardware inspection. NVIDIA's Xid catalog orders the
# recovery actions the same way (RESET_GPU, then RESTART_BM/reboot, then field diagnostics).
LADDER: tuple[Action, ...] = (Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE)
REMEDIATIONS = frozenset({Action.RESET_GPU, Action.REBOOT_NODE})
# A drain stands on the ladder's first rung: a GPU that fails again after it is rebooted.
RUNG = {Action.RESET_GPU: 0, Action.DRAIN: 0, Action.REBOOT_NODE: 1, Action.INSPECT_HARDWARE: 2}
# The detector of decisions an operator makes by hand (resume, hold): no hysteresis applies.
OPERATOR = "operator"
# Only informs people; never refused except as an exact duplicate.
INFORMING = frozenset({Action.OBSERVE, Action.ALERT})
# Severity for the cooldown: the Action enum is declared in rising order of cost to the job.
SEVERITY = {action: rank for rank, action in enumerate(Action)}
# The detector name of a shadow rule's decisions (``shadow:<rule>``): recorded, never admitted.
SHADOW_PREFIX = "shadow:"


def is_shadow(decision: Decision) -> bool:
    return decision.detector.startswith(SHADOW_PREFIX)


class MaintenanceWindow(StrictModel):
    nodes: list[str] = Field(min_length=1)  # fnmatch patterns, e.g. "gpu-0[0-3]*"
    start: datetime
    end: datetime
    note: str = ""

    @model_validator(mode="after")
    def _ordered(self) -> MaintenanceWindow:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise ValueError("start and end need a time zone (e.g. 2025-01-01T00:00:00Z)")
        if self.end <= self.start:
            raise ValueError("end must be after start")
        return self

    def covers(self, node: str, now: float) -> bool:
        return self.start.timestamp() <= now < self.end.timestamp() and any(
            fnmatch.fnmatchcase(node, pattern) for pattern in self.nodes
        )


class GateConfig(StrictModel):
    """Defaults are conservative: a breaker that stops after 5% of the fleet, or 3 nodes.

    The 5% share follows the common practice of fleet operators (e.g. Meta's and Google's
    published automated-repair systems cap concurrent repairs at a few percent of a cluster):
    more than that in an hour is a switch, a driver roll-out or a bad rule, not bad GPUs. The
    fleet is the nodes that reported within the breaker window (forged or departed nodes do not
    raise the budget), and a floor lets a small pilot act at all (5% of 10 nodes is 0)."""

    # The global switch is the aggregator's top-level ``dry_run``, carried on every Decision; this
    # forces dry run at the gate as well (a decision is dry if either says so).
    dry_run: bool = False
    # The same node+action (and job, for restart_job) within this window is a duplicate.
    dedup_seconds: float = Field(default=600.0, ge=0)
    # After a removing action, further removing actions on that node wait this long (a reset or
    # a reboot needs minutes to show whether it helped); inspect_hardware never waits.
    cooldown_seconds: float = Field(default=900.0, ge=0)
    # Hysteresis: a removed node is not resumed sooner than this after its last removal.
    min_removed_seconds: float = Field(default=1800.0, ge=0)
    escalation_window_seconds: float = Field(default=86400.0, gt=0)
    # Remediations (reset_gpu, reboot_node) per node in the escalation window; beyond it the
    # node goes to inspect_hardware instead: no reboot loops.
    max_remediation_attempts: int = Field(default=2, ge=1)
    breaker_window_seconds: float = Field(default=3600.0, gt=0)
    breaker_max_share: float = Field(default=0.05, gt=0, le=1)
    breaker_max_nodes: int | None = Field(default=None, ge=1)
    # A small fleet can still remove this many nodes per window whatever the share says: 3 lets
    # a 10-node pilot lose two nodes to real faults in an hour and still stop at a shared cause.
    breaker_floor_nodes: int = Field(default=3, ge=0)
    # After a start, the nodes that reported so far are not yet the fleet: for this long the
    # budget is the floor alone, and a removal beyond it waits (refused "startup_grace", proposed
    # again) instead of tripping the breaker. 120 s is 48 reports at the agent's 2.5 s cadence.
    breaker_startup_grace_seconds: float = Field(default=120.0, ge=0)
    # restart_job moves no node out of service but costs a whole job its progress: its own
    # budget per breaker window, cluster-wide; beyond it restarts wait (refused "restart_budget").
    restart_job_budget: int = Field(default=10, ge=0)
    # History: a removing fault on the same GPU (or, for node-level faults, from the same
    # detector on the node) within this horizon climbs the ladder: drain/reset -> reboot ->
    # inspect. A GPU that fails twice in a week is a repeat offender, not bad luck.
    history_horizon_seconds: float = Field(default=7 * 86400.0, gt=0)
    # A new occurrence this long after the one an episode's decision was made on is a repeat
    # (its own decision), not the same event re-read; lines of one event arrive within seconds.
    repeat_after_seconds: float = Field(default=300.0, gt=0)
    opt_out_nodes: list[str] = Field(default_factory=list)  # fnmatch patterns
    maintenance: list[MaintenanceWindow] = Field(default_factory=list)
    # Policy groups (aggregator/policy_groups.py, docs/gate.md "Policy groups"): the first group whose
    # selector matches a node sets the gate's mode for its decisions and adds a budget of its own;
    # a node in no group gets ``default_mode``. act: delivered; alert: an alert instead, nothing
    # drained, reset or rebooted; dry_run: recorded, not delivered (as the global dry_run).
    default_mode: GroupMode = "act"
    groups: list[PolicyGroup] = Field(default_factory=list, max_length=MAX_GROUPS)
    # Aggregator-side labels a node cannot forge, for ``select.labels``: label -> value -> fnmatch
    # patterns of node names (e.g. partition: {h200: ["h200-*"]}; the first value that matches).
    node_labels: dict[str, dict[str, list[str]]] = Field(default_factory=dict, max_length=32)

    @model_validator(mode="after")
    def _groups(self) -> GateConfig:
        check_groups(self.groups)
        return self

    @property
    def policy_groups(self) -> bool:
        """Whether any node's mode may differ from act: decisions then carry ``evidence.policy``."""
        return bool(self.groups) or self.default_mode != "act"

    def breaker_budget(self, fleet_nodes: int, in_grace: bool = False) -> int:
        """Most distinct nodes the gate may remove within one breaker window, given how many
        nodes reported within it; the floor alone during the start-up grace."""
        share = 0 if in_grace else math.floor(self.breaker_max_share * max(fleet_nodes, 0))
        budget = max(self.breaker_floor_nodes, share)
        if self.breaker_max_nodes is not None:
            budget = min(budget, self.breaker_max_nodes)
        return budget


@dataclass
class NodeRecord:
    condition: NodeCondition = "in_service"
    last_removal: Action | None = None
    last_removal_ts: float | None = None
    # (ts, action) of admitted remediations, pruned to the escalation window
    remediations: list[tuple[float, Action]] = field(default_factory=list)


@dataclass(frozen=True)
class HistoryEntry:
    """One earlier admitted removing decision: what the ladder counts."""

    ts: float
    id: str
    action: Action
    gpu: int | None
    detector: str
    since: float  # when its fault began

    def as_evidence(self) -> dict[str, object]:
        return {"id": self.id, "ts": self.ts, "action": self.action.value, "gpu": self.gpu,
                "detector": self.detector}


@dataclass(frozen=True)
class BreakerRecord:
    tripped: bool = False
    tripped_ts: float | None = None
    reason: str = ""


@dataclass
class GateState:
    """What the gate knows; the store loads it at start, persists every change and alone
    replaces it (``copy`` + ``apply`` on a shadow, committed with the verdicts' rows)."""

    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    removals: list[tuple[float, str]] = field(default_factory=list)  # (ts, node), breaker window
    restarts: list[tuple[float, str]] = field(default_factory=list)  # (ts, job), breaker window
    breaker: BreakerRecord = field(default_factory=BreakerRecord)
    # (node, action, job) -> ts of the last admission, for dedup
    recent: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # node -> (ts, note): an operator's hold; automation leaves the node alone
    holds: dict[str, tuple[float, str]] = field(default_factory=dict)
    # node -> admitted removing decisions, oldest first, pruned to the history horizon
    history: dict[str, list[HistoryEntry]] = field(default_factory=dict)

    def node(self, name: str) -> NodeRecord:
        return self.nodes.get(name) or NodeRecord()

    def copy(self) -> GateState:
        return GateState(
            nodes={k: NodeRecord(v.condition, v.last_removal, v.last_removal_ts, list(v.remediations))
                   for k, v in self.nodes.items()},
            removals=list(self.removals), restarts=list(self.restarts), breaker=self.breaker,
            recent=dict(self.recent), holds=dict(self.holds),
            history={k: list(v) for k, v in self.history.items()},
        )

    def remember(self, d: Decision, ts: float) -> None:
        """Add an admitted removing decision to its node's history."""
        entry = HistoryEntry(ts=ts, id=d.id, action=d.action, gpu=d.gpu, detector=d.detector,
                             since=d.since if d.since is not None else d.ts)
        self.history.setdefault(d.subject, []).append(entry)

    def earlier_faults(self, d: Decision, horizon_seconds: float, now: float, began: float) -> list[HistoryEntry]:
        """Earlier episodes of the same fault as ``d``: removing decisions on the same GPU (or,
        for a node-level fault, by the same detector) admitted within the horizon and before
        ``d``'s fault ``began`` (two detectors reading one event are one episode, not a repeat)."""
        out = []
        for e in self.history.get(d.subject, ()):
            if e.id == d.id or now - e.ts > horizon_seconds or e.ts >= began:
                continue
            same = e.gpu == d.gpu if d.gpu is not None else (e.gpu is None and e.detector == d.detector)
            if same:
                out.append(e)
        return out

    def removed_nodes_since(self, since: float) -> set[str]:
        return {node for ts, node in self.removals if ts >= since}

    def apply(self, verdict: Verdict, now: float) -> None:
        """Record an admitted decision's consequences (refusals change nothing but a trip)."""
        if verdict.trip:
            self.breaker = BreakerRecord(tripped=True, tripped_ts=now, reason=verdict.detail)
        if not verdict.admitted:
            return
        d = verdict.decision
        self.recent[_dedup_key(d)] = now
        if verdict.mode != "act":
            return  # an alert or a dry run of its group: nothing removed, no budget spent
        if d.action in JOB_RUN_ACTIONS:
            self.restarts.append((now, d.job or d.subject))
            return
        if d.action in INFORMING or d.node is None:
            return  # a job-level decision counts against no node
        if d.action in REMOVING_ACTIONS:
            self.remember(d, now)
        rec = self.node(d.node)
        if d.action is Action.RESUME:
            rec.condition = "in_service"
        else:
            rec.condition = "awaiting_inspection" if d.action is Action.INSPECT_HARDWARE else "removed"
            rec.last_removal, rec.last_removal_ts = d.action, now
            if d.action in REMEDIATIONS:
                rec.remediations.append((now, d.action))
            self.removals.append((now, d.node))
        self.nodes[d.node] = rec

    def prune(self, now: float, config: GateConfig) -> None:
        """Forget what no window can see any more (keeps memory bounded on a long run)."""
        self.removals = [(ts, n) for ts, n in self.removals if ts >= now - config.breaker_window_seconds]
        self.restarts = [(ts, j) for ts, j in self.restarts if ts >= now - config.breaker_window_seconds]
        self.recent = {k: ts for k, ts in self.recent.items() if ts >= now - config.dedup_seconds}
        for rec in self.nodes.values():
            rec.remediations = [(ts, a) for ts, a in rec.remediations if ts >= now - config.escalation_window_seconds]
        for node, entries in list(self.history.items()):
            kept = [e for e in entries if now - e.ts <= config.history_horizon_seconds]
            if kept:
                self.history[node] = kept
            else:
                del self.history[node]


@dataclass(frozen=True)
class Verdict:
    """``reason`` is a short code (``admitted``, ``escalated``, ``cooldown``, ``breaker_open``...);
    ``detail`` explains it to an operator. ``decision`` is the decision as admitted: its action
    may be escalated and ``dry_run`` is set by the gate. ``alerts`` are decisions the gate itself
    raises (one when the breaker trips)."""

    admitted: bool
    reason: str
    detail: str
    decision: Decision
    proposed_action: Action
    trip: bool = False
    alerts: Sequence[Decision] = ()
    # The policy group that applied (DEFAULT_GROUP: none) and its mode: only an ``act`` verdict
    # changes the gate's state beyond its dedup entry (GateState.apply).
    group: str = DEFAULT_GROUP
    mode: GroupMode = "act"


def _dedup_key(d: Decision) -> tuple[str, str, str]:
    return dedup_key(d.subject, d.action.value, d.job)


def dedup_key(subject: str, action: str, job: str | None) -> tuple[str, str, str]:
    """The gate's duplicate key: (node or ``job:<job>``, action, job or "")."""
    return (subject, action, job or "")


class Gate:
    """``started`` is when this aggregator started (the breaker's start-up grace counts from it)."""

    def __init__(self, config: GateConfig, started: float | None = None) -> None:
        self.config = config
        self.started = started
        self.groups = {g.name: g for g in config.groups}

    def in_grace(self, now: float) -> bool:
        return self.started is not None and now - self.started < self.config.breaker_startup_grace_seconds

    def group_of(self, node: str | None, membership: Membership | None) -> PolicyGroup | None:
        """The policy group of ``node`` (None: the default): as the membership resolved it from the
        fleet, else (a node the fleet does not know, proposed by Alertmanager) by its name and the
        static labels alone. A job-level decision (``node`` None) is the default's."""
        if node is None or not self.groups:
            return None
        name = membership.group_of.get(node) if membership is not None else None
        if name is None:
            cfg = self.config
            return resolve(cfg.groups, node, static_labels(node, cfg.node_labels), {})
        return self.groups.get(name)

    def judge(self, decision: Decision, now: float, fleet_nodes: int, state: GateState,
              membership: Membership | None = None) -> Verdict:
        """``fleet_nodes``: the nodes that reported within the breaker window; ``membership``: the
        policy group of each node the fleet knows (None: resolved from names and static labels)."""
        cfg = self.config
        proposed = decision.action
        dry_run = cfg.dry_run or decision.dry_run
        group = self.group_of(decision.node, membership)
        group_name = group.name if group is not None else DEFAULT_GROUP
        mode: GroupMode = group.mode if group is not None else cfg.default_mode
        if cfg.policy_groups:
            decision = decision.model_copy(update={"evidence": {**decision.evidence,
                                                                "policy": {"group": group_name, "mode": mode}}})

        def refuse(reason: str, detail: str, trip: bool = False, alerts: Sequence[Decision] = ()) -> Verdict:
            return Verdict(False, reason, detail, decision, proposed, trip=trip, alerts=alerts, group=group_name,
                           mode=mode)

        def admit(action: Action, reason: str = "admitted", detail: str = "",
                  earlier: Sequence[HistoryEntry] = ()) -> Verdict:
            evidence = dict(decision.evidence)
            if action is not proposed:
                evidence["escalated_from"] = proposed.value
            if action in RUNG:  # every removing decision says which earlier episodes it counted
                evidence["earlier_episodes"] = [e.as_evidence() for e in earlier]
            out = decision.model_copy(update={"action": action, "dry_run": dry_run, "evidence": evidence})
            return Verdict(True, reason, detail or f"{action.value} admitted", out, proposed, group=group_name)

        def relaxed(action: Action) -> Verdict:
            """What a group in alert or dry_run mode admits instead of ``action``: an alert saying what
            vigil would have done, or the decision as a dry run; neither changes the gate's state."""
            evidence = {**decision.evidence, "would_action": action.value}
            if action is not proposed:
                evidence["escalated_from"] = proposed.value
            if mode == "alert":
                out = decision.model_copy(update={
                    "action": Action.ALERT, "dry_run": dry_run, "evidence": evidence,
                    "reason": f"vigil would {action.value} {decision.subject} (group {group_name} in alert mode): "
                              f"{decision.reason}"})
                return Verdict(True, "group_alert", f"{action.value} turned into an alert: group {group_name} is "
                               "in alert mode", out, proposed, group=group_name, mode=mode)
            out = decision.model_copy(update={"action": action, "dry_run": True, "evidence": evidence})
            return Verdict(True, "group_dry_run", f"{action.value} recorded, not delivered: group {group_name} is "
                           "in dry_run mode", out, proposed, group=group_name, mode=mode)

        def alert(kind: str, why: str, evidence: dict[str, object], key: str | None = None) -> Decision:
            # Deterministic id: the same alert about the same thing is one alert, however often
            # its cause is proposed again. A component's (a switch, a rack) is named as such.
            key = key or f"{kind}\x1f{decision.node}\x1f{state.breaker.tripped_ts or now:.6f}"
            return Decision(id=f"{kind}-" + hashlib.sha256(key.encode()).hexdigest()[:14], ts=now,
                            node=decision.node, gpu=decision.gpu, component=decision.component,
                            action=Action.ALERT, reason=why, detector="gate", evidence=evidence, dry_run=dry_run)

        def refused_alert(action: Action) -> Decision:
            # A real fault still reaches a person while automation is stopped (the same id whether
            # this proposal tripped the breaker or found it open: one alert).
            return alert("breaker-refused", f"vigil did not {action.value} {decision.node} (circuit breaker "
                         f"open): {decision.reason}", {"refused_decision": decision.id,
                                                       "proposed_action": action.value,
                                                       "component": decision.component})

        if is_shadow(decision):  # a shadow rule's finding: recorded to compare, never delivered
            return refuse("shadow", f"shadow rule {decision.detector.removeprefix(SHADOW_PREFIX)}: recorded, "
                          f"not acted on (its group {group_name} is in {mode} mode)")
        last = state.recent.get(_dedup_key(decision))
        if last is not None and now - last < cfg.dedup_seconds:
            return refuse("duplicate", f"{proposed.value} on {decision.subject} already admitted {now - last:.0f}s ago")
        if proposed in INFORMING:
            return admit(proposed)
        by_hand = decision.detector == OPERATOR
        acting = by_hand or mode == "act"  # an operator's own decision is never relaxed by a group
        if decision.node is None:
            # About a whole job (Decision allows only restart_job and hold_job here): no node's hold, opt-out,
            # maintenance window, cooldown or breaker budget applies; the restart budget does.
            return self._restart(decision, now, state, refuse, admit) if acting else relaxed(proposed)
        if decision.node in state.holds and not by_hand:
            ts, note = state.holds[decision.node]
            return refuse("held", f"{decision.node} is held by an operator since {ts:.0f} {note}".strip())
        if any(fnmatch.fnmatchcase(decision.node, p) for p in cfg.opt_out_nodes):
            return refuse("opt_out", f"{decision.node} is opted out of automatic actions")
        for window in cfg.maintenance:
            if window.covers(decision.node, now):
                return refuse("maintenance", f"{decision.node} is in a maintenance window {window.note}".strip())

        rec = state.node(decision.node)
        if proposed is Action.RESUME:
            if rec.condition == "in_service":
                return refuse("not_removed", f"{decision.node} is in service; nothing to resume")
            if (not by_hand and rec.last_removal_ts is not None
                    and now - rec.last_removal_ts < cfg.min_removed_seconds):
                return refuse(
                    "hysteresis",
                    f"{decision.node} was removed {now - rec.last_removal_ts:.0f}s ago "
                    f"(< {cfg.min_removed_seconds:.0f}s)",
                )
            return admit(proposed) if acting else relaxed(proposed)
        if proposed in JOB_RUN_ACTIONS:
            return self._restart(decision, now, state, refuse, admit) if acting else relaxed(proposed)

        # Only what was done before this fault began counts as "failed again": a second reading of
        # the same event (another detector, a proposal judged again later) climbs nothing.
        began = decision.since if decision.since is not None else decision.ts
        earlier = state.earlier_faults(decision, cfg.history_horizon_seconds, now, began)
        action, reason, detail = self._escalate(proposed, rec, now, earlier, began)
        if rec.condition == "awaiting_inspection":
            return refuse("awaiting_inspection", f"{decision.node} is already out for hardware inspection")
        if action is Action.DRAIN and rec.condition == "removed":
            return refuse("already_removed", f"{decision.node} is already out ({rec.last_removal})")
        if (
            action is not Action.INSPECT_HARDWARE
            and rec.last_removal_ts is not None
            and now - rec.last_removal_ts < cfg.cooldown_seconds
        ):
            return refuse(
                "cooldown",
                f"{decision.node}: {rec.last_removal} {now - rec.last_removal_ts:.0f}s ago "
                f"(cooldown {cfg.cooldown_seconds:.0f}s)",
            )
        if not acting:  # before the breakers: a group that does not act spends no budget
            return relaxed(action)

        if state.breaker.tripped:
            why = f"circuit breaker open since {state.breaker.tripped_ts}: {state.breaker.reason}"
            return refuse("breaker_open", why, alerts=(refused_alert(action),))
        removed = state.removed_nodes_since(now - cfg.breaker_window_seconds)
        group_budget = group.budget(membership.members.get(group.name, 0) if membership else 0) if group else None
        if group is not None and group_budget is not None and membership is not None:
            # The group's own budget, before the global one: a canary group that exhausts it waits
            # (proposed again as its window frees) without stopping the other groups.
            ours = {n for n in removed if membership.group_of.get(n) == group.name}
            if decision.node not in ours and len(ours) + 1 > group_budget:
                why = (f"{len(ours) + 1} of group {group.name}'s {membership.members.get(group.name, 0)} reporting "
                       f"nodes would be removed within {cfg.breaker_window_seconds:.0f}s, group budget "
                       f"{group_budget}: waits until the window frees one")
                return refuse("group_budget", why, alerts=(alert(
                    "group-budget-refused", f"vigil did not {action.value} {decision.node} (group {group.name}'s "
                    f"breaker budget spent): {decision.reason}",
                    {"refused_decision": decision.id, "proposed_action": action.value, "group": group.name,
                     "removed_nodes": sorted(ours), "budget": group_budget},
                    key=f"group-budget\x1f{decision.id}"),))
        grace = self.in_grace(now)
        budget = cfg.breaker_budget(fleet_nodes, in_grace=grace)
        if decision.node not in removed and len(removed) + 1 > budget:
            if grace:
                return refuse("startup_grace", f"{len(removed) + 1} removals would exceed the floor of "
                              f"{budget} during the start-up grace; proposed again after it")
            why = (
                f"{len(removed) + 1} of {fleet_nodes} reporting nodes would be removed within "
                f"{cfg.breaker_window_seconds:.0f}s, budget {budget}: stopped acting until a manual reset"
            )
            tripped = Decision(
                id="breaker-" + hashlib.sha256(f"{now:.6f}".encode()).hexdigest()[:14],
                ts=now,
                node=decision.node,
                action=Action.ALERT,
                reason=f"vigil circuit breaker tripped: {why}",
                detector="gate",
                evidence={"removed_nodes": sorted(removed), "budget": budget, "fleet_nodes": fleet_nodes},
                dry_run=dry_run,
            )
            # The trip's alert is about the fleet and takes the alert slot of the refused subject
            # (dedup by node and action): the refused fault itself is alerted as well, so a
            # component's finding that trips the breaker still pages with its own reason.
            return refuse("breaker_tripped", why, trip=True, alerts=(tripped, refused_alert(action)))
        return admit(action, reason, detail, earlier)

    def _restart(self, decision: Decision, now: float, state: GateState, refuse: Callable[[str, str], Verdict],
                 admit: Callable[[Action], Verdict]) -> Verdict:
        cfg = self.config
        restarts = [ts for ts, _ in state.restarts if ts >= now - cfg.breaker_window_seconds]
        if len(restarts) + 1 > cfg.restart_job_budget:
            return refuse("restart_budget", f"{len(restarts)} job restarts within "
                          f"{cfg.breaker_window_seconds:.0f}s, budget {cfg.restart_job_budget}")
        return admit(decision.action)

    def _escalate(self, proposed: Action, rec: NodeRecord, now: float, earlier: Sequence[HistoryEntry],
                  began: float) -> tuple[Action, str, str]:
        if proposed not in RUNG:
            return proposed, "admitted", ""
        window = self.config.escalation_window_seconds
        recent = [a for ts, a in rec.remediations if now - ts <= window and ts < began]
        if proposed in REMEDIATIONS and len(recent) >= self.config.max_remediation_attempts:
            return (
                Action.INSPECT_HARDWARE,
                "escalated",
                f"{len(recent)} remediations within {window:.0f}s "
                f"(cap {self.config.max_remediation_attempts}): sent to hardware inspection instead",
            )
        step = RUNG[proposed]
        why = ""
        if proposed in REMEDIATIONS and recent:
            step = max(step, RUNG[recent[-1]] + 1)
            why = f"failed again after {recent[-1].value} within {window:.0f}s"
        if earlier:
            top = max(RUNG[e.action] for e in earlier)
            if top + 1 > step:
                step = top + 1
                why = (f"the same fault {len(earlier)} time(s) before within "
                       f"{self.config.history_horizon_seconds:.0f}s (last {earlier[-1].action.value})")
        action = LADDER[min(step, len(LADDER) - 1)]
        if action is proposed or (proposed is Action.DRAIN and step == 0):
            return proposed, "admitted", ""
        return action, "escalated", f"{why}: {action.value}"
