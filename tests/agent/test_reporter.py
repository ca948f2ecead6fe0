import asyncio
import json

from aiohttp import web

from tests.loopback import free_port
from vigil.agent.collectors.collector import Collection
from vigil.agent.reporter import Reporter, build_report
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.contract.wire import Event, GpuState, Report, decode_report, encode

_free_port = free_port


class FakeAggregator:
    """A loopback receiver that can be 'down' (503) and records the reports it accepts."""

    def __init__(self) -> None:
        self.up = False
        self.reports: list[Report] = []
        self.auth: list[str | None] = []
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        if not self.up:
            return web.Response(status=503)
        self.reports.append(decode_report(await request.read()))
        self.arrived.set()
        return web.json_response({"status": "ok"})


async def _serve(fake: FakeAggregator) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/reports", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _snapshot() -> Snapshot:
    snap = Snapshot()
    snap.put("gpu", CollectorResult(Collection(report={"gpus": [GpuState(index=0, uuid="GPU-a")]}), True, 0.001, 1.0))
    return snap


def test_build_report_merges_sections_and_names_failed_collectors() -> None:
    snap = _snapshot()
    snap.put("rdma", CollectorResult(Collection(), False, 0.1, 1.0, "boom"))
    r = build_report(snap, [], node="n1", boot_id="b", seq=3, ts=5.0, interval_seconds=2.5, topology={"rack": "r1"})
    assert r.gpus[0].uuid == "GPU-a" and r.failed_collectors == ["rdma"] and r.topology == {"rack": "r1"}


async def test_events_survive_an_aggregator_outage_and_urgent_pushes_at_once() -> None:
    fake = FakeAggregator()
    runner, url = await _serve(fake)
    rep = Reporter(url=url, token="s3cret", node="n1", boot_id="b1", topology={}, snapshot=_snapshot(),
                   interval_seconds=0.05, max_backoff_seconds=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(rep.run(stop))
    try:
        rep.add_events([Event(kind="xid", ts=1.0, code=48, urgent=False)])
        await asyncio.sleep(0.4)  # down: several failed attempts
        assert rep.counts["error"] >= 1 and not fake.reports
        fake.up = True
        await asyncio.wait_for(fake.arrived.wait(), 5)
        carried = [e.code for r in fake.reports for e in r.events]
        assert carried == [48]  # the event accepted while the aggregator was down is not lost
        assert fake.auth[-1] == "Bearer s3cret"
        success = [s.value for s in rep.samples() if s.name == "vigil_agent_last_report_success_timestamp_seconds"]
        assert len(success) == 1 and success[0] > 0
        # An urgent event is pushed without waiting for the (now long) interval.
        rep._interval = 30.0  # make the periodic push irrelevant
        await asyncio.sleep(0.1)
        fake.arrived.clear()
        n_before = len(fake.reports)
        rep.add_events([Event(kind="xid", ts=2.0, code=79, urgent=True)])
        await asyncio.wait_for(fake.arrived.wait(), 2)
        latest = fake.reports[n_before:]
        assert any(e.code == 79 for r in latest for e in r.events) and latest[-1].urgent
        seqs = [r.seq for r in fake.reports]
        assert seqs == sorted(seqs)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await runner.cleanup()


def test_pending_events_are_bounded_and_drops_counted() -> None:
    events = [Event(kind="xid", ts=float(i), code=13) for i in range(5)]
    one = len(encode(events[0]))
    rep = Reporter(url=None, token=None, node="n", boot_id="b", topology={}, snapshot=Snapshot(),
                   max_pending_event_bytes=3 * one)
    rep.add_events(events)
    report, n = rep.next_report()
    assert n == 3 and [e.ts for e in report.events] == [2.0, 3.0, 4.0]
    samples = {(s.name, s.label("reason")): s.value for s in rep.samples()}
    assert samples[("vigil_agent_events_dropped_total", "backlog_full")] == 2
    assert samples[("vigil_agent_events_pending_bytes", None)] == 3 * one
    json.loads(encode(report))


async def test_an_urgent_event_arriving_during_a_push_is_not_held_until_the_next_interval() -> None:
    """Regression: the wake flag was cleared at the top of the loop, after an urgent event had set
    it during the previous POST, so that event waited a whole interval."""
    got: asyncio.Queue[Report] = asyncio.Queue()
    first_post_started = asyncio.Event()
    release_first_post = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        report = decode_report(await request.read())
        if report.seq == 0:
            first_post_started.set()
            await release_first_post.wait()  # the periodic report is in flight...
        await got.put(report)
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/reports", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rep = Reporter(url=f"http://127.0.0.1:{port}", token=None, node="n1", boot_id="b", topology={},
                   snapshot=_snapshot(), interval_seconds=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(rep.run(stop))
    try:
        await asyncio.wait_for(first_post_started.wait(), 5)
        rep._interval = 60.0  # from now on only an urgent event can cause a push
        rep.add_events([Event(kind="xid", ts=1.0, code=79, urgent=True)])  # ...when the Xid arrives
        release_first_post.set()
        first = await asyncio.wait_for(got.get(), 5)
        assert first.seq == 0 and not first.events
        second = await asyncio.wait_for(got.get(), 5)  # not 60 s later
        assert [e.code for e in second.events] == [79] and second.urgent
    finally:
        stop.set()
        release_first_post.set()
        await asyncio.wait_for(task, 5)
        await runner.cleanup()
