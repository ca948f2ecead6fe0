"""Delivery: from the store to the actuators, at least once.

The ``Dispatcher`` is an async worker that takes due deliveries from the store (written there
by ``aggregator.ledger.Ledger``) and runs each (blocking) actuator in a thread, with jittered
exponential backoff and a dead-letter state; every failed attempt is a WARNING and a counted
outcome, every dead letter an ERROR. A delivered decision is handed to ``on_delivered`` (the
node-action outbox follows a delivered drain with its request to the agent). Only the leader of
an HA pair delivers (``acting``); the store refuses a standby's delivery updates besides. It
judges nothing and keeps no delivery state outside the store.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping

from vigil.aggregator.actuators.actuator import Actuator, DeliveryError, DispatchConfig
from vigil.aggregator.decision import Decision
from vigil.aggregator.store import WRITE_ERRORS, Delivery, Store

__all__ = ["DispatchConfig", "Dispatcher"]

log = logging.getLogger("vigil.aggregator.dispatch")


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
    ) -> None:
        self.store = store
        self.acting = acting
        # Called with (actuator, decision, now) once a delivery is recorded as delivered: the
        # node-action outbox follows a delivered drain with its request (aggregator/outbox.py).
        self.on_delivered = on_delivered
        self.actuators = dict(actuators)
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random()
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (actuator, delivered|failed|dead)
        self.store_errors = 0  # delivery state updates the store refused (retried next round)
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def backoff_seconds(self, attempt: int) -> float:
        """Exponential backoff with jitter in [0.5, 1] of the step, so retries of many
        deliveries after an outage spread out instead of arriving together."""
        step = min(self.config.max_backoff_seconds, self.config.base_backoff_seconds * 2 ** (attempt - 1))
        return step * self.rng.uniform(0.5, 1.0)

    def wake(self) -> None:
        """Deliver now (called by the sink after it stored something); safe from any thread."""
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)

    async def run_once(self) -> int:
        """Deliver every due delivery once; returns how many were attempted."""
        # Store calls run in worker threads: a large batch being committed holds the store's lock.
        due = await asyncio.to_thread(self.store.due, self.clock(), self.config.concurrency * 8)
        sem = asyncio.Semaphore(self.config.concurrency)

        async def one(delivery: Delivery, decision: Decision) -> None:
            async with sem:
                await self._deliver(delivery, decision)

        async with asyncio.TaskGroup() as tg:
            for delivery, decision in due:
                tg.create_task(one(delivery, decision))
        return len(due)

    async def _deliver(self, delivery: Delivery, decision: Decision) -> None:
        actuator = self.actuators.get(delivery.actuator)
        now = self.clock()
        if actuator is None:
            # Configured away since the decision was stored: keep the record, retry later.
            await asyncio.to_thread(
                self.store.mark,
                decision.id,
                delivery.actuator,
                "failed",
                now,
                now + self.config.max_backoff_seconds,
                error="actuator not configured",
            )
            return
        attempt = delivery.attempts + 1
        retryable = True
        try:
            async with asyncio.timeout(actuator.timeout_seconds):
                detail = await asyncio.to_thread(actuator.deliver, decision)
        except DeliveryError as exc:
            error, retryable = str(exc), exc.retryable
        except TimeoutError:
            error = f"timed out after {actuator.timeout_seconds}s"
        except Exception as exc:  # an actuator bug must not stop delivery of everything else
            log.exception("actuator %s failed on %s", actuator.name, decision.id)
            error = f"{type(exc).__name__}: {exc}"
        else:
            await asyncio.to_thread(self.store.mark, decision.id, actuator.name, "delivered", self.clock(),
                                    detail=detail)
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
                        decision.id, decision.action.value, decision.node, actuator.name, attempt,
                        self.config.max_attempts, retry, error)
            await asyncio.to_thread(self.store.mark, decision.id, actuator.name, "failed", now, now + retry,
                                    error=error)
            self.outcomes[(actuator.name, "failed")] += 1
        else:
            log.error("delivery of %s (%s %s) to %s is DEAD-LETTERED after %d attempt(s): %s; "
                      "nothing will retry it (see `vigil aggregator decisions`)", decision.id,
                      decision.action.value, decision.node, actuator.name, attempt, error)
            await asyncio.to_thread(self.store.mark, decision.id, actuator.name, "dead", now, error=error)
            self.outcomes[(actuator.name, "dead")] += 1

    async def run(self) -> None:
        """Deliver until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        while True:
            self._event.clear()
            if not self.acting():  # a standby: the leader delivers; woken when this one takes over
                await self._idle(self.config.poll_seconds)
                continue
            try:
                await self.run_once()
                next_ts = await asyncio.to_thread(self.store.next_due_ts)
            except* WRITE_ERRORS as group:
                # The delivery stays open in the store (or was done and is repeated: at least once).
                self.store_errors += 1
                log.error("decision store %s: delivery state not updated: %s; retrying", self.store.path,
                          group.exceptions[0])
                next_ts = None
            wait = self.config.poll_seconds
            if next_ts is not None:
                wait = max(0.0, min(wait, next_ts - self.clock()))
            await self._idle(wait)

    async def _idle(self, wait_seconds: float) -> None:
        assert self._event is not None
        try:
            async with asyncio.timeout(wait_seconds):
                await self._event.wait()
        except TimeoutError:
            pass

    def close(self) -> None:
        for actuator in self.actuators.values():
            actuator.close()
