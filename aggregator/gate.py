"""The gate: decides which proposed decisions may act, given what has already been done.

It reads a ``GateState`` (node states, escalation history, recent removals, the circuit breaker;
the store keeps it durable) and a proposed ``Decision`` and returns a ``Verdict``: admitted
(possibly escalated) or refused with a reason code. It is pure: no I/O, no clock (``now`` is
given), and it never delivers anything; ``GateState.apply`` records a verdict's consequences.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from aggregator.decision import Action, Decision

NodeCondition = Literal["in_service", "removed", "awaiting_inspection"]

# Remediation ladder (DESIGN.md section 7): a node that fails again after a GPU reset is
# rebooted; after a reboot it goes to hardware inspection. NVIDIA's Xid catalog orders the
# recovery actions the same way (RESET_GPU, then RESTART_BM/reboot, then field diagnostics).
LADDER: tuple[Action, ...] = (Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE)
REMEDIATIONS = frozenset({Action.RESET_GPU, Action.REBOOT_NODE})
# Only informs people; never refused except as an exact duplicate.
INFORMING = frozenset({Action.OBSERVE, Action.ALERT})
# Severity for the cooldown: the Action enum is declared in rising order of cost to the job.
SEVERITY = {action: rank for rank, action in enumerate(Action)}


class MaintenanceWindow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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


class GateConfig(BaseModel):
    """Defaults are conservative: a breaker that stops after 5% of the fleet.

    The 5% share follows the common practice of fleet operators (e.g. Meta's and Google's
    published automated-repair systems cap concurrent repairs at a few percent of a cluster):
    more than that in an hour is a switch, a driver roll-out or a bad rule, not bad GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    # A small fleet can still remove this many nodes whatever the share says.
    breaker_floor_nodes: int = Field(default=1, ge=0)
    opt_out_nodes: list[str] = Field(default_factory=list)  # fnmatch patterns
    maintenance: list[MaintenanceWindow] = Field(default_factory=list)

    def breaker_budget(self, fleet_nodes: int) -> int:
        """Most distinct nodes the gate may remove within one breaker window."""
        budget = max(self.breaker_floor_nodes, math.floor(self.breaker_max_share * max(fleet_nodes, 0)))
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


@dataclass
class BreakerRecord:
    tripped: bool = False
    tripped_ts: float | None = None
    reason: str = ""


@dataclass
class GateState:
    """What the gate knows; the store loads it at start and persists every change."""

    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    removals: list[tuple[float, str]] = field(default_factory=list)  # (ts, node), breaker window
    breaker: BreakerRecord = field(default_factory=BreakerRecord)
    # (node, action, job) -> ts of the last admission, for dedup
    recent: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def node(self, name: str) -> NodeRecord:
        return self.nodes.get(name) or NodeRecord()

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
        if d.action in INFORMING or d.action is Action.RESTART_JOB:
            return
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
        self.recent = {k: ts for k, ts in self.recent.items() if ts >= now - config.dedup_seconds}
        for rec in self.nodes.values():
            rec.remediations = [(ts, a) for ts, a in rec.remediations if ts >= now - config.escalation_window_seconds]

    def reset_breaker(self) -> None:
        self.breaker = BreakerRecord()


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


def _dedup_key(d: Decision) -> tuple[str, str, str]:
    return (d.node, d.action.value, d.job or "")


class Gate:
    def __init__(self, config: GateConfig) -> None:
        self.config = config

    def judge(self, decision: Decision, now: float, fleet_nodes: int, state: GateState) -> Verdict:
        cfg = self.config
        proposed = decision.action
        dry_run = cfg.dry_run or decision.dry_run

        def refuse(reason: str, detail: str, trip: bool = False, alerts: Sequence[Decision] = ()) -> Verdict:
            return Verdict(False, reason, detail, decision, proposed, trip=trip, alerts=alerts)

        def admit(action: Action, reason: str = "admitted", detail: str = "") -> Verdict:
            evidence = dict(decision.evidence)
            if action is not proposed:
                evidence["escalated_from"] = proposed.value
            out = decision.model_copy(update={"action": action, "dry_run": dry_run, "evidence": evidence})
            return Verdict(True, reason, detail or f"{action.value} admitted", out, proposed)

        last = state.recent.get(_dedup_key(decision))
        if last is not None and now - last < cfg.dedup_seconds:
            return refuse("duplicate", f"{proposed.value} on {decision.node} already admitted {now - last:.0f}s ago")
        if proposed in INFORMING:
            return admit(proposed)
        if any(fnmatch.fnmatchcase(decision.node, p) for p in cfg.opt_out_nodes):
            return refuse("opt_out", f"{decision.node} is opted out of automatic actions")
        for window in cfg.maintenance:
            if window.covers(decision.node, now):
                return refuse("maintenance", f"{decision.node} is in a maintenance window {window.note}".strip())

        rec = state.node(decision.node)
        if proposed is Action.RESUME:
            if rec.condition == "in_service":
                return refuse("not_removed", f"{decision.node} is in service; nothing to resume")
            if rec.last_removal_ts is not None and now - rec.last_removal_ts < cfg.min_removed_seconds:
                return refuse(
                    "hysteresis",
                    f"{decision.node} was removed {now - rec.last_removal_ts:.0f}s ago "
                    f"(< {cfg.min_removed_seconds:.0f}s)",
                )
            return admit(proposed)
        if proposed is Action.RESTART_JOB:
            return admit(proposed)

        action, reason, detail = self._escalate(proposed, rec, now)
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

        if state.breaker.tripped:
            return refuse(
                "breaker_open",
                f"circuit breaker open since {state.breaker.tripped_ts}: {state.breaker.reason}",
            )
        removed = state.removed_nodes_since(now - cfg.breaker_window_seconds)
        budget = cfg.breaker_budget(fleet_nodes)
        if decision.node not in removed and len(removed) + 1 > budget:
            why = (
                f"{len(removed) + 1} of {fleet_nodes} nodes would be removed within "
                f"{cfg.breaker_window_seconds:.0f}s, budget {budget}: stopped acting until a manual reset"
            )
            alert = Decision(
                id="breaker-" + hashlib.sha256(f"{now:.6f}".encode()).hexdigest()[:14],
                ts=now,
                node=decision.node,
                action=Action.ALERT,
                reason=f"vigil circuit breaker tripped: {why}",
                detector="gate",
                evidence={"removed_nodes": sorted(removed), "budget": budget, "fleet_nodes": fleet_nodes},
                dry_run=dry_run,
            )
            return refuse("breaker_tripped", why, trip=True, alerts=(alert,))
        return admit(action, reason, detail)

    def _escalate(self, proposed: Action, rec: NodeRecord, now: float) -> tuple[Action, str, str]:
        if proposed not in REMEDIATIONS:
            return proposed, "admitted", ""
        window = self.config.escalation_window_seconds
        recent = [a for ts, a in rec.remediations if now - ts <= window]
        if len(recent) >= self.config.max_remediation_attempts:
            return (
                Action.INSPECT_HARDWARE,
                "escalated",
                f"{len(recent)} remediations within {window:.0f}s "
                f"(cap {self.config.max_remediation_attempts}): sent to hardware inspection instead",
            )
        if recent:
            step = min(max(LADDER.index(proposed), LADDER.index(recent[-1]) + 1), len(LADDER) - 1)
            if LADDER[step] is not proposed:
                return (
                    LADDER[step],
                    "escalated",
                    f"failed again after {recent[-1].value} within {window:.0f}s: {LADDER[step].value}",
                )
        return proposed, "admitted", ""
