"""The durable decision log: SQLite in WAL mode, on disk.

Every proposed decision is written with its gate verdict, and every admitted one with a
delivery row per actuator, in one transaction before anything acts on it; node state,
escalation history and the circuit breaker live here too, so a restart neither loses an
accepted decision nor repeats a completed delivery. It judges nothing and delivers nothing.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from aggregator.decision import Action, Decision
from aggregator.gate import BreakerRecord, GateState, NodeRecord, Verdict

DeliveryState = Literal["pending", "delivered", "failed", "dead", "dry_run"]
# failed = will be retried at next_attempt_ts; dead = gave up (the dead-letter record)
OPEN_STATES = ("pending", "failed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    ts REAL NOT NULL,
    node TEXT NOT NULL,
    action TEXT NOT NULL,
    proposed_action TEXT NOT NULL,
    detector TEXT NOT NULL,
    admitted INTEGER NOT NULL,
    verdict TEXT NOT NULL,
    detail TEXT NOT NULL,
    dry_run INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_node ON decisions(node, seq);
CREATE TABLE IF NOT EXISTS deliveries (
    decision_id TEXT NOT NULL REFERENCES decisions(id),
    actuator TEXT NOT NULL,
    node TEXT NOT NULL,
    seq INTEGER NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_ts REAL NOT NULL,
    last_error TEXT NOT NULL DEFAULT '',
    detail TEXT NOT NULL DEFAULT '',
    updated_ts REAL NOT NULL,
    PRIMARY KEY (decision_id, actuator)
);
CREATE INDEX IF NOT EXISTS deliveries_open ON deliveries(state, next_attempt_ts);
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY,
    condition TEXT NOT NULL,
    last_removal TEXT,
    last_removal_ts REAL,
    remediations TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS removals (ts REAL NOT NULL, node TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS breaker (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    tripped INTEGER NOT NULL,
    tripped_ts REAL,
    reason TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class Delivery:
    decision_id: str
    actuator: str
    node: str
    state: DeliveryState
    attempts: int
    next_attempt_ts: float
    last_error: str
    detail: str


@dataclass(frozen=True)
class StoredDecision:
    seq: int
    decision: Decision
    proposed_action: Action
    admitted: bool
    verdict: str
    detail: str
    deliveries: tuple[Delivery, ...]


class Store:
    """One connection, serialised by a lock: the app's event loop and the dispatch threads share it."""

    def __init__(self, path: str | Path, busy_timeout_seconds: float = 5.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a decision acknowledged to the engine is on disk even if the machine loses power.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_seconds * 1000)}")
        self._db.executescript(SCHEMA)
        self.state = self._load_state()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- gate state ---------------------------------------------------------------------------

    def _load_state(self) -> GateState:
        state = GateState()
        for node, cond, last, last_ts, rem in self._db.execute("SELECT * FROM nodes"):
            state.nodes[node] = NodeRecord(
                condition=cond,
                last_removal=Action(last) if last else None,
                last_removal_ts=last_ts,
                remediations=[(float(ts), Action(a)) for ts, a in json.loads(rem)],
            )
        state.removals = [(ts, node) for ts, node in self._db.execute("SELECT ts, node FROM removals ORDER BY ts")]
        row = self._db.execute("SELECT tripped, tripped_ts, reason FROM breaker").fetchone()
        if row:
            state.breaker = BreakerRecord(tripped=bool(row[0]), tripped_ts=row[1], reason=row[2])
        for body, ts in self._db.execute("SELECT body, ts FROM decisions WHERE admitted = 1 ORDER BY seq"):
            d = Decision.model_validate_json(body)
            state.recent[(d.node, d.action.value, d.job or "")] = ts
        return state

    def verdict_of(self, decision_id: str) -> tuple[bool, str] | None:
        """(admitted, reason code) of a stored decision, or None if it was never proposed."""
        with self._lock:
            row = self._db.execute("SELECT admitted, verdict FROM decisions WHERE id = ?", (decision_id,)).fetchone()
        return (bool(row[0]), row[1]) if row else None

    def record(self, verdict: Verdict, now: float, actuators: Mapping[str, bool]) -> None:
        """Write the verdict (and, if admitted, one delivery row per actuator that takes it) and the
        gate-state changes in one transaction, then apply them to ``self.state``.

        ``actuators`` maps each actuator that handles this decision to whether it is delivered
        in dry run (notifiers); in dry run the others get a ``dry_run`` row: what would have been done.
        """
        d = verdict.decision
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                # A refused proposal proposed again is judged again; its new verdict replaces the
                # old row (and takes a new seq, so its deliveries queue behind earlier ones).
                cur.execute("DELETE FROM decisions WHERE id = ? AND admitted = 0", (d.id,))
                cur.execute(
                    "INSERT INTO decisions (id, ts, node, action, proposed_action, detector, admitted,"
                    " verdict, detail, dry_run, body) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        d.id,
                        now,
                        d.node,
                        d.action.value,
                        verdict.proposed_action.value,
                        d.detector,
                        int(verdict.admitted),
                        verdict.reason,
                        verdict.detail,
                        int(d.dry_run),
                        d.model_dump_json(),
                    ),
                )
                seq = cur.lastrowid
                if verdict.admitted:
                    for name, notify_in_dry_run in actuators.items():
                        st = "dry_run" if d.dry_run and not notify_in_dry_run else "pending"
                        cur.execute(
                            "INSERT INTO deliveries (decision_id, actuator, node, seq, state,"
                            " next_attempt_ts, updated_ts) VALUES (?,?,?,?,?,?,?)",
                            (d.id, name, d.node, seq, st, now, now),
                        )
                shadow = _copy_state(self.state)
                shadow.apply(verdict, now)
                if verdict.admitted and d.node in shadow.nodes:
                    rec = shadow.nodes[d.node]
                    cur.execute(
                        "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?)",
                        (
                            d.node,
                            rec.condition,
                            rec.last_removal.value if rec.last_removal else None,
                            rec.last_removal_ts,
                            json.dumps([[ts, a.value] for ts, a in rec.remediations]),
                        ),
                    )
                    if len(shadow.removals) > len(self.state.removals):
                        cur.execute("INSERT INTO removals VALUES (?,?)", shadow.removals[-1])
                if verdict.trip:
                    self._write_breaker(cur, shadow.breaker)
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            self.state = shadow

    def prune(self, now: float, breaker_window_seconds: float) -> None:
        with self._lock:
            self._db.execute("DELETE FROM removals WHERE ts < ?", (now - breaker_window_seconds,))

    def reset_breaker(self) -> BreakerRecord:
        """The manual reset (API or CLI). Returns the record as it was before."""
        with self._lock:
            before = self.state.breaker
            cur = self._db.cursor()
            self._write_breaker(cur, BreakerRecord())
            self.state.reset_breaker()
            return before

    def breaker(self) -> BreakerRecord:
        with self._lock:
            row = self._db.execute("SELECT tripped, tripped_ts, reason FROM breaker").fetchone()
        return BreakerRecord(tripped=bool(row[0]), tripped_ts=row[1], reason=row[2]) if row else BreakerRecord()

    @staticmethod
    def _write_breaker(cur: sqlite3.Cursor, rec: BreakerRecord) -> None:
        cur.execute(
            "INSERT OR REPLACE INTO breaker VALUES (1, ?, ?, ?)",
            (int(rec.tripped), rec.tripped_ts, rec.reason),
        )

    # -- deliveries ---------------------------------------------------------------------------

    def due(self, now: float, limit: int = 64) -> list[tuple[Delivery, Decision]]:
        """Open deliveries whose time has come, oldest first, at most one per (actuator, node):
        a node's resume never overtakes its drain."""
        with self._lock:
            rows = self._db.execute(
                """
                SELECT d.decision_id, d.actuator, d.node, d.state, d.attempts, d.next_attempt_ts,
                       d.last_error, d.detail, x.body
                FROM deliveries d JOIN decisions x ON x.id = d.decision_id
                WHERE d.state IN ('pending', 'failed') AND d.next_attempt_ts <= ?
                  AND NOT EXISTS (
                    SELECT 1 FROM deliveries e
                    WHERE e.actuator = d.actuator AND e.node = d.node AND e.seq < d.seq
                      AND e.state IN ('pending', 'failed'))
                ORDER BY d.seq LIMIT ?
                """,
                (now, limit),
            ).fetchall()
        return [(Delivery(*row[:8]), Decision.model_validate_json(row[8])) for row in rows]

    def next_due_ts(self) -> float | None:
        with self._lock:
            row = self._db.execute(
                """
                SELECT MIN(d.next_attempt_ts) FROM deliveries d
                WHERE d.state IN ('pending', 'failed') AND NOT EXISTS (
                    SELECT 1 FROM deliveries e
                    WHERE e.actuator = d.actuator AND e.node = d.node AND e.seq < d.seq
                      AND e.state IN ('pending', 'failed'))
                """
            ).fetchone()
        return row[0] if row else None

    def mark(
        self,
        decision_id: str,
        actuator: str,
        state: DeliveryState,
        now: float,
        next_attempt_ts: float | None = None,
        error: str = "",
        detail: str = "",
    ) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE deliveries SET state = ?, attempts = attempts + 1, next_attempt_ts = ?,"
                " last_error = ?, detail = ?, updated_ts = ? WHERE decision_id = ? AND actuator = ?",
                (
                    state,
                    next_attempt_ts if next_attempt_ts is not None else now,
                    error,
                    detail,
                    now,
                    decision_id,
                    actuator,
                ),
            )

    def deliveries(self, decision_id: str) -> list[Delivery]:
        with self._lock:
            rows = self._db.execute(
                "SELECT decision_id, actuator, node, state, attempts, next_attempt_ts, last_error, detail"
                " FROM deliveries WHERE decision_id = ? ORDER BY actuator",
                (decision_id,),
            ).fetchall()
        return [Delivery(*row) for row in rows]

    # -- reading back -------------------------------------------------------------------------

    def decisions(self, limit: int = 100, admitted_only: bool = False, node: str | None = None) -> list[StoredDecision]:
        """Most recent first."""
        where, args = [], []
        if admitted_only:
            where.append("admitted = 1")
        if node is not None:
            where.append("node = ?")
            args.append(node)
        sql = "SELECT seq, body, proposed_action, admitted, verdict, detail FROM decisions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit)).fetchall()
        return [
            StoredDecision(
                seq=seq,
                decision=Decision.model_validate_json(body),
                proposed_action=Action(proposed),
                admitted=bool(admitted),
                verdict=verdict,
                detail=detail,
                deliveries=tuple(self.deliveries(Decision.model_validate_json(body).id)),
            )
            for seq, body, proposed, admitted, verdict, detail in rows
        ]

    def delivery_counts(self) -> dict[tuple[str, str], int]:
        """(actuator, state) -> count, for /metrics."""
        with self._lock:
            rows = self._db.execute("SELECT actuator, state, COUNT(*) FROM deliveries GROUP BY actuator, state")
            return {(a, s): n for a, s, n in rows}


def _copy_state(state: GateState) -> GateState:
    return GateState(
        nodes={
            k: NodeRecord(v.condition, v.last_removal, v.last_removal_ts, list(v.remediations))
            for k, v in state.nodes.items()
        },
        removals=list(state.removals),
        breaker=state.breaker,
        recent=dict(state.recent),
    )


def decisions_as_dicts(rows: Iterable[StoredDecision]) -> list[dict[str, object]]:
    """The JSON form `vigil aggregator decisions --json` prints."""
    return [
        {
            "seq": r.seq,
            "decision": r.decision.model_dump(mode="json"),
            "proposed_action": r.proposed_action.value,
            "admitted": r.admitted,
            "verdict": r.verdict,
            "detail": r.detail,
            "deliveries": [
                {
                    "actuator": x.actuator,
                    "state": x.state,
                    "attempts": x.attempts,
                    "last_error": x.last_error,
                    "detail": x.detail,
                }
                for x in r.deliveries
            ],
        }
        for r in rows
    ]
