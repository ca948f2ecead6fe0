"""A node's standing with vigil, answered to its agent with each report: trusted or not, and why.

It reads the gate's in-memory state and the engine's last findings, indexed once per evaluation, and answers
untrusted while vigil has the node out or a current finding proposes to; only the acting replica answers, and
in dry run, with the breaker tripped or the node held, a finding alone leaves it trusted. It decides and acts
on nothing: the agent passes the standing to a launcher that asks (docs/reports.md, "Standing").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vigil.aggregator.decision import REMOVING_ACTIONS, WHOLE_JOB, Finding, decision_id
from vigil.aggregator.gate import GateState

# Bounds on what the answer carries (the agent bounds what it keeps the same way).
REASON_MAX_CHARS = 240


def _standing(trusted: bool, reason: str, decision: str, since: float | None) -> dict[str, Any]:
    return {"trusted": trusted, "reason": reason[:REASON_MAX_CHARS], "decision": decision, "since": since}


class NodeStanding:
    """``of(node)``: the standing as the report's answer carries it. ``gate_state`` returns the
    gate's current state (None: no gate, as with a sink that records only), ``findings`` the
    engine's last findings (a new list each evaluation: the index is rebuilt when it changes)."""

    def __init__(self, gate_state: Callable[[], GateState | None], findings: Callable[[], Sequence[Finding]], *,
                 dry_run: bool) -> None:
        self._gate_state = gate_state
        self._findings = findings
        self._dry_run = dry_run
        self._indexed: Sequence[Finding] | None = None
        self._proposed: dict[str, Finding] = {}

    def _proposals(self) -> dict[str, Finding]:
        """Node -> the first current finding that proposes taking it out (removing actions only;
        a restart of its job without it is the planner's, and its own finding is there too)."""
        found = self._findings()
        if found is not self._indexed:
            proposed: dict[str, Finding] = {}
            for f in found:
                if f.node != WHOLE_JOB and f.action in REMOVING_ACTIONS:
                    proposed.setdefault(f.node, f)
            self._indexed, self._proposed = found, proposed
        return self._proposed

    def of(self, node: str) -> dict[str, Any]:
        state = self._gate_state()
        rec = state.nodes.get(node) if state is not None else None
        if state is not None and rec is not None and rec.condition != "in_service":
            # Out (removed, or awaiting inspection) until a resume: untrusted whatever else holds.
            entry = next((e for e in reversed(state.history.get(node, ()))
                          if e.action is rec.last_removal and e.ts == rec.last_removal_ts), None)
            what = rec.last_removal.value if rec.last_removal is not None else "removed"
            reason = f"vigil has the node out ({what}" + (f", {entry.detector})" if entry else ")")
            return self._answer(reason, entry.id if entry else "", rec.last_removal_ts)
        f = self._proposals().get(node)
        if f is None:
            return _standing(True, "", "", None)
        if state is not None and state.breaker.tripped:
            return _standing(True, f"breaker tripped: a finding would distrust it ({f.detector}: {f.reason})",
                             decision_id(f), f.since)
        if state is not None and node in state.holds:
            return _standing(True, f"operator hold: a finding would distrust it ({f.detector}: {f.reason})",
                             decision_id(f), f.since)
        return self._answer(f"{f.detector} proposes {f.action.value}: {f.reason}", decision_id(f), f.since)

    def _answer(self, reason: str, decision: str, since: float | None) -> dict[str, Any]:
        if self._dry_run:
            return _standing(True, f"dry_run: vigil would distrust it: {reason}", decision, since)
        return _standing(False, reason, decision, since)
