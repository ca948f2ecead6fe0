"""Admission control at report intake: whether the aggregator takes one more report now.

It reads what app.py measures of its own backlog (reports held, event-loop lag) and a
``max_reports_per_second`` token bucket, and decides shed (a reason and a ``Retry-After``) or take, always
taking a node quiet for ``always_admit_after_seconds`` so shedding never makes it look silent. It does not
answer, count or log (app.py does), and never refuses a report for its content (docs/reports.md, "Overload").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from pydantic import Field

from vigil.contract.validation import StrictModel

# Why a report was shed (vigil_aggregator_reports_shed_total{reason}); each series exists at 0.
#
# Not a reason: a judging pass that runs long. Reports that arrive meanwhile are held and
# ingested after it as of their arrival; shedding them instead would make their nodes look silent
# to the next pass, and a pass's cost is the fleet's, not the intake's (bench_loadgen, issue 47: a
# 2,000-node pass that ran for over a minute on a machine made busy on purpose). The held bound
# protects memory while it runs.
SHED_REASONS = ("held_full", "loop_lag", "rate")


class AdmissionConfig(StrictModel):
    # Reports held (accepted while the detectors read the fleet, ingested right after) at most:
    # 5 s of a 12,500-node fleet at one report per 2.5 s (docs/architecture.md section 9). Past it
    # the judging thread is far behind intake: new reports are shed, not queued without bound.
    max_held_reports: int = Field(default=25_000, ge=1)
    # Shed while the event loop ran its last two 0.25 s timers this late: every request waits as
    # long behind it, and an agent gives up on its request after 5 s (agent.timeout_seconds): 2 s
    # is under half of that. Two in a row: one stall (a busy host's hiccup) sheds nothing.
    max_loop_lag_seconds: float = Field(default=2.0, gt=0)
    # Reports taken per second at most, bursts of one second's worth (0: no bound). For an
    # operator who sized the aggregator's core: 1 / its CPU per report (make bench).
    max_reports_per_second: float = Field(default=0.0, ge=0)
    # A node whose last report taken is this old is taken whatever the load (not past
    # max_held_reports): under the silence detector's 15 s alert (detectors.silence
    # .alert_after_seconds_min), so a node shed, waiting Retry-After and shed again is taken at its
    # next try. The aggregator then takes at least nodes / this many reports a second.
    always_admit_after_seconds: float = Field(default=10.0, gt=0)
    # What a shed answer's Retry-After says (whole seconds, RFC 9110); the agent waits that long
    # at least, jittered, and never less than its own cadence.
    retry_after_seconds: int = Field(default=5, ge=1, le=300)


class Shed(NamedTuple):
    reason: str  # one of SHED_REASONS
    status: int  # 429: over the configured rate; 503: the aggregator is behind on its work
    retry_after_seconds: int
    detail: str


class Admission:
    """One per aggregator. ``check`` is called for each report before its body is parsed."""

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._tokens = max(1.0, config.max_reports_per_second)
        self._filled_at = clock()
        # The event loop's lag as admission judges it: the smaller of the last two measurements
        # (note_loop_lag), so a lag that lasts sheds and one stall of a busy host does not.
        self.loop_lag_seconds = 0.0
        self._last_lag_seconds = 0.0

    def note_loop_lag(self, lag_seconds: float) -> None:
        """One measurement of the event loop's lag (aggregator/app.py measure_loop_lag)."""
        self.loop_lag_seconds = min(lag_seconds, self._last_lag_seconds)
        self._last_lag_seconds = lag_seconds

    def check(self, held: int, loop_lag_seconds: float,
              quiet_seconds: Callable[[], float | None] = lambda: None) -> Shed | None:
        """Shed this report (why, with what status and Retry-After) or None: take it.
        ``quiet_seconds``: how long since the sender's last report was taken (None: unknown, or
        never), asked only when the report would be shed for the load."""
        shed = self._check(held, loop_lag_seconds)
        if shed is None or shed.reason == "held_full":
            return shed
        quiet = quiet_seconds()
        if quiet is not None and quiet >= self.config.always_admit_after_seconds:
            return None
        return shed

    def _check(self, held: int, loop_lag_seconds: float) -> Shed | None:
        cfg = self.config
        after = cfg.retry_after_seconds
        if held >= cfg.max_held_reports:
            return Shed("held_full", 503, after, f"{held} reports wait for the detectors to finish reading the "
                        f"fleet (server.admission.max_held_reports {cfg.max_held_reports})")
        if loop_lag_seconds > cfg.max_loop_lag_seconds:
            return Shed("loop_lag", 503, after, f"the aggregator's event loop runs {loop_lag_seconds:.2f}s late "
                        f"(server.admission.max_loop_lag_seconds {cfg.max_loop_lag_seconds:g})")
        rate = cfg.max_reports_per_second
        if rate > 0:
            now = self._clock()
            self._tokens = min(max(1.0, rate), self._tokens + max(0.0, now - self._filled_at) * rate)
            self._filled_at = now
            if self._tokens < 1:
                wait = max(after, math.ceil((1 - self._tokens) / rate))
                return Shed("rate", 429, wait,
                            f"more than {rate:g} reports/s (server.admission.max_reports_per_second)")
            self._tokens -= 1
        return None
