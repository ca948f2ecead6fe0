"""The agent's half of "a resume voids pending node actions" (issue 37): the aggregator's outbox
signs each offer of a GPU reset valid for ``offer_ttl_seconds`` only and stops offering it once the
node is resumed; a copy the agent still holds (queued behind another reset) is refused ``expired``
when its turn comes, and nothing is reset. The lookalikes that must act: an offer run in time, and
a request that was not voided, whose stale offer is refused but whose next offer runs."""

from __future__ import annotations

from pathlib import Path

from tests.agent.test_node_action_runner import BOOT, MASTER, NODE, START, World
from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.fleet import Fleet
from vigil.aggregator.outbox import NodeActionsConfig, Outbox

OFFER_TTL_SECONDS = 60.0


def _outbox(w: World) -> Outbox:
    """The aggregator's outbox for World's node, which reports World's boot and GPU 2's uuid."""
    node = FakeNode(NODE)
    node.boot_id = BOOT
    node.gpus[2]["uuid"] = w.fake.handles[2].uuid
    fleet = Fleet()
    fleet.ingest(node.report(START), START)
    config = NodeActionsConfig(request_ttl_seconds=3600, retry_seconds=30, offer_ttl_seconds=OFFER_TTL_SECONDS)
    box = Outbox(MASTER, config, fleet)
    box.on_delivered("slurm", Decision(id="d-1", ts=START, node=NODE, action=Action.RESET_GPU, reason="Xid 79",
                                       detector="xid", gpu=2, dry_run=False), START + 10)
    return box


def test_a_reset_held_by_the_agent_past_the_resume_is_refused_and_nothing_is_reset(tmp_path: Path) -> None:
    w = World(tmp_path, allow=("reset_gpu",))
    box = _outbox(w)
    [offer] = box.due(NODE, START + 11, BOOT)
    assert box.void(NODE, "resumed", START + 20, "resumed by an operator") == 1  # Slurm has the node back
    w.clock.t = START + 11 + OFFER_TTL_SECONDS + 1  # the agent's queue reaches it
    result = w.runner.handle(offer)
    assert (result.outcome, result.reason) == ("refused", "expired")
    assert w.fake.resets == []
    assert box.record(NODE, [result], w.clock.t) == []  # already final: cancelled
    assert box.due(NODE, w.clock.t + 600, BOOT) == []  # and never offered again
    assert box.results[("reset_gpu", "cancelled", "resumed")] == 1


def test_an_offer_run_in_time_resets(tmp_path: Path) -> None:
    w = World(tmp_path, allow=("reset_gpu",))
    box = _outbox(w)
    [offer] = box.due(NODE, START + 11, BOOT)
    w.clock.t = START + 11 + OFFER_TTL_SECONDS - 1
    assert w.runner.handle(offer).outcome == "done" and len(w.fake.resets) == 1


def test_a_stale_offer_of_a_request_not_voided_is_refused_and_the_next_offer_runs(tmp_path: Path) -> None:
    w = World(tmp_path, allow=("reset_gpu",))
    box = _outbox(w)
    [offer] = box.due(NODE, START + 11, BOOT)
    w.clock.t = START + 11 + OFFER_TTL_SECONDS + 1
    stale = w.runner.handle(offer)
    assert stale.reason == "expired" and box.record(NODE, [stale], w.clock.t) == []  # not final: offered again
    [fresh] = box.due(NODE, START + 11 + 30 + OFFER_TTL_SECONDS, BOOT)
    assert fresh.id == offer.id and fresh.expires_at > w.clock.t
    done = w.runner.handle(fresh)  # the expired refusal was not remembered as this id's result
    assert (done.outcome, len(w.fake.resets)) == ("done", 1)
    assert w.count(action="reset_gpu", outcome="refused", reason="expired") == 1
