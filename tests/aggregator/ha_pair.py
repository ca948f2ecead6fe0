"""Two aggregator replicas on one PostgreSQL with nodes reporting to both, for the HA tests and
bench/bench_failover.py: the fleet that feeds them, their config, who leads, and a delivery held
mid-flight at a flaky webhook receiver. Loopback only; every process is stopped by pid by its owner.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

from tests.aggregator.aggregator_process import AggregatorProcess, WebhookReceiver, wait_for
from tests.aggregator.conftest import FakeNode
from tests.aggregator.test_acting_faults import config as acting_config
from tests.postgres import PostgresServer
from vigil.contract.wire import Event, Report

NODES = ("gpu-h1", "gpu-h2", "gpu-h3")
# The budget (docs/architecture.md section 9): the standby acting within 15 s of the leader's death.
FAILOVER_BUDGET_SECONDS = 15.0
# Short for the tests: the silence limit is set to it (the shipped defaults are 30 s and 15 s).
WARM_AFTER_SECONDS = 3.0


class Fleet:
    """Nodes reporting every half second to every live aggregator (as agents with two URLs do)."""

    def __init__(self, aggs: list[AggregatorProcess]) -> None:
        self.nodes = {n: FakeNode(n) for n in NODES}
        self.aggs = list(aggs)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet", daemon=True)

    def post(self, report: Report) -> None:
        with self._lock:
            aggs = [a for a in self.aggs if a.proc is not None]
            for agg in aggs:
                with contextlib.suppress(urllib.error.URLError, ConnectionError):  # killed just now
                    agg.post_report(report)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for node in self.nodes.values():
                self.post(node.report(time.time()))

    def start(self) -> None:
        for node in self.nodes.values():
            self.post(node.report(time.time()))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def ha_config(tmp_path: Path, receiver: WebhookReceiver, pg: PostgresServer, lock_key: int) -> dict[str, Any]:
    dsn = tmp_path / "pg.dsn"
    dsn.write_text(pg.dsn + "\n")
    dsn.chmod(0o600)
    cfg = acting_config(tmp_path, receiver)
    cfg["store"] = {**cfg["store"], "backend": "postgresql", "dsn_file": str(dsn)}
    cfg["ha"] = {"warm_after_seconds": WARM_AFTER_SECONDS, "lock_key": lock_key}
    cfg["detectors"] = {"silence": {"alert_after_seconds_min": WARM_AFTER_SECONDS}}
    return cfg


def roles(aggs: list[AggregatorProcess]) -> dict[str, list[AggregatorProcess]]:
    out: dict[str, list[AggregatorProcess]] = {"leader": [], "standby": []}
    for agg in aggs:
        if agg.proc is None:
            continue
        try:
            _, body = agg.status("/healthz")
        except (urllib.error.URLError, ConnectionError):
            continue
        out[body["role"]].append(agg)
    return out


def delivered(agg: AggregatorProcess, key: str) -> bool:
    try:
        deliveries = agg.request("GET", "/v1/decisions")["deliveries"]
    except (urllib.error.URLError, ConnectionError, AssertionError):
        return False
    return any(d["state"] == "delivered" for d in deliveries.get(key, []))


def in_flight_after_failures(receiver: WebhookReceiver, leader: AggregatorProcess, fleet: Fleet) -> str:
    """A fatal Xid reported to both replicas; the leader's delivery fails three times and the
    fourth is held open by the receiver (applied there, unanswered): mid-delivery."""
    receiver.fail_first = 3
    receiver.hold.clear()
    now = time.time()
    event = Event(kind="xid", ts=now, code=79, gpu=3, urgent=True, source="kmsg",
                  message="NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.")
    fleet.post(fleet.nodes["gpu-h2"].report(now, events=[event], urgent=True))  # the same report to both
    wait_for("the request in flight after three failures", lambda: receiver.in_flight == 1)
    (key,) = receiver.applied
    assert receiver.arrivals[key] == 4
    return key


class HaPair:
    """Two replicas (``root``/a and ``root``/b) and the fleet reporting to both; ``start`` returns
    once one of them leads. ``stop`` stops the fleet and every replica still running, by pid."""

    def __init__(self, root: Path, receiver: WebhookReceiver, pg: PostgresServer, lock_key: int) -> None:
        self.aggs = []
        for name in ("a", "b"):
            (root / name).mkdir()
            self.aggs.append(AggregatorProcess(root / name, ha_config(root / name, receiver, pg, lock_key)))
        self.fleet = Fleet(self.aggs)

    def start(self) -> None:
        for agg in self.aggs:
            agg.start()
        self.fleet.start()
        wait_for("one leader", lambda: len(roles(self.aggs)["leader"]) == 1, 20)

    def stop(self) -> None:
        self.fleet.stop()
        for agg in self.aggs:
            agg.stop()
