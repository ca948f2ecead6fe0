"""The snapshot: each collector's latest result, replaced whole every cycle.

The exporter renders ``/metrics`` from it and the reporter builds Reports from it, so neither a
scrape nor a push ever touches NVML or sysfs. It holds state only; it schedules nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vigil.agent.collectors.collector import Collection
from vigil.agent.metric import Sample
from vigil.contract.wire import to_readable


@dataclass(frozen=True, slots=True)
class CollectorResult:
    collection: Collection
    success: bool
    duration_seconds: float
    ts: float
    error: str | None = None


@dataclass
class Snapshot:
    _results: dict[str, CollectorResult] = field(default_factory=dict)

    def put(self, name: str, result: CollectorResult) -> None:
        """Replace a collector's result. A failed cycle keeps no stale samples: absent, not old."""
        self._results = {**self._results, name: result}

    def results(self) -> dict[str, CollectorResult]:
        return self._results  # replaced, never mutated in place: safe to iterate while put() runs

    def samples(self) -> Iterator[Sample]:
        for result in self._results.values():
            yield from result.collection.samples

    def report_sections(self) -> dict[str, Any]:
        """Merge every collector's report contribution (each owns distinct Report fields)."""
        merged: dict[str, Any] = {}
        for result in self._results.values():
            merged.update(result.collection.report)
        return merged

    def failed(self) -> list[str]:
        return sorted(name for name, r in self._results.items() if not r.success)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, r in self._results.items():
            out[name] = {
                "success": r.success,
                "duration_seconds": r.duration_seconds,
                "ts": r.ts,
                "error": r.error,
                "samples": [{"name": s.name, "labels": dict(s.labels), "value": s.value}
                            for s in r.collection.samples],
                "report": {k: _jsonable(v) for k, v in r.collection.report.items()},
            }
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return to_readable(value)
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value
