"""Delivery: the engine's decisions go through the gate into the store, and from the store to the actuators.

``GatedSink`` is the engine's ``DecisionSink``: it judges each decision with the ``Gate`` and
writes it, with its verdict and one pending delivery per actuator, before returning. The
``Dispatcher`` is an async worker that takes due deliveries from the store and runs each
(blocking) actuator in a thread, with jittered exponential backoff and a dead-letter state.
Neither judges a node's health; neither keeps delivery state outside the store.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from aggregator.actuators.actuator import Actuator, DeliveryError, DispatchConfig
from aggregator.decision import Decision
from aggregator.gate import Gate, Verdict
from aggregator.store import Delivery, Store

__all__ = ["DispatchConfig", "Dispatcher", "GatedSink"]

log = logging.getLogger(__name__)


class GatedSink:
    """Implements ``aggregator.sink.DecisionSink``: ``submit`` returns the admitted decisions
    (as admitted: escalated action, dry_run set) plus any alert the gate raised."""

    def __init__(
        self,
        gate: Gate,
        store: Store,
        actuators: Mapping[str, Actuator],
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.gate = gate
        self.store = store
        self.actuators = dict(actuators)
        self.wake = wake
        # verdict reason -> count of decisions judged so (duplicates of admitted ids included)
        self.verdicts: Counter[str] = Counter()

    def routes(self, decision: Decision) -> dict[str, bool]:
        return {name: a.notify_in_dry_run for name, a in self.actuators.items() if a.handles(decision)}

    def submit(self, decisions: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        admitted: list[Decision] = []
        # The breaker may have been reset by `vigil aggregator breaker reset` in another process.
        self.store.state.breaker = self.store.breaker()
        for decision in decisions:
            prior = self.store.verdict_of(decision.id)
            if prior is not None and prior[0]:
                self.verdicts["duplicate"] += 1
                continue
            verdict = self.gate.judge(decision, now, fleet_nodes, self.store.state)
            self.verdicts[verdict.reason] += 1
            if prior is not None and not verdict.admitted and prior[1] == verdict.reason:
                continue  # the same refusal again: already on record, do not rewrite it each cycle
            self.store.record(verdict, now, self.routes(verdict.decision))
            if verdict.admitted:
                admitted.append(verdict.decision)
            for alert in verdict.alerts:
                self.store.record(
                    Verdict(True, "gate_alert", alert.reason, alert, alert.action), now, self.routes(alert)
                )
                admitted.append(alert)
        self.store.prune(now, self.gate.config.breaker_window_seconds)
        self.store.state.prune(now, self.gate.config)
        if admitted and self.wake is not None:
            self.wake()
        return admitted

    def recent(self, limit: int = 100) -> list[Decision]:
        return [r.decision for r in self.store.decisions(limit=limit, admitted_only=True)]

    def delivery_states(self, decision_id: str) -> list[dict[str, object]]:
        """Each actuator's delivery of one decision, as ``GET /v1/decisions`` shows it."""
        return [
            {"actuator": x.actuator, "state": x.state, "attempts": x.attempts, "last_error": x.last_error,
             "detail": x.detail}
            for x in self.store.deliveries(decision_id)
        ]

    def reset_breaker(self) -> bool:
        """The manual reset; returns whether the breaker was tripped."""
        return self.store.reset_breaker().tripped


class Dispatcher:
    def __init__(
        self,
        store: Store,
        actuators: Mapping[str, Actuator],
        config: DispatchConfig,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.actuators = dict(actuators)
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random()
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (actuator, delivered|failed|dead)
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
        due = self.store.due(self.clock(), limit=self.config.concurrency * 8)
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
            self.store.mark(
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
            self.store.mark(decision.id, actuator.name, "delivered", self.clock(), detail=detail)
            self.outcomes[(actuator.name, "delivered")] += 1
            return
        now = self.clock()
        if retryable and attempt < self.config.max_attempts:
            self.store.mark(decision.id, actuator.name, "failed", now, now + self.backoff_seconds(attempt), error=error)
            self.outcomes[(actuator.name, "failed")] += 1
        else:
            log.error(
                "delivery of %s to %s is dead after %d attempts: %s",
                decision.id,
                actuator.name,
                attempt,
                error,
            )
            self.store.mark(decision.id, actuator.name, "dead", now, error=error)
            self.outcomes[(actuator.name, "dead")] += 1

    async def run(self) -> None:
        """Deliver until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        while True:
            self._event.clear()
            await self.run_once()
            next_ts = self.store.next_due_ts()
            wait = self.config.poll_seconds
            if next_ts is not None:
                wait = max(0.0, min(wait, next_ts - self.clock()))
            try:
                async with asyncio.timeout(wait):
                    await self._event.wait()
            except TimeoutError:
                pass

    def close(self) -> None:
        for actuator in self.actuators.values():
            actuator.close()
