"""Where the engine hands its decisions: the ``DecisionSink`` seam, and an in-memory recorder.

The gate over the store (``aggregator.ledger.Ledger``) implements the same protocol with the
circuit breaker and durability. The engine proposes every current episode each cycle, so a sink
admits each decision id once. ``RecordingSink`` admits every new id and only remembers, for
tests, benchmarks and a service run without a gate. Neither judges nor delivers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

from vigil.aggregator.decision import Decision


class DecisionSink(Protocol):
    # (action, detector, verdict) -> verdicts recorded, for /metrics
    recorded: Counter[tuple[str, str, str]]

    def submit(self, decisions: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        """Offer ``decisions`` (``fleet_nodes``: nodes that reported within the breaker window);
        return those admitted now (to be acted on). Ids already admitted are skipped."""
        ...

    def problem(self) -> str | None:
        """Why decisions cannot be recorded right now (the store is failing), or None."""
        ...

    def recent(self, limit: int = 100) -> list[Decision]:
        """The latest admitted decisions, newest first."""
        ...


class RecordingSink:
    """Admits every new decision id and keeps the latest ``capacity`` of them in memory."""

    def __init__(self, capacity: int = 10_000, ids_remembered: int = 100_000) -> None:
        self._decisions: deque[Decision] = deque(maxlen=capacity)
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._ids_remembered = ids_remembered
        self.recorded: Counter[tuple[str, str, str]] = Counter()

    def submit(self, decisions: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        admitted = [d for d in decisions if d.id not in self._ids]
        for d in admitted:
            self._ids[d.id] = None
            self.recorded[(d.action.value, d.detector, "admitted")] += 1
        while len(self._ids) > self._ids_remembered:
            self._ids.popitem(last=False)
        self._decisions.extend(admitted)
        return admitted

    def problem(self) -> str | None:
        return None

    def recent(self, limit: int = 100) -> list[Decision]:
        if limit <= 0:
            return []
        out = []
        for d in reversed(self._decisions):
            out.append(d)
            if len(out) >= limit:
                break
        return out
