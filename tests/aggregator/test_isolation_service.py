"""Group-testing isolation through the service: an operator starts one over HTTP, the agents'
signed collective results come back in their reports, the one node the isolation names faulty is
drained through the gate and the Slurm actuator, the others are not; bad input is a 4xx with its
reason, counted; no operator token, no isolation. Also the detector's side alone: an isolation
naming most of one leaf is that leaf's alert, not drains (the shared-switch lookalike)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import FakeNode
from tests.aggregator.test_app_node_actions import MASTER, SECRET, T0, Clock, FakeSlurm
from vigil.aggregator.actuators.actuator import DispatchConfig
from vigil.aggregator.app import EVALUATE_KEY, PROBER_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.probe_verdict import (
    IsolationOutcome,
    IsolationTest,
    ProbeVerdictConfig,
    ProbeVerdictDetector,
)
from vigil.aggregator.dispatch import Dispatcher
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet
from vigil.aggregator.gate import Gate
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.prober import ProbesConfig
from vigil.aggregator.store import Store
from vigil.cli import main
from vigil.contract.node_actions import node_key, sign_result
from vigil.contract.wire import NodeActionRequest, NodeActionResult, ProbeResult, convert, encode, to_builtins

OPERATOR = b"operator-token-for-tests-0123456789"
NODES = [f"gpu-{i}" for i in range(6)]  # gpu-0..gpu-3 the repaired set, gpu-4 and gpu-5 partners
BAD = "gpu-2"


class Service:
    def __init__(self, client: TestClient, clock: Clock, dispatcher: Dispatcher, slurm: FakeSlurm) -> None:
        self.client = client
        self.clock = clock
        self.dispatcher = dispatcher
        self.slurm = slurm
        self.nodes = {n: FakeNode(n) for n in NODES}
        self.results: dict[str, list[dict]] = {n: [] for n in NODES}

    async def round(self) -> list[NodeActionRequest]:
        """Every node reports once (carrying its pending results); the requests answered back."""
        self.clock.t += 2.5
        requests = []
        for name, node in self.nodes.items():
            body = json.loads(encode(node.report(self.clock.t)))
            if self.results[name]:
                body["action_results"], self.results[name] = self.results[name], []
            resp = await self.client.post("/v1/reports", data=json.dumps(body),
                                          headers={"Authorization": f"Bearer {node_token(SECRET, name)}"})
            assert resp.status == 202
            requests += [convert(r, NodeActionRequest) for r in (await resp.json()).get("requests", [])]
        return requests

    def answer(self, request: NodeActionRequest, busbw: float) -> None:
        """The agent's signed collective result, sent with its next report."""
        result = NodeActionResult(
            id=request.id, action="run_probes", outcome="done", reason="done", ts=self.clock.t, node=request.node,
            boot_id=request.boot_id, probes=[ProbeResult(probe="collective", status="pass", value=busbw,
                                                         unit="gb_per_s")])
        self.results[request.node].append(to_builtins(sign_result(result, node_key(MASTER, request.node))))

    async def start(self, body: object, token: bytes | None = OPERATOR) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {token.decode()}"} if token is not None else {}
        resp = await self.client.post("/v1/probes/isolations", data=json.dumps(body), headers=headers)
        return resp.status, await resp.json()


@contextlib.asynccontextmanager
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    key = tmp_path / "master.key"
    key.write_text(MASTER.hex() + "\n")
    config = parse_config({
        "dry_run": False, "evaluate_interval_seconds": 3600, "actuators": {"slurm": {"enabled": True}},
        "node_actions": {"key_file": str(key)}, "gate": {"min_removed_seconds": 0},
        "detectors": {"probe_verdict": {"enabled": True}},
        "probes": {"enabled": True, "max_fleet_share": 1.0, "max_isolation_nodes": 5,
                   "baselines": {"default": {"collective": {"min_value": 40.0}}}}})
    clock = Clock(T0)
    store = Store(tmp_path / "decisions.sqlite")
    slurm = FakeSlurm()
    dispatcher = Dispatcher(store, {"slurm": slurm}, DispatchConfig(), clock=clock)
    sink = Ledger(Gate(config.gate), store, {"slurm": slurm}, wake=dispatcher.wake)
    app = make_app(config, Engine(config, sink), sink, clock=clock,
                   credentials=Credentials(site_secret=SECRET, operator=OPERATOR), dispatcher=dispatcher)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield Service(client, clock, dispatcher, slurm)
    finally:
        store.close()


async def test_an_operator_isolation_over_http_drains_the_one_bad_node_through_the_gate(tmp_path: Path) -> None:
    async with service(tmp_path) as s:
        for _ in range(3):
            await s.round()
        status, started = await s.start({"nodes": NODES[:4], "d_hint": 1, "note": "repaired  today"})
        assert status == 202 and started["state"] == "running" and started["note"] == "repaired today"
        assert started["information_bound"] == 2.0  # log2 C(4, 1)
        evaluate = s.client.app[EVALUATE_KEY]
        for _ in range(30):
            evaluate()
            groups: dict[str, list[NodeActionRequest]] = {}
            for request in await s.round():  # every member of a test is offered in the same round
                assert request.probes == ["collective"] and request.probe_group is not None
                groups.setdefault(request.probe_group.group, []).append(request)
            for members in groups.values():
                slow = any(r.node == BAD for r in members)  # its HCA slows every collective it is in
                for r in members:
                    s.answer(r, 10.0 if slow else 90.0)
            if s.client.app[PROBER_KEY].isolations[-1].state != "running":
                break
        decisions = evaluate()
        assert [(d.node, d.action, d.detector) for d in decisions] == [(BAD, Action.DRAIN, "probe_verdict")]
        assert decisions[0].evidence["partner"] in ("gpu-4", "gpu-5")
        await s.dispatcher.run_once()
        assert [d.node for d in s.slurm.drained] == [BAD]
        listing = await (await s.client.get("/v1/probes/isolations",
                                            headers={"Authorization": f"Bearer {OPERATOR.decode()}"})).json()
        [done] = listing["isolations"]
        assert (done["state"], done["faulty"], done["cleared"], done["source"]) == ("done", [BAD], 3, "operator")
        assert done["tests_used"] >= 2
        metrics = await (await s.client.get("/metrics")).text()
        assert 'vigil_aggregator_isolations_started_total{source="operator"} 1.0' in metrics
        assert 'vigil_aggregator_isolations_finished_total{outcome="done"} 1.0' in metrics
        assert f"vigil_aggregator_isolation_tests_total {float(done['tests_used'])}" in metrics
        assert evaluate() == []  # the same finding again: the gate does not remove twice


async def test_bad_input_is_a_4xx_with_its_reason_counted_and_no_operator_token_no_isolation(
        tmp_path: Path) -> None:
    async with service(tmp_path) as s:
        await s.round()
        for body, token, status, reason in [
            ({"nodes": ["gpu-0", "gpu-1"]}, None, 401, None),
            ({"nodes": ["gpu-0", "gpu-1"]}, b"not-the-operator-token-0123456789", 401, None),
            ({"nodes": ["gpu-0", "gpu-1"]}, node_token(SECRET, "gpu-0").encode(), 403, None),
            ([1, 2], OPERATOR, 400, "invalid_json"),
            ({"nodes": ["gpu-0"], "extra": 1}, OPERATOR, 400, "unknown_field"),
            ({"nodes": []}, OPERATOR, 400, "bad_nodes"),
            ({"nodes": NODES}, OPERATOR, 400, "bad_nodes"),  # 6 > probes.max_isolation_nodes 5
            ({"nodes": ["gpu-0", "gpu-0"]}, OPERATOR, 400, "bad_nodes"),
            ({"nodes": ["bad name/.."]}, OPERATOR, 400, "bad_nodes"),
            ({"nodes": ["gpu-0", "gpu-1"], "d_hint": 3}, OPERATOR, 400, "bad_d_hint"),
            ({"nodes": ["gpu-0", "gpu-1"], "d_hint": True}, OPERATOR, 400, "bad_d_hint"),
            ({"nodes": ["gpu-0"], "note": "x" * 501}, OPERATOR, 400, "bad_note"),
            ({"nodes": ["gpu-0", "nowhere-7"]}, OPERATOR, 400, "unknown_node"),
        ]:
            got, answer = await s.start(body, token)
            assert got == status, (body, answer)
            if reason is not None:
                assert answer["error"] == reason and answer["detail"], answer
        assert s.client.app[PROBER_KEY].isolations == []  # nothing started by any of them
        assert (await s.start({"nodes": ["gpu-0", "gpu-1"]}))[0] == 202
        status, answer = await s.start({"nodes": ["gpu-2", "gpu-3"]})
        assert (status, answer["error"]) == (409, "running") and "one at a time" in answer["detail"]
        metrics = await (await s.client.get("/metrics")).text()
        for reason, n in (("bad_nodes", 4), ("running", 1), ("unknown_node", 1), ("invalid_json", 1)):
            assert f'vigil_aggregator_isolation_refusals_total{{reason="{reason}"}} {float(n)}' in metrics


def _done(faulty: tuple[str, ...], nodes: tuple[str, ...], leaf_of: dict[str, str]) -> IsolationOutcome:
    tests = tuple(IsolationTest((n,), "p0", False) for n in faulty)
    return IsolationOutcome(name="iso-1", source="operator", note="", nodes=nodes, d_hint=len(faulty) or 1,
                            started=100.0, state="done", finished=200.0, faulty=faulty,
                            cleared=tuple(n for n in nodes if n not in faulty), tests_used=12,
                            information_bound=10.0, tests=tests, leaf_of=leaf_of)


def test_an_isolation_naming_most_of_one_leaf_is_that_leafs_alert_not_drains() -> None:
    """The shared-switch lookalike: a leaf that fails under every node fails their tests alone
    too (their partners come from the same leaf first); 4 of its 6 nodes named is the switch."""
    fleet = Fleet()
    fleet.probes = ProbesConfig(enabled=True)
    nodes = tuple(f"a{i}" for i in range(6)) + tuple(f"b{i}" for i in range(6))
    for n in (*nodes, "p0"):
        fleet.ingest(FakeNode(n).report(150.0), 150.0)
    leaf_of = {n: f"leaf-{n[0]}" for n in nodes}
    detector = ProbeVerdictDetector(ProbeVerdictConfig(enabled=True))
    fleet.isolations = (_done(("a0", "a1", "a2", "a3", "b4"), nodes, leaf_of),)
    findings = detector.evaluate(fleet.view(), 210.0)
    assert sorted((f.node, f.action) for f in findings) == [("b4", Action.DRAIN), ("leaf-a", Action.ALERT)]
    [leaf] = [f for f in findings if f.action is Action.ALERT]
    assert leaf.component == "leaf-a" and leaf.evidence["faulty"] == ["a0", "a1", "a2", "a3"]
    [drain] = [f for f in findings if f.action is Action.DRAIN]
    assert drain.evidence["partner"] == "p0" and drain.evidence["failed_tests"] == [
        {"members": ["b4"], "partner": "p0", "passed": False}]
    # Control: 2 of a leaf is two node faults (below leaf_suspicion_min_nodes), both drained.
    fleet.isolations = (_done(("a0", "a1"), nodes, leaf_of),)
    assert sorted((f.node, f.action) for f in detector.evaluate(fleet.view(), 210.0)) == [
        ("a0", Action.DRAIN), ("a1", Action.DRAIN)]
    # A running or aborted isolation names nobody; a finished one counts for window_seconds.
    aborted = _done(("a0",), nodes, leaf_of)
    fleet.isolations = (IsolationOutcome(**{**aborted.__dict__, "state": "aborted"}),)
    assert detector.evaluate(fleet.view(), 210.0) == []
    fleet.isolations = (_done(("a0",), nodes, leaf_of),)
    assert detector.evaluate(fleet.view(), 200.0 + 3601.0) == []


async def test_vigil_aggregator_isolate_starts_one_and_isolations_lists_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with service(tmp_path) as s:
        await s.round()
        token = tmp_path / "operator.token"
        token.write_text(OPERATOR.decode() + "\n")
        url = str(s.client.make_url("")).rstrip("/")
        common = ["--url", url, "--token-file", str(token)]
        assert await asyncio.to_thread(main, ["aggregator", "isolate", "gpu-0", "gpu-1", "gpu-2", "--d-hint", "1",
                                              "--note", "repaired", *common]) == 0
        out = capsys.readouterr().out
        assert "isolation iso-operator-1-" in out and "3 nodes, d_hint 1" in out
        assert await asyncio.to_thread(main, ["aggregator", "isolations", *common]) == 0
        assert "running; 0 tests (information bound 1.58); repaired" in capsys.readouterr().out
        # A refusal is one line on stderr with the API's reason, exit 1.
        assert await asyncio.to_thread(main, ["aggregator", "isolate", "gpu-3", "gpu-4", *common]) == 1
        assert "HTTP 409 running" in capsys.readouterr().err
