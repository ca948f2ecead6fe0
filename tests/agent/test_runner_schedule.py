"""The runner's callback schedule: a timed-out cycle is recorded as such and its late result is not;
a fault in the runner's own bookkeeping stops run() with it instead of silently ending a collector."""

import asyncio
import threading
from collections.abc import Callable

import pytest

from tests.agent.test_runner import Counting
from vigil.agent.runner import Runner
from vigil.agent.snapshot import Snapshot


async def _until(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_timed_out_cycle_is_a_timeout_failure_and_its_late_result_is_dropped() -> None:
    gate = threading.Event()
    c = Counting(block=gate)
    snap = Snapshot()
    runner = Runner([c], {"counting": (0.01, 0.05)}, snap, on_events=lambda _: None)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    await _until(lambda: "counting" in snap.results())
    first = snap.results()["counting"]
    assert not first.success and first.error == "timed out after 0.05s"
    failures = {s.labels: s.value for s in runner.self_samples() if s.name == "vigil_collector_failures_total"}
    assert failures == {(("collector", "counting"), ("reason", "timeout")): 1}
    assert c.calls == 1  # never two at once: the due cycles are skipped while it runs
    gate.set()
    await _until(lambda: snap.results()["counting"].success)  # the next cycle's, not the late one's
    assert snap.results()["counting"].collection.samples[0].value >= 2  # the blocked call 1 was not recorded
    stop.set()
    await asyncio.wait_for(task, 5)
    assert c.closed and c.max_concurrent == 1


async def test_a_fault_in_the_runners_bookkeeping_is_raised_by_run() -> None:
    def broken(_: object) -> None:
        raise RuntimeError("reporter gone")

    c = Counting(urgent=True)
    runner = Runner([c], {"counting": (0.01, 1.0)}, Snapshot(), on_events=broken)
    with pytest.raises(RuntimeError, match="reporter gone"):
        await asyncio.wait_for(runner.run(asyncio.Event()), 5)
    assert c.closed
