"""The acting path under receivers that hold requests open: every exchange is cut at its total
deadline (not per read), each actuator runs on workers of its own so a stuck one delays no other,
start-up checks run after the listener opened, and /healthz and the metrics say what stalls.
The receivers are real loopback sockets (tests/aggregator/stuck_receivers.py); the aggregator is
a real process where the issue says so."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.aggregator.aggregator_process import SECRET, AggregatorProcess, wait_for
from tests.aggregator.ha_pair import Fleet
from tests.aggregator.stuck_receivers import TRICKLED_ANSWER, RecordingAlertmanager, SilentReceiver, TricklingReceiver
from tests.aggregator.test_acting_faults import metric
from tests.aggregator.test_dispatch import RecordingActuator
from vigil.aggregator.actuators.actuator import DeadlineExceeded, DeliveryError
from vigil.aggregator.actuators.alertmanager import AlertmanagerActuator, AlertmanagerConfig
from vigil.aggregator.actuators.webhook import WebhookActuator, WebhookConfig
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.dispatch import DispatchConfig, Dispatcher
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.wire import Event

T0 = 1_700_000_000.0
WAIT_SECONDS = 30.0  # every wait below is bounded by this (polling a condition, never a sleep)


def decision(node: str, id: str, action: Action = Action.DRAIN) -> Decision:
    return Decision(id=id, ts=T0, node=node, action=action, reason="r", detector="xid", dry_run=False)


@pytest.fixture
def trickling() -> Iterator[TricklingReceiver]:
    receiver = TricklingReceiver(interval_seconds=0.2)
    yield receiver
    receiver.close()


@pytest.fixture
def silent() -> Iterator[SilentReceiver]:
    receiver = SilentReceiver()
    yield receiver
    receiver.close()


def webhook(url: str, timeout_seconds: float) -> WebhookActuator:
    return WebhookActuator(WebhookConfig(enabled=True, url=url, timeout_seconds=timeout_seconds), secret=SECRET)


# -- one exchange, one deadline ---------------------------------------------------------------------


def test_a_trickling_receiver_is_cut_off_at_the_total_deadline_not_per_read(trickling: TricklingReceiver) -> None:
    # Each byte comes 0.2 s after the last: a per-read timeout of 1 s never fires, and the whole
    # answer (a valid 200) would arrive after ~12 s. The total deadline cuts it first.
    hook = webhook(trickling.url, timeout_seconds=1.0)
    with pytest.raises(DeadlineExceeded, match="deadline of 1 s"):
        hook.deliver(decision("n1", "d1"))
    with pytest.raises(DeadlineExceeded):
        hook.check()
    am = AlertmanagerActuator(AlertmanagerConfig(enabled=True, url=trickling.url.removesuffix("/vigil"),
                                                 timeout_seconds=1.0))
    with pytest.raises(DeadlineExceeded):
        am.deliver(decision("n1", "d2", Action.ALERT))
    wait_for("the receiver to see all three cut", lambda: trickling.cut == 3, WAIT_SECONDS)
    assert trickling.completed == 0


def test_a_receiver_that_never_answers_is_cut_off_at_the_deadline(silent: SilentReceiver) -> None:
    with pytest.raises(DeadlineExceeded) as info:
        webhook(silent.url, timeout_seconds=0.5).deliver(decision("n1", "d1"))
    assert info.value.retryable
    wait_for("the receiver to see it cut", lambda: silent.cut == 1, WAIT_SECONDS)


def test_a_slow_but_whole_answer_within_the_deadline_is_delivered() -> None:
    # The lookalike that must not be cut: the same trickle, finished well within the deadline.
    receiver = TricklingReceiver(interval_seconds=0.005)
    try:
        assert webhook(receiver.url, timeout_seconds=20).deliver(decision("n1", "d1")).endswith(": 200")
        wait_for("the receiver to finish its answer", lambda: receiver.completed == 1, WAIT_SECONDS)
        assert receiver.cut == 0
    finally:
        receiver.close()
    assert len(TRICKLED_ANSWER) > 50


def test_a_refused_connection_is_a_plain_delivery_error_not_a_deadline() -> None:
    with pytest.raises(DeliveryError) as info:
        webhook("http://127.0.0.1:9/hook", timeout_seconds=2).deliver(decision("n1", "d1"))
    assert not isinstance(info.value, DeadlineExceeded)


# -- the dispatcher: each actuator on workers of its own ---------------------------------------------


class BlockingActuator(RecordingActuator):
    """Ignores every deadline: its deliver returns only once ``release`` is set (a client whose
    timeout is per read, a resolver that hangs)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.timeout_seconds = 0.3
        self.release = threading.Event()
        self.entered = 0

    def deliver(self, decision: Decision) -> str:
        self.entered += 1
        assert self.release.wait(WAIT_SECONDS)
        return super().deliver(decision)


def setup_dispatch(tmp_path: Path, actuators: dict[str, Any], **config: Any) -> tuple[Store, Ledger, Dispatcher]:
    store = Store(tmp_path / "d.db")
    dispatcher = Dispatcher(store, actuators, DispatchConfig(poll_seconds=0.05, base_backoff_seconds=0.05,
                                                             max_backoff_seconds=0.1, max_attempts=1000, **config))
    sink = Ledger(Gate(GateConfig(dry_run=False)), store, actuators, wake=dispatcher.wake)
    return store, sink, dispatcher


async def until(what: str, check: Any) -> None:
    async with asyncio.timeout(WAIT_SECONDS):
        while not check():
            await asyncio.sleep(0.01)


async def test_a_silent_receiver_delays_no_other_actuator(tmp_path: Path, silent: SilentReceiver) -> None:
    other = RecordingActuator("slurm")
    hook = webhook(silent.url, timeout_seconds=2.0)
    store, sink, dispatcher = setup_dispatch(tmp_path, {"webhook": hook, "slurm": other}, workers=1)
    task = asyncio.create_task(dispatcher.run())
    try:
        for i in range(3):
            sink.submit([decision(f"n{i}", f"d{i}")], T0, 100)
        await until("every drain at the other actuator", lambda: len(other.received) == 3)
        # Delivered while the webhook's one worker is held by the receiver that never answers.
        assert silent.holding == 1 and dispatcher.workers["webhook"].busy() == 1
        assert [d.state for i in range(3) for d in store.deliveries(f"d{i}") if d.actuator == "webhook"] \
            == ["pending"] * 3
        await until("the webhook cut off at its deadline",
                    lambda: dispatcher.workers["webhook"].deadline_exceeded["delivery"] >= 1)
        assert dispatcher.workers["webhook"].stalled() and not dispatcher.workers["slurm"].stalled()

        def webhook_errors() -> list[str]:
            return [d.last_error for i in range(3) for d in store.deliveries(f"d{i}") if d.actuator == "webhook"]

        await until("the cut recorded as the attempt's error", lambda: any("deadline" in e for e in webhook_errors()))
    finally:
        task.cancel()
        dispatcher.close()
        store.close()


async def test_a_worker_held_past_its_deadline_leaves_its_actuator_waiting_and_others_going(
        tmp_path: Path) -> None:
    stuck, other = BlockingActuator("kubernetes"), RecordingActuator("slurm")
    store, sink, dispatcher = setup_dispatch(tmp_path, {"kubernetes": stuck, "slurm": other}, workers=1)
    task = asyncio.create_task(dispatcher.run())
    try:
        sink.submit([decision("n1", "a1")], T0, 100)
        await until("the first delivery to hold the worker past its deadline",
                    lambda: dispatcher.workers["kubernetes"].deadline_exceeded["delivery"] == 1)
        workers = dispatcher.workers["kubernetes"]
        assert workers.busy() == 1 and workers.stalled()
        sink.submit([decision("n2", "a2")], T0, 100)
        await until("the other actuator served", lambda: other.received == ["a1", "a2"])
        [waiting] = [d for d in store.deliveries("a2") if d.actuator == "kubernetes"]
        assert waiting.state == "pending" and waiting.attempts == 0  # waiting for a worker: no attempt spent
        assert stuck.entered == 1  # nothing new started on the stuck actuator
        stuck.release.set()  # the worker returns; the waiting delivery goes out on it
        await until("both recorded delivered", lambda: all(
            d.state == "delivered" for i in (1, 2) for d in store.deliveries(f"a{i}")))
        # a1's first outcome was given up at the deadline, so a1 was sent again: at least once.
        assert set(stuck.received) == {"a1", "a2"} and stuck.received.count("a2") == 1
        assert workers.busy() == 0 and not workers.stalled()
    finally:
        stuck.release.set()
        task.cancel()
        dispatcher.close()
        store.close()


async def test_a_replica_that_stopped_acting_sends_nothing_it_had_claimed(tmp_path: Path) -> None:
    other = RecordingActuator("slurm")
    acting = [True]
    store, sink, dispatcher = setup_dispatch(tmp_path, {"slurm": other})
    sink.submit([decision("n1", "a1")], T0, 100)
    due = await asyncio.to_thread(store.due, time.time(), 10)
    dispatcher.acting = lambda: acting[0]
    acting[0] = False  # lost between the claim and the worker's send (a lease that lapsed)
    tasks, _ = await dispatcher._start(due)  # the seam between claim and send
    await asyncio.wait(tasks)
    assert other.received == [] and dispatcher.not_acting == 1
    assert store.deliveries("a1")[0].attempts == 0
    dispatcher.close()
    store.close()


# -- the real process ---------------------------------------------------------------------------------


def xid_report(fleet: Fleet, node: str) -> None:
    now = time.time()
    event = Event(kind="xid", ts=now, code=79, gpu=3, urgent=True, source="kmsg",
                  message="NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.")
    fleet.post(fleet.nodes[node].report(now, events=[event], urgent=True))


def deliveries_of(agg: AggregatorProcess, actuator: str) -> dict[str, str]:
    _, deliveries = agg.decisions()
    return {key: d["state"] for key, rows in deliveries.items() for d in rows if d["actuator"] == actuator}


@pytest.mark.parametrize("kind", ["trickling", "silent"])
def test_a_stuck_webhook_receiver_delays_neither_start_up_nor_another_actuator_and_healthz_says_so(
        tmp_path: Path, kind: str) -> None:
    receiver: TricklingReceiver | SilentReceiver = TricklingReceiver(0.2) if kind == "trickling" else SilentReceiver()
    am = RecordingAlertmanager()
    secret = tmp_path / "webhook.secret"
    secret.write_bytes(SECRET + b"\n")
    agg = AggregatorProcess(tmp_path, {
        "dry_run": False,
        "evaluate_interval_seconds": 0.3,
        "gate": {"breaker_startup_grace_seconds": 0},
        "actuators": {
            # 6 s: the whole trickled answer takes ~12 s; a per-read timeout would never fire.
            "webhook": {"enabled": True, "url": receiver.url, "secret_file": str(secret), "timeout_seconds": 6},
            "alertmanager": {"enabled": True, "url": am.url, "timeout_seconds": 3},
            "delivery": {"base_backoff_seconds": 0.1, "max_backoff_seconds": 0.3, "poll_seconds": 0.2,
                         "max_attempts": 1000},
        },
    })
    fleet = Fleet([agg])
    try:
        agg.start()  # returns once it listens: the webhook's reach check is still held by the receiver
        wait_for("the reach check at the receiver", lambda: receiver.accepted >= 1, WAIT_SECONDS)
        status, body = agg.status("/healthz")
        assert status == 200 and receiver.cut == 0  # answered while the check was still held open
        assert body["role"] == "leader"
        log = agg.log()
        assert log.index("listening on") < log.index("actuator webhook: checking that it reaches its target")

        wait_for("the check cut at its deadline", lambda: "actuator webhook cannot reach its target: no answer "
                 "within its deadline" in agg.log(), WAIT_SECONDS)
        log = agg.log()
        assert log.index("listening on") < log.index("actuator webhook cannot reach its target")
        assert "actuator alertmanager reaches its target" in log
        status, body = agg.status("/healthz")
        assert status == 200 and body["status"] == "degraded", body  # intake works: no restart wanted
        assert body["acting"]["stalled_actuators"] == ["webhook"] and "webhook" in body["degraded"][0]
        assert metric(agg, 'vigil_aggregator_actuator_deadline_exceeded_total{actuator="webhook",phase="check"}') == 1
        assert metric(agg, 'vigil_aggregator_actuator_stalled{actuator="webhook"}') == 1
        assert metric(agg, 'vigil_aggregator_actuator_stalled{actuator="alertmanager"}') == 0
        assert metric(agg, 'vigil_aggregator_actuator_up{actuator="webhook"}') == 0

        fleet.start()
        xid_report(fleet, "gpu-h2")
        wait_for("the alert at the other actuator", lambda: "gpu-h2" in am.nodes(), WAIT_SECONDS)
        # Delivered while the webhook's delivery of the same decision is held by the stuck receiver.
        [(key, state)] = [(k, s) for k, s in deliveries_of(agg, "alertmanager").items()]
        assert state == "delivered"
        assert deliveries_of(agg, "webhook")[key] != "delivered"
        wait_for("the webhook delivery cut at its deadline", lambda: metric(
            agg, 'vigil_aggregator_actuator_deadline_exceeded_total{actuator="webhook",phase="delivery"}') >= 1,
            WAIT_SECONDS)
        assert receiver.completed == 0
        assert agg.status("/healthz")[0] == 200
    finally:
        fleet.stop()
        agg.stop()
        receiver.close()
        am.close()
