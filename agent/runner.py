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
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from vigil.agent.collectors.collector import Collection, Collector, Wakeable
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.contract.wire import PortState, check, encode

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
    raises SchemaError naming the field.

    A section that is a list of one Struct type is checked in one encode and one decode of the
    whole list (a node's eight rank summaries cost eight of each, a tenth of the simulated agent's
    tick); only when that fails is it checked item by item, so the error raised is the one the
    item's own check names."""
    for value in collection.report.values():
        if isinstance(value, list):
            if len(value) > 1 and _checks_whole(value):
                continue
            for item in value:
                if item is not None:
                    check(item)
        elif value is not None:
            check(value)
    for event in collection.events:
        check(event)


# A strict decoder of a list of each Struct type checked whole (``_checks_whole``), made once.
_LIST_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _checks_whole(items: list[object]) -> bool:
    """Whether ``items``, all of one Struct type without a check of its own beyond the decode
    (PortState's counters have one), pass the decode as one list; False: check them one by one."""
    kind = type(items[0])
    if not issubclass(kind, msgspec.Struct) or kind is PortState or any(type(i) is not kind for i in items):
        return False
    decoder = _LIST_DECODERS.get(kind)
    if decoder is None:
        decoder = _LIST_DECODERS[kind] = msgspec.json.Decoder(list[kind])  # type: ignore[valid-type]
    try:
        decoder.decode(encode(items))
    except Exception:  # noqa: BLE001 - whatever it is, the item-by-item check raises it as it always has
        return False
    return True


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
        """Run every collector at its interval until ``stop``; then let the cycles in flight finish
        (each within its timeout) and close the collectors. An exception in the runner's own
        bookkeeping (never a collector's: those are failed results) is raised here."""
        loop = asyncio.get_running_loop()
        crashed: asyncio.Future[object] = loop.create_future()
        schedules = [_Schedule(self, c, *self._intervals.get(c.name, (1.0, 5.0)), loop, crashed)
                     for c in self.collectors]
        try:
            for schedule in schedules:
                schedule.start()
            stopping: asyncio.Future[object] = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait((stopping, crashed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
            for schedule in schedules:
                schedule.stop()
            if crashed.done():
                crashed.result()
            for schedule in schedules:
                await schedule.finish()
        finally:
            for schedule in schedules:
                schedule.stop()
            for c in self.collectors:
                try:
                    c.close()
                except Exception as exc:  # noqa: BLE001 - closing must reach every collector
                    log.warning("closing collector %s: %s", c.name, exc)
            self._pool.shutdown(wait=False, cancel_futures=True)


class _Schedule:
    """One collector's cycles, driven by loop callbacks rather than a coroutine: a timer starts a
    cycle in the pool, the pool's completion (or the timeout's timer, whichever the loop runs
    first) records it and sets the next timer. Per cycle that is one timer, one hand-off to a
    worker thread and one back; a coroutine per collector (wait_for on the stop event, a wait on
    the executor's future) cost the idle agent about 0.4 ms of CPU per cycle in tasks, futures
    and loop iterations (scripts/agent-cpu-breakdown.py). The schedule is the one the coroutine
    kept: the next cycle is due an interval after the previous one was due, counted from when it
    finished or timed out; a cycle that falls behind starts the next one at once, never in a
    burst; while a timed-out call is still running, each due cycle is skipped and counted.

    A ``Wakeable`` collector whose source polls (the xid collector on /dev/kmsg) is also started by
    its descriptor turning readable: between cycles the loop watches it, and the next cycle
    without a readable moment is due at the seconds the collector gives, not at its interval. The
    descriptor is watched only while no call of the collector runs (the call reads it, and may
    close it); a descriptor the loop cannot watch leaves the collector on its interval. A readable
    moment never starts a cycle sooner than the interval after the last one started: a flood that
    keeps the descriptor readable is read at the interval's pace, as it was when polled."""

    def __init__(self, runner: Runner, collector: Collector, interval: float, timeout: float,
                 loop: asyncio.AbstractEventLoop, crashed: asyncio.Future[object]) -> None:
        self._runner = runner
        self._collector = collector
        self._interval = interval
        self._timeout = timeout
        self._loop = loop
        self._crashed = crashed
        self._next_at = 0.0
        self._timer: asyncio.Handle | None = None  # the next cycle's start, or the timeout
        self._in_flight: concurrent.futures.Future[CollectorResult] | None = None
        self._waited: concurrent.futures.Future[CollectorResult] | None = None  # in flight, not timed out
        self._started: tuple[float, CollectorResult | None] = (0.0, None)  # (now, previous) of _waited
        self._deadline = 0.0  # loop time at which _waited times out
        self._stopped = False
        self._wakeable = collector if isinstance(collector, Wakeable) else None
        self._watched: int | None = None  # the descriptor the loop watches for a readable wake
        self._last_start = -math.inf  # loop time at which the last cycle started

    def start(self) -> None:
        self._next_at = self._loop.time()
        self._timer = self._loop.call_soon(self._guarded, self._tick)

    def stop(self) -> None:
        self._stopped = True
        self._unwatch()
        if self._timer is not None and self._waited is None:  # a cycle's timeout timer stays
            self._timer.cancel()
            self._timer = None

    async def finish(self) -> None:
        """Wait for the cycle in flight to be recorded (done or timed out)."""
        while self._waited is not None:
            waited = asyncio.wrap_future(self._waited)
            await asyncio.wait({waited}, timeout=max(0.0, self._deadline - self._loop.time()))
            await asyncio.sleep(0)  # let the completion's callback, queued by the worker, run
            if self._waited is not None and self._loop.time() >= self._deadline:
                self._time_out()

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the runner's own fault: run() raises it
            if not self._crashed.done():
                self._crashed.set_exception(exc)

    def _tick(self) -> None:
        self._timer = None
        if self._stopped:
            return
        self._unwatch()  # the call reads (and may close) what the loop watched
        runner, name = self._runner, self._collector.name
        if self._in_flight is not None and not self._in_flight.done():
            runner._skipped[name] += 1
            self._schedule_next()
            return
        now = runner._clock()
        previous = runner.snapshot.results().get(name)
        self._last_start = self._loop.time()
        future = runner._pool.submit(collect_once, self._collector, now, time.perf_counter, previous)
        self._in_flight = self._waited = future
        self._started = (now, previous)
        self._deadline = self._loop.time() + self._timeout
        self._timer = self._loop.call_at(self._deadline, self._guarded, self._time_out)
        future.add_done_callback(self._completed_in_worker)

    def _completed_in_worker(self, future: concurrent.futures.Future[CollectorResult]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed first: nothing is left to record
            self._loop.call_soon_threadsafe(self._guarded, lambda: self._done(future))

    def _done(self, future: concurrent.futures.Future[CollectorResult]) -> None:
        if future is not self._waited:  # it had timed out: a late result is not recorded
            return
        self._waited = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._record(future.result(), timed_out=False)

    def _time_out(self) -> None:
        if self._timer is not None:  # finish() may get here before the timer does
            self._timer.cancel()
            self._timer = None
        if self._waited is None:
            return
        self._waited = None
        now, previous = self._started
        name, timeout = self._collector.name, self._timeout
        result = CollectorResult(Collection(), False, timeout, now, f"timed out after {timeout}s")
        if previous is None or previous.error != result.error:
            log.warning("collector %s timed out after %.1fs", name, timeout)
        self._record(result, timed_out=True)

    def _record(self, result: CollectorResult, *, timed_out: bool) -> None:
        self._runner._record(self._collector.name, result, timed_out=timed_out)
        if result.collection.events:
            self._runner._on_events(result.collection)
        self._schedule_next()

    def _readable(self) -> None:
        """The watched descriptor has something: the cycle due later starts now, or once the
        interval since the last one started is up."""
        self._unwatch()
        if self._stopped or self._waited is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._loop.time()
        self._next_at = max(now, self._last_start + self._interval)
        if self._next_at <= now:
            self._tick()
        else:
            self._timer = self._loop.call_at(self._next_at, self._guarded, self._tick)

    def _watch(self, fd: int) -> bool:
        try:
            self._loop.add_reader(fd, self._guarded, self._readable)
        except (OSError, ValueError) as exc:  # not pollable after all: the interval it is
            log.debug("collector %s: descriptor %s cannot be watched: %s", self._collector.name, fd, exc)
            return False
        self._watched = fd
        return True

    def _unwatch(self) -> None:
        if self._watched is not None:
            self._loop.remove_reader(self._watched)
            self._watched = None

    def _schedule_next(self) -> None:
        if self._stopped:
            return
        interval = self._interval
        # Watched only while no call runs: a timed-out one still running may never read what is
        # there, and a readable descriptor would start (and skip) a cycle at every loop pass.
        if self._wakeable is not None and (self._in_flight is None or self._in_flight.done()):
            wake = self._wakeable.wake(self._runner._clock())
            if wake is not None and self._watch(wake[0]):
                interval = wake[1]
        self._next_at += interval
        now = self._loop.time()
        if self._next_at < now:  # fell behind (slow cycle): start again from now, do not burst
            self._next_at = now
        self._timer = self._loop.call_at(self._next_at, self._guarded, self._tick)
