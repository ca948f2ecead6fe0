"""Which replica of an HA pair acts: a PostgreSQL session-level advisory lock on its own connection.

It reads PostgreSQL's answer to ``pg_try_advisory_lock`` on a dedicated connection, checked every
``check_interval_seconds``, and says whether this replica leads (``leader``) and which database
session holds the lock for it (``holder_pid``: the store fences every acting write on it, in the
write's own transaction). A replica asks for the lock only once its fleet view is warm; one that
loses the connection stops leading at once. It is no consensus protocol of its own (PostgreSQL's
lock manager is the one arbiter) and it judges and delivers nothing. A lone aggregator on SQLite
uses ``SoleLeader``: always the leader.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import Field

from vigil.agent.validation import StrictModel
from vigil.aggregator.store import PG_ERRORS, pg_connect

log = logging.getLogger("vigil.aggregator.leadership")

# Statements on the lock connection give up after this (a server that hangs must not hold the
# check, and with it the knowledge that leadership is lost, for longer than a couple of checks).
CHECK_STATEMENT_TIMEOUT_MS = 2000


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


class SoleLeader:
    """The one aggregator of a SQLite store: it always acts."""

    leader = True
    holder_pid: int | None = None
    transitions = 0
    ha = False

    def check(self, warm: bool) -> bool:
        return True

    def release(self) -> None:
        pass


class Leadership:
    """The lock on its own connection. ``check`` runs on one thread at a time (the app's
    leadership task); ``leader`` and ``holder_pid`` are read from any thread."""

    ha = True

    def __init__(self, dsn: str, lock_key: int, *, connect: Callable[[str], Any] = pg_connect,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dsn = dsn
        self.lock_key = lock_key
        self.connect = connect
        self.clock = clock
        self.holder_pid: int | None = None
        self.transitions = 0  # times this replica became leader or stopped being it
        self.errors = 0  # checks that failed on the database (connection lost, timeout)
        self.since = clock()
        self._conn: Any = None
        self._lock = threading.Lock()

    @property
    def leader(self) -> bool:
        return self.holder_pid is not None

    def check(self, warm: bool) -> bool:
        """Verify the lock is still ours, or (when ``warm``) try to take it; returns ``leader``."""
        with self._lock:
            try:
                if self.holder_pid is not None:
                    self._verify()
                elif warm:
                    self._try_take()
            except PG_ERRORS as exc:
                self.errors += 1
                self._drop(f"database connection failed: {' '.join(str(exc).split()) or type(exc).__name__}")
            return self.leader

    def _connection(self) -> Any:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = self.connect(self.dsn)
            self._conn.execute(f"SET statement_timeout = {CHECK_STATEMENT_TIMEOUT_MS}")
        return self._conn

    def _try_take(self) -> None:
        conn = self._connection()
        got, pid = conn.execute("SELECT pg_try_advisory_lock(%s), pg_backend_pid()", (self.lock_key,)).fetchone()
        if got:
            self.holder_pid = int(pid)
            self._changed()
            log.warning("this replica is the LEADER now (advisory lock %d, database session %d)", self.lock_key, pid)

    def _verify(self) -> None:
        key = self.lock_key & 0xFFFFFFFFFFFFFFFF
        row = self._connection().execute(
            "SELECT pg_backend_pid(), EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
            " AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 1 AND pid = pg_backend_pid()"
            " AND granted)", (key >> 32, key & 0xFFFFFFFF)).fetchone()
        if row[0] != self.holder_pid or not row[1]:
            self._drop("the lock is no longer held by this replica's session")

    def _drop(self, why: str) -> None:
        if self._conn is not None:
            self._conn.close()  # a broken session's lock is PostgreSQL's to release; never ours to keep
            self._conn = None
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
