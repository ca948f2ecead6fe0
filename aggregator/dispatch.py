"""Delivery: from the store to the actuators, at least once, each actuator on workers of its own.

The ``Dispatcher`` reads due deliveries from the store, claims each with a fenced write, and runs its actuator
on that actuator's own bounded thread pool under a total deadline, with jittered backoff into a dead-letter
state; a delivered decision goes to ``on_delivered`` and each round to ``last_round``, which HA leadership
follows. It judges nothing and keeps no delivery state outside the store (README.md, "Delivery guarantee";
docs/ha.md, "How it works"; docs/architecture.md, "11. The acting path").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from vigil.aggregator.actuators.actuator import Actuator, DeadlineExceeded, DeliveryError, DispatchConfig
from vigil.aggregator.decision import Decision
from vigil.aggregator.store import WRITE_ERRORS, Delivery, Store

__all__ = ["DEADLINE_GRACE_SECONDS", "ActuatorWorkers", "DispatchConfig", "Dispatcher"]

log = logging.getLogger("vigil.aggregator.dispatch")

T = TypeVar("T")

# The actuator cuts its own exchange at its deadline (timeout_seconds); the dispatcher stops
# waiting this much later whatever the actuator does (a worker stuck in name resolution, a client
# whose timeout is per read), records the attempt as failed and leaves the worker to finish.
DEADLINE_GRACE_SECONDS = 1.0
# While every worker of an actuator is busy, its due deliveries are postponed by this many polls
# (then looked at again); a worker coming free wakes the dispatcher before that.
BUSY_POSTPONE_POLLS = 5
PHASES = ("delivery", "check")


class NotActing(Exception):
    """The worker found this replica no longer acting (leadership lost or its lease lapsed)
    between the claim and the send: nothing was sent, nothing is recorded."""


class ActuatorWorkers:
    """One actuator's own threads and what occupies them now. ``submit`` runs on the event loop;
    the readings (``busy``, ``oldest_seconds``, ``stalled``) are safe from any thread."""

    def __init__(self, name: str, size: int, deadline_seconds: float, *,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.size = size
        self.deadline_seconds = deadline_seconds
        self.monotonic = monotonic
        self.executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"vigil-actuator-{name}")
        self.deadline_exceeded: Counter[str] = Counter()  # phase (delivery, check) -> count
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}  # token -> when its work took a worker (monotonic)
        self._tokens = 0
        self._timing_out = False

    def free(self) -> int:
        with self._lock:
            return self.size - len(self._started)

    def busy(self) -> int:
        with self._lock:
            return len(self._started)

    def oldest_seconds(self) -> float:
        """How long the longest-running work of this actuator has held its worker (0: none)."""
        with self._lock:
            first = min(self._started.values(), default=None)
        return 0.0 if first is None else max(0.0, self.monotonic() - first)

    def stalled(self) -> bool:
        """The target's last exchange was cut off at the deadline (none answered since), or every
        worker is busy past it (nothing new can start)."""
        with self._lock:
            timing_out = self._timing_out
        return timing_out or (self.free() <= 0 and self.oldest_seconds() > self.deadline_seconds
                              + DEADLINE_GRACE_SECONDS)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` on a worker of this actuator's (callers submit only while ``free``, so work
        never queues behind a stuck worker); the worker counts as busy until ``fn`` returns."""
        with self._lock:
            self._tokens += 1
            token = self._tokens
            self._started[token] = self.monotonic()
        future = self.executor.submit(fn, *args)
        future.add_done_callback(lambda _: self._release(token))
        return future

    def _release(self, token: int) -> None:
        with self._lock:
            self._started.pop(token, None)

    def count_deadline(self, phase: str) -> None:
        """A delivery or check (``phase``) cut off at the deadline: the actuator counts as stalled
        until its target answers again."""
        with self._lock:
            self.deadline_exceeded[phase] += 1
            self._timing_out = True

    def answered(self) -> None:
        """The target answered within the deadline (success or a refusal): not stalled."""
        with self._lock:
            self._timing_out = False

    def close(self) -> None:
        # A worker still blocked in its exchange finishes by its deadline; nothing waits for it here.
        self.executor.shutdown(wait=False, cancel_futures=True)


class Dispatcher:
    def __init__(
        self,
        store: Store,
        actuators: Mapping[str, Actuator],
        config: DispatchConfig,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_delivered: Callable[[str, Decision, float], None] | None = None,
        acting: Callable[[], bool] = lambda: True,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.acting = acting
        # Called with (actuator, decision, now) once a delivery is recorded as delivered: the
        # node-action outbox follows a delivered drain with its request (aggregator/outbox.py).
        self.on_delivered = on_delivered
        self.actuators = dict(actuators)
        self.config = config
        self.clock = clock
        self.monotonic = monotonic
        self.rng = rng or random.Random()
        self.workers = {name: ActuatorWorkers(name, config.workers_of(name), a.timeout_seconds, monotonic=monotonic)
                        for name, a in self.actuators.items()}
        # The store's calls from here: never behind a delivery, never in the loop's default pool.
        self._store_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vigil-dispatch-store")
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (actuator, delivered|failed|dead)
        self.store_errors = 0  # delivery state updates the store refused (retried next round)
        self.not_acting = 0  # deliveries claimed, then not sent: this replica stopped acting meanwhile
        self.last_round: float | None = None  # monotonic end of the acting loop's last round
        self._in_flight: set[tuple[str, str]] = set()  # (decision id, actuator) holding a worker
        self._busy_logged: set[str] = set()
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def backoff_seconds(self, attempt: int) -> float:
        """Exponential backoff with jitter in [0.5, 1] of the step, so retries of many
        deliveries after an outage spread out instead of arriving together."""
        step = min(self.config.max_backoff_seconds, self.config.base_backoff_seconds * 2 ** (attempt - 1))
        return step * self.rng.uniform(0.5, 1.0)

    def round_age(self) -> float | None:
        """Seconds since the acting loop last completed a round; None before ``run`` started
        (deliveries disabled: there is no acting loop to follow)."""
        return None if self.last_round is None else max(0.0, self.monotonic() - self.last_round)

    def wake(self) -> None:
        """Deliver now (called by the sink after it stored something); safe from any thread."""
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)

    async def _store(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._store_executor, functools.partial(fn, *args))

    async def run_once(self) -> int:
        """Deliver every due delivery once and wait for them; returns how many were started.
        Those of a busy actuator start as its workers come free (one left busy past its deadline
        leaves them postponed in the store)."""
        waiting = await self._store(self.store.due, self.clock(), self.config.concurrency * 8)
        running: set[asyncio.Task[None]] = set()
        started = 0
        while waiting or running:
            tasks, waiting = await self._start(waiting)
            started += len(tasks)
            running |= set(tasks)
            if not running:
                break
            _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        await self._postpone(waiting)
        return started

    async def start_due(self, horizon_seconds: float = 0.0) -> list[asyncio.Task[None]]:
        """Claim and start the due deliveries that have a free worker of their actuator; postpone
        the others of a busy actuator. Returns the started deliveries' tasks (not awaited).
        ``horizon_seconds``: also those due that much later (a claim of a previous leader or run)."""
        due = await self._store(self.store.due, self.clock() + horizon_seconds, self.config.concurrency * 8)
        tasks, waiting = await self._start(due)
        await self._postpone(waiting)
        return tasks

    async def _start(self, due: list[tuple[Delivery, Decision]]
                     ) -> tuple[list[asyncio.Task[None]], list[tuple[Delivery, Decision]]]:
        """Claim (a fenced write) and start those of ``due`` whose actuator has a free worker;
        returns their tasks and the ones left waiting."""
        free = {name: w.free() for name, w in self.workers.items()}
        start: list[tuple[Delivery, Decision]] = []
        waiting: list[tuple[Delivery, Decision]] = []
        for delivery, decision in due:
            name = delivery.actuator
            if (decision.id, name) in self._in_flight or free.get(name, 1) <= 0:
                waiting.append((delivery, decision))
                continue
            if name in free:
                free[name] -= 1
            start.append((delivery, decision))
        self._log_busy({d.actuator for d, _ in waiting})
        if not start:
            return [], waiting
        now = self.clock()
        await self._store(self.store.postpone, [(x.id, d.actuator, now + self._deadline(d.actuator)) for d, x in start])
        return [asyncio.create_task(self._deliver(d, x)) for d, x in start], waiting

    async def _postpone(self, waiting: list[tuple[Delivery, Decision]]) -> None:
        """A busy actuator's due deliveries wait in the store (no attempt counted) for a while;
        a worker coming free wakes the dispatcher sooner."""
        until = self.clock() + BUSY_POSTPONE_POLLS * self.config.poll_seconds
        await self._store(self.store.postpone, [(x.id, d.actuator, until) for d, x in waiting])

    def _deadline(self, name: str) -> float:
        actuator = self.actuators.get(name)
        return (actuator.timeout_seconds if actuator is not None else 0.0) + DEADLINE_GRACE_SECONDS

    def _log_busy(self, waiting: set[str]) -> None:
        """One ERROR when an actuator's deliveries start waiting for its workers, one WARNING
        when a worker of it is free again."""
        for name in sorted(waiting - self._busy_logged):
            w = self.workers.get(name)
            if w is not None and w.free() <= 0:
                self._busy_logged.add(name)
                log.error("actuator %s: all %d workers busy, the oldest for %.1fs (deadline %gs): its deliveries "
                          "wait in the store; other actuators go on", name, w.size, w.oldest_seconds(),
                          w.deadline_seconds)
        for name in sorted(self._busy_logged):
            if self.workers[name].free() > 0:
                self._busy_logged.discard(name)
                log.warning("actuator %s: a worker is free again; its waiting deliveries go out", name)

    def _send(self, actuator: Actuator, decision: Decision) -> str:
        """On the actuator's worker: the last look at leadership, then the delivery itself."""
        if not self.acting():
            raise NotActing
        return actuator.deliver(decision)

    async def _deliver(self, delivery: Delivery, decision: Decision) -> None:
        try:
            await self._attempt(delivery, decision)
        except WRITE_ERRORS as exc:
            # The delivery stays open in the store (or was done and is repeated: at least once).
            self.store_errors += 1
            log.error("decision store %s: delivery state of %s to %s not updated: %s; retrying", self.store.path,
                      decision.id, delivery.actuator, exc)

    async def _attempt(self, delivery: Delivery, decision: Decision) -> None:
        actuator = self.actuators.get(delivery.actuator)
        now = self.clock()
        if actuator is None:
            # Configured away since the decision was stored: keep the record, retry later.
            await self._store(self.store.mark, decision.id, delivery.actuator, "failed", now,
                              now + self.config.max_backoff_seconds, "actuator not configured")
            return
        workers = self.workers[actuator.name]
        key = (decision.id, actuator.name)
        self._in_flight.add(key)
        loop = asyncio.get_running_loop()
        future = workers.submit(self._send, actuator, decision)
        future.add_done_callback(lambda _: self._freed_from_worker(loop, key))
        attempt = delivery.attempts + 1
        retryable = True
        deadline = actuator.timeout_seconds + DEADLINE_GRACE_SECONDS
        try:
            async with asyncio.timeout(deadline):
                detail = await asyncio.wrap_future(future)
        except NotActing:
            self.not_acting += 1
            log.warning("delivery of %s to %s not sent: this replica stopped acting before it started",
                        decision.id, actuator.name)
            return
        except DeadlineExceeded as exc:
            workers.count_deadline("delivery")
            error = str(exc)
        except DeliveryError as exc:
            workers.answered()
            error, retryable = str(exc), exc.retryable
        except TimeoutError:
            workers.count_deadline("delivery")
            error = (f"no outcome within its deadline of {actuator.timeout_seconds:g}s (+{DEADLINE_GRACE_SECONDS:g}s):"
                     " its worker stays busy until the actuator returns")
        except Exception as exc:  # an actuator bug must not stop delivery of everything else
            log.exception("actuator %s failed on %s", actuator.name, decision.id)
            error = f"{type(exc).__name__}: {exc}"
        else:
            workers.answered()
            await self._store(self.store.mark, decision.id, actuator.name, "delivered", self.clock(), None, "", detail)
            self.outcomes[(actuator.name, "delivered")] += 1
            if self.on_delivered is not None:
                try:
                    self.on_delivered(actuator.name, decision, self.clock())
                except Exception:  # the delivery stands; the follow-up's owner logs and counts its own refusals
                    log.exception("after delivering %s to %s: follow-up failed", decision.id, actuator.name)
            return
        now = self.clock()
        if retryable and attempt < self.config.max_attempts:
            retry = self.backoff_seconds(attempt)
            log.warning("delivery of %s (%s %s) to %s failed, attempt %d of %d, retry in %.1fs: %s",
                        decision.id, decision.action.value, decision.subject, actuator.name, attempt,
                        self.config.max_attempts, retry, error)
            await self._store(self.store.mark, decision.id, actuator.name, "failed", now, now + retry, error)
            self.outcomes[(actuator.name, "failed")] += 1
        else:
            log.error("delivery of %s (%s %s) to %s is DEAD-LETTERED after %d attempt(s): %s; "
                      "nothing will retry it (see `vigil aggregator decisions`)", decision.id,
                      decision.action.value, decision.subject, actuator.name, attempt, error)
            await self._store(self.store.mark, decision.id, actuator.name, "dead", now, None, error)
            self.outcomes[(actuator.name, "dead")] += 1

    def _freed_from_worker(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str]) -> None:
        """``_freed`` on the loop, from the worker thread; a worker that returns after the service
        stopped (its loop closed) has nothing left to wake."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            loop.call_soon_threadsafe(self._freed, key)

    def _freed(self, key: tuple[str, str]) -> None:
        """A worker returned (its outcome recorded, or given up on at the deadline): look again."""
        self._in_flight.discard(key)
        if self._event is not None:
            self._event.set()

    async def run(self) -> None:
        """Deliver until cancelled; each pass is a round (``last_round``), delivering or standing by."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self.last_round = self.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        # On starting to act (at start-up, on taking over), deliveries another run or the old
        # leader had claimed are started at once rather than when their claim runs out: it is
        # fenced or gone, and a repeat carries the same key (at least once).
        claims_seconds = max((self._deadline(name) for name in self.actuators), default=0.0)
        was_acting = False
        try:
            while True:
                self._event.clear()
                wait = self.config.poll_seconds
                acting = self.acting()
                if acting:  # a standby: the leader delivers; woken when this one takes over
                    done = await self._round(tasks, 0.0 if was_acting else claims_seconds)
                    wait = self.config.poll_seconds if done is None else done
                    acting = done is not None  # a round the store refused is tried again as the first
                was_acting = acting
                self.last_round = self.monotonic()
                await self._idle(wait)
        finally:
            for task in tasks:  # cut off here, a delivery stays open in the store: retried at the next start
                task.cancel()

    async def _round(self, tasks: set[asyncio.Task[None]], horizon_seconds: float) -> float | None:
        """One pass: start what is due; returns how long to wait, None when the store failed."""
        wait = self.config.poll_seconds
        try:
            for task in await self.start_due(horizon_seconds):
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            next_ts = await self._store(self.store.next_due_ts)
        except WRITE_ERRORS as exc:
            # Nothing was claimed or started: the deliveries stay open in the store for the next round.
            self.store_errors += 1
            log.error("decision store %s: due deliveries not read or claimed: %s; retrying", self.store.path, exc)
            return None
        if next_ts is not None:
            wait = max(0.0, min(wait, next_ts - self.clock()))
        return wait

    async def _idle(self, wait_seconds: float) -> None:
        assert self._event is not None
        try:
            async with asyncio.timeout(wait_seconds):
                await self._event.wait()
        except TimeoutError:
            pass

    def close(self) -> None:
        for workers in self.workers.values():
            workers.close()
        self._store_executor.shutdown(wait=False, cancel_futures=True)
        for actuator in self.actuators.values():
            actuator.close()
