"""Faults on the acting side, against the real aggregator process: a full disk, a read-only or
deleted store, a tripped breaker, a crash while a flaky receiver is mid-delivery. Each is seen
(/healthz, a metric, a log line) and loses nothing."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.aggregator.aggregator_process import REPO, SECRET, AggregatorProcess, WebhookReceiver, wait_for
from tests.aggregator.conftest import FakeNode
from vigil.aggregator.store import Store
from vigil.contract.wire import Event

NODES = ("gpu-a1", "gpu-a2", "gpu-a3")


def config(tmp_path: Path, receiver: WebhookReceiver, **gate: Any) -> dict[str, Any]:
    secret = tmp_path / "webhook.secret"
    secret.write_bytes(SECRET + b"\n")
    return {
        "dry_run": False,
        "evaluate_interval_seconds": 0.3,
        "gate": {"breaker_startup_grace_seconds": 0, **gate},
        "store": {"retry_base_seconds": 0.2, "retry_max_seconds": 0.5},
        "actuators": {
            "webhook": {"enabled": True, "url": receiver.url, "secret_file": str(secret), "timeout_seconds": 5},
            "delivery": {"base_backoff_seconds": 0.1, "max_backoff_seconds": 0.3, "poll_seconds": 0.2,
                         "max_attempts": 1000},
        },
    }


@pytest.fixture
def procs() -> Iterator[list[AggregatorProcess]]:
    started: list[AggregatorProcess] = []
    try:
        yield started
    finally:
        for agg in started:
            agg.stop()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs of the test's own (root only; skipped where mounting is not permitted)."""
    mnt = tmp_path / "store"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        pytest.skip(f"mount not permitted here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def xid79(agg: AggregatorProcess, node: FakeNode, gpu: int = 3) -> None:
    now = time.time()
    event = Event(kind="xid", ts=now, code=79, gpu=gpu, urgent=True, source="kmsg",
                  message="NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.")
    agg.post_report(node.report(now, events=[event], urgent=True))


def removing(receiver: WebhookReceiver) -> dict[str, dict[str, Any]]:
    """node -> the removing decision the receiver applied for it."""
    return {d["node"]: d for d in receiver.applied.values() if d["action"] not in ("alert", "resume")}


def metric(agg: AggregatorProcess, prefix: str) -> float:
    text = urllib_text(agg.url + "/metrics")
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]
    assert values, f"{prefix} not in /metrics"
    return sum(values)


def urllib_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def fill(directory: Path) -> Path:
    """Write a file until the file system is full; returns it."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_a_full_disk_makes_healthz_503_and_the_decision_is_delivered_once_it_frees(
        tmp_path: Path, tmpfs: Path, receiver: WebhookReceiver, procs: list[AggregatorProcess]) -> None:
    agg = AggregatorProcess(tmp_path, config(tmp_path, receiver), store_path=tmpfs / "decisions.sqlite")
    procs.append(agg)
    agg.start()
    nodes = {n: FakeNode(n) for n in NODES}
    for node in nodes.values():
        agg.post_report(node.report(time.time()))
    assert agg.status("/healthz")[0] == 200
    filler = fill(tmpfs)

    xid79(agg, nodes["gpu-a2"])
    status, body = wait_for_value("healthz 503", lambda: _failing(agg))
    assert status == 503 and body["status"] == "failing" and "full" in body["reason"]
    assert metric(agg, "vigil_aggregator_store_up") == 0
    assert metric(agg, 'vigil_aggregator_store_errors_total{kind="write"}') >= 1
    assert "ERROR" in agg.log() and "write failed: database or disk is full" in agg.log()
    assert not receiver.applied  # not made, so not acted on

    filler.unlink()
    wait_for("the decision delivered after the disk freed", lambda: "gpu-a2" in removing(receiver))
    assert agg.status("/healthz")[0] == 200
    assert metric(agg, "vigil_aggregator_store_up") == 1
    assert "works again" in agg.log()


def _failing(agg: AggregatorProcess) -> tuple[int, Any] | None:
    status, body = agg.status("/healthz")
    return (status, body) if status == 503 else None


def wait_for_value(what: str, check: Any, timeout_seconds: float = 15.0) -> Any:
    got: list[Any] = []

    def probe() -> bool:
        value = check()
        if value:
            got.append(value)
        return bool(value)

    wait_for(what, probe, timeout_seconds)
    return got[-1]


def start_and_fail(tmp_path: Path, store: Path) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "ro.yaml"
    cfg.write_text(f"store_path: {store}\nlisten: 127.0.0.1:1\n")
    return subprocess.run([sys.executable, "-m", "vigil", "aggregator", "--config", str(cfg)], cwd=REPO,
                          capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_read_only_or_corrupt_store_stops_the_start_with_one_line_and_status_2(tmp_path: Path, tmpfs: Path) -> None:
    Store(tmpfs / "existing.sqlite").close()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True, timeout=10)
    for store in (tmpfs / "new.sqlite", tmpfs / "existing.sqlite"):
        done = start_and_fail(tmp_path, store)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and str(store) in done.stderr and "Traceback" not in done.stderr
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"SQLite format 3\0" + os.urandom(8192))
    done = start_and_fail(tmp_path, corrupt)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and str(corrupt) in done.stderr, done.stderr


def test_a_store_file_deleted_while_running_is_restored_and_nothing_is_lost(
        tmp_path: Path, receiver: WebhookReceiver, procs: list[AggregatorProcess]) -> None:
    agg = AggregatorProcess(tmp_path, config(tmp_path, receiver))
    procs.append(agg)
    agg.start()
    nodes = {n: FakeNode(n) for n in NODES}
    xid79(agg, nodes["gpu-a1"])
    wait_for("the first decision", lambda: "gpu-a1" in removing(receiver))
    for path in tmp_path.glob("decisions.sqlite*"):
        path.unlink()
    xid79(agg, nodes["gpu-a2"])
    wait_for("the second decision", lambda: "gpu-a2" in removing(receiver))
    assert "was deleted while running; restoring it" in agg.log()
    assert metric(agg, 'vigil_aggregator_store_errors_total{kind="file"}') == 1
    assert agg.stop() == 0
    store = Store(agg.store_path)  # what the next start reads
    try:
        ids = {d["id"] for d in removing(receiver).values()}
        assert all(store.verdict_of(i) == (True, "admitted") for i in ids) and len(ids) == 2
        assert {n for _, n in store.state.removals} == {"gpu-a1", "gpu-a2"}
    finally:
        store.close()


def vigil(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vigil", "aggregator", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_breaker_trip_alerts_then_a_reset_drains_the_still_lost_gpu_and_operators_hold_and_resume(
        tmp_path: Path, receiver: WebhookReceiver, procs: list[AggregatorProcess]) -> None:
    cfg = config(tmp_path, receiver, breaker_max_nodes=1, breaker_floor_nodes=1, breaker_window_seconds=3,
                 min_removed_seconds=0)
    agg = AggregatorProcess(tmp_path, cfg)
    procs.append(agg)
    agg.start()
    nodes = {n: FakeNode(n) for n in NODES}
    xid79(agg, nodes["gpu-a1"])
    wait_for("the first removal", lambda: "gpu-a1" in removing(receiver))
    xid79(agg, nodes["gpu-a2"])
    wait_for("the breaker to trip", lambda: agg.request("GET", "/v1/breaker")["tripped"])
    xid79(agg, nodes["gpu-a3"])
    wait_for("the refused lost GPU alerted", lambda: any(
        d["id"].startswith("breaker-refused-") and d["node"] == "gpu-a3" for d in receiver.applied.values()))
    assert any("circuit breaker tripped" in d["reason"] for d in receiver.applied.values())
    assert set(removing(receiver)) == {"gpu-a1"}
    assert metric(agg, "vigil_aggregator_breaker_tripped") == 1
    assert "circuit breaker TRIPPED" in agg.log() and "refused, breaker_open" in agg.log()
    operator = ("--url", agg.url, "--token-file", str(agg.root / "operator.token"))  # README "Security"
    shown = vigil("breaker", "show", *operator)
    assert shown.returncode == 0 and "TRIPPED" in shown.stdout

    # Once the window has moved past the first removal, a person re-arms it: the lost GPUs that
    # were refused are proposed again and the budget goes to them.
    wait_for("the window to pass", lambda: agg.request("GET", "/v1/breaker")["removals_in_window"] == 0)
    reset = vigil("breaker", "reset", *operator)
    assert reset.returncode == 0 and reset.stdout == "circuit breaker reset\n", reset.stderr
    wait_for("a still-lost GPU drained after the reset", lambda: bool(set(removing(receiver)) & {"gpu-a2", "gpu-a3"}))

    held = vigil("hold", "gpu-a1", "--note", "cabling", *operator)
    assert held.returncode == 0 and "gpu-a1 held" in held.stdout, held.stderr
    gate = vigil("gate", "--json", *operator)
    assert gate.returncode == 0 and '"gpu-a1"' in gate.stdout and "cabling" in gate.stdout
    resumed = vigil("resume", "gpu-a1", *operator)
    assert resumed.returncode == 0 and "hold released" in resumed.stdout and "admitted" in resumed.stdout
    wait_for("the resume delivered", lambda: any(d["action"] == "resume" and d["node"] == "gpu-a1"
                                                 for d in receiver.applied.values()))
    nowhere = vigil("gate", "--url", "http://127.0.0.1:1")
    assert nowhere.returncode == 1 and nowhere.stderr.count("\n") == 1 and "cannot reach" in nowhere.stderr


def test_killed_mid_delivery_to_a_flaky_receiver_every_duplicate_carries_the_same_key(
        tmp_path: Path, receiver: WebhookReceiver, procs: list[AggregatorProcess]) -> None:
    agg = AggregatorProcess(tmp_path, config(tmp_path, receiver))
    procs.append(agg)
    receiver.fail_first = 3  # 500 three times, then it commits and is slow to answer
    receiver.hold.clear()
    agg.start()
    xid79(agg, FakeNode("gpu-a1"))
    wait_for("the request in flight after three failures", lambda: receiver.in_flight == 1)
    (key,) = receiver.applied
    assert receiver.arrivals[key] == 4
    assert metric(agg, 'vigil_aggregator_deliveries_total{actuator="webhook",outcome="failed"}') == 3
    assert agg.log().count("delivery of " + key) == 3  # one WARNING per failed attempt
    agg.kill()
    receiver.hold.set()
    agg.start()
    wait_for("delivered after the restart", lambda: any(
        d["state"] == "delivered" for d in agg.request("GET", "/v1/decisions")["deliveries"].get(key, [])))
    assert list(receiver.arrivals) == [key] and receiver.arrivals[key] == 5  # every duplicate: one key
    assert list(receiver.applied) == [key]  # applied once
