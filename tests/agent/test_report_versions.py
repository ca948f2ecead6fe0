"""The one report version (wire.REPORT_VERSION), both ways, with the real Reporter: against the
real aggregator application the first report is whole and each later one compact, and the fleet
holds the same state as from whole reports (with telemetry in every report; by default the compact
ones carry it every 30 s, and the fleet has it as of the last refresh); an older agent's whole
report without a version is taken, its version-1 or -2 report refused by name (422
unsupported_report_version, counted); a restarted aggregator (no base) gets the report whole
again, and one refusing a compact report for its content gets it whole, with no event lost."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from tests.aggregator.conftest import proposals_ledger
from tests.loopback import free_port
from vigil.agent.collectors.collector import Collection
from vigil.agent.reporter import Reporter
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.aggregator.app import ENGINE_KEY, METRICS_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.contract.wire import Event, GpuState, PortState

SECRET = b"site-secret-for-tests-0123456789abcdef"
NODE = "n1"
WAIT_SECONDS = 10.0


@dataclass
class Seen:
    """(status, version, base_seq, event codes) of each report body, in arrival order."""

    bodies: list[tuple[int, int, int | None, list[int]]] = field(default_factory=list)
    raw: list[dict] = field(default_factory=list)  # each body as sent
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def add(self, status: int, body: bytes) -> None:
        raw = json.loads(body)
        async with self.changed:
            self.bodies.append((status, raw.get("version", 3), raw.get("base_seq"),
                                [e["code"] for e in raw.get("events", [])]))
            self.raw.append(raw)
            self.changed.notify_all()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), WAIT_SECONDS)

    def accepted(self) -> list[tuple[int, int | None, list[int]]]:
        return [(v, b, codes) for status, v, b, codes in self.bodies if status == 202]


def recording(seen: Seen) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def record(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        body = await request.read()
        response = await handler(request)
        if request.path == "/v1/reports":
            await seen.add(response.status, body)
        return response

    return record


def aggregator_app() -> web.Application:
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    return make_app(config, Engine(config, sink), sink, credentials=Credentials(site_secret=SECRET))


def front(seen: Seen, backend_url: str, answer_versions: list[int] | None = None) -> web.Application:
    """Loopback in front of the real aggregator: passes each report on and records it with the
    status the aggregator answered (the aggregator reads its body off the socket itself).
    ``answer_versions``: its answers list these versions instead (an aggregator of an older
    release, which took version 2 as this one does)."""

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        async with aiohttp.ClientSession() as session, session.post(
                backend_url + "/v1/reports", data=body, headers={"Authorization": request.headers["Authorization"]}
        ) as resp:
            answer = await resp.read()
        if answer_versions is not None and resp.status == 202:
            answer = json.dumps({**json.loads(answer), "report_versions": answer_versions}).encode()
        await seen.add(resp.status, body)
        return web.Response(status=resp.status, body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/reports", forward)
    return app


@asynccontextmanager
async def serving(app: web.Application, port: int) -> AsyncIterator[None]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


def node_snapshot(temperature: float, xmit: int, rcv: int, snap: Snapshot | None = None, *,
                  sm_active: float = 0.5, symbol_errors: int = 0) -> Snapshot:
    """The node's state as its collectors put it (into ``snap`` when given, as a new cycle does)."""
    snap = snap if snap is not None else Snapshot()
    gpus = [GpuState(index=i, uuid=f"GPU-{i}", temperature_celsius=temperature + i, power_limit_watts=700.0,
                     ecc_corrected_volatile=3, sm_active_ratio=sm_active) for i in range(2)]
    ports = [PortState(device="mlx5_0", port=1, state="4: ACTIVE", rate_bits_per_second=4e11,
                       counters={"port_xmit_data": xmit, "port_rcv_data": rcv, "symbol_error": symbol_errors})]
    snap.put("gpu", CollectorResult(Collection(report={"gpus": gpus}), True, 0.001, 1.0))
    snap.put("rdma", CollectorResult(Collection(report={"ports": ports}), True, 0.001, 1.0))
    return snap


def reporter(url: str, snap: Snapshot, *, telemetry_seconds: float = 30.0,
             clock: Callable[[], float] = time.time) -> Reporter:
    return Reporter(url=url, token=node_token(SECRET, NODE), node=NODE, boot_id="boot-1", topology={"rack": "r1"},
                    snapshot=snap, interval_seconds=0.02, max_backoff_seconds=0.05,
                    telemetry_seconds=telemetry_seconds, clock=clock)


@asynccontextmanager
async def reporting(rep: Reporter) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(rep.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_SECONDS)


def xid(code: int) -> Event:
    return Event(kind="xid", ts=time.time(), code=code)


async def test_the_agent_sends_compact_reports_once_one_was_accepted_and_the_fleet_state_is_whole():
    seen, port, backend = Seen(), free_port(), free_port()
    app = aggregator_app()
    snap = node_snapshot(40.0, 1000, 2000)
    rep = reporter(f"http://127.0.0.1:{port}", snap, telemetry_seconds=0)
    compact = 3
    async with serving(app, backend), serving(front(seen, f"http://127.0.0.1:{backend}"), port), reporting(rep):
        await seen.until(lambda: len(seen.accepted()) >= 3)
        # Values move: one GPU field and one counter; the rest must stay as the base had them.
        node_snapshot(55.0, 5000, 2000, snap)
        rep.add_events([xid(48)])
        await seen.until(lambda: any(48 in codes for _, _, codes in seen.accepted()))
        await seen.until(lambda: len(seen.accepted()) >= 6)
    accepted = seen.accepted()
    assert accepted[0][:2] == (compact, None)  # whole: no base yet
    assert all(v == compact and base is not None for v, base, _ in accepted[1:])
    node = app[ENGINE_KEY].fleet.view().nodes[NODE]
    gpu = node.gpus[1].last
    assert gpu.temperature_celsius == 56.0 and gpu.power_limit_watts == 700.0 and gpu.ecc_corrected_volatile == 3
    counters = node.ports[("mlx5_0", 1)].last.counters
    assert counters == {"port_xmit_data": 5000, "port_rcv_data": 2000, "symbol_error": 0}
    assert node.topology == {"rack": "r1"} and node.seq_gaps == 0
    assert rep.counts["rebased"] == rep.counts["downgraded"] == rep.counts["rejected"] == 0
    # What the agent shows of its last report (/v1/state, the demo's GPU table) is the whole
    # report, not the compact body it sent.
    assert json.loads(rep.last_report_body or b"{}").get("base_seq") is not None
    shown = rep.last_report
    assert shown is not None and shown.base_seq is None
    assert [(g.index, g.power_limit_watts, g.ecc_corrected_volatile) for g in shown.gpus] == [
        (0, 700.0, 3), (1, 700.0, 3)]
    assert shown.ports[0].counters == counters and shown.topology == {"rack": "r1"}


async def test_compact_reports_carry_telemetry_every_telemetry_seconds_and_faults_in_every_report():
    """Telemetry (a GPU's profiling ratio, a port's traffic counter) that moves waits for the
    next refresh; a judged field and a fault counter that move go in the next report; a whole
    report carries everything; after the refresh the fleet holds what the agent has."""
    seen, port, backend = Seen(), free_port(), free_port()
    app = aggregator_app()
    now = [time.time()]
    snap = node_snapshot(40.0, 1000, 2000, sm_active=0.1)
    rep = reporter(f"http://127.0.0.1:{port}", snap, clock=lambda: now[0])
    async with serving(app, backend), serving(front(seen, f"http://127.0.0.1:{backend}"), port), reporting(rep):
        await seen.until(lambda: len(seen.accepted()) >= 3)
        node_snapshot(55.0, 5000, 2000, snap, sm_active=0.9, symbol_errors=2)
        moved = len(seen.raw)
        await seen.until(lambda: len(seen.accepted()) >= 6)
        node = app[ENGINE_KEY].fleet.view().nodes[NODE]
        held = (node.gpus[1].last.sm_active_ratio, node.ports[("mlx5_0", 1)].last.counters["port_xmit_data"])
        fresh = (node.gpus[1].last.temperature_celsius, node.ports[("mlx5_0", 1)].last.counters["symbol_error"])
        refreshed = len(seen.raw)
        now[0] += 30.0  # the agent's clock: the telemetry interval has passed
        await seen.until(lambda: len(seen.accepted()) >= 9)
    assert held == (0.1, 1000)  # as of the whole report: nothing moved it since
    assert fresh == (56.0, 2)  # judged and faults: in the next compact report
    # The first body that carries the telemetry again was built after the clock moved (one
    # already in flight then may still hold it back).
    refresh = next(i for i in range(moved, len(seen.raw)) if "sm_active_ratio" in seen.raw[i]["gpus"][0])
    assert refresh >= refreshed
    sent = seen.raw[moved:refresh]
    assert len(sent) >= 3 and all(r.get("base_seq") is not None for r in sent)
    assert not any("sm_active_ratio" in g for r in sent for g in r["gpus"])
    assert not any("port_xmit_data" in p.get("counters", {}) for r in sent for p in r["ports"])
    assert [g["sm_active_ratio"] for g in seen.raw[refresh]["gpus"]] == [0.9, 0.9]
    assert seen.raw[refresh]["ports"][0]["counters"] == {"port_xmit_data": 5000}
    assert not any("sm_active_ratio" in g for r in seen.raw[refresh + 1:] for g in r["gpus"])  # unchanged since
    node = app[ENGINE_KEY].fleet.view().nodes[NODE]
    assert node.gpus[1].last.sm_active_ratio == 0.9 and node.ports[("mlx5_0", 1)].last.counters == {
        "port_xmit_data": 5000, "port_rcv_data": 2000, "symbol_error": 2}
    assert seen.raw[0].get("base_seq") is None and seen.raw[0]["gpus"][0]["sm_active_ratio"] == 0.1  # whole


@pytest.mark.parametrize("version, status", [(None, 202), (1, 422), (2, 422)])
async def test_an_old_agents_whole_report_is_taken_and_a_removed_version_is_refused_by_name(
        version: int | None, status: int):
    """Versions 1 (whole) and 2 (compact) were removed before the first release: an agent that
    names one is told which version this aggregator takes (422 unsupported_report_version,
    counted); a whole report without a version (what a version-1 agent sent) is a whole report."""
    port = free_port()
    app = aggregator_app()
    rep = reporter(f"http://127.0.0.1:{port}", node_snapshot(40.0, 1000, 2000))
    raw = json.loads(rep.build_body()[0])
    raw.pop("version")
    if version is not None:
        raw["version"] = version
    async with serving(app, port), aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}/v1/reports", data=json.dumps(raw),
            headers={"Authorization": f"Bearer {node_token(SECRET, NODE)}"}) as resp:
        assert resp.status == status
        answer = await resp.json()
    if status == 202:
        assert answer["report_versions"] == [3] and NODE in app[ENGINE_KEY].fleet.view().nodes
        return
    assert answer["error"] == "unsupported_report_version" and "takes version 3 only" in answer["detail"]
    assert NODE not in app[ENGINE_KEY].fleet.view().nodes
    metrics = app[METRICS_KEY].render().decode()
    assert 'vigil_aggregator_refusals_total{door="reports",reason="unsupported_report_version"} 1.0' in metrics


async def test_a_restarted_aggregator_gets_the_report_whole_again_and_no_event_is_lost():
    seen, port, backend = Seen(), free_port(), free_port()
    rep = reporter(f"http://127.0.0.1:{port}", node_snapshot(40.0, 1000, 2000))
    async with serving(front(seen, f"http://127.0.0.1:{backend}"), port), reporting(rep):
        async with serving(aggregator_app(), backend):
            await seen.until(lambda: any(base is not None for _, base, _ in seen.accepted()))
        rep.add_events([xid(79)])  # while the aggregator is down: kept, retried
        restarted = aggregator_app()  # a new process: no base for the node
        async with serving(restarted, backend):
            await seen.until(lambda: any(79 in codes for _, _, codes in seen.accepted()))
    refused = [(status, base) for status, _, base, _ in seen.bodies if status == 409]
    assert refused and all(base is not None for _, base in refused)  # the compact one, refused for its base
    first_refused = next(i for i, b in enumerate(seen.bodies) if b[0] == 409)
    assert 79 in seen.bodies[first_refused][3]
    first_after = seen.bodies[first_refused + 1]
    assert first_after[0] == 202 and first_after[2] is None and first_after[3] == [79]  # whole, with the event
    assert rep.counts["rebased"] == 1 and rep.dropped_events == 0
    assert restarted[ENGINE_KEY].fleet.view().nodes[NODE].gpus[0].last.power_limit_watts == 700.0


async def test_a_compact_report_refused_for_its_content_is_resent_whole_and_no_event_is_lost():
    seen, port = Seen(), free_port()
    refuse = [False]

    async def picky(request: web.Request) -> web.Response:
        raw = json.loads(await request.read())
        if refuse[0] and raw.get("base_seq") is not None:  # once: an aggregator that cannot take it
            refuse[0] = False
            return web.json_response({"error": "schema", "detail": "refused at `$.cleared`"}, status=400)
        return web.json_response({"status": "accepted", "node": NODE, "seq": raw["seq"], "report_versions": [3]},
                                 status=202)

    app = web.Application(middlewares=[recording(seen)])
    app.router.add_post("/v1/reports", picky)
    rep = reporter(f"http://127.0.0.1:{port}", node_snapshot(40.0, 1000, 2000))
    async with serving(app, port), reporting(rep):
        await seen.until(lambda: any(base is not None for _, base, _ in seen.accepted()))
        refuse[0] = True
        rep.add_events([xid(31)])
        await seen.until(lambda: any(31 in codes for _, _, codes in seen.accepted()))
        resent = len(seen.bodies)
        await seen.until(lambda: len(seen.bodies) >= resent + 3)
    carried = [(base, codes) for _, base, codes in seen.accepted() if 31 in codes]
    assert carried == [(None, [31])]  # resent whole, once
    assert rep.counts["downgraded"] == 1 and rep.dropped_events == 0
    # Then compact again against the whole one.
    after = [(status, base is not None) for status, _, base, _ in seen.bodies[resent:]]
    assert {status for status, _ in after} == {202} and any(compact for _, compact in after)


def test_telemetry_waits_for_its_interval_and_a_clock_stepped_back_refreshes_it_at_once():
    now = [time.time()]
    snap = node_snapshot(40.0, 1000, 2000, sm_active=0.1)
    rep = reporter("http://127.0.0.1:1", snap, clock=lambda: now[0])
    versions = {"report_versions": [3]}

    def sent() -> dict:
        body = json.loads(rep.build_body()[0])
        rep.accepted(versions)
        return body

    assert sent()["gpus"][0]["sm_active_ratio"] == 0.1  # whole: no report accepted yet
    node_snapshot(40.0, 1000, 2000, snap, sm_active=0.9)
    now[0] += 29.0
    assert "sm_active_ratio" not in sent()["gpus"][0]  # 29 s: held back
    now[0] += 1.0
    assert sent()["gpus"][0]["sm_active_ratio"] == 0.9  # 30 s since the whole one
    node_snapshot(40.0, 1000, 2000, snap, sm_active=0.5)
    now[0] += 5.0
    assert "sm_active_ratio" not in sent()["gpus"][0]
    now[0] -= 3600.0  # NTP stepped the clock back an hour
    assert sent()["gpus"][0]["sm_active_ratio"] == 0.5
