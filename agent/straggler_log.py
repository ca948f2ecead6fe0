"""Megatron-LM's own straggler report (``--log-straggler``): the slowest and fastest rank by id.

Megatron's ``StragglerDetector`` (megatron/core/utils.py) gathers every rank's timings every log
interval and prints, on rank 0, the minimum and maximum of each metric with the rank that had it:
``MnRtt/Rnk: 3453.08ms/8 | MxRtt/Rnk: 3468.20ms/0 | ... | MnEtpt/Rnk: 296.02TF/0 | ...``, and with
``--straggler-minmax-count N`` the N lowest and highest throughput ranks. This module parses those
lines into ``StragglerReport``s (which rank is slowest, by how much); it keeps no state, reads no
file (``agent.file_follower.FileFollower`` does) and decides nothing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Metric names as Megatron prints them -> our names (times converted from ms to seconds).
METRICS: dict[str, str] = {
    "Rtt": "round_trip_seconds",  # time in the timed ops per iteration, printed in ms
    "Pwr": "power",  # printed as the sum NVML reports (mW as "W" in the examples); compared, not converted
    "Tmp": "temperature_celsius",
    "Utl": "utilization_percent",
    "Clk": "sm_clock_mhz",
    "DRtt": "data_seconds",  # get_batch latency, printed in ms
    "Etpt": "throughput_tflops",  # estimated TFLOP/s of the rank
}
_MS = {"Rtt", "DRtt"}
_FIELD = re.compile(r"\b(Mn|Mx)(Rtt|Pwr|Tmp|Utl|Clk|DRtt|Etpt)/Rnk:\s*([0-9.eE+-]+)\s*[A-Za-z%]*/(\d+)")
_MINMAX = re.compile(r"\b(Bottom|Top)\s+(\d+)\s+Ranks with (?:lowest|highest)\s+Etpt\(TF\):\s*(.*)$")
_PAIR = re.compile(r"([0-9.eE+-]+)/(\d+)")


@dataclass(frozen=True)
class Extreme:
    value: float
    rank: int


@dataclass
class StragglerReport:
    """One report: per metric, the minimum and maximum with their ranks (base units for times)."""

    low: dict[str, Extreme] = field(default_factory=dict)
    high: dict[str, Extreme] = field(default_factory=dict)
    # From the Bottom/Top N lines: (throughput TF, rank), lowest first / highest last.
    bottom: list[Extreme] = field(default_factory=list)
    top: list[Extreme] = field(default_factory=list)

    def slowest(self) -> tuple[int, float] | None:
        """(rank, how much slower than the fastest as a ratio) by estimated throughput, else by
        round-trip time; None when the report carries neither."""
        lo, hi = self.low.get("throughput_tflops"), self.high.get("throughput_tflops")
        if lo is not None and hi is not None and hi.value > 0:
            return lo.rank, 1.0 - lo.value / hi.value
        lo, hi = self.low.get("round_trip_seconds"), self.high.get("round_trip_seconds")
        if lo is not None and hi is not None and hi.value > 0:
            return hi.rank, 1.0 - lo.value / hi.value
        return None


def _number(raw: str) -> float | None:
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_straggler_line(line: str) -> StragglerReport | None:
    """A ``MnRtt/Rnk ...`` report line, or a ``Bottom/Top N Ranks`` line, parsed; None otherwise."""
    match = _MINMAX.search(line)
    if match is not None:
        pairs = [Extreme(v, int(r)) for raw, r in _PAIR.findall(match.group(3))
                 if (v := _number(raw)) is not None]
        return StragglerReport(bottom=pairs) if match.group(1) == "Bottom" else StragglerReport(top=pairs)
    report = StragglerReport()
    for side, metric, raw, rank in _FIELD.findall(line):
        value = _number(raw)
        if value is None:
            continue
        if metric in _MS:
            value /= 1000.0
        (report.low if side == "Mn" else report.high)[METRICS[metric]] = Extreme(value, int(rank))
    return report if report.low or report.high else None
