import asyncio
import threading
from collections.abc import Sequence

from vigil.agent.collectors.collector import Collection
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.runner import Runner, collect_once
from vigil.agent.snapshot import Snapshot
from vigil.contract.wire import Event

VALUE = MetricSpec("vigil_test_value", MetricKind.GAUGE, "test")


class Counting:
    """A collector that counts its calls and can be told to fail or to block."""

    name = "counting"
    specs: Sequence[MetricSpec] = (VALUE,)

    def __init__(self, fail: bool = False, block: threading.Event | None = None, urgent: bool = False) -> None:
        self.calls = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self.fail = fail
        self.block = block
        self.urgent = urgent
        self.closed = False

    def collect(self, now: float) -> Collection:
        self.calls += 1
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            if self.block is not None:
                self.block.wait(5)
            if self.fail:
                raise OSError("sensor unreadable")
            events = [Event(kind="xid", ts=now, urgent=True, code=79)] if self.urgent else []
            return Collection(samples=[Sample.of(VALUE, self.calls)], events=events)
        finally:
            self.concurrent -= 1

    def close(self) -> None:
        self.closed = True


def test_collect_once_turns_an_exception_into_a_failed_result() -> None:
    r = collect_once(Counting(fail=True), now=100.0)
    assert not r.success and "sensor unreadable" in (r.error or "")
    assert r.collection.samples == []


async def test_a_slow_collector_is_never_called_twice_at_once() -> None:
    gate = threading.Event()
    c = Counting(block=gate)
    snap = Snapshot()
    runner = Runner([c], {"counting": (0.01, 0.05)}, snap, on_events=lambda _: None)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    await asyncio.sleep(0.3)
    gate.set()
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert c.max_concurrent == 1
    names = {s.name: s for s in runner.self_samples()}
    assert names["vigil_collector_skipped_total"].value > 0
    assert c.closed


async def test_failures_leave_no_stale_samples_and_events_are_forwarded() -> None:
    c = Counting(urgent=True)
    snap = Snapshot()
    seen: list[Collection] = []
    runner = Runner([c], {"counting": (0.01, 1.0)}, snap, on_events=seen.append)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    await asyncio.sleep(0.1)
    assert [s.name for s in snap.samples()] == ["vigil_test_value"]
    c.fail = True
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert list(snap.samples()) == []
    assert snap.failed() == ["counting"]
    assert seen and seen[0].events[0].code == 79
    success = [s for s in runner.self_samples() if s.name == "vigil_collector_success"]
    assert success[0].value == 0


def test_a_list_section_checked_whole_fails_as_its_item_does() -> None:
    """check_wire checks a section's list in one decode; a bad item still fails the cycle with
    the error its own check names (checked again item by item), and a good list passes."""
    import msgspec
    import pytest

    from vigil.agent.runner import check_wire
    from vigil.contract.wire import RankSummary, check

    def summary(rank: int, steps: int) -> RankSummary:
        return RankSummary(job="4242", rank=rank, window_seconds=5.0, steps=steps, last_step=10,
                           last_progress_ts=1.7e9, step_seconds_p50=1.0)

    good = [summary(r, 3) for r in range(8)]
    check_wire(Collection(report={"ranks": good}))
    bad = [*good[:5], summary(5, -1), *good[6:]]
    with pytest.raises(msgspec.ValidationError) as alone:
        check(bad[5])
    with pytest.raises(msgspec.ValidationError) as whole:
        check_wire(Collection(report={"ranks": bad}))
    assert str(whole.value) == str(alone.value)
    failed = collect_once(_Fixed(Collection(report={"ranks": bad})), 1.0)
    assert not failed.success and failed.error == f"ValidationError: {alone.value}"


class _Fixed:
    """A collector that returns one collection."""

    name = "fixed"
    specs: Sequence[MetricSpec] = ()

    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    def collect(self, now: float) -> Collection:
        return self.collection

    def close(self) -> None:
        pass
