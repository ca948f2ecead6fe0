"""A node's remediation history in one view: what was proposed for it, judged, delivered and done by hand.

It reads the decision store (the node's decision rows with their gate verdicts and delivery
rows, the ``node_history`` log of operator holds and delivery attempts, and the gate's state for
the node's current standing) and emits one JSON-ready document: the standing and a bounded,
time-ordered list of entries, newest first. It decides nothing and changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from vigil.aggregator.decision import REMOVING_ACTIONS
from vigil.aggregator.store import NodeEvent, Store, StoredDecision

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
# An evidence summary is one line an operator reads in a table, not the whole evidence.
EVIDENCE_SUMMARY_CHARS = 240
# Evidence the gate adds when it admits (the stored body is the admitted decision): not the
# detector's, so a proposal's summary leaves it out; the verdict's action shows an escalation.
GATE_EVIDENCE = frozenset({"earlier_episodes", "escalated_from"})
# Kinds in the order one moment's entries are listed (oldest first): proposed, judged, then acted on.
KINDS = ("proposed", "verdict", "delivery", "hold", "release")
_KIND_ORDER = {kind: i for i, kind in enumerate(KINDS)}


def evidence_summary(evidence: dict[str, Any]) -> str:
    """The detector's evidence as ``key=value`` pairs on one line, cut at ``EVIDENCE_SUMMARY_CHARS``."""
    parts = []
    for key, value in evidence.items():
        if key in GATE_EVIDENCE:
            continue
        if isinstance(value, str | int | float | bool) or value is None:
            parts.append(f"{key}={value}")
        else:
            parts.append(f"{key}={json.dumps(value, separators=(',', ':'), default=str)}")
    text = " ".join(parts)
    return text if len(text) <= EVIDENCE_SUMMARY_CHARS else text[:EVIDENCE_SUMMARY_CHARS - 3] + "..."


def _entry(ts: float, kind: str, action: str, decision: str | None, outcome: str, detail: str, actor: str,
           order: tuple[float, int, int]) -> tuple[tuple[float, int, int], dict[str, Any]]:
    return order, {"ts": ts, "kind": kind, "action": action, "decision": decision, "outcome": outcome,
                   "detail": detail, "actor": actor}


def _decision_entries(row: StoredDecision, logged: set[tuple[str, str]], verdict_ts: float
                      ) -> list[tuple[tuple[float, int, int], dict[str, Any]]]:
    d = row.decision
    summary = evidence_summary(d.evidence)
    proposed = d.reason + (f" [{summary}]" if summary else "")
    out = [
        _entry(d.ts, "proposed", row.proposed_action.value, d.id, "proposed", proposed, d.detector,
               (d.ts, row.seq, _KIND_ORDER["proposed"])),
        _entry(verdict_ts, "verdict", d.action.value, d.id, "admitted" if row.admitted else f"refused: {row.verdict}",
               row.detail, "gate", (verdict_ts, row.seq, _KIND_ORDER["verdict"])),
    ]
    for x in row.deliveries:
        if (d.id, x.actuator) in logged:
            continue  # its attempts are in node_history, one entry each
        # not attempted yet (pending, dry run) or written before attempts were logged: the row itself
        detail = x.last_error or x.detail or ("would have been delivered (dry run)" if x.state == "dry_run" else "")
        outcome = x.state + (f" after {x.attempts} attempt(s)" if x.attempts > 1 else "")
        out.append(_entry(verdict_ts, "delivery", d.action.value, d.id, outcome, detail, x.actuator,
                          (verdict_ts, row.seq, _KIND_ORDER["delivery"])))
    return out


def _event_entry(e: NodeEvent) -> tuple[tuple[float, int, int], dict[str, Any]]:
    if e.kind == "delivery":  # after the verdicts of its instant
        outcome = e.outcome + (f" (attempt {e.attempt})" if e.attempt else "")
        return _entry(e.ts, "delivery", e.action, e.decision_id or None, outcome, e.detail, e.actor,
                      (e.ts, 1 << 62, e.seq))
    # at one instant an operator's hold or release comes first (the resume route releases, then proposes)
    return _entry(e.ts, e.kind, "", None, "held" if e.kind == "hold" else "released", e.detail, e.actor,
                  (e.ts, -1, e.seq))


def standing(store: Store, node: str, entries_newest_first: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the node is out of service (by which action and decision, since when) and held."""
    state = store.state
    rec = state.nodes.get(node)
    removed = rec is not None and rec.condition != "in_service"
    removal = None
    if removed and rec is not None and rec.last_removal is not None:
        removal = next((e["decision"] for e in entries_newest_first
                        if e["kind"] == "verdict" and e["outcome"] == "admitted"
                        and e["action"] in {a.value for a in REMOVING_ACTIONS}), None)
    hold = state.holds.get(node)
    return {
        "condition": rec.condition if rec is not None else "in_service",
        "removed": removed,
        "removed_by": rec.last_removal.value if removed and rec is not None and rec.last_removal else None,
        "removed_decision": removal,
        "removed_since": rec.last_removal_ts if removed and rec is not None else None,
        "held": hold is not None,
        "held_since": hold[0] if hold else None,
        "held_by": "operator" if hold else None,
        "hold_note": hold[1] if hold else None,
    }


def node_history(store: Store, node: str, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """The history document of ``node`` (``GET /v1/nodes/{node}/history``): its standing and its
    newest ``limit`` entries, newest first. A node the store has never seen has an empty list."""
    limit = max(1, min(limit, MAX_LIMIT))
    rows = store.decisions(limit=limit, node=node)
    events = store.node_events(node, limit=limit)
    logged = {(e.decision_id, e.actor) for e in events if e.kind == "delivery"}
    verdict_ts = store.verdict_times([r.decision.id for r in rows])
    keyed = [_event_entry(e) for e in events]
    for row in rows:
        keyed.extend(_decision_entries(row, logged, verdict_ts.get(row.decision.id, row.decision.ts)))
    keyed.sort(key=lambda k: k[0], reverse=True)
    entries = [e for _, e in keyed[:limit]]
    return {"node": node, "standing": standing(store, node, entries), "order": "newest_first", "limit": limit,
            "truncated": len(keyed) > limit, "entries": entries}

