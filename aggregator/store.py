"""The durable decision log and the one owner of the gate's state: SQLite in WAL mode on disk, or PostgreSQL.

It writes every proposed decision with its verdict, and every admitted one with a delivery row per actuator,
in one transaction before anything acts, and is the only writer of node state, holds, the fault history,
recent removals and the breaker; on PostgreSQL the acting writes are fenced (``NotLeader`` unless this replica
holds the leadership lock). It judges nothing and delivers nothing (docs/gate.md, "store:"; docs/ha.md, "How
it works"; docs/architecture.md, "11. The acting path").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from vigil.aggregator.decision import JOB_SUBJECT_PREFIX, REMOVING_ACTIONS, Action, Decision
from vigil.aggregator.gate import BreakerRecord, GateConfig, GateState, NodeRecord, Verdict, dedup_key
from vigil.contract.validation import StrictModel

log = logging.getLogger(__name__)

DeliveryState = Literal["pending", "delivered", "failed", "dead", "dry_run"]
# failed = will be retried at next_attempt_ts; dead = gave up (the dead-letter record)
OPEN_STATES = ("pending", "failed")


class NotLeader(Exception):
    """An acting write refused: this replica does not hold the leadership lock (any more)."""


try:  # the PostgreSQL engine is optional (extra ``postgres``); SQLite needs nothing
    import psycopg
    PG_ERRORS: tuple[type[Exception], ...] = (psycopg.Error,)
except ImportError:  # pragma: no cover - exercised where psycopg is absent
    psycopg = None  # type: ignore[assignment]
    PG_ERRORS = ()

# What a write can meet at run time: disk full, read-only, I/O error, lock timeout, file gone, the
# database server gone or restarting, the leadership lost.
WRITE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, OSError, NotLeader, *PG_ERRORS)


class StoreError(Exception):
    """The store cannot be opened (corrupt, unreadable, a newer schema): one line naming the file."""


class StoreConfig(StrictModel):
    """``store:`` in the aggregator config: how the decision log is run."""

    # sqlite: one aggregator, the file at store_path. postgresql: the shared database of an HA
    # pair (docs/ha.md); two or more replicas, one acting at a time.
    backend: Literal["sqlite", "postgresql"] = "sqlite"
    # postgresql: a file holding the libpq connection string (password included), readable only
    # by the aggregator; never on the command line or in this config.
    dsn_file: str | None = None
    # How long a write waits for another connection's lock (a backup, the CLI) before it fails.
    busy_timeout_seconds: float = Field(default=5.0, gt=0)
    # Decisions whose deliveries are all finished, and refusals, are deleted after this long. It
    # must cover the gate's history horizon, which is read back from them (30 days >> 7 days).
    retention_seconds: float = Field(default=30 * 86400.0, gt=0)
    # Forgotten nodes' archived history is kept this long, for post-mortems.
    archive_retention_seconds: float = Field(default=90 * 86400.0, gt=0)
    # A failed write is retried after this, doubling up to the maximum (seconds).
    retry_base_seconds: float = Field(default=0.5, gt=0)
    retry_max_seconds: float = Field(default=30.0, gt=0)


# Ordered migrations: MIGRATIONS[i] takes a store from schema version i to i + 1 (SQLite's
# user_version). Version 0 is an empty file or a store written before versions existed (its
# tables are version 1's, hence IF NOT EXISTS there). Never edit a shipped step; add one.
MIGRATIONS: tuple[str, ...] = (
    """
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
    """,
    # 2: operator holds, the removal kind (restart_job has its own budget), archived nodes, and
    # the columns retention and the history horizon select on.
    """
    CREATE TABLE holds (node TEXT PRIMARY KEY, ts REAL NOT NULL, note TEXT NOT NULL);
    ALTER TABLE removals ADD COLUMN kind TEXT NOT NULL DEFAULT 'node';
    CREATE TABLE archived_nodes (node TEXT NOT NULL, ts REAL NOT NULL, body TEXT NOT NULL);
    CREATE INDEX decisions_ts ON decisions(ts);
    """,
    # 3: what happened to a node beyond its decision rows, for its history (`GET
    # /v1/nodes/{node}/history`): operator holds and releases, and every delivery attempt.
    """
    CREATE TABLE node_history (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        node TEXT NOT NULL,
        kind TEXT NOT NULL,
        actor TEXT NOT NULL,
        decision_id TEXT NOT NULL DEFAULT '',
        action TEXT NOT NULL DEFAULT '',
        outcome TEXT NOT NULL DEFAULT '',
        attempt INTEGER NOT NULL DEFAULT 0,
        detail TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX node_history_node ON node_history(node, seq);
    CREATE INDEX node_history_ts ON node_history(ts);
    """,
    # 4: precision from outcomes (aggregator/outcomes.py, aggregator/precision.py): each removal
    # followed, its label once known (final), and each rule's standing (demoted or not) with its changes.
    """
    CREATE TABLE outcomes (
        decision_id TEXT PRIMARY KEY,
        ts REAL NOT NULL,
        node TEXT NOT NULL,
        detector TEXT NOT NULL,
        rule TEXT NOT NULL,
        label TEXT NOT NULL,
        body TEXT NOT NULL
    );
    CREATE TABLE rule_standing (
        detector TEXT NOT NULL,
        rule TEXT NOT NULL,
        demoted INTEGER NOT NULL,
        ts REAL NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (detector, rule)
    );
    CREATE TABLE rule_changes (ts REAL NOT NULL, detector TEXT NOT NULL, rule TEXT NOT NULL,
                               demoted INTEGER NOT NULL, actor TEXT NOT NULL, body TEXT NOT NULL);
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
# Open deliveries due now, oldest first, at most one per (actuator, node).
DUE_SQL = """
    SELECT d.decision_id, d.actuator, d.node, d.state, d.attempts, d.next_attempt_ts,
           d.last_error, d.detail, x.body
    FROM deliveries d JOIN decisions x ON x.id = d.decision_id
    WHERE d.state IN ('pending', 'failed') AND d.next_attempt_ts <= ?
      AND NOT EXISTS (
        SELECT 1 FROM deliveries e
        WHERE e.actuator = d.actuator AND e.node = d.node AND e.seq < d.seq
          AND e.state IN ('pending', 'failed'))
    ORDER BY d.seq LIMIT ?
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
class NodeEvent:
    """A row of ``node_history``: kind ``hold``/``release`` (actor ``operator``, detail its note)
    or ``delivery`` (actor the actuator; outcome delivered/failed/dead; detail its error or account)."""

    seq: int
    ts: float
    node: str
    kind: str
    actor: str
    decision_id: str
    action: str
    outcome: str
    attempt: int
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


class Dialect:
    """What differs between the engines, and nothing else: placeholders, the column types of the
    migrations, how a write transaction starts, where the schema version lives."""

    name = "sqlite"
    begin = "BEGIN IMMEDIATE"

    def sql(self, text: str) -> str:
        return text

    def migration(self, text: str) -> str:
        return text


class PostgresDialect(Dialect):
    name = "postgresql"
    begin = "BEGIN"

    def sql(self, text: str) -> str:
        return text.replace("?", "%s")

    def migration(self, text: str) -> str:
        # REAL is 4 bytes in PostgreSQL: timestamps need DOUBLE PRECISION; AUTOINCREMENT is SQLite's.
        return (text.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
                .replace(" REAL", " DOUBLE PRECISION"))


# PostgreSQL: the schema version row (SQLite keeps it in PRAGMA user_version), and the advisory
# lock key that serialises two replicas migrating at once ("vigm").
PG_VERSION_TABLE = ("CREATE TABLE IF NOT EXISTS vigil_schema"
                    " (one INTEGER PRIMARY KEY CHECK (one = 1), version INTEGER NOT NULL)")
PG_MIGRATION_LOCK = 0x7669676D
# libpq settings of every connection: give up connecting after this, and notice a peer that died
# without closing the connection (a machine lost) within ~11 s instead of the kernel's 2 hours.
PG_CONNECT = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
              "keepalives_count": 3}


def read_dsn(path: str) -> str:
    """The connection string from its file (one line); StoreError naming the file otherwise."""
    try:
        dsn = Path(path).read_text().strip()
    except OSError as exc:
        raise StoreError(f"cannot read store.dsn_file {path}: {exc.strerror or exc}") from None
    if not dsn or "\n" in dsn:
        raise StoreError(f"store.dsn_file {path} must hold one libpq connection string on one line")
    return dsn


def pg_connect(dsn: str) -> Any:
    """An autocommit psycopg connection with ``PG_CONNECT``'s bounds."""
    if psycopg is None:
        raise StoreError("store.backend postgresql needs psycopg: pip install 'vigil-fleet[postgres]'")
    return psycopg.connect(dsn, autocommit=True, **PG_CONNECT)  # type: ignore[arg-type]


def _open(path: Path, busy_timeout_seconds: float) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    # FULL: a decision acknowledged to the engine is on disk even if the machine loses power.
    db.execute("PRAGMA synchronous=FULL")
    db.execute(f"PRAGMA busy_timeout={int(busy_timeout_seconds * 1000)}")
    return db


class Store:
    """One connection, serialised by a lock: the app's event loop and the dispatch threads share it.

    ``state`` is the gate's state; it changes only through ``commit``, ``set_hold``,
    ``reset_breaker`` and ``prune``, each after its rows are durably written (and through
    ``reload``, which reads it back from the database: a replica taking over from another).

    ``dsn`` selects PostgreSQL (``path`` then only names the store in messages). ``fence``, with
    PostgreSQL, returns the backend pid of the session holding the leadership lock while this
    replica holds it (None when it does not): every acting write checks, in its own transaction,
    that this session still holds lock ``lock_key``, and raises ``NotLeader`` otherwise."""

    def __init__(self, path: str | Path, busy_timeout_seconds: float = 5.0, *, dsn: str | None = None,
                 fence: Callable[[], int | None] | None = None, lock_key: int = 0) -> None:
        self.path = Path(path)
        self.dsn = dsn
        self.memory = dsn is not None or str(path) == ":memory:"  # no file of ours under us
        self.busy_timeout_seconds = busy_timeout_seconds
        self.dialect: Dialect = PostgresDialect() if dsn is not None else Dialect()
        self.fence = fence
        self.lock_key = lock_key
        self._lock = threading.RLock()
        try:
            if dsn is not None:
                self._db: Any = pg_connect(dsn)
            else:
                if not self.memory:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = _open(self.path, busy_timeout_seconds)
            self._migrate()
            if dsn is None:
                check = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]
                if check != "ok":
                    raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            self.state = self._load_state()
        except (sqlite3.Error, OSError, ValueError, *PG_ERRORS) as exc:  # type: ignore[misc]
            raise StoreError(f"decision store {self.path}: {_one_line(exc)}") from None
        self._inode = self._file_id()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _x(self, cur: Any, sql: str, args: Sequence[object] = ()) -> Any:
        """Execute ``sql`` (written with ``?`` placeholders) on ``cur`` in this engine's dialect."""
        cur.execute(self.dialect.sql(sql), args)
        return cur

    def _q(self, sql: str, args: Sequence[object] = ()) -> Any:
        """A statement on its own (reconnecting first if the server dropped the connection)."""
        return self._fresh(lambda: self._x(self._conn().cursor(), sql, args))

    def _fresh(self, first: Callable[[], Any]) -> Any:
        """Run the first statement of a unit of work; on PostgreSQL, a connection the server closed
        since the last use (a restart) is only found broken now: reconnect and run it once more.
        Nothing of the unit was done on the dead connection, so once more is not twice."""
        try:
            return first()
        except PG_ERRORS:
            if self.dsn is None or not self._db.broken:
                raise
            return first()  # _conn() reconnects

    def _conn(self) -> Any:
        if self.dsn is not None and (self._db.closed or self._db.broken):
            log.warning("decision store %s: reconnecting to PostgreSQL", self.path)
            self._db.close()
            self._db = pg_connect(self.dsn)
        return self._db

    def _begin(self) -> Any:
        def begin() -> Any:
            cur = self._conn().cursor()
            cur.execute(self.dialect.begin)
            return cur

        return self._fresh(begin)

    def _fenced(self, cur: Any) -> None:
        """In an acting write's transaction: refuse unless this replica holds the leadership lock,
        as the database itself sees it (the lock-holding session alive, and still ours)."""
        if self.fence is None:
            return
        holder = self.fence()
        if holder is None:
            raise NotLeader("this replica is not the leader")
        key = self.lock_key & 0xFFFFFFFFFFFFFFFF
        row = self._x(cur, "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid::bigint = ?"
                      " AND objid::bigint = ? AND objsubid = 1 AND pid = ? AND granted",
                      (key >> 32, key & 0xFFFFFFFF, holder)).fetchone()
        if row is None:
            raise NotLeader(f"the leadership lock is no longer held by this replica (session {holder})")

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._version()

    def _version(self) -> int:
        if self.dsn is None:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])
        row = self._q("SELECT version FROM vigil_schema").fetchone()
        return int(row[0]) if row else 0

    def _migrate(self) -> None:
        if self.dsn is not None:
            self._q(PG_VERSION_TABLE)
        initial: int | None = None  # the version found: 0 is a new store, not a migration to log
        while True:
            cur = self._begin()
            try:
                if self.dsn is not None:  # two replicas starting together: one migrates, the other waits
                    self._x(cur, "SELECT pg_advisory_xact_lock(?)", (PG_MIGRATION_LOCK,))
                version = self._version()
                initial = version if initial is None else initial
                if version > SCHEMA_VERSION:
                    raise StoreError(f"decision store {self.path}: schema version {version} is newer than this "
                                     f"vigil's {SCHEMA_VERSION}")
                if version == SCHEMA_VERSION:
                    cur.execute("COMMIT")
                    return
                for statement in self.dialect.migration(MIGRATIONS[version]).split(";"):
                    if statement.strip():
                        cur.execute(statement)
                if self.dsn is None:
                    cur.execute(f"PRAGMA user_version={version + 1}")
                else:
                    self._x(cur, "INSERT INTO vigil_schema VALUES (1, ?) ON CONFLICT (one) DO UPDATE"
                            " SET version = excluded.version", (version + 1,))
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise
            if initial:
                log.warning("decision store %s migrated to schema version %d", self.path, version + 1)

    def reload(self) -> None:
        """Read the gate's state back from the database: another replica changed it while this
        one stood by."""
        with self._lock:
            self.state = self._load_state()

    # -- the file under us --------------------------------------------------------------------

    def _file_id(self) -> tuple[int, int] | None:
        if self.memory:
            return None
        st = os.stat(self.path)
        return (st.st_dev, st.st_ino)

    def check_file(self) -> tuple[str, bool] | None:
        """None while the file we write is the file at our path; otherwise (what happened, whether
        writing may go on). A store whose file was deleted is copied from the still-open database
        to a new file at the path, so nothing written is lost at the next restart (writing goes on);
        a file replaced by another one, or a restore that failed, stops writing until it is fixed."""
        if self.memory:
            return None
        with self._lock:
            try:
                current: tuple[int, int] | None = self._file_id()
            except FileNotFoundError:
                current = None
            if current == self._inode:
                return None
            if current is not None:
                return f"store file {self.path} was replaced by another file while running; restart to use it", False
            log.error("decision store %s was deleted while running; restoring it from the open database", self.path)
            tmp = self.path.with_name(self.path.name + ".restoring")
            try:
                tmp.unlink(missing_ok=True)
                copy = sqlite3.connect(tmp)
                try:
                    self._db.backup(copy)
                finally:
                    copy.close()
                self._db.close()  # removes the old -wal/-shm names, which belong to the deleted file
                os.replace(tmp, self.path)
                self._db = _open(self.path, self.busy_timeout_seconds)
                self._inode = self._file_id()
            except WRITE_ERRORS as exc:
                return f"store file {self.path} was deleted and could not be restored: {_one_line(exc)}", False
            count = self._db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]
            log.warning("decision store %s restored (%d decisions)", self.path, count)
            return f"store file {self.path} was deleted while running; restored from the open database", True

    # -- gate state ---------------------------------------------------------------------------

    def _load_state(self) -> GateState:
        state = GateState()
        for node, cond, last, last_ts, rem in self._q("SELECT * FROM nodes"):
            state.nodes[node] = NodeRecord(
                condition=cond,
                last_removal=Action(last) if last else None,
                last_removal_ts=last_ts,
                remediations=[(float(ts), Action(a)) for ts, a in json.loads(rem)],
            )
        for ts, node, kind in self._q("SELECT ts, node, kind FROM removals ORDER BY ts"):
            (state.restarts if kind == "restart_job" else state.removals).append((ts, node))
        row = self._q("SELECT tripped, tripped_ts, reason FROM breaker").fetchone()
        if row:
            state.breaker = BreakerRecord(tripped=bool(row[0]), tripped_ts=row[1], reason=row[2])
        for node, ts, note in self._q("SELECT node, ts, note FROM holds"):
            state.holds[node] = (ts, note)
        for body, ts in self._q("SELECT body, ts FROM decisions WHERE admitted = 1 ORDER BY seq"):
            d = Decision.model_validate_json(body)
            state.recent[dedup_key(d.subject, d.action.value, d.job)] = ts
            if d.action in REMOVING_ACTIONS:
                state.remember(d, ts)
        return state

    def verdict_of(self, decision_id: str) -> tuple[bool, str] | None:
        """(admitted, reason code) of a stored decision, or None if it was never proposed."""
        with self._lock:
            row = self._q("SELECT admitted, verdict FROM decisions WHERE id = ?", (decision_id,)).fetchone()
        return (bool(row[0]), row[1]) if row else None

    def verdicts_of(self, decision_ids: Sequence[str]) -> dict[str, tuple[bool, str]]:
        """``verdict_of`` for many ids in one query per 500."""
        out: dict[str, tuple[bool, str]] = {}
        with self._lock:
            for i in range(0, len(decision_ids), 500):
                chunk = list(decision_ids[i:i + 500])
                marks = ",".join("?" * len(chunk))
                for did, admitted, verdict in self._q(
                        f"SELECT id, admitted, verdict FROM decisions WHERE id IN ({marks})", chunk):
                    out[did] = (bool(admitted), verdict)
        return out

    def commit(self, verdicts: Sequence[tuple[Verdict, Mapping[str, bool]]], now: float, shadow: GateState) -> None:
        """Write a batch of verdicts (and, for each admitted one, a delivery row per actuator that
        takes it) with the gate state they lead to (``shadow``), in ONE transaction and one fsync;
        only then does ``shadow`` become ``self.state``. Raises one of ``WRITE_ERRORS`` and
        changes nothing when the write fails.

        ``actuators`` maps each actuator that handles a decision to whether it is delivered in
        dry run (notifiers); in dry run the others get a ``dry_run`` row: what would have been done.
        """
        with self._lock:
            cur = self._begin()
            try:
                self._fenced(cur)
                touched: set[str] = set()
                for verdict, actuators in verdicts:
                    d = verdict.decision
                    # A refused proposal proposed again is judged again; its new verdict replaces the
                    # old row (and takes a new seq, so its deliveries queue behind earlier ones).
                    self._x(cur, "DELETE FROM decisions WHERE id = ? AND admitted = 0", (d.id,))
                    self._x(cur,
                        "INSERT INTO decisions (id, ts, node, action, proposed_action, detector, admitted,"
                        " verdict, detail, dry_run, body) VALUES (?,?,?,?,?,?,?,?,?,?,?) RETURNING seq",
                        (d.id, now, d.subject, d.action.value, verdict.proposed_action.value, d.detector,
                         int(verdict.admitted), verdict.reason, verdict.detail, int(d.dry_run),
                         d.model_dump_json()),
                    )
                    seq = cur.fetchone()[0]
                    if verdict.admitted:
                        if d.node is not None:
                            touched.add(d.node)
                        for name, notify_in_dry_run in actuators.items():
                            st = "dry_run" if d.dry_run and not notify_in_dry_run else "pending"
                            self._x(cur,
                                "INSERT INTO deliveries (decision_id, actuator, node, seq, state,"
                                " next_attempt_ts, updated_ts) VALUES (?,?,?,?,?,?,?)",
                                (d.id, name, d.subject, seq, st, now, now),
                            )
                for node in sorted(touched & shadow.nodes.keys()):
                    self._write_node(cur, node, shadow.nodes[node])
                for kind, old, new in (("node", self.state.removals, shadow.removals),
                                       ("restart_job", self.state.restarts, shadow.restarts)):
                    for ts, node in new[len(old):]:
                        self._x(cur, "INSERT INTO removals (ts, node, kind) VALUES (?,?,?)", (ts, node, kind))
                if shadow.breaker != self.state.breaker:
                    self._write_breaker(cur, shadow.breaker)
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise
            self.state = shadow

    def _write_node(self, cur: Any, node: str, rec: NodeRecord) -> None:
        self._x(
            cur,
            "INSERT INTO nodes VALUES (?,?,?,?,?) ON CONFLICT (node) DO UPDATE SET condition = excluded.condition,"
            " last_removal = excluded.last_removal, last_removal_ts = excluded.last_removal_ts,"
            " remediations = excluded.remediations",
            (node, rec.condition, rec.last_removal.value if rec.last_removal else None, rec.last_removal_ts,
             json.dumps([[ts, a.value] for ts, a in rec.remediations])),
        )

    def set_hold(self, node: str, held: bool, now: float, note: str = "") -> bool:
        """An operator's hold on a node (automation leaves it alone) set or released; returns
        whether it was held before."""
        with self._lock:
            before = node in self.state.holds
            cur = self._begin()
            try:
                self._fenced(cur)
                if held:
                    self._x(cur, "INSERT INTO holds VALUES (?,?,?) ON CONFLICT (node) DO UPDATE SET ts = excluded.ts,"
                            " note = excluded.note", (node, now, note))
                else:
                    self._x(cur, "DELETE FROM holds WHERE node = ?", (node,))
                self._x(cur, "INSERT INTO node_history (ts, node, kind, actor, detail) VALUES (?,?,?,?,?)",
                            (now, node, "hold" if held else "release", "operator", note))
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise
            if held:
                self.state.holds[node] = (now, note)
            else:
                self.state.holds.pop(node, None)
            return before

    def prune(self, now: float, config: GateConfig) -> None:
        """Forget what no gate window can see any more (rows first, then the state)."""
        with self._lock:
            self._q("DELETE FROM removals WHERE ts < ?", (now - config.breaker_window_seconds,))
            self.state.prune(now, config)

    def apply_retention(self, now: float, config: StoreConfig) -> int:
        """Delete finished decisions and refusals older than the retention, and old archived
        nodes; returns how many decisions went. Open (pending, failed) deliveries are kept."""
        cutoff = now - config.retention_seconds
        with self._lock:
            cur = self._begin()
            try:
                self._x(cur,
                    "DELETE FROM deliveries WHERE decision_id IN (SELECT id FROM decisions x WHERE x.ts < ? AND"
                    " NOT EXISTS (SELECT 1 FROM deliveries e WHERE e.decision_id = x.id"
                    " AND e.state IN ('pending', 'failed')))", (cutoff,))
                self._x(cur,
                    "DELETE FROM decisions WHERE ts < ? AND NOT EXISTS (SELECT 1 FROM deliveries e"
                    " WHERE e.decision_id = decisions.id)", (cutoff,))
                gone = cur.rowcount
                self._x(cur, "DELETE FROM archived_nodes WHERE ts < ?", (now - config.archive_retention_seconds,))
                self._x(cur, "DELETE FROM node_history WHERE ts < ?", (cutoff,))
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise
        return gone

    # -- outcomes of removals and each rule's standing (aggregator/precision.py owns them) ---------

    def write_outcome(self, decision_id: str, ts: float, node: str, detector: str, rule: str, label: str,
                      body: Mapping[str, object]) -> None:
        """A removal followed (``label`` empty) or labelled; a label once written is never replaced."""
        with self._lock:
            self._q("INSERT INTO outcomes VALUES (?,?,?,?,?,?,?) ON CONFLICT (decision_id) DO UPDATE SET"
                    " label = excluded.label, body = excluded.body WHERE outcomes.label = ''",
                    (decision_id, ts, node, detector, rule, label, json.dumps(body, default=str)))

    def outcomes(self) -> list[tuple[str, float, str, str, str, str, dict[str, Any]]]:
        """Every removal followed: (decision id, ts, node, detector, rule, label, body), oldest first."""
        with self._lock:
            rows = self._q("SELECT decision_id, ts, node, detector, rule, label, body FROM outcomes"
                           " ORDER BY ts").fetchall()
        return [(i, ts, n, d, r, label, json.loads(body)) for i, ts, n, d, r, label, body in rows]

    def write_rule_standing(self, detector: str, rule: str, demoted: bool, now: float, actor: str,
                            body: Mapping[str, object]) -> None:
        """A rule demoted or promoted (by ``actor``: auto or operator), its change kept as a row."""
        text = json.dumps(body, default=str)
        with self._lock:
            cur = self._begin()
            try:
                self._fenced(cur)
                self._x(cur, "INSERT INTO rule_standing VALUES (?,?,?,?,?) ON CONFLICT (detector, rule) DO UPDATE"
                        " SET demoted = excluded.demoted, ts = excluded.ts, body = excluded.body",
                        (detector, rule, int(demoted), now, text))
                self._x(cur, "INSERT INTO rule_changes VALUES (?,?,?,?,?,?)",
                        (now, detector, rule, int(demoted), actor, text))
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise

    def rule_standings(self) -> dict[tuple[str, str], tuple[bool, float, dict[str, Any]]]:
        """(detector, rule) -> (demoted, since, the evidence of its last change)."""
        with self._lock:
            rows = self._q("SELECT detector, rule, demoted, ts, body FROM rule_standing").fetchall()
        return {(d, r): (bool(x), ts, json.loads(body)) for d, r, x, ts, body in rows}

    def archive_node(self, node: str, now: float, body: Mapping[str, object]) -> None:
        """Keep a forgotten node's last known state (the fleet forgets it; post-mortems do not)."""
        with self._lock:
            self._q("INSERT INTO archived_nodes VALUES (?,?,?)", (node, now, json.dumps(body, default=str)))

    def archived_nodes(self) -> list[str]:
        with self._lock:
            return [n for (n,) in self._q("SELECT node FROM archived_nodes ORDER BY ts")]

    def departed_nodes(self) -> list[tuple[str, float, dict[str, object]]]:
        """(node, when it was forgotten, its last known state) of every archived node, oldest first."""
        with self._lock:
            rows = self._q("SELECT node, ts, body FROM archived_nodes ORDER BY ts").fetchall()
        return [(n, ts, json.loads(body)) for n, ts, body in rows]

    def reset_breaker(self) -> BreakerRecord:
        """The manual reset (operator API). Returns the record as it was before."""
        with self._lock:
            before = self.state.breaker
            cur = self._begin()
            try:
                self._fenced(cur)
                self._write_breaker(cur, BreakerRecord())
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise
            self.state.breaker = BreakerRecord()
            return before

    def breaker(self) -> BreakerRecord:
        with self._lock:
            row = self._q("SELECT tripped, tripped_ts, reason FROM breaker").fetchone()
        return BreakerRecord(tripped=bool(row[0]), tripped_ts=row[1], reason=row[2]) if row else BreakerRecord()

    def _write_breaker(self, cur: Any, rec: BreakerRecord) -> None:
        self._x(
            cur,
            "INSERT INTO breaker VALUES (1, ?, ?, ?) ON CONFLICT (one) DO UPDATE SET tripped = excluded.tripped,"
            " tripped_ts = excluded.tripped_ts, reason = excluded.reason",
            (int(rec.tripped), rec.tripped_ts, rec.reason),
        )

    # -- deliveries ---------------------------------------------------------------------------

    def due(self, now: float, limit: int = 64) -> list[tuple[Delivery, Decision]]:
        """Open deliveries whose time has come, oldest first, at most one per (actuator, node):
        a node's resume never overtakes its drain. Fenced like the acting writes: a replica that
        lost the lock and has not noticed yet is handed nothing to deliver (``NotLeader``)."""
        with self._lock:
            cur = self._begin()
            try:
                self._fenced(cur)
                rows = self._x(cur, DUE_SQL, (now, limit)).fetchall()
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise
        return [(Delivery(*row[:8]), Decision.model_validate_json(row[8])) for row in rows]

    def postpone(self, deliveries: Sequence[tuple[str, str, float]]) -> None:
        """Move each (decision id, actuator, until) delivery's next attempt to ``until`` without
        counting an attempt: the dispatcher claims a delivery it is about to start (so a replica
        that lost the lock and has not noticed yet is refused here, in the database, before it
        sends; ``NotLeader``) and defers those of an actuator whose workers are all busy."""
        if not deliveries:
            return
        with self._lock:
            cur = self._begin()
            try:
                self._fenced(cur)
                for decision_id, actuator, until in deliveries:
                    self._x(cur, "UPDATE deliveries SET next_attempt_ts = ? WHERE decision_id = ? AND actuator = ?"
                            " AND state IN ('pending', 'failed')", (until, decision_id, actuator))
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise

    def next_due_ts(self) -> float | None:
        with self._lock:
            row = self._q(
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
            cur = self._begin()
            try:
                self._fenced(cur)
                self._x(cur,
                    "UPDATE deliveries SET state = ?, attempts = attempts + 1, next_attempt_ts = ?,"
                    " last_error = ?, detail = ?, updated_ts = ? WHERE decision_id = ? AND actuator = ?",
                    (state, next_attempt_ts if next_attempt_ts is not None else now, error, detail, now,
                     decision_id, actuator),
                )
                # the attempt, for the node's history (the row above keeps only the latest)
                self._x(cur,
                    "INSERT INTO node_history (ts, node, kind, actor, decision_id, action, outcome, attempt, detail)"
                    " SELECT ?, d.node, 'delivery', d.actuator, d.decision_id, x.action, ?, d.attempts, ?"
                    " FROM deliveries d JOIN decisions x ON x.id = d.decision_id"
                    " WHERE d.decision_id = ? AND d.actuator = ?"
                    f" AND substr(d.node, 1, {len(JOB_SUBJECT_PREFIX)}) <> '{JOB_SUBJECT_PREFIX}'",
                    (now, state, error or detail, decision_id, actuator),
                )
                cur.execute("COMMIT")
            except BaseException:
                _rollback(cur)
                raise

    def deliveries(self, decision_id: str) -> list[Delivery]:
        with self._lock:
            rows = self._q(
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
            rows = self._q(sql, (*args, limit)).fetchall()
        out = []
        for seq, body, proposed, admitted, verdict, detail in rows:
            decision = Decision.model_validate_json(body)
            out.append(StoredDecision(seq=seq, decision=decision, proposed_action=Action(proposed),
                                      admitted=bool(admitted), verdict=verdict, detail=detail,
                                      deliveries=tuple(self.deliveries(decision.id))))
        return out

    def verdict_times(self, decision_ids: Sequence[str]) -> dict[str, float]:
        """When each stored decision's (latest) verdict was written, in one query per 500 ids."""
        out: dict[str, float] = {}
        with self._lock:
            for i in range(0, len(decision_ids), 500):
                chunk = list(decision_ids[i:i + 500])
                marks = ",".join("?" * len(chunk))
                out.update(self._q(f"SELECT id, ts FROM decisions WHERE id IN ({marks})", chunk).fetchall())
        return out

    def node_events(self, node: str, limit: int = 100) -> list[NodeEvent]:
        """The node's ``node_history`` rows, most recent first (job-level deliveries have none)."""
        with self._lock:
            rows = self._q(
                "SELECT seq, ts, node, kind, actor, decision_id, action, outcome, attempt, detail FROM node_history"
                " WHERE node = ? ORDER BY seq DESC LIMIT ?", (node, limit)).fetchall()
        return [NodeEvent(*row) for row in rows]

    def delivery_counts(self) -> dict[tuple[str, str], int]:
        """(actuator, state) -> count, for /metrics."""
        with self._lock:
            rows = self._q("SELECT actuator, state, COUNT(*) FROM deliveries GROUP BY actuator, state")
            return {(a, s): n for a, s, n in rows}


def _rollback(cur: Any) -> None:
    # A full disk, an I/O error or a lost server may already have ended the transaction: nothing
    # left to undo.
    with contextlib.suppress(sqlite3.Error, *PG_ERRORS):
        cur.execute("ROLLBACK")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if not isinstance(exc, OSError) or not exc.strerror else exc.strerror


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
                {"actuator": x.actuator, "state": x.state, "attempts": x.attempts, "last_error": x.last_error,
                 "detail": x.detail}
                for x in r.deliveries
            ],
        }
        for r in rows
    ]

