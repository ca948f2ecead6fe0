"""Node actions over HTTP: an Xid that calls for a GPU reset is admitted, drained through a fake
Slurm actuator, and the next answer to the node's report carries the signed request; the agent's
results come back in reports, are counted, and bad or unknown ones are refused without a 5xx."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.actuators.actuator import DispatchConfig
from vigil.aggregator.app import EVALUATE_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import AggregatorConfig, ConfigError, parse_config
from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision
from vigil.aggregator.dispatch import Dispatcher
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import Gate
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.node_actions import node_key, signature_ok
from vigil.contract.wire import Event, NodeActionRequest, NodeActionResult, convert, encode, to_builtins

SECRET = b"site-secret-for-tests-0123456789abcdef"
MASTER = bytes(range(32, 64))
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeSlurm:
    """Takes what the Slurm actuator takes and records it (no scontrol)."""

    name = "slurm"
    notify_in_dry_run = False
    timeout_seconds = 5.0

    def __init__(self) -> None:
        self.drained: list[Decision] = []

    def handles(self, decision: Decision) -> bool:
        return decision.action in REMOVING_ACTIONS

    def deliver(self, decision: Decision) -> str:
        self.drained.append(decision)
        return f"drained {decision.node}"

    def check(self) -> str:
        return "ok"

    def close(self) -> None:
        pass


@dataclass
class Cluster:
    client: TestClient
    clock: Clock
    dispatcher: Dispatcher
    slurm: FakeSlurm
    node: FakeNode

    async def post(self, results: list[dict] | None = None, events: list[Event] | None = None) -> tuple[int, dict]:
        self.clock.t += 2.5
        # Not urgent: an urgent report wakes the app's own evaluator; the test evaluates itself.
        report = json.loads(encode(self.node.report(self.clock.t, events=events)))
        if results is not None:
            report["action_results"] = results
        resp = await self.client.post("/v1/reports", data=json.dumps(report),
                                      headers={"Authorization": f"Bearer {node_token(SECRET, self.node.name)}"})
        return resp.status, await resp.json()

    async def metrics(self) -> str:
        return await (await self.client.get("/metrics")).text()


def _config(tmp_path: Path, reset_gpu: bool = True) -> dict:
    key = tmp_path / "master.key"
    key.write_text(MASTER.hex() + "\n")
    return {"dry_run": False, "evaluate_interval_seconds": 3600,
            "actuators": {"slurm": {"enabled": True, "reset_gpu": reset_gpu}},
            "node_actions": {"key_file": str(key), "request_ttl_seconds": 3600, "retry_seconds": 30}}


@contextlib.asynccontextmanager
async def _cluster(tmp_path: Path, config: AggregatorConfig) -> AsyncIterator[Cluster]:
    clock = Clock(T0)
    store = Store(tmp_path / "decisions.sqlite")
    slurm = FakeSlurm()
    dispatcher = Dispatcher(store, {"slurm": slurm}, DispatchConfig(), clock=clock)
    sink = Ledger(Gate(config.gate), store, {"slurm": slurm}, wake=dispatcher.wake)
    app = make_app(config, Engine(config, sink), sink, clock=clock, credentials=Credentials(site_secret=SECRET),
                   dispatcher=dispatcher)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield Cluster(client, clock, dispatcher, slurm, FakeNode("gpu-1"))
    finally:
        store.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with _cluster(tmp_path, parse_config(_config(tmp_path))) as c:
        yield c


async def _reset_requested(c: Cluster) -> NodeActionRequest:
    status, answer = await c.post()
    assert status == 202 and "requests" not in answer  # nothing due yet
    xid = Event(kind="xid", ts=c.clock.t + 2.5, code=46, gpu=3, message="Xid 46")
    assert (await c.post(events=[xid]))[0] == 202
    admitted = c.client.app[EVALUATE_KEY]()
    assert [(d.action, d.gpu) for d in admitted] == [(Action.RESET_GPU, 3)]
    status, answer = await c.post()
    assert "requests" not in answer  # admitted, but the drain is not delivered yet: no request
    await c.dispatcher.run_once()
    assert [d.id for d in c.slurm.drained] == [admitted[0].id]
    status, answer = await c.post()
    assert status == 202
    [raw] = answer["requests"]
    request = convert(raw, NodeActionRequest)
    assert (request.id, request.action, request.node, request.gpu, request.gpu_uuid, request.boot_id) == \
        (admitted[0].id, "reset_gpu", "gpu-1", 3, "GPU-gpu-1-3", c.node.boot_id)
    assert signature_ok(request, node_key(MASTER, "gpu-1"))
    assert not signature_ok(request, node_key(MASTER, "gpu-2"))
    return request


def _result(request: NodeActionRequest, outcome: str, reason: str, ts: float) -> dict:
    return to_builtins(NodeActionResult(id=request.id, action=request.action, gpu=request.gpu, outcome=outcome,  # type: ignore[arg-type]
                            reason=reason, ts=ts))


async def test_a_reset_is_requested_signed_after_the_drain_and_its_results_are_recorded(cluster: Cluster) -> None:
    c = cluster
    request = await _reset_requested(c)
    status, answer = await c.post()
    assert "requests" not in answer  # offered 2.5 s ago: not again before retry_seconds
    status, answer = await c.post([_result(request, "refused", "busy", c.clock.t)])
    assert status == 202 and "requests" not in answer
    c.clock.t += 30
    status, answer = await c.post()
    assert [r["id"] for r in answer["requests"]] == [request.id]  # busy: offered again
    status, answer = await c.post([_result(request, "done", "done", c.clock.t)])
    assert status == 202
    c.clock.t += 60
    status, answer = await c.post()
    assert "requests" not in answer  # done is final
    metrics = await c.metrics()
    assert 'vigil_aggregator_node_action_requests_total{action="reset_gpu"} 2.0' in metrics
    assert ('vigil_aggregator_node_action_results_total{action="reset_gpu",outcome="refused",reason="busy"} 1.0'
            in metrics)
    assert ('vigil_aggregator_node_action_results_total{action="reset_gpu",outcome="done",reason="done"} 1.0'
            in metrics)
    assert "vigil_aggregator_node_actions_pending 0.0" in metrics


async def test_unknown_or_malformed_results_are_counted_or_refused_never_a_5xx(cluster: Cluster) -> None:
    c = cluster
    request = await _reset_requested(c)
    unknown = {**_result(request, "done", "done", c.clock.t), "id": "no-such-request"}
    status, _ = await c.post([unknown])
    assert status == 202
    bad = [{**_result(request, "done", "done", c.clock.t), "outcome": "exploded"},
           {**_result(request, "done", "done", c.clock.t), "extra": 1},
           {"id": request.id}]
    for result in bad:
        status, answer = await c.post([result])
        assert status == 400 and answer["error"] == "schema"
        c.node.seq -= 1  # the refused report was not taken; the agent sends that seq again
    metrics = await c.metrics()
    assert ('vigil_aggregator_node_action_results_total{action="reset_gpu",outcome="done",reason="unknown_id"} 1.0'
            in metrics)
    assert "vigil_aggregator_node_actions_pending 1.0" in metrics  # the real request still waits


async def test_off_by_default_reset_gpu_stays_a_drain(tmp_path: Path) -> None:
    config = parse_config({"dry_run": False, "evaluate_interval_seconds": 3600})
    assert not config.actuators.slurm.reset_gpu and config.node_actions.key_file is None
    with pytest.raises(ConfigError, match=r"reset_gpu needs node_actions\.key_file"):
        parse_config({"actuators": {"slurm": {"enabled": True, "reset_gpu": True}}})
    async with _cluster(tmp_path, config) as c:
        await c.post()
        await c.post(events=[Event(kind="xid", ts=c.clock.t + 2.5, code=46, gpu=3)])
        assert [d.action for d in c.client.app[EVALUATE_KEY]()] == [Action.RESET_GPU]
        await c.dispatcher.run_once()
        assert len(c.slurm.drained) == 1
        status, answer = await c.post()
        assert status == 202 and "requests" not in answer


def test_an_unreadable_or_short_master_key_stops_the_start(tmp_path: Path) -> None:
    data = _config(tmp_path)
    (tmp_path / "master.key").write_text("abcd\n")
    config = parse_config(data)
    sink = Ledger(Gate(config.gate), Store(":memory:"), {})
    with pytest.raises(ConfigError, match="holds 2 bytes"):
        make_app(config, Engine(config, sink), sink, credentials=Credentials(site_secret=SECRET))
