"""What a benchmark reports: one measured figure beside its DESIGN.md section 9 budget.

Each ``bench/bench_*.py`` module exposes ``measure() -> list[Measurement]``; ``bench/run.py``
lists them explicitly and prints one table. Benchmarks measure; tests never time anything.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    what: str  # e.g. "agent CPU per collection cycle (8 GPUs + 8 HCAs + 8 ranks)"
    value: float
    unit: str  # e.g. "ms", "us", "reports/s", "s"
    budget: float | None  # None: reported, no budget
    higher_is_better: bool = False
    note: str = ""

    @property
    def within_budget(self) -> bool | None:
        if self.budget is None:
            return None
        return self.value >= self.budget if self.higher_is_better else self.value <= self.budget
