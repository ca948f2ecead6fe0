"""The aggregator as a real process: a fatal Xid reaches a signed webhook, and a SIGKILL between
store and delivery neither loses the decision nor delivers it twice after a restart."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.aggregator.aggregator_process import SECRET, AggregatorProcess, WebhookReceiver, wait_for
from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Decision
from vigil.contract.wire import Event

NODES = ("gpu-a1", "gpu-a2", "gpu-a3")


@pytest.fixture
def aggregator(tmp_path: Path, receiver: WebhookReceiver) -> Iterator[AggregatorProcess]:
    secret = tmp_path / "webhook.secret"
    secret.write_bytes(SECRET + b"\n")
    config: dict[str, Any] = {
        "dry_run": False,
        "evaluate_interval_seconds": 0.5,
        "actuators": {
            "webhook": {"enabled": True, "url": receiver.url, "secret_file": str(secret), "timeout_seconds": 5},
            # Fast retries so the test sees a few attempts; never dead within the test.
            "delivery": {"base_backoff_seconds": 0.1, "max_backoff_seconds": 0.3, "poll_seconds": 0.2,
                         "max_attempts": 1000},
        },
    }
    agg = AggregatorProcess(tmp_path, config)
    try:
        yield agg
    finally:
        agg.stop()


def report_xid(agg: AggregatorProcess, nodes: dict[str, FakeNode], bad: str) -> None:
    now = time.time()
    for node in nodes.values():
        agg.post_report(node.report(now))
    xid = Event(kind="xid", ts=now, code=79, gpu=3, urgent=True, source="kmsg",
                message="NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.")
    agg.post_report(nodes[bad].report(now + 0.01, events=[xid], urgent=True))


def webhook_delivery(agg: AggregatorProcess, decision_id: str) -> dict[str, Any] | None:
    _, deliveries = agg.decisions()
    return next((d for d in deliveries.get(decision_id, []) if d["actuator"] == "webhook"), None)


def only_decision(agg: AggregatorProcess) -> dict[str, Any]:
    decisions, _ = agg.decisions()
    assert len(decisions) == 1, decisions
    return decisions[0]


def test_fatal_xid_reaches_the_webhook_signed_and_shows_as_delivered(aggregator, receiver) -> None:
    nodes = {n: FakeNode(n) for n in NODES}
    aggregator.start()
    report_xid(aggregator, nodes, "gpu-a2")
    wait_for("the webhook", lambda: len(receiver.applied) == 1)
    (key, body), = receiver.applied.items()
    decision = Decision.model_validate(body)
    assert key == decision.id
    assert decision.node == "gpu-a2" and decision.gpu == 3 and not decision.dry_run
    assert decision.action.value in ("reset_gpu", "drain", "reboot_node") and "Xid 79" in decision.reason
    assert receiver.bad_signatures == 0
    wait_for("delivered in the store", lambda: (webhook_delivery(aggregator, key) or {}).get("state") == "delivered")
    listed = only_decision(aggregator)
    assert listed["id"] == key and listed["node"] == "gpu-a2"
    assert webhook_delivery(aggregator, key) == {
        "actuator": "webhook", "state": "delivered", "attempts": 1, "last_error": "", "detail": "POST "
        + receiver.url + ": 200",
    }


def test_killed_while_the_receiver_is_down_the_decision_is_delivered_once_after_restart(aggregator, receiver) -> None:
    nodes = {n: FakeNode(n) for n in NODES}
    receiver.fail_status = 503
    aggregator.start()
    report_xid(aggregator, nodes, "gpu-a1")
    # Stored and tried, not delivered: the window a crash must not lose.
    wait_for("a failed attempt on record", lambda: any(
        d["actuator"] == "webhook" and d["state"] == "failed" and d["attempts"] >= 1
        for ds in aggregator.decisions()[1].values() for d in ds))
    decision_id = only_decision(aggregator)["id"]
    aggregator.kill()
    refused = receiver.arrivals[decision_id]
    assert refused >= 1 and not receiver.applied

    receiver.fail_status = None
    aggregator.start()  # same store, nothing re-reported: only the store knows the decision
    wait_for("delivery after restart", lambda: decision_id in receiver.applied)
    wait_for("delivered in the store",
             lambda: (webhook_delivery(aggregator, decision_id) or {}).get("state") == "delivered")
    assert receiver.arrivals[decision_id] == refused + 1  # exactly one successful request
    assert list(receiver.applied) == [decision_id]

    # Another clean restart repeats nothing that completed.
    assert aggregator.stop() == 0  # SIGTERM: the dispatcher and the store close cleanly
    aggregator.start()
    time.sleep(1.0)  # several dispatcher polls (0.2 s)
    assert receiver.arrivals[decision_id] == refused + 1
    assert webhook_delivery(aggregator, decision_id)["state"] == "delivered"  # type: ignore[index]


def test_killed_before_reading_the_receivers_answer_it_is_resent_and_applied_once(aggregator, receiver) -> None:
    nodes = {n: FakeNode(n) for n in NODES}
    receiver.hold.clear()  # the receiver commits, then is slow to answer
    aggregator.start()
    report_xid(aggregator, nodes, "gpu-a3")
    wait_for("the request at the receiver", lambda: receiver.in_flight == 1)
    (decision_id,) = receiver.applied
    assert webhook_delivery(aggregator, decision_id)["state"] == "pending"  # type: ignore[index]
    aggregator.kill()
    receiver.hold.set()

    aggregator.start()
    wait_for("delivered in the store",
             lambda: (webhook_delivery(aggregator, decision_id) or {}).get("state") == "delivered")
    # At least once on the wire, exactly once at the receiver: the idempotency key makes the difference.
    assert receiver.arrivals[decision_id] == 2
    assert list(receiver.applied) == [decision_id]
    assert receiver.actions().total() == 1
    assert only_decision(aggregator)["id"] == decision_id
