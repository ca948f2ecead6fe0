"""The collector contract: a synchronous reader of one source that returns samples and events.

A collector reads its source when ``collect`` is called (from a worker thread; the runner
guarantees no two calls of one collector overlap) and returns a ``Collection``. It does not
schedule itself, render metrics or talk to the aggregator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from vigil.agent.metric import MetricSpec, Sample
from vigil.contract.validation import StrictModel
from vigil.contract.wire import Event


@dataclass(slots=True)
class Collection:
    """What one ``collect`` call observed.

    ``samples`` feed ``/metrics``; ``events`` (Xids, link flaps, hangs) go into the next report,
    and an urgent one makes the reporter push at once; ``report`` is this collector's compact
    contribution to the Report (e.g. ``{"gpus": [GpuState, ...]}``), keyed by Report field name.
    """

    samples: list[Sample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)


class Collector(Protocol):
    """One source. ``name`` is its registry key; ``specs`` declares every metric it may emit."""

    name: str
    specs: Sequence[MetricSpec]

    def collect(self, now: float) -> Collection: ...

    def close(self) -> None: ...


@runtime_checkable
class Wakeable(Protocol):
    """A collector whose source can say when it has something new (the kernel log's /dev/kmsg is
    readable when a record is logged). ``wake`` is asked on the runner's loop between cycles, never
    during one: (a descriptor the loop may wait on for readability, the seconds until the next
    cycle if it stays quiet), or None to be run at its interval. While it gives one, the runner
    starts a cycle as soon as the descriptor is readable instead of polling it."""

    def wake(self, now: float) -> tuple[int, float] | None: ...


class CollectorConfig(StrictModel):
    """Settings every collector has; a collector's own config subclasses this."""

    enabled: bool = True
    interval_seconds: float = Field(default=1.0, gt=0)
    timeout_seconds: float = Field(default=5.0, gt=0)

