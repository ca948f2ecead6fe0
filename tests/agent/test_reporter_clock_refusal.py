"""A report refused for a reason a later resend can pass never drops the events it carries (issue 37).

An older aggregator refuses a node whose clock stepped with 422 stale_ts / future_ts; any
aggregator refuses a seq it cannot place yet with 409 seq_jump. The fatal Xid such a report carries
must reach the aggregator once it takes the node's reports again: kept, resent with backoff, the
refusals counted. The lookalike: a report refused for its content (422 with another reason) still
drops its events, counted as rejected, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.loopback import free_port
from vigil.agent.collectors.collector import Collection
from vigil.agent.reporter import Reporter
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.contract.wire import Event, GpuState, decode_report

T0 = 1_700_000_000.0
FATAL_XID = Event(kind="xid", ts=T0, urgent=True, code=79, gpu=3, source="kmsg",
                  message="NVRM: Xid (PCI:0000:1c:00): 79, pid=0, GPU has fallen off the bus.")


class RefusingAggregator:
    """Accepts the first report (offering the compact versions, so the agent's compact path is the one
    refused), refuses the next ``refusals`` with ``status`` and ``reason`` (JSON, as the aggregator
    answers), then accepts again, recording every event it accepted."""

    def __init__(self, status: int, reason: str, refusals: int) -> None:
        self.status, self.reason, self.refusals = status, reason, refusals
        self.statuses: list[int] = []
        self.versions: list[int] = []
        self.events: list[Event] = []
        self.first = asyncio.Event()  # the first report accepted
        self.accepted = asyncio.Event()  # a report with events accepted
        self.answered_after = asyncio.Event()  # a report accepted after the refusals

    async def handle(self, request: web.Request) -> web.Response:
        report = decode_report(await request.read())
        self.versions.append(report.version)
        if 1 <= len(self.statuses) <= self.refusals:
            self.statuses.append(self.status)
            return web.json_response({"error": self.reason, "detail": "refused by the test"}, status=self.status)
        if self.statuses:
            self.answered_after.set()
        self.statuses.append(202)
        self.first.set()
        self.events.extend(report.events)
        if report.events:
            self.accepted.set()
        return web.json_response({"status": "accepted", "report_versions": [1, 2, 3]}, status=202)


@pytest.fixture
async def serve() -> AsyncIterator[list[web.AppRunner]]:
    runners: list[web.AppRunner] = []
    yield runners
    for runner in runners:
        await runner.cleanup()


async def _url(runners: list[web.AppRunner], fake: RefusingAggregator) -> str:
    app = web.Application()
    app.router.add_post("/v1/reports", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    runners.append(runner)
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}"


def _reporter(url: str) -> Reporter:
    snap = Snapshot()
    gpus = [GpuState(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000") for i in range(8)]
    snap.put("gpu", CollectorResult(Collection(report={"gpus": gpus}), True, 0.001, T0))
    return Reporter(url=url, token="t", node="gpu-a1", boot_id="b", topology={}, snapshot=snap,
                    interval_seconds=0.01, max_backoff_seconds=0.02, clock=lambda: T0)


async def _xid_after_the_first_report(reporter: Reporter, fake: RefusingAggregator, until: asyncio.Event) -> None:
    """The reporter runs; once its first report is accepted the fatal Xid arrives; it stops when
    ``until`` is set."""
    stop = asyncio.Event()
    task = asyncio.create_task(reporter.run(stop))
    try:
        await asyncio.wait_for(fake.first.wait(), 30)
        reporter.add_events([FATAL_XID])
        await asyncio.wait_for(until.wait(), 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize(("status", "reason"), [(422, "stale_ts"), (422, "future_ts"), (409, "seq_jump")])
async def test_a_transient_refusal_keeps_the_fatal_xid_and_resends_it(
        serve: list[web.AppRunner], status: int, reason: str) -> None:
    fake = RefusingAggregator(status, reason, refusals=5)
    reporter = _reporter(await _url(serve, fake))
    await _xid_after_the_first_report(reporter, fake, fake.accepted)
    assert fake.statuses[:6] == [202] + [status] * 5
    assert set(fake.versions[1:]) == {3}  # refused compact reports were neither downgraded nor lost
    assert [(e.code, e.gpu, e.ts) for e in fake.events] == [(79, 3, T0)]  # once, as it was
    assert reporter.dropped == {"backlog_full": 0, "too_large": 0, "rejected": 0, "unreadable": 0}
    assert reporter.errors["refused_transient"] == 5 and reporter.counts["rejected"] == 0
    samples = {(s.name, s.label("reason")): s.value for s in reporter.samples()}
    assert samples[("vigil_agent_report_errors_total", "refused_transient")] == 5
    assert samples[("vigil_agent_events_pending", None)] == 0


async def test_a_refusal_for_the_content_still_drops_its_events_counted(serve: list[web.AppRunner]) -> None:
    """The lookalike: a 422 for the report's content would be refused again: the compact report is
    resent as version 1 (events kept), and that one refused too drops them, counted."""
    fake = RefusingAggregator(422, "schema_mismatch", refusals=2)
    reporter = _reporter(await _url(serve, fake))
    # The next report accepted goes out without it: the drop is what this pins (and is counted).
    await _xid_after_the_first_report(reporter, fake, fake.answered_after)
    assert fake.events == []
    assert reporter.dropped["rejected"] == 1 and reporter.errors["refused_transient"] == 0

