"""The agent never drops what it buffered (issue 13 point 3), through the real Reporter loop.

A fake aggregator on loopback is down for a simulated minute (503 to every attempt) while an Xid
flood of 9,216 events arrives in collector-sized batches; then it comes back with a body limit a
quarter of the agent's (an aggregator configured lower than contract/limits.py), so the first
backlog report gets a 413 and must be split. Every event must arrive exactly once, in order; the
ones a bounded backlog cannot hold are counted and logged, never lost silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.loopback import free_port
from vigil.agent.backlog import JOURNAL_FILE
from vigil.agent.collectors.collector import Collection
from vigil.agent.reporter import Reporter
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.contract.limits import REPORT_MAX_BYTES, REPORT_MAX_EVENTS
from vigil.contract.wire import MAX_TEXT_CHARS, Event, GpuState, decode_report

T0 = 1_700_000_000.0
CYCLE_SECONDS = 2.5
OUTAGE_SECONDS = 60.0
PER_CYCLE = 384  # 24 cycles x 384 = 9,216 events in the minute (issue 13's backlog)
# Real kernel-log text (tests/fixtures/kernel-log): the longest lines an Xid flood carries.
XID_LINE = ("NVRM: Xid (PCI:0000:{bus:02x}:00): 94, pid=91237, name=python3, Contained: SM (0x1). RST: No, "
            "D-RST: No")


class FakeClock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


class FakeAggregator:
    """Answers 503 while ``down``; else refuses bodies over ``max_body_bytes`` with 413 (as the
    real aggregator does) and records the events of every report it accepts."""

    def __init__(self, max_body_bytes: int) -> None:
        self.down = True
        self.max_body_bytes = max_body_bytes
        self.attempted = asyncio.Event()
        self.statuses: list[int] = []
        self.sizes: list[int] = []
        self.events: list[Event] = []
        self.want = 0
        self.all_arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.sizes.append(len(body))
        status = 503 if self.down else 413 if len(body) > self.max_body_bytes else 202
        self.statuses.append(status)
        self.attempted.set()
        if status != 202:
            return web.json_response({"error": "unavailable" if status == 503 else "too_large"}, status=status)
        report = decode_report(body)  # every body is a valid report
        self.events.extend(report.events)
        if self.want and len(self.events) >= self.want:
            self.all_arrived.set()
        return web.json_response({"status": "accepted"}, status=202)


@pytest.fixture
async def aggregator() -> AsyncIterator[tuple[FakeAggregator, str]]:
    fake = FakeAggregator(max_body_bytes=REPORT_MAX_BYTES // 4)
    app = web.Application(client_max_size=4 * REPORT_MAX_BYTES)
    app.router.add_post("/v1/reports", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _snapshot() -> Snapshot:
    snap = Snapshot()
    gpus = [GpuState(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="NVIDIA H100 80GB HBM3")
            for i in range(8)]
    snap.put("gpu", CollectorResult(Collection(report={"gpus": gpus}), True, 0.001, T0))
    return snap


def _flood(cycle: int, clock: FakeClock) -> list[Event]:
    out = []
    for i in range(PER_CYCLE):
        gpu = i % 8
        out.append(Event(kind="xid", ts=clock.t + i * 1e-4, urgent=True, code=94, gpu=gpu,
                         uuid=f"GPU-{gpu:08x}-0000-0000-0000-000000000000",
                         pci_bus_id=f"00000000:{0x19 + gpu:02x}:00.0",
                         message=XID_LINE.format(bus=0x19 + gpu) + f" cycle={cycle} n={i}", source="kmsg"))
    return out


async def _run_reporter(reporter: Reporter) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    return stop, asyncio.create_task(reporter.run(stop))


async def test_an_outage_with_an_xid_flood_delivers_every_event_once_in_order(
        aggregator: tuple[FakeAggregator, str]) -> None:
    fake, url = aggregator
    clock = FakeClock()
    reporter = Reporter(url=url, token="t", node="gpu-a1", boot_id="b", topology={}, snapshot=_snapshot(),
                        interval_seconds=0.01, max_backoff_seconds=0.02, clock=clock)
    sent: list[Event] = []
    stop, task = await _run_reporter(reporter)
    try:
        # The outage: one collector cycle of events at a time, each followed by a failed attempt.
        cycle = 0
        while clock.t - T0 < OUTAGE_SECONDS:
            clock.t += CYCLE_SECONDS
            batch = _flood(cycle, clock)
            sent += batch
            fake.attempted.clear()
            reporter.add_events(batch)
            await asyncio.wait_for(fake.attempted.wait(), 10)
            cycle += 1
        assert len(sent) == 9216 and not fake.events
        assert set(fake.statuses) == {503} and reporter.errors["server_error"] == len(fake.statuses)
        assert reporter.pending_events == 9216
        # It comes back, limiting bodies to a quarter of what the agent builds; the flood goes on.
        fake.down = False
        for _ in range(2):
            clock.t += CYCLE_SECONDS
            batch = _flood(cycle, clock)
            sent += batch
            reporter.add_events(batch)
            cycle += 1
        fake.want = len(sent)
        await asyncio.wait_for(fake.all_arrived.wait(), 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)

    # Every event exactly once, oldest first, none dropped, counted or not.
    assert [(e.ts, e.message) for e in fake.events] == [(e.ts, e.message) for e in sent]
    assert reporter.dropped == {"backlog_full": 0, "too_large": 0, "rejected": 0, "unreadable": 0}
    assert reporter.pending_events == 0
    # The 413 split the report instead of discarding it, and later reports fit at once.
    first_413 = fake.statuses.index(413)
    assert fake.sizes[first_413] <= REPORT_MAX_BYTES  # the agent's own bound held
    assert reporter.counts["split"] >= 1 and reporter.body_limit_bytes <= fake.max_body_bytes
    accepted = [s for s, st in zip(fake.sizes, fake.statuses, strict=True) if st == 202]
    assert max(accepted) <= fake.max_body_bytes
    assert fake.statuses[first_413:].count(413) <= 3  # halving converges in a few tries, not per report
    samples = {(s.name, s.label("reason")): s.value for s in reporter.samples()}
    assert samples[("vigil_agent_events_dropped_total", "backlog_full")] == 0
    assert samples[("vigil_agent_events_pending", None)] == 0


async def test_a_full_backlog_drops_the_oldest_counted_and_logged(
        aggregator: tuple[FakeAggregator, str], caplog: pytest.LogCaptureFixture) -> None:
    fake, url = aggregator
    clock = FakeClock()
    bound = 256 * 1024
    reporter = Reporter(url=url, token="t", node="gpu-a1", boot_id="b", topology={}, snapshot=_snapshot(),
                        interval_seconds=0.01, max_backoff_seconds=0.02, max_pending_event_bytes=bound, clock=clock)
    sent: list[Event] = []
    stop, task = await _run_reporter(reporter)
    try:
        with caplog.at_level(logging.ERROR, logger="vigil.agent.reporter"):
            for cycle in range(8):
                clock.t += CYCLE_SECONDS
                batch = _flood(cycle, clock)
                sent += batch
                fake.attempted.clear()
                reporter.add_events(batch)
                await asyncio.wait_for(fake.attempted.wait(), 10)
        dropped = reporter.dropped["backlog_full"]
        assert dropped > 0 and reporter.pending_events + dropped == len(sent)
        assert any("event backlog full" in r.getMessage() for r in caplog.records)
        fake.down = False
        fake.want = len(sent) - dropped
        await asyncio.wait_for(fake.all_arrived.wait(), 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    # What arrived is exactly the newest events, in order; the rest is counted, not lost silently.
    assert [(e.ts, e.message) for e in fake.events] == [(e.ts, e.message) for e in sent[dropped:]]
    assert len(fake.events) + reporter.dropped_events == len(sent)
    samples = {(s.name, s.label("reason")): s.value for s in reporter.samples()}
    assert samples[("vigil_agent_events_dropped_total", "backlog_full")] == dropped


async def test_an_event_the_aggregator_refuses_alone_is_dropped_counted_and_the_rest_flow(
        aggregator: tuple[FakeAggregator, str], caplog: pytest.LogCaptureFixture) -> None:
    fake, url = aggregator
    fake.down = False
    fake.max_body_bytes = 4 * 1024  # the state fits, one event of the longest message (MAX_TEXT_CHARS) does not
    clock = FakeClock()
    reporter = Reporter(url=url, token="t", node="gpu-a1", boot_id="b", topology={}, snapshot=_snapshot(),
                        interval_seconds=0.01, max_backoff_seconds=0.02, clock=clock)
    big = Event(kind="xid", ts=T0 + 1, code=13, message="x" * MAX_TEXT_CHARS)
    small = [Event(kind="xid", ts=T0 + 2 + i, code=13, message=f"n={i}") for i in range(3)]
    fake.want = 3
    stop, task = await _run_reporter(reporter)
    try:
        with caplog.at_level(logging.ERROR, logger="vigil.agent.reporter"):
            reporter.add_events([big, *small])
            await asyncio.wait_for(fake.all_arrived.wait(), 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert [e.message for e in fake.events] == ["n=0", "n=1", "n=2"]
    assert reporter.dropped == {"backlog_full": 0, "too_large": 1, "rejected": 0, "unreadable": 0}
    assert any("refused one event alone" in r.getMessage() for r in caplog.records)


async def test_a_restart_or_a_crash_during_an_outage_keeps_the_backlog(
        aggregator: tuple[FakeAggregator, str], tmp_path: Path) -> None:
    """Stopped (an upgrade, a DaemonSet roll) or killed while the aggregator is down, the agent's
    pending events are in state_dir's journal and the next run sends them. The kernel-log cursor
    is already past them, so without the journal they would be lost uncounted."""
    fake, url = aggregator
    clock = FakeClock()

    def reporter() -> Reporter:
        return Reporter(url=url, token="t", node="gpu-a1", boot_id="b", topology={}, snapshot=_snapshot(),
                        interval_seconds=0.01, max_backoff_seconds=0.02, state_dir=tmp_path, clock=clock)

    journal = tmp_path / JOURNAL_FILE
    # A run that is killed: it never gets to stop, yet every event it took is in the journal.
    killed = reporter()
    crashed = _flood(0, clock)
    killed.add_events(crashed)
    assert len(journal.read_bytes().splitlines()) == len(crashed)
    del killed

    # The next run takes them back, takes more, and is stopped while the aggregator is still down.
    stopped = reporter()
    assert stopped.pending_events == len(crashed)
    more = _flood(1, clock)
    stop, task = await _run_reporter(stopped)
    try:
        fake.attempted.clear()
        stopped.add_events(more)
        await asyncio.wait_for(fake.attempted.wait(), 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(journal.read_bytes().splitlines()) == len(crashed) + len(more)
    with journal.open("ab") as f:
        f.write(b'{"kind": "xid", "ts": \n')  # a torn last line: counted, not fatal

    final = reporter()
    assert final.pending_events == len(crashed) + len(more) and final.dropped["unreadable"] == 1
    fake.down = False
    fake.want = len(crashed) + len(more)
    stop, task = await _run_reporter(final)
    try:
        await asyncio.wait_for(fake.all_arrived.wait(), 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert [(e.ts, e.message) for e in fake.events] == [(e.ts, e.message) for e in crashed + more]
    assert not journal.exists()  # nothing pending: no journal left behind


def test_a_backlog_of_short_events_goes_out_in_reports_the_aggregator_schema_accepts() -> None:
    # At the default 1 MiB limit a backlog of short Xid lines (~140 bytes each) would fill a
    # report with ~7,000 events by size alone; the aggregator's schema takes REPORT_MAX_EVENTS.
    clock = FakeClock()
    reporter = Reporter(url=None, token=None, node="gpu-a1", boot_id="b", topology={}, snapshot=_snapshot(),
                        interval_seconds=2.5, clock=clock)
    short = [Event(kind="xid", ts=T0 + i * 1e-4, urgent=True, code=13, gpu=i % 8,
                   pci_bus_id=f"00000000:{0x19 + i % 8:02x}:00.0", source="kmsg",
                   message=f"NVRM: Xid (PCI:0000:{0x19 + i % 8:02x}:00): 13, pid={1000 + i}, Graphics Exception")
             for i in range(9216)]
    reporter.add_events(short)
    delivered: list[Event] = []
    while reporter.pending_events:
        body, _, n = reporter.build_body()
        assert len(body) <= REPORT_MAX_BYTES
        report = decode_report(body)  # what the aggregator's schema checks
        assert len(report.events) == n <= REPORT_MAX_EVENTS
        delivered += report.events
        reporter.acknowledge(n)
    assert [e.message for e in delivered] == [e.message for e in short]
    assert len(short) * len(short[0].message) < 3 * REPORT_MAX_BYTES  # by size alone they would fit 2 reports
