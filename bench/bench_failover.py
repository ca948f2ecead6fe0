"""HA failover time: two real aggregator processes on a real PostgreSQL (Debian's server, started as
its own user on loopback), nodes reporting to both, a delivery held mid-flight at a flaky webhook
receiver. Each round kills the leader with SIGKILL (or restarts the database with ``pg_ctl restart
-m fast``) and measures until the pending delivery is done by whoever leads then; printed against
the 15 s budget of docs/architecture.md section 9. Needs root and the postgresql package (it says
so and measures nothing otherwise).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import Measurement
from tests.aggregator.aggregator_process import WebhookReceiver, wait_for
from tests.aggregator.ha_pair import FAILOVER_BUDGET_SECONDS, HaPair, delivered, in_flight_after_failures, roles
from tests.postgres import PostgresServer, skip_reason

ROUNDS = 3
LOCK_KEY = 77


def one_round(pg: PostgresServer, kill_leader: bool) -> float:
    """Seconds from the fault (SIGKILL of the leader, or the database restart beginning) to the
    pending delivery recorded as delivered by the replica leading then."""
    pg.reset_database()
    receiver = WebhookReceiver()
    with tempfile.TemporaryDirectory(prefix="vigil-failover-") as tmp:
        pair = HaPair(Path(tmp), receiver, pg, LOCK_KEY)
        try:
            pair.start()
            [leader] = roles(pair.aggs)["leader"]
            key = in_flight_after_failures(receiver, leader, pair.fleet)
            began = time.monotonic()
            if kill_leader:
                leader.kill()
            else:
                pg.restart()
            receiver.hold.set()

            def done() -> bool:
                leading = roles(pair.aggs)["leader"]
                return len(leading) == 1 and delivered(leading[0], key)

            wait_for("the pending delivery done", done, 60)
            took = time.monotonic() - began
            assert list(receiver.applied) == [key], "a second decision or key"
            return took
        finally:
            pair.stop()
            receiver.close()


def measure() -> list[Measurement]:
    reason = skip_reason()
    if reason is not None:
        print(f"bench_failover: not measured: {reason}", file=sys.stderr)
        return []
    pg = PostgresServer()
    try:
        killed = [one_round(pg, kill_leader=True) for _ in range(ROUNDS)]
        restarted = [one_round(pg, kill_leader=False) for _ in range(ROUNDS)]
    finally:
        pg.stop()
    note = f"{ROUNDS} rounds; median {statistics.median(killed):.2f} s"
    return [
        Measurement("HA failover, leader killed mid-delivery -> standby delivered (max)", max(killed), "s",
                    FAILOVER_BUDGET_SECONDS, note=note),
        Measurement("HA failover, PostgreSQL restarted mid-delivery -> acting again (max)", max(restarted), "s",
                    FAILOVER_BUDGET_SECONDS, note=f"{ROUNDS} rounds; median {statistics.median(restarted):.2f} s"),
    ]


if __name__ == "__main__":
    for m in measure():
        print(f"{m.what}: {m.value:.2f} {m.unit} (budget {m.budget} {m.unit}; {m.note})")
