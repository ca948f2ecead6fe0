"""HA leadership follows progress, not a TCP session, against a real PostgreSQL (tests/postgres.py).

Directly: a leader whose acting loop stalls gives the lock up; a standby fences a holder whose
recorded progress is stale (its lock session terminated, its writes refused by the store) and
never one that progresses; a frozen leader's lease lapses on its own clock. With two real
aggregator processes: the leader frozen by SIGSTOP for 30 s is fenced and the standby acts within
the 15 s failover budget, and the frozen one, resumed, delivers nothing twice; a leader whose
webhook receiver trickles keeps leading and delays no other actuator.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.aggregator.aggregator_process import AggregatorProcess, WebhookReceiver, wait_for
from tests.aggregator.ha_pair import FAILOVER_BUDGET_SECONDS, Fleet, HaPair, delivered, ha_config, roles
from tests.aggregator.stuck_receivers import RecordingAlertmanager, TricklingReceiver
from tests.aggregator.test_acting_deadlines import xid_report
from tests.aggregator.test_acting_faults import metric
from tests.aggregator.test_store import T0
from tests.postgres import PostgresServer
from vigil.aggregator.leadership import LEASE_MARGIN_SECONDS, HaConfig, Leadership
from vigil.aggregator.store import NotLeader, Store

pytestmark = pytest.mark.external

LOCK_KEY = 4343
TIMEOUT = 3.0  # progress_timeout_seconds of the direct tests
FROZEN_SECONDS = 30.0  # the SIGSTOP


@pytest.fixture
def pg(postgres_server: PostgresServer) -> PostgresServer:
    postgres_server.reset_database()
    return postgres_server


class Progress:
    """The acting loop's round age as the leadership reads it: set by the test."""

    def __init__(self) -> None:
        self.age: float | None = 0.0

    def __call__(self) -> float | None:
        return self.age


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_progress_timeout_leaves_room_for_two_checks() -> None:
    shipped = HaConfig()
    assert shipped.progress_timeout_seconds + 2 * shipped.check_interval_seconds < FAILOVER_BUDGET_SECONDS
    with pytest.raises(ValueError, match="twice check_interval_seconds"):
        HaConfig(check_interval_seconds=2, progress_timeout_seconds=4)


def test_a_leader_whose_acting_loop_stalls_gives_the_lock_up_and_takes_it_back_only_once_it_progresses(
        pg: PostgresServer) -> None:
    progress = Progress()
    a = Leadership(pg.dsn, LOCK_KEY, progress_timeout_seconds=TIMEOUT, progress=progress)
    b = Leadership(pg.dsn, LOCK_KEY, progress_timeout_seconds=TIMEOUT)
    try:
        assert a.check(warm=True)
        progress.age = TIMEOUT - LEASE_MARGIN_SECONDS - 0.5  # slow, within the lease: keeps leading (lookalike)
        assert a.check(warm=True) and a.relinquished == 0
        progress.age = TIMEOUT + 0.1
        assert not a.check(warm=True) and a.relinquished == 1 and a.holder_pid is None
        assert not a.check(warm=True)  # a stalled loop does not even ask for the lock
        assert b.check(warm=True) and b.fenced == 0  # free: taken without fencing anyone
        progress.age = 0.0
        assert not a.check(warm=True)  # b leads and progresses
    finally:
        a.release()
        b.release()


def test_a_standby_fences_a_leader_whose_progress_is_stale_and_its_writes_are_refused(pg: PostgresServer) -> None:
    clock = Clock()
    a = Leadership(pg.dsn, LOCK_KEY, progress_timeout_seconds=TIMEOUT, clock=clock)
    b = Leadership(pg.dsn, LOCK_KEY, progress_timeout_seconds=TIMEOUT)
    store = Store("postgresql", dsn=pg.dsn, fence=lambda: a.holder_pid, lock_key=LOCK_KEY)
    try:
        assert a.check(warm=True)
        held = a.holder_pid
        # a keeps recording progress: b must not fence it however often it looks.
        deadline = time.monotonic() + 2 * TIMEOUT
        while time.monotonic() < deadline:
            assert a.check(warm=True)
            assert not b.check(warm=True)
        assert b.fenced == 0
        # a freezes: it records nothing more. Its own lease lapses on its own clock first...
        clock.now += TIMEOUT - LEASE_MARGIN_SECONDS
        assert not a.leader and a.holder_pid == held
        # ...and b, once a's progress is older than the bound in the database's time, fences it.
        wait_for("b to fence a and lead", lambda: b.check(warm=True), 10 * TIMEOUT)
        assert b.fenced == 1 and b.holder_pid != held
        recorded = pg.psql(f"SELECT holder_pid FROM vigil_leader_progress WHERE lock_key = {LOCK_KEY}", "vigil")
        assert recorded.strip() == str(b.holder_pid)  # b records its own progress from the start
        assert pg.psql(f"SELECT count(*) FROM pg_stat_activity WHERE pid = {held}").strip() == "0"
        with pytest.raises(NotLeader):  # whatever a still tries is refused in the database
            store.set_hold("n1", True, T0)
        assert not a.check(warm=True) and a.holder_pid is None  # a finds out at its next check
    finally:
        a.release()
        b.release()
        store.close()


def test_a_holder_that_never_records_progress_is_fenced_too(pg: PostgresServer) -> None:
    # An older replica (or one wedged right after taking the lock) holds it and records nothing.
    with psycopg.connect(pg.dsn, autocommit=True) as old:
        assert old.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()[0]
        b = Leadership(pg.dsn, LOCK_KEY, progress_timeout_seconds=TIMEOUT)
        try:
            assert not b.check(warm=True)  # first seen now: not yet stale
            wait_for("b to fence the silent holder", lambda: b.check(warm=True), 10 * TIMEOUT)
            assert b.fenced == 1
        finally:
            b.release()


# -- two real aggregator processes ---------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path, receiver: WebhookReceiver, pg: PostgresServer) -> Iterator[HaPair]:
    ha = HaPair(tmp_path, receiver, pg, LOCK_KEY)
    try:
        ha.start()
        yield ha
    finally:
        for agg in ha.aggs:  # a frozen process is resumed before it is stopped
            if agg.proc is not None:
                os.kill(agg.proc.pid, signal.SIGCONT)
        ha.stop()


def test_a_leader_frozen_30_s_is_fenced_the_standby_acts_within_15_s_and_nothing_is_delivered_twice(
        pair: HaPair, receiver: WebhookReceiver) -> None:
    aggs, fleet = pair.aggs, pair.fleet
    [leader], [standby] = roles(aggs)["leader"], roles(aggs)["standby"]
    # Both healthy for a while: the standby fences nobody (the lookalike).
    wait_for("rounds recorded", lambda: metric(standby, "vigil_aggregator_leader_transitions_total") == 0
             and metric(leader, "vigil_aggregator_leader ") == 1, 10)
    assert metric(standby, "vigil_aggregator_leadership_fenced_total") == 0
    assert leader.proc is not None
    with fleet._lock:  # the agents' reports go to the live replica only while the leader is frozen
        fleet.aggs.remove(leader)
    os.kill(leader.proc.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        xid_report(fleet, "gpu-h2")  # reaches the standby only
        wait_for("the standby leading", lambda: roles([standby])["leader"] == [standby], FAILOVER_BUDGET_SECONDS)
        leading = time.monotonic() - frozen
        wait_for("the decision delivered by the new leader", lambda: len(receiver.applied) == 1,
                 FAILOVER_BUDGET_SECONDS)
        acting = time.monotonic() - frozen
        (key,) = receiver.applied
        wait_for("its delivery recorded", lambda: delivered(standby, key), FAILOVER_BUDGET_SECONDS)
        print(f"\nfailover, leader frozen: standby leading after {leading:.2f} s, delivered after {acting:.2f} s")
        assert acting <= FAILOVER_BUDGET_SECONDS
        assert metric(standby, "vigil_aggregator_leadership_fenced_total") == 1
        assert "fencing it" in standby.log()
        threading.Event().wait(max(0.0, FROZEN_SECONDS - (time.monotonic() - frozen)))  # the freeze lasts 30 s
    finally:
        os.kill(leader.proc.pid, signal.SIGCONT)
    wait_for("the resumed one to find it lost the lock", lambda: "leadership LOST" in leader.log(), 15)
    with fleet._lock:
        fleet.aggs.append(leader)
    after = time.time() + 2.0  # both evaluate on for a while: nothing more is decided or delivered
    wait_for("more evaluations", lambda: all(
        metric(a, "vigil_aggregator_last_evaluation_timestamp_seconds") > after for a in aggs), 15)
    assert roles(aggs) == {"leader": [standby], "standby": [leader]}
    assert receiver.arrivals[key] == 1 and list(receiver.applied) == [key]  # once, by the new leader only
    assert metric(leader, 'vigil_aggregator_deliveries_total{actuator="webhook",outcome="delivered"}') == 0
    decisions, _ = standby.decisions()
    assert [d["id"] for d in decisions] == [key]  # the freeze itself decided nothing (no silence)


def test_a_trickling_webhook_receiver_neither_unseats_the_leader_nor_delays_failover(
        tmp_path: Path, pg: PostgresServer) -> None:
    trickling = TricklingReceiver(0.2)
    am = RecordingAlertmanager()
    aggs = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            cfg = _trickling_ha_config(tmp_path / name, trickling, am, pg)
            aggs.append(AggregatorProcess(tmp_path / name, cfg))
        fleet = Fleet(aggs)
        for agg in aggs:
            agg.start()
        fleet.start()
        wait_for("one leader", lambda: len(roles(aggs)["leader"]) == 1, 20)
        [leader] = roles(aggs)["leader"]
        xid_report(fleet, "gpu-h2")
        wait_for("the alert at the other actuator", lambda: "gpu-h2" in am.nodes(), FAILOVER_BUDGET_SECONDS)
        wait_for("the webhook delivery cut at its deadline", lambda: metric(
            leader, 'vigil_aggregator_actuator_deadline_exceeded_total{actuator="webhook",phase="delivery"}') >= 1,
            30)
        # The leader's loop goes on around the stuck receiver: nobody fences it, nobody fails over.
        assert roles(aggs)["leader"] == [leader]
        assert all(metric(a, "vigil_aggregator_leadership_fenced_total") == 0 for a in aggs)
        assert metric(leader, "vigil_aggregator_leadership_relinquished_total") == 0
        assert trickling.completed == 0
        # The leader dies while the receiver still holds one of its exchanges open: the standby takes
        # over and acts within the failover budget all the same (its own reach check and deliveries
        # to that receiver are held too, on the webhook's workers only).
        [standby] = [a for a in aggs if a is not leader]
        wait_for("an exchange held open by the receiver", lambda: trickling.holding >= 1, 30)
        assert leader.proc is not None
        with fleet._lock:
            fleet.aggs.remove(leader)
        leader.proc.kill()
        killed = time.monotonic()
        leader.proc.wait(timeout=10)
        xid_report(fleet, "gpu-h3")
        wait_for("the new leader's alert at the other actuator", lambda: "gpu-h3" in am.nodes(),
                 FAILOVER_BUDGET_SECONDS)
        acting = time.monotonic() - killed
        print(f"\nfailover, leader killed while its webhook receiver trickles: acting after {acting:.2f} s")
        assert acting <= FAILOVER_BUDGET_SECONDS and roles([standby])["leader"] == [standby]
        assert trickling.completed == 0
        fleet.stop()
    finally:
        for agg in aggs:
            agg.stop()
        trickling.close()
        am.close()


def _trickling_ha_config(root: Path, trickling: TricklingReceiver, am: RecordingAlertmanager,
                         pg: PostgresServer) -> dict[str, object]:
    receiver = WebhookReceiver()  # only for ha_config's shape; its URL is replaced
    try:
        cfg = ha_config(root, receiver, pg, LOCK_KEY)
    finally:
        receiver.close()
    actuators = dict(cfg["actuators"])  # type: ignore[call-overload]
    actuators["webhook"] = {**actuators["webhook"], "url": trickling.url, "timeout_seconds": 4}
    actuators["alertmanager"] = {"enabled": True, "url": am.url, "timeout_seconds": 3}
    return {**cfg, "actuators": actuators}
