"""The HA pair for real: two aggregator processes on one real PostgreSQL (tests/postgres.py), nodes
reporting to both, a webhook receiver that fails its first requests. The leader is killed (or the
database restarted) mid-delivery: the standby takes over within the 15 s budget, delivers what was
pending with the same idempotency key, and decides nothing because of the failover itself. The
leadership lock and the store's fence are also tested directly against the server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.aggregator.aggregator_process import REPO, AggregatorProcess, WebhookReceiver, wait_for
from tests.aggregator.ha_pair import (
    FAILOVER_BUDGET_SECONDS,
    WARM_AFTER_SECONDS,
    Fleet,
    HaPair,
    delivered,
    ha_config,
    in_flight_after_failures,
    roles,
)
from tests.aggregator.test_acting_faults import metric
from tests.aggregator.test_store import T0, Takes, dec
from tests.postgres import PASSWORD, PostgresServer
from vigil.aggregator.decision import Action
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.leadership import Leadership
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import NotLeader, Store

pytestmark = pytest.mark.external

LOCK_KEY = 4242


@pytest.fixture
def pg(postgres_server: PostgresServer) -> PostgresServer:
    postgres_server.reset_database()
    return postgres_server


# -- the lock and the fence, directly ------------------------------------------------------------


def test_one_leader_at_a_time_and_the_lock_passes_when_the_leader_session_dies(pg: PostgresServer) -> None:
    a, b = Leadership(pg.dsn, LOCK_KEY), Leadership(pg.dsn, LOCK_KEY)
    try:
        assert not a.check(warm=False)  # a cold replica does not even ask
        assert a.check(warm=True) and not b.check(warm=True)
        assert a.check(warm=True) and a.transitions == 1
        pg.psql(f"SELECT pg_terminate_backend({a.holder_pid})")  # the leader's session dies
        assert not a.check(warm=True)  # lost at its next check
        assert a.transitions == 2 and a.errors == 1
        assert b.check(warm=True)
        assert not a.check(warm=True)  # the lock is b's now
    finally:
        a.release()
        b.release()


def test_acting_writes_are_refused_unless_this_replica_holds_the_lock(pg: PostgresServer) -> None:
    lead = Leadership(pg.dsn, LOCK_KEY)
    store = Store("postgresql", dsn=pg.dsn, fence=lambda: lead.holder_pid, lock_key=LOCK_KEY)
    sink = Ledger(Gate(GateConfig(dry_run=False)), store, {"hook": Takes("hook")}, leadership=lead)
    try:
        assert sink.submit([dec("n1", Action.DRAIN, "a1")], T0, 10) == []  # a standby proposes nothing
        assert store.decisions() == []
        with pytest.raises(NotLeader):
            store.set_hold("n1", True, T0)
        assert lead.check(warm=True)
        sink.take_over()
        [admitted] = sink.submit([dec("n1", Action.DRAIN, "a1")], T0, 10)
        assert admitted.id == "a1"
        holder = lead.holder_pid
        pg.psql(f"SELECT pg_terminate_backend({holder})")  # lost, and this replica has not noticed yet
        assert lead.holder_pid == holder
        with pytest.raises(NotLeader, match="no longer held"):  # the database says so in the write itself
            store.mark("a1", "hook", "delivered", T0 + 1)
        [row] = store.deliveries("a1")
        assert row.state == "pending"  # nothing was written
    finally:
        lead.release()
        store.close()


# -- two real aggregator processes ----------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path, receiver: WebhookReceiver, pg: PostgresServer) -> Iterator[tuple[list[AggregatorProcess],
                                                                                          Fleet]]:
    ha = HaPair(tmp_path, receiver, pg, LOCK_KEY)
    try:
        ha.start()
        yield ha.aggs, ha.fleet
    finally:
        ha.stop()


def no_failover_decisions(agg: AggregatorProcess, key: str) -> None:
    """Only the Xid's decision exists: no silence, no breaker, nothing else caused by the failover."""
    decisions, deliveries = agg.decisions()
    assert [d["id"] for d in decisions] == [key], decisions
    assert agg.request("GET", "/v1/breaker")["tripped"] is False
    assert [d["state"] for d in deliveries[key]] == ["delivered"]


def test_leader_killed_mid_delivery_the_standby_delivers_within_15_s_and_repeats_nothing(
        pair: tuple[list[AggregatorProcess], Fleet], receiver: WebhookReceiver) -> None:
    aggs, fleet = pair
    [leader], [standby] = roles(aggs)["leader"], roles(aggs)["standby"]
    key = in_flight_after_failures(receiver, leader, fleet)
    assert metric(standby, 'vigil_aggregator_deliveries_total{actuator="webhook",outcome="failed"}') == 0

    leader.kill()
    killed = time.monotonic()
    receiver.hold.set()
    wait_for("the standby leading", lambda: roles(aggs)["leader"] == [standby], FAILOVER_BUDGET_SECONDS)
    leading = time.monotonic() - killed
    wait_for("the pending delivery done by the new leader", lambda: delivered(standby, key), FAILOVER_BUDGET_SECONDS)
    acting = time.monotonic() - killed
    print(f"\nfailover, leader killed: leading after {leading:.2f} s, pending delivery done after {acting:.2f} s")
    assert acting <= FAILOVER_BUDGET_SECONDS

    assert list(receiver.arrivals) == [key] and receiver.arrivals[key] == 5  # every duplicate: one key
    assert list(receiver.applied) == [key]  # one decision, applied once
    after = time.time() + 1.0  # the new leader's evaluations go on (every 0.3 s): they add nothing
    wait_for("more evaluations", lambda: metric(standby, "vigil_aggregator_last_evaluation_timestamp_seconds") > after)
    no_failover_decisions(standby, key)
    assert metric(standby, "vigil_aggregator_leader ") == 1
    assert metric(standby, "vigil_aggregator_leader_transitions_total") == 1
    assert "taking over" in standby.log()


def test_database_restarted_mid_delivery_leadership_returns_and_nothing_is_lost_or_repeated(
        pair: tuple[list[AggregatorProcess], Fleet], receiver: WebhookReceiver, pg: PostgresServer) -> None:
    aggs, fleet = pair
    [leader] = roles(aggs)["leader"]
    key = in_flight_after_failures(receiver, leader, fleet)

    restarted = time.monotonic()
    pg.restart()
    receiver.hold.set()
    wait_for("a leader again", lambda: len(roles(aggs)["leader"]) == 1, FAILOVER_BUDGET_SECONDS)
    [now_leading] = roles(aggs)["leader"]
    wait_for("the delivery done", lambda: delivered(now_leading, key), FAILOVER_BUDGET_SECONDS)
    acting = time.monotonic() - restarted
    print(f"\nfailover, database restarted: acting again {acting:.2f} s after the restart began")

    # The held request was applied; its answer could not be recorded (the database was down), so
    # it is sent again: at least once, every time with the one key.
    assert list(receiver.arrivals) == [key] and 5 <= receiver.arrivals[key] <= 6
    assert list(receiver.applied) == [key]
    for agg in aggs:
        no_failover_decisions(agg, key)
    # The old leader's lock session died with the server; its own check notices at its next turn,
    # which a connect still waiting on the restarting server can delay (its writes are fenced
    # meanwhile: the delivery above was made once). Then exactly one replica leads.
    wait_for("the old leader to notice", lambda: "leadership LOST" in leader.log(), FAILOVER_BUDGET_SECONDS)
    wait_for("one leader", lambda: sum(metric(a, "vigil_aggregator_leader ") for a in aggs) == 1,
             FAILOVER_BUDGET_SECONDS)


def test_the_decisions_command_reads_the_postgresql_store(pg: PostgresServer, tmp_path: Path) -> None:
    lead = Leadership(pg.dsn, LOCK_KEY)
    store = Store("postgresql", dsn=pg.dsn, fence=lambda: lead.holder_pid, lock_key=LOCK_KEY)
    try:
        assert lead.check(warm=True)
        sink = Ledger(Gate(GateConfig(dry_run=False)), store, {"hook": Takes("hook")}, leadership=lead)
        sink.take_over()
        sink.submit([dec("n7", Action.DRAIN, "d7")], T0, 10)
    finally:
        lead.release()
        store.close()
    dsn = tmp_path / "pg.dsn"
    dsn.write_text(pg.dsn + "\n")
    dsn.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "vigil", "aggregator", "decisions", "--dsn-file", str(dsn), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)["decisions"]
    assert row["decision"]["id"] == "d7" and row["deliveries"][0]["state"] == "pending"
    assert PASSWORD not in done.stdout + done.stderr


def test_the_standby_refuses_what_only_the_leader_may_do_and_a_cold_replica_waits(
        pair: tuple[list[AggregatorProcess], Fleet], receiver: WebhookReceiver, pg: PostgresServer,
        tmp_path: Path) -> None:
    aggs, _ = pair
    [standby] = roles(aggs)["standby"]
    alerts = json.dumps({"version": "4", "status": "firing", "receiver": "vigil", "groupKey": "g",
                         "alerts": []}).encode()
    assert standby.request("POST", "/v1/alertmanager", alerts, expect=503)["error"] == "standby"
    assert standby.request("POST", "/v1/breaker/reset", b"", expect=503)["error"] == "standby"
    held = standby.request("POST", "/v1/nodes/gpu-h1/hold", json.dumps({"note": "x"}).encode(), expect=503)
    assert held["error"] == "store_unavailable" and "not the leader" in held["detail"]
    assert metric(standby, "vigil_aggregator_leader ") == 0

    # A third replica started now is cold: it stands by for its warm-up even with no leader around.
    for agg in aggs:
        agg.stop()
    (tmp_path / "c").mkdir()
    cold = AggregatorProcess(tmp_path / "c", ha_config(tmp_path / "c", receiver, pg, LOCK_KEY))
    try:
        cold.start()
        assert cold.status("/healthz")[1]["role"] == "standby"
        wait_for("the cold replica leading after its warm-up", lambda: roles([cold])["leader"] == [cold], 15)
        lines = cold.log().splitlines()
        started = next(line for line in lines if " vigil aggregator " in line and " on 127.0.0.1" in line)
        leading = next(line for line in lines if "LEADER now" in line)
        assert seconds(leading) - seconds(started) >= WARM_AFTER_SECONDS - 1.0  # the warm-up began before "on"
    finally:
        cold.stop()


def seconds(log_line: str) -> float:
    """Seconds since midnight of a log line's "YYYY-MM-DD HH:MM:SS,mmm" stamp."""
    clock = log_line.split()[1]
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s.replace(",", "."))


def test_the_store_reads_and_writes_on_after_the_database_restarted_under_it(pg: PostgresServer) -> None:
    store = Store("postgresql", dsn=pg.dsn)
    sink = Ledger(Gate(GateConfig(dry_run=False)), store, {"hook": Takes("hook")})
    try:
        sink.submit([dec("n1", Action.DRAIN, "before")], T0, 10)
        pg.restart()  # every session is cut; the store finds out at its next statement
        assert [r.decision.id for r in store.decisions()] == ["before"]
        store.mark("before", "hook", "delivered", T0 + 1)
        assert store.deliveries("before")[0].state == "delivered"
    finally:
        store.close()
