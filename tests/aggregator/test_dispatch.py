"""The delivery worker: retries with jittered backoff, dead letters, dry run, and at most one
delivery per actuator across restarts (property test)."""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.dispatch import DispatchConfig, Dispatcher
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store

T0 = 1_700_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecordingActuator:
    """Stands for an outside system: remembers what reached it, across aggregator restarts."""

    def __init__(
        self, name: str = "rec", fail_first: int = 0, retryable: bool = True, notify_in_dry_run: bool = False
    ) -> None:
        self.name = name
        self.notify_in_dry_run = notify_in_dry_run
        self.timeout_seconds = 5.0
        self.fail_first = fail_first
        self.retryable = retryable
        self.calls = 0
        self.received: list[str] = []

    def handles(self, decision: Decision) -> bool:
        return decision.action is not Action.OBSERVE

    def deliver(self, decision: Decision) -> str:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise DeliveryError(f"attempt {self.calls} refused", retryable=self.retryable)
        self.received.append(decision.id)
        return f"took {decision.action.value}"

    def check(self) -> str:
        return "reachable"

    def close(self) -> None:
        pass


def dec(node: str, action: Action, id: str) -> Decision:
    return Decision(id=id, ts=T0, node=node, action=action, reason="r", detector="xid", dry_run=False)


def setup(
    path: Path, actuator: RecordingActuator, clock: FakeClock, dry_run: bool = False, max_attempts: int = 4
) -> tuple[Store, Ledger, Dispatcher]:
    store = Store(path)
    sink = Ledger(Gate(GateConfig(dry_run=dry_run)), store, {actuator.name: actuator})
    cfg = DispatchConfig(max_attempts=max_attempts, base_backoff_seconds=2, max_backoff_seconds=30)
    return store, sink, Dispatcher(store, {actuator.name: actuator}, cfg, clock=clock, rng=random.Random(7))


async def test_delivers_once_and_records_the_outcome(tmp_path) -> None:
    clock, act = FakeClock(), RecordingActuator()
    store, sink, dispatcher = setup(tmp_path / "d.db", act, clock)
    sink.submit([dec("n1", Action.DRAIN, "a")], clock.now, 100)
    assert await dispatcher.run_once() == 1
    assert await dispatcher.run_once() == 0
    assert act.received == ["a"]
    [d] = store.deliveries("a")
    assert (d.state, d.attempts, d.detail) == ("delivered", 1, "took drain")


async def test_retries_with_jittered_exponential_backoff_then_delivers(tmp_path) -> None:
    clock, act = FakeClock(), RecordingActuator(fail_first=2)
    store, sink, dispatcher = setup(tmp_path / "d.db", act, clock)
    sink.submit([dec("n1", Action.DRAIN, "a")], clock.now, 100)
    await dispatcher.run_once()
    [d] = store.deliveries("a")
    assert d.state == "failed" and d.last_error == "attempt 1 refused"
    assert T0 + 1 <= d.next_attempt_ts <= T0 + 2  # base 2 s, jitter in [0.5, 1]
    assert await dispatcher.run_once() == 0  # not due yet
    clock.now = d.next_attempt_ts
    await dispatcher.run_once()
    [d] = store.deliveries("a")
    assert clock.now + 2 <= d.next_attempt_ts <= clock.now + 4  # doubled
    clock.now = d.next_attempt_ts
    await dispatcher.run_once()
    assert act.received == ["a"] and store.deliveries("a")[0].state == "delivered"


async def test_dead_letter_after_the_last_attempt_and_at_once_when_not_retryable(tmp_path) -> None:
    clock, act = FakeClock(), RecordingActuator(fail_first=100)
    store, sink, dispatcher = setup(tmp_path / "d.db", act, clock, max_attempts=3)
    sink.submit([dec("n1", Action.DRAIN, "a")], clock.now, 100)
    for _ in range(5):
        await dispatcher.run_once()
        clock.now += 100
    [d] = store.deliveries("a")
    assert (d.state, d.attempts, d.last_error) == ("dead", 3, "attempt 3 refused")
    assert act.calls == 3

    clock2, act2 = FakeClock(), RecordingActuator(fail_first=1, retryable=False)
    store2, sink2, dispatcher2 = setup(tmp_path / "e.db", act2, clock2)
    sink2.submit([dec("n1", Action.DRAIN, "b")], clock2.now, 100)
    await dispatcher2.run_once()
    assert (store2.deliveries("b")[0].state, act2.calls) == ("dead", 1)


async def test_dry_run_delivers_nothing_except_to_notifiers(tmp_path) -> None:
    clock = FakeClock()
    scheduler, notifier = RecordingActuator("slurm"), RecordingActuator("hook", notify_in_dry_run=True)
    store = Store(tmp_path / "d.db")
    acts = {"slurm": scheduler, "hook": notifier}
    Ledger(Gate(GateConfig(dry_run=True)), store, acts).submit([dec("n1", Action.DRAIN, "a")], clock.now, 100)
    await Dispatcher(store, acts, DispatchConfig(), clock=clock).run_once()
    assert scheduler.received == [] and notifier.received == ["a"]
    assert {(d.actuator, d.state) for d in store.deliveries("a")} == {("slurm", "dry_run"), ("hook", "delivered")}


async def test_an_actuator_bug_is_contained_and_retried(tmp_path) -> None:
    class Broken(RecordingActuator):
        def deliver(self, decision: Decision) -> str:
            raise KeyError("oops")

    clock, act = FakeClock(), Broken()
    store, sink, dispatcher = setup(tmp_path / "d.db", act, clock)
    sink.submit([dec("n1", Action.DRAIN, "a")], clock.now, 100)
    await dispatcher.run_once()
    [d] = store.deliveries("a")
    assert d.state == "failed" and "KeyError" in d.last_error


async def test_the_worker_wakes_on_submit(tmp_path) -> None:
    act = RecordingActuator()
    store = Store(tmp_path / "d.db")
    dispatcher = Dispatcher(store, {"rec": act}, DispatchConfig(poll_seconds=60))
    sink = Ledger(Gate(GateConfig(dry_run=False)), store, {"rec": act}, wake=dispatcher.wake)
    task = asyncio.create_task(dispatcher.run())
    await asyncio.sleep(0.05)
    sink.submit([dec("n1", Action.DRAIN, "a")], T0, 100)
    async with asyncio.timeout(5):  # poll_seconds is 60: only the wake-up can deliver it in time
        while not act.received:
            await asyncio.sleep(0.01)
    task.cancel()
    assert act.received == ["a"]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 7), st.sampled_from([Action.DRAIN, Action.ALERT, Action.RESUME])),
        st.tuples(st.just("deliver"), st.integers(0, 1), st.just(Action.OBSERVE)),
        st.tuples(st.just("restart"), st.just(0), st.just(Action.OBSERVE)),
        st.tuples(st.just("tick"), st.integers(1, 4000), st.just(Action.OBSERVE)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, flaky=st.integers(0, 3))
def test_each_decision_reaches_each_actuator_at_most_once_across_restarts(ops, flaky) -> None:
    async def scenario(path: Path) -> None:
        clock = FakeClock()
        act = RecordingActuator(fail_first=flaky)  # the outside world outlives the aggregator
        store, sink, dispatcher = setup(path, act, clock)
        admitted: set[str] = set()
        for i, (op, arg, action) in enumerate(ops):
            if op == "submit":
                admitted |= {
                    d.id for d in sink.submit([dec(f"n{arg}", action, f"{arg}-{action}-{i // 5}")], clock.now, 8)
                }
            elif op == "deliver":
                await dispatcher.run_once()
            elif op == "restart":
                store.close()
                store, sink, dispatcher = setup(path, act, clock)
            else:
                clock.now += arg
        for _ in range(10):  # drain everything still owed
            clock.now += 1000
            await dispatcher.run_once()
        assert len(act.received) == len(set(act.received))
        assert set(act.received) == admitted
        store.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp) / "d.db"))
