"""The reporter: builds compact Reports from the snapshot and pushes them to the aggregator.

A report carries the collectors' report contributions (GPU, port, rank and host state) and every
event since the last acknowledged report. Events are kept until the aggregator accepts them, so
an aggregator that is down loses nothing but the oldest events past a bound (counted); an urgent
event makes the reporter push at once. It judges nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from agent.metric import MetricKind, MetricSpec, Sample
from agent.snapshot import Snapshot
from agent.wire import Event, Report

log = logging.getLogger("vigil.agent.reporter")

REPORTS = MetricSpec("vigil_agent_reports_total", MetricKind.COUNTER,
                     "Reports pushed to the aggregator, by result (ok, error, rejected).", labels=("result",))
EVENTS_PENDING = MetricSpec("vigil_agent_events_pending", MetricKind.GAUGE,
                            "Events waiting for the aggregator to accept them.")
EVENTS_DROPPED = MetricSpec("vigil_agent_events_dropped_total", MetricKind.COUNTER,
                            "Events dropped because the pending queue was full (aggregator down too long).")
LAST_SUCCESS = MetricSpec("vigil_agent_last_report_success_timestamp_seconds", MetricKind.GAUGE,
                          "Unix time of the last report the aggregator accepted.", unit="seconds")
REPORTER_SPECS = (REPORTS, EVENTS_PENDING, EVENTS_DROPPED, LAST_SUCCESS)

# Sections a collector may contribute; anything else in a Collection.report is a programming error.
_REPORT_SECTIONS = frozenset({"gpus", "ports", "ranks", "host", "nvml_available"})


def build_report(
    snapshot: Snapshot,
    events: Sequence[Event],
    *,
    node: str,
    boot_id: str,
    seq: int,
    ts: float,
    interval_seconds: float,
    topology: Mapping[str, str],
    urgent: bool = False,
) -> Report:
    sections: dict[str, Any] = snapshot.report_sections()
    unknown = sections.keys() - _REPORT_SECTIONS
    if unknown:
        raise ValueError(f"collectors contributed unknown report sections: {sorted(unknown)}")
    return Report(
        node=node,
        boot_id=boot_id,
        seq=seq,
        ts=ts,
        interval_seconds=interval_seconds,
        urgent=urgent,
        topology=dict(topology),
        events=list(events),
        failed_collectors=snapshot.failed(),
        **sections,
    )


class Reporter:
    def __init__(
        self,
        *,
        url: str | None,
        token: str | None,
        node: str,
        boot_id: str,
        topology: Mapping[str, str],
        snapshot: Snapshot,
        interval_seconds: float = 2.5,
        timeout_seconds: float = 5.0,
        max_backoff_seconds: float = 60.0,
        max_pending_events: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._url = url.rstrip("/") + "/v1/reports" if url else None
        self._token = token
        self._node = node
        self._boot_id = boot_id
        self._topology = dict(topology)
        self._snapshot = snapshot
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self._max_backoff = max_backoff_seconds
        self._pending: deque[Event] = deque()
        self._max_pending = max_pending_events
        self._clock = clock
        self._seq = 0
        self._wake = asyncio.Event()
        self._urgent = False
        self.counts = {"ok": 0, "error": 0, "rejected": 0}
        self.dropped_events = 0
        self.last_success_ts: float | None = None
        self.last_report: Report | None = None

    def add_events(self, events: Sequence[Event]) -> None:
        """Called on the event loop by the runner after a collector cycle."""
        for ev in events:
            if len(self._pending) >= self._max_pending:
                self._pending.popleft()
                self.dropped_events += 1
            self._pending.append(ev)
        if any(ev.urgent for ev in events):
            self._urgent = True
            self._wake.set()

    def samples(self) -> list[Sample]:
        out = [Sample.of(REPORTS, n, result=r) for r, n in self.counts.items()]
        out.append(Sample.of(EVENTS_PENDING, len(self._pending)))
        out.append(Sample.of(EVENTS_DROPPED, self.dropped_events))
        if self.last_success_ts is not None:
            out.append(Sample.of(LAST_SUCCESS, self.last_success_ts))
        return out

    def next_report(self) -> tuple[Report, int]:
        """The report to send now and how many pending events it carries."""
        n = len(self._pending)
        report = build_report(
            self._snapshot, list(self._pending), node=self._node, boot_id=self._boot_id, seq=self._seq,
            ts=self._clock(), interval_seconds=self._interval, topology=self._topology, urgent=self._urgent)
        self._seq += 1
        self._urgent = False
        return report, n

    def acknowledge(self, n_events: int) -> None:
        for _ in range(min(n_events, len(self._pending))):
            self._pending.popleft()

    async def run(self, stop: asyncio.Event) -> None:
        if self._url is None:
            log.info("no aggregator configured: reports are built for /v1/state only")
        backoff = 0.0
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            while not stop.is_set():
                # An urgent event that arrived while the previous report was in flight goes out now:
                # the wake flag is cleared only after a wait, never before, so it cannot be lost.
                if not self._urgent:
                    delay = backoff if backoff > 0 else self._interval
                    waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())}
                    _, pending = await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                    for w in pending:
                        w.cancel()
                self._wake.clear()
                if stop.is_set():
                    break
                report, n = self.next_report()
                self.last_report = report
                if self._url is None:
                    self.acknowledge(n)
                    continue
                ok = await self._post(session, report)
                if ok:
                    self.acknowledge(n)
                    backoff = 0.0
                else:
                    # Jittered exponential backoff; events stay pending and ride the next report.
                    backoff = min(self._max_backoff, max(1.0, backoff * 2)) * random.uniform(0.8, 1.2)

    async def _post(self, session: aiohttp.ClientSession, report: Report) -> bool:
        assert self._url is not None
        body = report.model_dump_json(exclude_none=True)
        try:
            async with session.post(self._url, data=body) as resp:
                if resp.status < 300:
                    self.counts["ok"] += 1
                    self.last_success_ts = self._clock()
                    return True
                text = (await resp.text())[:300]
                if 400 <= resp.status < 500 and resp.status not in (401, 408, 429):
                    # The aggregator refused this report's content: resending it would fail again.
                    # Count it loudly and drop the events it carried rather than loop forever.
                    self.counts["rejected"] += 1
                    log.error("aggregator rejected report seq=%d: %d %s", report.seq, resp.status, text)
                    return True
                self.counts["error"] += 1
                log.warning("aggregator answered %d: %s", resp.status, text)
                return False
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.counts["error"] += 1
            log.warning("cannot reach aggregator at %s: %s", self._url, exc or type(exc).__name__)
            return False
