"""Outcomes: each removal labelled by what happened next, from evidence the aggregator already receives.

It reads the decisions the ledger records after a removal (a failed probe, an inspection, a resume, the
same rule removing the node again), how the node ran under load after it was given back, and an
operator's ticket verdict; it returns a final label, CONFIRMED or NOT_CONFIRMED, with its evidence.
Pure functions over plain records: it keeps no state, writes nothing and judges no rule (precision.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision

CONFIRMED: Final = "confirmed"
NOT_CONFIRMED: Final = "not_confirmed"
Label = Literal["confirmed", "not_confirmed"]
LABELS: tuple[Label, ...] = (CONFIRMED, NOT_CONFIRMED)
# The kinds of evidence that label a removal (the ``evidence.kind`` of each label).
EVIDENCE_KINDS = ("probe_failed", "repair", "recurred", "ticket_fault", "probes_passed", "clean_run",
                  "ticket_no_fault")
# Removals that change the node (a reboot, a GPU reset): a node that passes its probes or runs clean
# after one proves the remediation worked, not that the fault was never there (a reboot cures a real
# Xid 79 as well as it "cures" a healthy node), so neither labels it NOT_CONFIRMED; only an operator's
# ticket does. A failure after it (probe failed, inspection, recurrence) still confirms it.
REMEDIATING_ACTIONS = frozenset({Action.REBOOT_NODE, Action.RESET_GPU})
# A rule's name as a metric label: a detector's evidence ``signal`` is a constant of its code
# (``memory_temperature_celsius``, ``clock_event_reasons``); anything else falls back to the action.
_RULE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def rule_of(decision: Decision) -> str:
    """The rule that made ``decision`` within its detector: its evidence's ``signal`` (a constant in
    the detector's code, a bounded set), else its proposed action's name."""
    signal = decision.evidence.get("signal")
    if isinstance(signal, str) and _RULE_NAME.fullmatch(signal):
        return signal
    return decision.action.value


@dataclass(frozen=True)
class Outcome:
    """A final label and what proved it: ``kind`` (one of EVIDENCE_KINDS), when, a line and details."""

    label: Label
    ts: float
    kind: str
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)

    def as_evidence(self) -> dict[str, Any]:
        return {"label": self.label, "ts": self.ts, "kind": self.kind, "detail": self.detail, **self.extra}


@dataclass(frozen=True)
class Followed:
    """A removal followed until labelled: the admitted decision's identity, and what the follower has
    seen since (when the node was given back, how long it has run clean under load since)."""

    decision_id: str
    node: str
    detector: str
    rule: str
    action: Action
    ts: float
    resumed: float | None = None
    clean_seconds: float = 0.0
    clean_at: float | None = None

    @classmethod
    def of(cls, decision: Decision, ts: float) -> Followed:
        assert decision.node is not None
        return cls(decision.id, decision.node, decision.detector, rule_of(decision), decision.action, ts)

    def as_body(self) -> dict[str, Any]:
        return {"node": self.node, "detector": self.detector, "rule": self.rule, "action": self.action.value,
                "ts": self.ts, "resumed": self.resumed, "clean_seconds": round(self.clean_seconds, 1)}


def follows(decision: Decision) -> bool:
    """Whether an admitted decision is a removal to label: a node removed by a detector for real
    (not a dry run, not an operator's hand, not a job-level decision)."""
    return decision.action in REMOVING_ACTIONS and decision.node is not None and not decision.dry_run


def after_decision(f: Followed, d: Decision, now: float, recurrence_horizon_seconds: float
                   ) -> tuple[Followed, Outcome | None]:
    """The removal ``f`` after the ledger admitted ``d`` (a later decision) at ``now``: its label if
    ``d`` settles it, and the follower's record (a resume noted). Sources of each rule: issue 45 item 4."""
    if d.node != f.node or d.id == f.decision_id or now < f.ts:
        return f, None
    signal = d.evidence.get("signal")
    ref = {"decision": d.id, "detector": d.detector, "action": d.action.value}
    # A validation probe on the node failed after the removal: the recovery detector's failed recovery
    # probe (docs/probes.md) or the probe verdict detector's failed suspect run.
    if signal in ("probe_failed", "isolation_faulty"):
        return f, Outcome(CONFIRMED, now, "probe_failed", f"a validation probe on {f.node} failed: {d.reason}", ref)
    # The node needed an inspection or repair: a technician's turn (the recovery detector sends a node
    # whose fault came back after its remediation, the gate's ladder one that failed too often).
    if d.action is Action.INSPECT_HARDWARE:
        return f, Outcome(CONFIRMED, now, "repair", f"{f.node} needed a hardware inspection: {d.reason}", ref)
    if d.action is Action.RESUME:
        # Probes passed before the resume (the recovery detector's verified resume with probes on): the
        # node as it was removed is healthy, unless the removal itself remediated it.
        if d.evidence.get("probes") and f.action not in REMEDIATING_ACTIONS and f.resumed is None:
            return replace(f, resumed=now, clean_seconds=0.0, clean_at=None), Outcome(
                NOT_CONFIRMED, now, "probes_passed", f"{f.node} passed its validation probes", ref)
        return replace(f, resumed=now, clean_seconds=0.0, clean_at=None), None
    # The same rule removed the node again within the horizon after it was given back.
    if (d.action in REMOVING_ACTIONS and f.resumed is not None and now - f.resumed <= recurrence_horizon_seconds
            and d.detector == f.detector and rule_of(d) == f.rule):
        return f, Outcome(CONFIRMED, now, "recurred", f"the same fault came back on {f.node} "
                          f"{now - f.resumed:.0f} s after it was given back", ref)
    return f, None


def after_clean_pass(f: Followed, now: float, clean: bool, clean_run_seconds: float
                     ) -> tuple[Followed, Outcome | None]:
    """One evaluation's look at a given-back node: ``clean`` when it reported on time with a job on it
    and no removing finding. Clean time adds up between consecutive clean passes (a gap, a job-less or a
    faulty pass starts it again); ``clean_run_seconds`` of it labels a removal that did not change the
    node NOT_CONFIRMED (a remediating one is never labelled so: REMEDIATING_ACTIONS)."""
    if f.resumed is None or f.action in REMEDIATING_ACTIONS:
        return f, None
    if not clean:
        return replace(f, clean_seconds=0.0, clean_at=None), None
    seconds = f.clean_seconds + (now - f.clean_at if f.clean_at is not None else 0.0)
    f = replace(f, clean_seconds=seconds, clean_at=now)
    if seconds >= clean_run_seconds:
        return f, Outcome(NOT_CONFIRMED, now, "clean_run", f"{f.node} ran clean under load for {seconds:.0f} s "
                          "after it was given back", {"clean_seconds": round(seconds, 1)})
    return f, None


def from_ticket(f: Followed, now: float, fault: bool, note: str) -> Outcome:
    """An operator closed the node's hardware ticket for this removal: a fault found, or none."""
    return Outcome(CONFIRMED if fault else NOT_CONFIRMED, now, "ticket_fault" if fault else "ticket_no_fault",
                   f"an operator closed the ticket of {f.node} as {'a fault' if fault else 'no fault'}"
                   f"{': ' + note if note else ''}", {"actor": "operator"})
