"""aggregator/outbox.py: requests made from delivered reset_gpu decisions, offered and re-offered on
an injected clock, ended by final results or expiry, signed for one node only, bounded."""

from __future__ import annotations

import pytest

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.fleet import Fleet
from vigil.aggregator.outbox import NodeActionsConfig, Outbox
from vigil.contract.node_actions import node_key, signature_ok
from vigil.contract.wire import MAX_REQUESTS_PER_RESPONSE, NodeActionResult

MASTER = bytes(range(32))
T0 = 10_000.0


def _decision(node: str = "gpu-1", gpu: int | None = 3, id: str = "d1", action: Action = Action.RESET_GPU,
              dry_run: bool = False) -> Decision:
    return Decision(id=id, ts=T0, node=node, action=action, reason="Xid 79 on GPU 3", detector="xid", gpu=gpu,
                    dry_run=dry_run)


def _result(id: str = "d1", outcome: str = "done", reason: str = "done", ts: float = T0 + 5,
            action: str = "reset_gpu") -> NodeActionResult:
    return NodeActionResult(id=id, action=action, gpu=3, outcome=outcome, reason=reason, ts=ts)  # type: ignore[arg-type]


def _outbox(*nodes: str, **config: object) -> tuple[Outbox, Fleet]:
    fleet = Fleet()
    for name in nodes or ("gpu-1",):
        fleet.ingest(FakeNode(name).report(T0), T0)
    cfg = NodeActionsConfig.model_validate({"request_ttl_seconds": 600, "retry_seconds": 30, **config})
    return Outbox(MASTER, cfg, fleet), fleet


def test_a_delivered_reset_becomes_one_signed_request_for_the_node_boot_and_gpu() -> None:
    box, fleet = _outbox("gpu-1", "gpu-2")
    box.on_delivered("slurm", _decision(), T0)
    [req] = box.due("gpu-1", T0 + 1, "boot-gpu-1-1")
    assert (req.id, req.action, req.node, req.boot_id, req.gpu, req.gpu_uuid) == \
        ("d1", "reset_gpu", "gpu-1", "boot-gpu-1-1", 3, "GPU-gpu-1-3")
    assert (req.issued_at, req.expires_at) == (T0, T0 + 1 + 60)  # this offer's validity (offer_ttl_seconds)
    assert signature_ok(req, node_key(MASTER, "gpu-1"))
    assert not signature_ok(req, node_key(MASTER, "gpu-2"))
    assert not signature_ok(req, node_key(b"another master key, 32 bytes...", "gpu-1"))
    assert box.due("gpu-2", T0 + 1) == []
    assert fleet.view().nodes["gpu-1"].action_expiry == {"d1": T0 + 600}
    assert box.offered["reset_gpu"] == 1 and box.pending() == 1


@pytest.mark.parametrize("actuator, decision", [
    ("kubernetes", _decision()), ("slurm", _decision(action=Action.DRAIN)), ("slurm", _decision(dry_run=True))])
def test_only_a_slurm_delivered_real_reset_is_requested(actuator: str, decision: Decision) -> None:
    box, _ = _outbox()
    box.on_delivered(actuator, decision, T0)
    assert box.pending() == 0


def test_without_a_master_key_nothing_is_requested() -> None:
    box = Outbox(None, NodeActionsConfig(), Fleet())
    box.on_delivered("slurm", _decision(), T0)
    assert box.pending() == 0 and box.due("gpu-1", T0) == []


def test_offered_again_every_retry_seconds_until_a_final_result() -> None:
    box, _ = _outbox()
    box.enqueue(_decision(), T0)
    assert len(box.due("gpu-1", T0)) == 1
    assert box.due("gpu-1", T0 + 29.9) == []  # answered within the retry period: not again
    assert len(box.due("gpu-1", T0 + 30)) == 1
    assert box.due("gpu-1", T0 + 31) == []
    accepted = box.record("gpu-1", [_result()], T0 + 40)
    assert [r.outcome for r in accepted] == ["done"]
    assert box.due("gpu-1", T0 + 100) == [] and box.pending() == 0
    assert box.results[("reset_gpu", "done", "done")] == 1
    assert box.offered["reset_gpu"] == 2


def test_delivered_twice_is_one_request() -> None:
    box, _ = _outbox()
    first = box.enqueue(_decision(), T0)
    assert first is not None and box.enqueue(_decision(), T0 + 5) is None
    box.record("gpu-1", [_result()], T0 + 10)
    assert box.enqueue(_decision(), T0 + 20) is None  # finished: not asked again
    assert box.pending() == 0


def test_busy_keeps_it_pending_until_expiry_then_expired_is_counted() -> None:
    box, fleet = _outbox()
    box.enqueue(_decision(), T0)
    box.due("gpu-1", T0)
    box.record("gpu-1", [_result(outcome="refused", reason="busy", ts=T0 + 3)], T0 + 3)
    assert box.pending() == 1
    assert len(box.due("gpu-1", T0 + 30)) == 1  # the GPU may have freed up
    box.record("gpu-1", [_result(outcome="refused", reason="busy", ts=T0 + 33)], T0 + 33)
    assert fleet.view().nodes["gpu-1"].action_results["d1"].result.reason == "busy"
    assert box.due("gpu-1", T0 + 600) == []  # expired: never offered again
    assert box.pending() == 0
    assert box.results[("reset_gpu", "refused", "busy")] == 2
    assert box.results[("reset_gpu", "expired", "no_final_result")] == 1


@pytest.mark.parametrize("outcome, reason", [("failed", "command_failed"), ("refused", "bad_signature"),
                                             ("refused", "not_allowed")])
def test_failed_or_any_other_refusal_is_final(outcome: str, reason: str) -> None:
    box, fleet = _outbox()
    box.enqueue(_decision(), T0)
    box.due("gpu-1", T0)
    box.record("gpu-1", [_result(outcome=outcome, reason=reason)], T0 + 5)
    assert box.pending() == 0 and box.due("gpu-1", T0 + 60) == []
    assert box.results[("reset_gpu", outcome, reason)] == 1
    assert fleet.view().nodes["gpu-1"].action_results["d1"].received == T0 + 5


def test_a_new_boot_voids_the_request() -> None:
    box, _ = _outbox()
    box.enqueue(_decision(), T0)
    assert box.due("gpu-1", T0 + 1, "boot-gpu-1-2") == []
    assert box.pending() == 0 and box.results[("reset_gpu", "void", "new_boot")] == 1


def test_unknown_ids_and_other_nodes_results_are_counted_and_ignored() -> None:
    box, fleet = _outbox("gpu-1", "gpu-2")
    box.enqueue(_decision(), T0)
    assert box.record("gpu-2", [_result()], T0 + 1) == []  # d1 is gpu-1's, not gpu-2's
    assert box.record("gpu-1", [_result(id="nope")], T0 + 1) == []
    assert box.record("gpu-1", [_result(action="request_reboot")], T0 + 1) == []
    assert box.results[("reset_gpu", "done", "unknown_id")] == 2
    assert box.results[("request_reboot", "done", "action_mismatch")] == 1
    assert box.pending() == 1 and fleet.view().nodes["gpu-1"].action_results == {}


def test_free_text_reasons_do_not_become_labels() -> None:
    box, _ = _outbox(max_pending_per_node=100, max_pending_total=100)
    for i in range(41):
        box.enqueue(_decision(id=f"d{i}"), T0)
    for i in range(40):
        box.record("gpu-1", [_result(id=f"d{i}", outcome="refused", reason=f"r{i}")], T0)
    box.record("gpu-1", [_result(id="d40", outcome="refused", reason="Not A Word!")], T0)
    reasons = {r for _, _, r in box.results}
    assert len(reasons) == 33 and "other" in reasons and "Not A Word!" not in reasons
    assert box.results[("reset_gpu", "refused", "other")] == 41 - 32


def test_bounded_per_node_and_in_all() -> None:
    box, _ = _outbox("gpu-1", "gpu-2", max_pending_per_node=2, max_pending_total=3)
    made = [box.enqueue(_decision(id=f"a{i}"), T0) for i in range(3)]
    assert [m is not None for m in made] == [True, True, False]
    assert box.enqueue(_decision(node="gpu-2", id="b0"), T0) is not None
    assert box.enqueue(_decision(node="gpu-2", id="b1"), T0) is None  # 3 in all
    assert box.pending() == 3 and box.not_queued[("reset_gpu", "outbox_full")] == 2


def test_at_most_one_answer_s_worth_per_report() -> None:
    box, _ = _outbox(max_pending_per_node=40, max_pending_total=100)
    for i in range(MAX_REQUESTS_PER_RESPONSE + 4):
        box.enqueue(_decision(id=f"d{i}"), T0)
    assert len(box.due("gpu-1", T0)) == MAX_REQUESTS_PER_RESPONSE
    assert len(box.due("gpu-1", T0 + 1)) == 4  # the rest in the next answer


def test_a_reset_without_a_gpu_or_for_an_unknown_node_is_counted_not_sent() -> None:
    box, _ = _outbox()
    assert box.enqueue(_decision(gpu=None), T0) is None
    assert box.enqueue(_decision(gpu=42, id="d2"), T0) is None
    assert box.enqueue(_decision(node="elsewhere", id="d3"), T0) is None
    assert box.not_queued == {("reset_gpu", "no_gpu"): 2, ("reset_gpu", "unknown_node"): 1}


def test_a_node_whose_clock_is_off_is_offered_a_request_valid_on_its_own_clock() -> None:
    # gpu-1's clock runs 180 s ahead of the aggregator's: the fleet measures it from its report,
    # and the offer's window is told on the node's clock (which the agent checks it against), as
    # long as anyone else's: not expired on arrival, not valid longer.
    node, fleet = FakeNode("gpu-1"), Fleet()
    fleet.ingest(node.report(T0 + 180), T0)
    fleet.ingest(node.report(T0 + 181), T0 + 1)
    box = Outbox(MASTER, NodeActionsConfig.model_validate({"request_ttl_seconds": 600}), fleet)
    assert fleet.clock_offset("gpu-1") == 180 and fleet.clock_offset("unknown") == 0
    box.on_delivered("slurm", _decision(), T0 + 1)
    [req] = box.due("gpu-1", T0 + 2, "boot-gpu-1-1", fleet.clock_offset("gpu-1"))
    assert (req.issued_at, req.expires_at) == (T0 + 1 + 180, T0 + 2 + 60 + 180)
    assert signature_ok(req, node_key(MASTER, "gpu-1"))
    # The request's own expiry stays on the aggregator's clock.
    assert fleet.view().nodes["gpu-1"].action_expiry == {"d1": T0 + 1 + 600}
