"""Issue 7's done-when: a storm that would drain 40% of a fleet trips the breaker at its share and
drains no more (counted at a real webhook receiver), until a manual reset; and with a real Slurm
on loopback, an Xid 79 drains the node with the decision id as reason, once, across a restart."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.aggregator_process import (
    SECRET,
    AggregatorProcess,
    WebhookReceiver,
    slurm_aggregator_config,
    wait_for,
)
from tests.aggregator.conftest import FakeNode
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.actuators.webhook import WebhookActuator, WebhookConfig
from vigil.aggregator.app import EVALUATE_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.dispatch import DispatchConfig, Dispatcher
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import Gate
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.wire import Event, encode

FLEET = 50
STORM = 20  # 40% of the fleet
SHARE = 0.10  # budget: 5 nodes per window
T0 = 1_700_000_000.0
SITE_SECRET = b"site-secret-of-the-breaker-storm-0123456789"
OPERATOR = {"Authorization": "Bearer operator-token-0123456789"}


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def xid79(ts: float) -> Event:
    return Event(kind="xid", ts=ts, code=79, gpu=0, urgent=True, source="kmsg")


class Storm:
    def __init__(self, client: TestClient, clock: Clock, dispatcher: Dispatcher, sink: Ledger,
                 receiver: WebhookReceiver) -> None:
        self.client, self.clock, self.dispatcher, self.sink, self.receiver = client, clock, dispatcher, sink, receiver
        self.nodes = [FakeNode(f"gpu-{i:03d}") for i in range(FLEET)]

    async def round(self, bad: set[str] | frozenset[str] = frozenset()) -> None:
        """Every node reports once (the bad ones with a fatal Xid); evaluate; deliver."""
        self.clock.t += 2.5
        for node in self.nodes:
            events = [xid79(self.clock.t)] if node.name in bad else None
            body = encode(node.report(self.clock.t, events=events, urgent=bool(events)))
            resp = await self.client.post("/v1/reports", data=body,
                                          headers={"Authorization": f"Bearer {node_token(SITE_SECRET, node.name)}"})
            assert resp.status == 202
        self.client.app[EVALUATE_KEY]()
        while await self.dispatcher.run_once():
            pass


@pytest.fixture
async def storm(tmp_path: Path) -> AsyncIterator[Storm]:
    config = parse_config({
        "dry_run": False, "evaluate_interval_seconds": 3600,
        "gate": {"breaker_max_share": SHARE, "breaker_window_seconds": 600},
    })
    receiver = WebhookReceiver()
    clock = Clock(T0)
    store = Store(tmp_path / "decisions.sqlite")
    actuators = {"webhook": WebhookActuator(WebhookConfig(enabled=True, url=receiver.url), secret=SECRET)}
    dispatcher = Dispatcher(store, actuators, DispatchConfig(), clock=clock)
    sink = Ledger(Gate(config.gate), store, actuators, wake=dispatcher.wake)
    credentials = Credentials(site_secret=SITE_SECRET, operator=OPERATOR["Authorization"][7:].encode())
    app = make_app(config, Engine(config, sink), sink, clock=clock, credentials=credentials)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            s = Storm(client, clock, dispatcher, sink, receiver)
            await s.round()
            yield s
    finally:
        receiver.close()
        store.close()


def trips(receiver: WebhookReceiver) -> list[dict]:
    return [d for d in receiver.applied.values() if d["action"] == "alert" and d["id"].startswith("breaker-")
            and not d["id"].startswith("breaker-refused-")]


def refused_alerts(receiver: WebhookReceiver) -> set[str]:
    return {d["node"] for d in receiver.applied.values() if d["id"].startswith("breaker-refused-")}


async def test_a_storm_on_40_percent_of_the_fleet_drains_the_budget_alerts_and_waits_for_a_reset(storm) -> None:
    budget = int(FLEET * SHARE)
    bad = [n.name for n in storm.nodes[:STORM]]
    for i in range(0, STORM, 4):  # the storm arrives over a few report rounds
        await storm.round(set(bad[i:i + 4]))
    actions = storm.receiver.actions()
    removing = {k: v for k, v in actions.items() if k != "alert"}
    assert sum(removing.values()) == budget  # exactly the budget, whatever the action
    (alert,) = trips(storm.receiver)
    assert alert["detector"] == "gate" and "circuit breaker tripped" in alert["reason"]
    removed = {d["node"] for d in storm.receiver.applied.values() if d["action"] != "alert"}
    assert removed <= set(bad[:8])  # the first nodes to fail, none after the trip
    # Every real fault refused while the breaker is open still reaches a person, once per node.
    assert refused_alerts(storm.receiver) == set(bad) - removed
    assert storm.sink.verdicts["breaker_open"] >= STORM - budget - 1
    assert storm.sink.store.breaker().tripped

    # The breaker outlasts its window: only a person re-arms it; refusals are not alerted twice.
    storm.clock.t += 700
    await storm.round({storm.nodes[30].name})
    assert sum(v for k, v in storm.receiver.actions().items() if k != "alert") == budget
    assert refused_alerts(storm.receiver) == set(bad) - removed | {storm.nodes[30].name}

    assert (await storm.client.post("/v1/breaker/reset")).status == 401  # an operator's action
    resp = await storm.client.post("/v1/breaker/reset", headers=OPERATOR)
    assert resp.status == 200 and await resp.json() == {"reset": True, "was_tripped": True}
    assert not storm.sink.store.breaker().tripped
    # The faults refused while it was open are proposed again: the budget of the new window goes
    # to the nodes still failing, oldest first, and the rest trip it again.
    await storm.round()
    after = {d["node"] for d in storm.receiver.applied.values() if d["action"] != "alert"} - removed
    assert len(after) == budget and after <= set(bad) | {storm.nodes[30].name}
    assert storm.sink.store.breaker().tripped
    assert len(trips(storm.receiver)) == 2


# The real Slurm ----------------------------------------------------------------------------------

@pytest.fixture
def slurm_aggregator(tmp_path: Path, slurm_cluster: SlurmCluster) -> Iterator[AggregatorProcess]:  # noqa: F811
    slurm_cluster.reset()
    agg = AggregatorProcess(tmp_path, slurm_aggregator_config(slurm_cluster.scontrol,
                                                              str(slurm_cluster.root / "slurm.conf")))
    try:
        yield agg
    finally:
        agg.stop()
        slurm_cluster.reset()


def reason_and_time(cluster: SlurmCluster, node: str) -> str:
    # %E the reason, %H when it was set: a second drain would change the time.
    return cluster.run([cluster.sinfo, "-h", "-N", "-n", node, "-o", "%E|%H"]).strip()


@pytest.mark.external
def test_xid_79_drains_the_slurm_node_with_the_decision_id_once_across_a_restart(
    slurm_aggregator: AggregatorProcess, slurm_cluster: SlurmCluster  # noqa: F811
) -> None:
    nodes = {n: FakeNode(n) for n in slurm_cluster.nodes}
    now = time.time()
    event = xid79(now)

    def run_once() -> None:
        for node in nodes.values():
            slurm_aggregator.post_report(node.report(time.time()))
        slurm_aggregator.post_report(nodes["vnode1"].report(time.time(), events=[event], urgent=True))

    slurm_aggregator.start()
    run_once()
    wait_for("vnode1 drained", lambda: "drain" in slurm_cluster.sinfo_state("vnode1"), 20)
    decisions, _ = slurm_aggregator.decisions()
    (decision,) = decisions
    assert decision["node"] == "vnode1"
    reason = slurm_cluster.reason("vnode1")
    assert reason.startswith("vigil:") and decision["id"] in reason and "Xid 79" in reason
    wait_for("delivered in the store",
             lambda: slurm_aggregator.decisions()[1][decision["id"]][0]["state"] == "delivered")
    before = reason_and_time(slurm_cluster, "vnode1")
    assert [slurm_cluster.sinfo_state(n) for n in ("vnode2", "vnode3")] == ["idle", "idle"]

    # The same run after a restart: the agents report the same Xid again.
    assert slurm_aggregator.stop() == 0
    time.sleep(1.1)  # so that a second drain would show a different reason time (%H has seconds)
    slurm_aggregator.start()
    run_once()
    time.sleep(1.5)  # three evaluations and several dispatcher polls
    decisions_after, deliveries_after = slurm_aggregator.decisions()
    assert [d["id"] for d in decisions_after] == [decision["id"]]
    slurm = [d for d in deliveries_after[decision["id"]] if d["actuator"] == "slurm"]
    assert len(slurm) == 1 and slurm[0]["state"] == "delivered" and slurm[0]["attempts"] == 1
    assert reason_and_time(slurm_cluster, "vnode1") == before
    assert [slurm_cluster.sinfo_state(n) for n in ("vnode2", "vnode3")] == ["idle", "idle"]
