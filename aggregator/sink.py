"""Where the engine hands its decisions: the ``DecisionSink`` seam, and an in-memory recorder.

The gate (``aggregator.dispatch.GatedSink``) implements the same protocol with dedup, the
circuit breaker and a durable store. ``RecordingSink`` admits everything and only remembers, for
tests, the simulator and a service run without a gate. Neither judges nor delivers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from aggregator.decision import Decision


class DecisionSink(Protocol):
    def submit(self, decisions: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        """Offer ``decisions``; return those admitted (to be acted on)."""
        ...

    def recent(self, limit: int = 100) -> list[Decision]:
        """The latest admitted decisions, newest first."""
        ...


class RecordingSink:
    """Admits every decision and keeps the latest ``capacity`` of them in memory."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._decisions: deque[Decision] = deque(maxlen=capacity)

    def submit(self, decisions: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        admitted = list(decisions)
        self._decisions.extend(admitted)
        return admitted

    def recent(self, limit: int = 100) -> list[Decision]:
        if limit <= 0:
            return []
        out = []
        for d in reversed(self._decisions):
            out.append(d)
            if len(out) >= limit:
                break
        return out
