"""The agent's runner: one periodic task per collector, the reporter, and nothing else async.

Each collector's blocking ``collect`` runs in a worker thread with a timeout; a collector whose
previous call is still running is skipped (never two in flight), and a timed-out or failed cycle
leaves no samples for that collector (absent, not stale), is counted by reason and logged when it
starts or changes (a source that stays broken, such as a missing kernel log file, logs once, not
every cycle; its recovery logs once too). Events go to the reporter; an urgent one makes it push at
once. The runner reads no hardware itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from vigil.agent.collectors.collector import Collection, Collector
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.agent.wire import check

log = logging.getLogger("vigil.agent.runner")

COLLECTOR_SUCCESS = MetricSpec("vigil_collector_success", MetricKind.GAUGE,
                               "1 if the collector's last cycle succeeded, else 0.", labels=("collector",))
COLLECTOR_DURATION = MetricSpec("vigil_collector_duration_seconds", MetricKind.GAUGE,
                                "Wall time of the collector's last cycle.", labels=("collector",), unit="seconds")
COLLECTOR_SKIPPED = MetricSpec("vigil_collector_skipped_total", MetricKind.COUNTER,
                               "Cycles skipped because the previous call was still running.",
                               labels=("collector",))
COLLECTOR_FAILURES = MetricSpec("vigil_collector_failures_total", MetricKind.COUNTER,
                                "Failed collection cycles, by reason: the exception's type (e.g. FileNotFoundError "
                                "for a missing kernel log file), or timeout.", labels=("collector", "reason"))
RUNNER_SPECS = (COLLECTOR_SUCCESS, COLLECTOR_DURATION, COLLECTOR_SKIPPED, COLLECTOR_FAILURES)
TIMEOUT_REASON = "timeout"


def collect_once(collector: Collector, now: float, timer: Callable[[], float] = time.perf_counter,
                 previous: CollectorResult | None = None) -> CollectorResult:
    """Run one cycle synchronously and record its outcome. Exceptions become a failed result:
    a broken source must never take the agent down. So does output that breaks the wire contract
    (building a wire Struct checks nothing): a value out of its bounds would make the aggregator
    refuse the whole report, so the cycle fails instead, named in the report's failed_collectors.
    With ``previous`` (this collector's last result), a failure is logged only when it differs from
    the previous one, and a success after a failure is logged as the recovery."""
    start = timer()
    try:
        collection = collector.collect(now)
        check_wire(collection)
    except Exception as exc:  # noqa: BLE001 - any failure of one source is reported, not raised
        error = f"{type(exc).__name__}: {exc}"
        if previous is None or previous.error != error:
            log.warning("collector %s failed: %s%s", collector.name, error,
                        "" if previous is None else " (logged again when this changes; "
                        "vigil_collector_failures_total counts each cycle)")
        return CollectorResult(Collection(), False, timer() - start, now, error)
    if previous is not None and not previous.success:
        log.info("collector %s recovered (it failed: %s)", collector.name, previous.error)
    return CollectorResult(collection, True, timer() - start, now)


def check_wire(collection: Collection) -> None:
    """Validate what ``collection`` puts into a report as the aggregator will (wire.check);
    raises SchemaError naming the field."""
    for value in collection.report.values():
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                check(item)
    for event in collection.events:
        check(event)


class Runner:
    def __init__(
        self,
        collectors: Sequence[Collector],
        intervals: dict[str, tuple[float, float]],  # name -> (interval_seconds, timeout_seconds)
        snapshot: Snapshot,
        on_events: Callable[[Collection], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.collectors = list(collectors)
        self._intervals = intervals
        self.snapshot = snapshot
        self._on_events = on_events
        self._clock = clock
        self._skipped: dict[str, int] = {c.name: 0 for c in collectors}
        self._failures: dict[tuple[str, str], int] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, len(self.collectors)), thread_name_prefix="vigil-collect")

    def self_samples(self) -> list[Sample]:
        out: list[Sample] = []
        for name, r in self.snapshot.results().items():
            out.append(Sample.of(COLLECTOR_SUCCESS, 1 if r.success else 0, collector=name))
            out.append(Sample.of(COLLECTOR_DURATION, r.duration_seconds, collector=name))
        for name, n in self._skipped.items():
            out.append(Sample.of(COLLECTOR_SKIPPED, n, collector=name))
        for (name, reason), n in self._failures.items():
            out.append(Sample.of(COLLECTOR_FAILURES, n, collector=name, reason=reason))
        return out

    def cycle(self, collector: Collector) -> CollectorResult:
        """One cycle now, in this thread, recorded as the loop records one (tests, drills)."""
        result = collect_once(collector, self._clock(), previous=self.snapshot.results().get(collector.name))
        self._record(collector.name, result)
        return result

    def _record(self, name: str, result: CollectorResult, *, timed_out: bool = False) -> None:
        if not result.success:
            # collect_once writes "<exception type>: <message>": the type is the reason (bounded by code)
            key = (name, TIMEOUT_REASON if timed_out else (result.error or "").partition(":")[0] or "unknown")
            self._failures[key] = self._failures.get(key, 0) + 1
        self.snapshot.put(name, result)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for c in self.collectors:
                    tg.create_task(self._loop(c, stop), name=f"collect-{c.name}")
        finally:
            for c in self.collectors:
                try:
                    c.close()
                except Exception as exc:  # noqa: BLE001 - closing must reach every collector
                    log.warning("closing collector %s: %s", c.name, exc)
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _loop(self, collector: Collector, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        interval, timeout = self._intervals.get(collector.name, (1.0, 5.0))
        in_flight: asyncio.Future[CollectorResult] | None = None
        next_at = loop.time()
        while not stop.is_set():
            if in_flight is not None and not in_flight.done():
                self._skipped[collector.name] += 1
            else:
                now = self._clock()
                previous = self.snapshot.results().get(collector.name)
                in_flight = loop.run_in_executor(self._pool, collect_once, collector, now, time.perf_counter,
                                                 previous)
                done, _ = await asyncio.wait({in_flight}, timeout=timeout)
                if done:
                    result = in_flight.result()
                else:
                    result = CollectorResult(Collection(), False, timeout, now, f"timed out after {timeout}s")
                    if previous is None or previous.error != result.error:
                        log.warning("collector %s timed out after %.1fs", collector.name, timeout)
                self._record(collector.name, result, timed_out=not done)
                if result.collection.events:
                    self._on_events(result.collection)
            next_at += interval
            delay = next_at - loop.time()
            if delay < 0:  # fell behind (slow cycle): start again from now, do not burst
                next_at = loop.time()
                delay = 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
