"""What a door that proposes decisions needs of the ledger: the ``DecisionSink`` protocol.

The gate over the store (``aggregator.ledger.Ledger``, also over a store in memory:
``Ledger.in_memory``) is its one implementation; the Alertmanager input proposes through it. A
sink admits each decision id once; it neither judges detectors' evidence nor delivers.
"""

from __future__ import annotations

from collections import Counter
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
