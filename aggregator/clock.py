"""The aggregator's step-free clock (wall time read once at start, then advanced by the monotonic clock) and the
watch over the fleet's clocks against it.

It reads the system's wall and monotonic clocks and gives the engine, the fleet and the gate a time an NTP
step or ``date -s`` cannot move, reporting the wall clock's offset and each step it sees; ``FleetClockWatch``
reads the nodes' measured offsets and tells skewed nodes from a step of most of the fleet. It decides nothing
and never re-anchors (a restart anchors anew) (docs/reports.md, "Time").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# A wall clock that moved this much against the monotonic one between two checks stepped. NTP slews
# (at most 500 ppm: 0.5 ms a second) and only steps beyond 128 ms (ntpd's step threshold; chrony's
# makestep is configured in the same range); one second keeps a busy, late check well clear of
# slewing and still sees every step that could matter to a 15 s silence threshold.
STEP_TOLERANCE_SECONDS = 1.0


class SteadyClock:
    """``wall0 + (monotonic() - mono0)``: seconds since the epoch as the wall clock read them at start,
    advanced only by the monotonic clock. Callable as ``clock=``; ``wall`` and ``monotonic`` are the
    OS boundary (tests pass fakes)."""

    def __init__(self, *, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 step_tolerance_seconds: float = STEP_TOLERANCE_SECONDS) -> None:
        self._wall = wall
        self._monotonic = monotonic
        self._mono0 = monotonic()
        self._wall0 = wall()
        self._tolerance = step_tolerance_seconds
        self._last_offset = 0.0
        self.steps = 0
        self.last_step_seconds = 0.0

    def __call__(self) -> float:
        return self._wall0 + (self._monotonic() - self._mono0)

    def offset_seconds(self) -> float:
        """The wall clock now minus this clock: 0 until the system clock is stepped (or slewed far)."""
        return self._wall() - self()

    def check(self) -> float | None:
        """The size of the step the wall clock made since the last check (signed seconds), counted in
        ``steps``; None when it moved less than the tolerance."""
        offset = self.offset_seconds()
        moved = offset - self._last_offset
        self._last_offset = offset  # between checks: a slew never adds up to a step
        if abs(moved) < self._tolerance:
            return None
        self.steps += 1
        self.last_step_seconds = moved
        return moved

    def wall(self) -> float:
        """The system's wall clock now (what Prometheus compares its timestamps with)."""
        return self._wall()


# Nodes heard from within this long speak for the fleet's clocks: one silent longer says nothing
# about its clock now (and the silence detector speaks for it).
FLEET_CLOCK_HORIZON_SECONDS = 300.0
# Skewed nodes named in vigil_aggregator_node_clock_skew_seconds{node}, furthest first: enough to
# point at them, bounded whatever the fleet does (the count of all of them is its own gauge).
NAMED_SKEWED_NODES = 20


@dataclass(frozen=True)
class ClockReading:
    """The fleet's clocks against the aggregator's at one evaluation."""

    nodes: int = 0  # nodes heard from within FLEET_CLOCK_HORIZON_SECONDS
    skewed: int = 0  # of them, those further than the limit from the aggregator's clock
    median_offset_seconds: float = 0.0  # the fleet's clocks minus the aggregator's, median
    furthest: tuple[tuple[str, float], ...] = ()  # (node, offset) of the furthest skewed nodes


class FleetClockWatch:
    """Reads the nodes' clock offsets (NodeState.clock_offset_seconds) once an evaluation: how many
    are skewed, the fleet's median offset, and whether most of the fleet moved by about the same
    offset at once (a step of the site's time source, or of the clock the aggregator was started
    with): counted in ``fleet_steps``, never a node's fault."""

    def __init__(self, limit_seconds: float, tolerance_seconds: float) -> None:
        self._limit = limit_seconds
        self._tolerance = tolerance_seconds
        self._median: float | None = None
        self.fleet_steps = 0
        self.reading = ClockReading()

    def observe(self, offsets: Mapping[str, float]) -> ClockReading:
        if not offsets:
            self.reading = ClockReading()
            return self.reading
        values = sorted(offsets.values())
        middle = len(values) // 2
        median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
        agreeing = sum(1 for v in values if abs(v - median) <= self._tolerance)
        if (self._median is not None and abs(median - self._median) > self._tolerance
                and len(values) >= 2 and 2 * agreeing > len(values)):
            self.fleet_steps += 1
        self._median = median
        skewed = sorted(((name, v) for name, v in offsets.items() if abs(v) > self._limit),
                        key=lambda item: -abs(item[1]))
        self.reading = ClockReading(len(values), len(skewed), median, tuple(skewed[:NAMED_SKEWED_NODES]))
        return self.reading
