"""Node actions end to end through the real Agent and its reporter: a loopback server stands in for
the aggregator and answers a report with requests signed under the node key; the results come
back in the following reports, survive a failed post, and stop once a report carrying them is
accepted. A malformed answer is counted and changes nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from tests.loopback import free_port
from vigil.agent.config import parse_config
from vigil.agent.daemon import Agent
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import NodeScenario
from vigil.contract.node_actions import node_key, sign
from vigil.contract.seams import Seams
from vigil.contract.wire import MAX_REQUESTS_PER_RESPONSE, NodeActionRequest, Report, decode_report, to_builtins

START = 1_700_000_000.0
NODE = "gpu-node-3"
MASTER = b"site node-action master key 0123456789"
WAIT_SECONDS = 10.0


@dataclass
class StandIn:
    """The aggregator's side of POST /v1/reports: scripted answers, then 202 accepted."""

    answers: list[tuple[int, object]] = field(default_factory=list)
    reports: list[tuple[int, Report]] = field(default_factory=list)  # (status answered, report)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def handle(self, request: web.Request) -> web.Response:
        report = decode_report(await request.read())
        status, body = self.answers.pop(0) if self.answers else (202, {"status": "accepted"})
        if report.action_results and status == 202 and not any(r.action_results for s, r in self.reports):
            status, body = 503, {"error": "unavailable"}  # the first report with results is lost
        async with self.changed:
            self.reports.append((status, report))
            self.changed.notify_all()
        if isinstance(body, bytes):
            return web.Response(status=status, body=body, content_type="application/json")
        return web.json_response(body, status=status)

    async def wait_for(self, predicate: object) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), WAIT_SECONDS)  # type: ignore[arg-type]


@dataclass
class Running:
    agent: Agent
    fake: FakeNvml
    stand_in: StandIn


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    now = [START]
    clock = lambda: now[0]  # noqa: E731 - a clock that moves only when told: requests stay valid
    scenario = NodeScenario.model_validate(
        {"gpus": 4, "faults": [{"kind": "reset_required", "gpu": 2, "at_seconds": 10}]})
    fake = FakeNvml(scenario, clock, start=START)
    backend = PynvmlBackend(fake)
    backend.init()
    for index in range(4):
        backend.identity(index)  # as the GPU collector does at start, before GPU 2's fault
    now[0] = START + 30.0
    (tmp_path / "node.key").write_text(node_key(MASTER, NODE).hex())
    stand_in = StandIn()
    app = web.Application()
    app.router.add_post("/v1/reports", stand_in.handle)
    server = web.AppRunner(app)
    await server.setup()
    port = free_port()
    await web.TCPSite(server, "127.0.0.1", port).start()
    config = parse_config({
        "node": NODE,
        "aggregator": {"url": f"http://127.0.0.1:{port}", "interval_seconds": 0.05, "max_backoff_seconds": 0.1},
        "collectors": {name: {"enabled": False} for name in ("gpu", "host", "rdma", "training", "xid")},
        "node_actions": {"allow": ["reset_gpu"], "key_file": str(tmp_path / "node.key"),
                         "reboot_sentinel_path": str(tmp_path / "reboot-required")},
    })
    agent = Agent(config, Seams(nvml=backend, clock=clock, state_dir=tmp_path))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.reporter.run(stop))
    try:
        yield Running(agent, fake, stand_in)
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_SECONDS)
        await server.cleanup()


def _request(r: Running, id_: str, gpu: int, action: str = "reset_gpu") -> dict[str, object]:
    request = NodeActionRequest(id=id_, action=action, node=NODE, boot_id=r.agent.boot_id,  # type: ignore[arg-type]
                                gpu=gpu, gpu_uuid=r.fake.handles[gpu].uuid, issued_at=START + 29,
                                expires_at=START + 600, reason="test")
    return to_builtins(sign(request, node_key(MASTER, NODE)))


async def test_results_ride_the_next_reports_until_accepted(running: Running) -> None:
    r = running
    r.fake.running_pids[1] = [31337]
    requests = [_request(r, "d-reset", 2), _request(r, "d-busy", 1), _request(r, "d-reboot", 0, "request_reboot")]
    r.stand_in.answers.append((202, {"status": "accepted", "node": NODE, "seq": 0, "requests": requests}))

    def accepted_ids() -> list[str]:
        return sorted(x.id for s, rep in r.stand_in.reports if s == 202 for x in rep.action_results)

    await r.stand_in.wait_for(lambda: len(accepted_ids()) >= 3)
    # Each result is accepted exactly once; the first report carrying any was answered 503 and
    # what it carried went again in a later report.
    assert accepted_ids() == ["d-busy", "d-reboot", "d-reset"]
    carrying = [(s, {x.id for x in rep.action_results}) for s, rep in r.stand_in.reports if rep.action_results]
    assert carrying[0][0] == 503
    assert any(s == 202 and carrying[0][1] <= ids for s, ids in carrying[1:])
    results = {x.id: x for s, rep in r.stand_in.reports if s == 202 for x in rep.action_results}
    assert (results["d-reset"].outcome, results["d-reset"].reason) == ("done", "done")
    assert (results["d-busy"].outcome, results["d-busy"].reason) == ("refused", "busy")
    assert "31337" in results["d-busy"].detail
    assert (results["d-reboot"].outcome, results["d-reboot"].reason) == ("refused", "not_allowed")
    assert r.fake.resets == [(2, 30.0)] and r.fake.running_pids[1] == [31337]

    # Once accepted, later reports carry them no more.
    n = len(r.stand_in.reports)
    await r.stand_in.wait_for(lambda: len(r.stand_in.reports) >= n + 2)
    assert all(not rep.action_results for _, rep in r.stand_in.reports[n:])
    metrics = r.agent.render_metrics().decode()
    assert 'vigil_agent_node_actions_total{action="reset_gpu",outcome="done",reason="done"} 1' in metrics
    assert 'vigil_agent_node_actions_total{action="reset_gpu",outcome="refused",reason="busy"} 1' in metrics


async def test_malformed_answers_are_counted_and_ignored(running: Running) -> None:
    r = running
    good = _request(r, "d-ok", 2)
    too_many = [good] * (MAX_REQUESTS_PER_RESPONSE + 1)
    r.stand_in.answers.extend([
        (202, b"{not json"),
        (202, {"status": "accepted", "requests": "reset everything"}),
        (202, {"status": "accepted", "requests": too_many}),
        (202, {"status": "accepted", "requests": [{"id": "x", "action": "format_disk"}, good]}),
    ])
    await r.stand_in.wait_for(lambda: any(s == 202 and rep.action_results for s, rep in r.stand_in.reports))
    ignored = r.agent.reporter.requests_ignored
    assert ignored == {"malformed": 3, "too_many": MAX_REQUESTS_PER_RESPONSE + 1, "queue_full": 0}
    delivered = [x for s, rep in r.stand_in.reports if s == 202 for x in rep.action_results]
    assert [(x.id, x.outcome) for x in delivered] == [("d-ok", "done")]  # the valid one still ran, once
    assert len(r.fake.resets) == 1
    assert json.loads(r.agent.reporter.last_report_body or b"{}")["node"] == NODE
