"""The simulated clock: a number that only the driver moves.

Collectors, FakeNvml, the training model and the aggregator all read time from one ``SimClock``
(it is callable like ``time.time``), so a simulated hour costs what its work costs, not an hour.
It never sleeps and never reads the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimClock:
    # A fixed, plausible epoch (2026-01-01T00:00:00Z) so timestamps look like Unix times.
    start: float = 1_767_225_600.0
    now: float = 0.0

    def __post_init__(self) -> None:
        if self.now == 0.0:
            self.now = self.start

    def __call__(self) -> float:
        return self.now

    @property
    def elapsed(self) -> float:
        """Simulated seconds since the start."""
        return self.now - self.start

    def advance_to(self, elapsed_seconds: float) -> None:
        target = self.start + elapsed_seconds
        if target < self.now:
            raise ValueError(f"the simulated clock cannot go back ({elapsed_seconds} < {self.elapsed})")
        self.now = target
