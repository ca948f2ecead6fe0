"""Which replica of an HA pair acts: a PostgreSQL advisory lock, kept only while the acting loop progresses.

It reads ``pg_try_advisory_lock`` on a dedicated connection and the leader's recorded progress, and says
whether this replica leads and which session holds the lock (the store fences on it); a leader whose acting
loop stalls gives the lock up, and a warm standby fences it with ``pg_terminate_backend``. It is no consensus
protocol of its own and judges and delivers nothing; a lone aggregator on SQLite uses ``SoleLeader``
(docs/ha.md, "How it works").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import Field, model_validator

from vigil.aggregator.store import PG_ERRORS, PG_MIGRATION_LOCK, pg_connect
from vigil.contract.validation import StrictModel

log = logging.getLogger("vigil.aggregator.leadership")

# Statements on the lock connection give up after this (a server that hangs must not hold the
# check, and with it the knowledge that leadership is lost, for longer than a couple of checks).
CHECK_STATEMENT_TIMEOUT_MS = 2000
# A standby fencing a stalled leader waits this long for its lock session to end (the lock is
# released when the backend exits); a longer exit is found at the next check.
FENCE_WAIT_MS = 1000
# The leader's lease ends this long before a standby may fence it (progress_timeout_seconds after
# the progress it last wrote): room for the two clocks' readings and one delivery's claim.
LEASE_MARGIN_SECONDS = 1.0
# The leader's progress, one row per lock key, written in the database's own time (the replicas'
# clocks never compared). Its own table, not a store migration: only an HA pair has one.
PROGRESS_TABLE = ("CREATE TABLE IF NOT EXISTS vigil_leader_progress (lock_key BIGINT PRIMARY KEY,"
                  " holder_pid INTEGER NOT NULL, progress_ts TIMESTAMPTZ NOT NULL)")
WRITE_PROGRESS = ("INSERT INTO vigil_leader_progress (lock_key, holder_pid, progress_ts)"
                  " VALUES (%s, pg_backend_pid(), clock_timestamp() - make_interval(secs => %s))"
                  " ON CONFLICT (lock_key) DO UPDATE SET holder_pid = excluded.holder_pid,"
                  " progress_ts = excluded.progress_ts")
# The lock's holder now, and how old its recorded progress is (NULL: it recorded none yet).
HOLDER_PROGRESS = ("SELECT l.pid, EXTRACT(EPOCH FROM clock_timestamp() - p.progress_ts)::float8"
                   " FROM pg_locks l LEFT JOIN vigil_leader_progress p ON p.lock_key = %s AND p.holder_pid = l.pid"
                   " WHERE l.locktype = 'advisory' AND l.classid::bigint = %s AND l.objid::bigint = %s"
                   " AND l.objsubid = 1 AND l.granted")


class HaConfig(StrictModel):
    """``ha:`` in the aggregator config: the leadership of replicas sharing a PostgreSQL store
    (``store.backend: postgresql``; ignored with SQLite). docs/ha.md."""

    # The advisory lock's key: one per pair sharing a database ("vigi" in ASCII).
    lock_key: int = Field(default=0x76696769, ge=-(2**63), lt=2**63)
    # How often the leader verifies it still holds the lock and a standby tries to take it; the
    # takeover after a leader dies is at most about this plus the database noticing the death.
    check_interval_seconds: float = Field(default=1.0, gt=0, le=10)
    # A replica asks for the lock only after receiving reports this long: its fleet view must
    # cover the silence detector's limit (detectors.silence.alert_after_seconds_min, 15 s) twice
    # over, so that a node is never silent merely because this replica has not heard it yet.
    warm_after_seconds: float = Field(default=30.0, ge=0)
    # The leader keeps the lock only while its acting loop completes a round at least this often
    # (it does every actuators.delivery.poll_seconds, 1 s, when idle); a standby fences a leader
    # whose recorded progress is older. Detection plus takeover stay within the 15 s failover
    # budget (docs/architecture.md section 9): this + 2 checks + reading the gate's state back.
    progress_timeout_seconds: float = Field(default=6.0, gt=0, le=60)

    @model_validator(mode="after")
    def _room_for_checks(self) -> HaConfig:
        if self.progress_timeout_seconds < 2 * self.check_interval_seconds + LEASE_MARGIN_SECONDS:
            raise ValueError(f"progress_timeout_seconds must be at least twice check_interval_seconds plus "
                             f"{LEASE_MARGIN_SECONDS:g} s (a leader writes its progress at every check)")
        return self


class SoleLeader:
    """The one aggregator of a SQLite store: it always acts."""

    leader = True
    holder_pid: int | None = None
    transitions = 0
    fenced = 0
    relinquished = 0
    ha = False

    def check(self, warm: bool) -> bool:
        return True

    def release(self) -> None:
        pass


class Leadership:
    """The lock on its own connection. ``check`` runs on one thread at a time (the app's
    leadership task); ``leader`` and ``holder_pid`` are read from any thread. ``progress`` says
    how many seconds ago the acting loop last completed a round (None: no acting loop to follow)."""

    ha = True

    def __init__(self, dsn: str, lock_key: int, *, connect: Callable[[str], Any] = pg_connect,
                 clock: Callable[[], float] = time.monotonic, progress_timeout_seconds: float = 6.0,
                 progress: Callable[[], float | None] = lambda: None) -> None:
        self.dsn = dsn
        self.lock_key = lock_key
        self.connect = connect
        self.clock = clock
        self.progress_timeout_seconds = progress_timeout_seconds
        self.progress = progress
        self.holder_pid: int | None = None
        self.transitions = 0  # times this replica became leader or stopped being it
        self.errors = 0  # checks that failed on the database (connection lost, timeout)
        self.fenced = 0  # stalled leaders this replica fenced (terminated their lock session)
        self.relinquished = 0  # times this leader gave the lock up: its own acting loop stalled
        self.since = clock()
        self._lease_until = 0.0  # clock() reading up to which this leader may act
        self._conn: Any = None
        self._lock = threading.Lock()
        self._unrecorded: tuple[int, float] | None = None  # (holder pid, first seen) without progress

    @property
    def leader(self) -> bool:
        """Holds the lock, and its lease (renewed with each progress written) has not lapsed: a
        replica frozen past it (SIGSTOP, a stalled loop) acts on nothing when it wakes up."""
        return self.holder_pid is not None and self.clock() < self._lease_until

    def check(self, warm: bool) -> bool:
        """Verify the lock is still ours and record progress (or give it up when the acting loop
        stalled), or (when ``warm``) take it, fencing a stalled holder first; returns ``leader``."""
        with self._lock:
            try:
                age = self._round_age()
                if self.holder_pid is not None:
                    if age > self.progress_timeout_seconds:
                        self.relinquished += 1
                        self._drop(f"this replica's acting loop completed no round for {age:.1f}s "
                                   f"(ha.progress_timeout_seconds {self.progress_timeout_seconds:g})")
                    else:
                        self._verify(age)
                elif warm and age <= self.progress_timeout_seconds:
                    self._try_take(age)
            except PG_ERRORS as exc:
                self.errors += 1
                self._drop(f"database connection failed: {' '.join(str(exc).split()) or type(exc).__name__}")
            return self.leader

    def _round_age(self) -> float:
        age = self.progress()
        return 0.0 if age is None else age

    def _connection(self) -> Any:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = self.connect(self.dsn)
            self._conn.execute(f"SET statement_timeout = {CHECK_STATEMENT_TIMEOUT_MS}")
            with self._conn.transaction():  # two replicas starting together: one creates it
                self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (PG_MIGRATION_LOCK,))
                self._conn.execute(PROGRESS_TABLE)
        return self._conn

    def _key_halves(self) -> tuple[int, int]:
        key = self.lock_key & 0xFFFFFFFFFFFFFFFF
        return key >> 32, key & 0xFFFFFFFF

    def _try_take(self, age: float) -> None:
        conn = self._connection()
        got, pid = conn.execute("SELECT pg_try_advisory_lock(%s), pg_backend_pid()", (self.lock_key,)).fetchone()
        if not got and self._fence_stalled(conn):
            got, pid = conn.execute("SELECT pg_try_advisory_lock(%s), pg_backend_pid()",
                                    (self.lock_key,)).fetchone()
        if got:
            self.holder_pid = int(pid)
            self._record(conn, age)
            self._changed()
            log.warning("this replica is the LEADER now (advisory lock %d, database session %d)", self.lock_key, pid)

    def _fence_stalled(self, conn: Any) -> bool:
        """The lock is held by another session: when its recorded progress is older than the
        bound (or it recorded none for that long, as seen from here), terminate that session so
        the lock is free and every write of the stalled leader is refused by the store's fence."""
        row = conn.execute(HOLDER_PROGRESS, (self.lock_key, *self._key_halves())).fetchone()
        if row is None:  # released since: taken at the next try
            return True
        holder, age = int(row[0]), row[1]
        if age is None:  # no progress recorded by this holder (it just took the lock, or is older than 0.x)
            if self._unrecorded is None or self._unrecorded[0] != holder:
                self._unrecorded = (holder, self.clock())
            age = self.clock() - self._unrecorded[1]
        if age <= self.progress_timeout_seconds:
            return False
        log.error("the leader (database session %d) recorded no progress for %.1fs (ha.progress_timeout_seconds "
                  "%g): fencing it (its lock session is terminated; the store refuses its writes) and taking over",
                  holder, age, self.progress_timeout_seconds)
        conn.execute("SELECT pg_terminate_backend(%s, %s)", (holder, FENCE_WAIT_MS))
        self.fenced += 1
        return True

    def _verify(self, age: float) -> None:
        conn = self._connection()
        row = conn.execute(
            "SELECT pg_backend_pid(), EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
            " AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 1 AND pid = pg_backend_pid()"
            " AND granted)", self._key_halves()).fetchone()
        if row[0] != self.holder_pid or not row[1]:
            self._drop("the lock is no longer held by this replica's session")
            return
        self._record(conn, age)

    def _record(self, conn: Any, age: float) -> None:
        """The acting loop's last round, in the database's time; the lease runs from it."""
        asked = self.clock()
        conn.execute(WRITE_PROGRESS, (self.lock_key, age))
        self._lease_until = asked - age + self.progress_timeout_seconds - LEASE_MARGIN_SECONDS

    def _drop(self, why: str) -> None:
        if self._conn is not None:
            self._conn.close()  # a broken session's lock is PostgreSQL's to release; never ours to keep
            self._conn = None
        self._lease_until = 0.0
        if self.holder_pid is not None:
            self.holder_pid = None
            self._changed()
            log.error("leadership LOST: %s; this replica stops acting now (standby)", why)

    def _changed(self) -> None:
        self.transitions += 1
        self.since = self.clock()

    def release(self) -> None:
        """A clean stop hands the lock over at once (closing the session releases it)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self.holder_pid = None
            self._lease_until = 0.0
