"""A node's removal ends, and its pending node actions end with it (issue 37): an operator's resume
or hold over HTTP, or a delivered resume decision, cancels the signed GPU reset the outbox still
offers, counted (outcome cancelled, reason resumed or held) and logged; each offer is signed for a
short validity only, and an offer the agent refused as expired before the request itself expired
is offered again, not taken for a failed reset."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import FakeNode
from tests.aggregator.test_app_node_actions import (
    MASTER,
    SECRET,
    T0,
    Clock,
    Cluster,
    FakeSlurm,
    _config,
    _reset_requested,
    _result,
)
from vigil.aggregator.actuators.actuator import DispatchConfig
from vigil.aggregator.app import make_app
from vigil.aggregator.auth import Credentials
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.dispatch import Dispatcher
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet
from vigil.aggregator.gate import Gate
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.outbox import NodeActionsConfig, Outbox
from vigil.aggregator.store import Store
from vigil.contract.node_actions import node_key, signature_ok
from vigil.contract.wire import NodeActionResult

OPERATOR = {"Authorization": "Bearer operator-token-of-void-tests-01"}
CANCELLED = 'vigil_aggregator_node_action_results_total{{action="reset_gpu",outcome="cancelled",reason="{}"}} 1.0'


@contextlib.asynccontextmanager
async def _cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    config = parse_config(_config(tmp_path))
    clock = Clock(T0)
    store = Store(tmp_path / "decisions.sqlite")
    slurm = FakeSlurm()
    dispatcher = Dispatcher(store, {"slurm": slurm}, DispatchConfig(), clock=clock)
    sink = Ledger(Gate(config.gate), store, {"slurm": slurm}, wake=dispatcher.wake)
    credentials = Credentials(site_secret=SECRET, operator=OPERATOR["Authorization"][7:].encode())
    app = make_app(config, Engine(config, sink), sink, clock=clock, credentials=credentials, dispatcher=dispatcher)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield Cluster(client, clock, dispatcher, slurm, FakeNode("gpu-1"))
    finally:
        store.close()


@pytest.mark.parametrize("route, reason", [("resume", "resumed"), ("hold", "held")])
async def test_an_operator_resume_or_hold_cancels_the_pending_reset(tmp_path: Path, route: str, reason: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    async with _cluster(tmp_path) as c:
        request = await _reset_requested(c)
        # The GPU is busy (the job still runs after the drain): the reset stays pending, re-offered.
        assert (await c.post([_result(request, "refused", "busy", c.clock.t)]))[0] == 202
        resp = await c.client.post(f"/v1/nodes/gpu-1/{route}", json={"note": "fixed by hand"}, headers=OPERATOR)
        assert resp.status == 200 and (await resp.json())["node_actions_cancelled"] == 1
        for _ in range(3):  # well past retry_seconds: never offered again
            c.clock.t += 30
            status, answer = await c.post()
            assert status == 202 and "requests" not in answer
        # The agent's late result for it (it ran a copy it held) is known as final, not unknown.
        await c.post([_result(request, "refused", "expired", c.clock.t)])
        metrics = await c.metrics()
        assert CANCELLED.format(reason) in metrics and "vigil_aggregator_node_actions_pending 0.0" in metrics
        assert 'reason="unknown_id"' not in metrics
    assert any(f"cancelled: {reason} by an operator: fixed by hand" in r.getMessage() for r in caplog.records)


async def test_a_hold_on_another_node_cancels_nothing(tmp_path: Path) -> None:
    async with _cluster(tmp_path) as c:
        request = await _reset_requested(c)
        resp = await c.client.post("/v1/nodes/gpu-2/hold", headers=OPERATOR)
        assert resp.status == 200 and (await resp.json())["node_actions_cancelled"] == 0
        c.clock.t += 30
        _, answer = await c.post()
        assert [r["id"] for r in answer["requests"]] == [request.id]  # still offered to gpu-1


def _outbox(**config: float) -> Outbox:
    fleet = Fleet()
    fleet.ingest(FakeNode("gpu-1").report(T0), T0)
    cfg = NodeActionsConfig.model_validate({"request_ttl_seconds": 600, "retry_seconds": 30, **config})
    return Outbox(MASTER, cfg, fleet)


def _reset(id: str = "d1", action: Action = Action.RESET_GPU) -> Decision:
    return Decision(id=id, ts=T0, node="gpu-1", action=action, reason="Xid 79 on GPU 3", detector="xid", gpu=3,
                    dry_run=False)


def test_a_delivered_resume_decision_cancels_the_pending_reset() -> None:
    box = _outbox()
    box.on_delivered("slurm", _reset(), T0)
    assert box.pending() == 1
    box.on_delivered("slurm", _reset(id="r1", action=Action.RESUME), T0 + 5)  # e.g. the recovery detector's
    assert box.pending() == 0 and box.due("gpu-1", T0 + 60) == []
    assert box.results[("reset_gpu", "cancelled", "resumed")] == 1


def test_each_offer_is_signed_for_a_short_validity_and_renewed_at_the_next() -> None:
    box = _outbox(offer_ttl_seconds=60)
    box.on_delivered("slurm", _reset(), T0)
    [first] = box.due("gpu-1", T0 + 1)
    assert first.expires_at == T0 + 61 and signature_ok(first, node_key(MASTER, "gpu-1"))
    [second] = box.due("gpu-1", T0 + 31)
    assert second.expires_at == T0 + 91 and signature_ok(second, node_key(MASTER, "gpu-1"))
    [last] = box.due("gpu-1", T0 + 571)
    assert last.expires_at == T0 + 600  # never past the request's own expiry


def test_an_offer_the_agent_refused_as_expired_is_offered_again_not_a_failed_reset() -> None:
    """The offer waited in the agent's queue past its validity: the request stands (the fleet is
    not told, so the recovery detector does not escalate to a reboot); once the request itself has
    expired, the agent's expired is final."""
    box = _outbox(offer_ttl_seconds=60)
    fleet = box.fleet
    assert fleet is not None
    box.on_delivered("slurm", _reset(), T0)
    box.due("gpu-1", T0 + 1)
    late = NodeActionResult(id="d1", action="reset_gpu", gpu=3, outcome="refused", reason="expired", ts=T0 + 70)
    assert box.record("gpu-1", [late], T0 + 70) == []
    assert box.pending() == 1 and "d1" not in fleet.view().nodes["gpu-1"].action_results
    assert box.results[("reset_gpu", "refused", "offer_expired")] == 1
    [again] = box.due("gpu-1", T0 + 71)
    assert again.expires_at == T0 + 131
    # Past the request's own expiry the refusal is final (and the sweep would have ended it anyway).
    final = NodeActionResult(id="d1", action="reset_gpu", gpu=3, outcome="refused", reason="expired", ts=T0 + 599)
    box.record("gpu-1", [final], T0 + 600.5)
    assert box.pending() == 0
