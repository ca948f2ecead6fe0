"""Recovery detector with agent resets on: a reset_gpu removal is verified from the agent's `done`
result (the window starts when it arrived), a failed reset or an expired request climbs to
reboot_node, a busy GPU keeps the node waiting; then the gate's treatment of that reboot."""

from __future__ import annotations

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.detectors.recovery import RecoveryConfig, RecoveryDetector
from vigil.aggregator.fleet import Fleet, Removal
from vigil.aggregator.gate import Gate, GateConfig, GateState
from vigil.contract.wire import NodeActionRequest, NodeActionResult

REMOVED_AT = 1_000.0
TTL = 3600.0
RESET = Removal(Action.RESET_GPU, REMOVED_AT, "dec-reset", 2, held=False)
# reboot_node is followed by default; reset_gpu is followed because agent resets are on.
DETECTOR = RecoveryDetector(RecoveryConfig(enabled=True))


def run(fleet: Fleet, node: FakeNode, start: float, end: float) -> float:
    t = start
    while t <= end:
        fleet.ingest(node.report(t), t)
        t += node.interval
    return t - node.interval


def setup() -> tuple[Fleet, FakeNode]:
    """Healthy until the removal, then GPU 2 needs a reset; the request was made at the removal."""
    fleet, node = Fleet(agent_resets=True), FakeNode("n1")
    run(fleet, node, 0.0, REMOVED_AT)
    fleet.note_action_request(NodeActionRequest(
        id="dec-reset", action="reset_gpu", node="n1", boot_id=node.boot_id, gpu=2, gpu_uuid="GPU-n1-2",
        issued_at=REMOVED_AT, expires_at=REMOVED_AT + TTL))
    node.gpus[2]["health"] = "reset_required"
    return fleet, node


def result(outcome: str, reason: str, ts: float) -> NodeActionResult:
    return NodeActionResult(id="dec-reset", action="reset_gpu", gpu=2, outcome=outcome,  # type: ignore[arg-type]
                            reason=reason, ts=ts)


def judge(fleet: Fleet, now: float):
    return DETECTOR.evaluate(fleet.view({"n1": RESET}), now)


def test_done_starts_the_window_and_resume_follows_the_persistence() -> None:
    fleet, node = setup()
    last = run(fleet, node, REMOVED_AT + 2.5, REMOVED_AT + 120.0)  # reset_required: before the reset
    assert judge(fleet, last) == []  # no result yet: waiting, not inspection
    node.gpus[2]["health"] = "ok"  # the agent reset it
    done_at = last + 2.5
    fleet.ingest(node.report(done_at), done_at)
    fleet.record_action_results("n1", [result("done", "done", done_at - 0.4)], done_at)
    last = run(fleet, node, done_at + 2.5, done_at + 55.0)
    assert judge(fleet, last) == []  # 55 s of 60 clean
    last = run(fleet, node, last + 2.5, done_at + 62.5)
    [f] = judge(fleet, last)
    assert f.action is Action.RESUME and f.since == done_at  # the arrival of the done result
    assert f.evidence["reset"]["outcome"] == "done" and f.evidence["reset"]["agent_ts"] == done_at - 0.4


def test_a_fault_after_the_done_goes_to_inspection() -> None:
    fleet, node = setup()
    done_at = REMOVED_AT + 30.0
    fleet.record_action_results("n1", [result("done", "done", done_at)], done_at)
    last = run(fleet, node, done_at + 2.5, done_at + 20.0)  # still reset_required after the reset
    [f] = judge(fleet, last)
    assert f.action is Action.INSPECT_HARDWARE and f.evidence["signal"] == "gpu_health"


def test_failed_reset_proposes_a_reboot_of_the_node() -> None:
    fleet, node = setup()
    last = run(fleet, node, REMOVED_AT + 2.5, REMOVED_AT + 20.0)
    fleet.record_action_results("n1", [result("failed", "command_failed", last)], last)
    [f] = judge(fleet, last + 2.5)
    assert f.action is Action.REBOOT_NODE and f.gpu == 2 and f.since == last and f.key == "reset_failed"
    assert "failed (command_failed)" in f.reason


def test_busy_waits_and_expiry_without_done_proposes_a_reboot() -> None:
    fleet, node = setup()
    last = run(fleet, node, REMOVED_AT + 2.5, REMOVED_AT + 20.0)
    fleet.record_action_results("n1", [result("refused", "busy", last)], last)
    last = run(fleet, node, last + 2.5, REMOVED_AT + 600.0)
    assert judge(fleet, last) == []  # the job may still end under the drain
    last = run(fleet, node, last + 2.5, REMOVED_AT + TTL - 5)
    found = judge(fleet, last)
    assert [f.action for f in found] == [Action.ALERT]  # unverified for 30 min: a person looks
    assert "busy" in found[0].evidence["waiting_for"]
    last = run(fleet, node, last + 2.5, REMOVED_AT + TTL + 5)
    [f] = judge(fleet, last)
    assert f.action is Action.REBOOT_NODE and f.key == "reset_expired" and f.since == REMOVED_AT + TTL
    assert "(last: refused busy)" in f.reason


def test_with_agent_resets_off_a_reset_is_not_followed_unless_configured() -> None:
    fleet, node = Fleet(agent_resets=False), FakeNode("n1")
    last = run(fleet, node, 0.0, REMOVED_AT + 120.0)
    assert DETECTOR.evaluate(fleet.view({"n1": RESET}), last) == []


def test_the_gate_takes_the_reboot_after_its_cooldown_as_the_ladder_s_next_rung() -> None:
    gate = Gate(GateConfig(cooldown_seconds=900.0))
    state = GateState()
    reset = Decision(id="dec-reset", ts=REMOVED_AT, node="n1", action=Action.RESET_GPU, reason="Xid 79",
                     detector="xid", gpu=2, since=REMOVED_AT - 1)
    verdict = gate.judge(reset, REMOVED_AT, 100, state)
    assert verdict.admitted
    state.apply(verdict, REMOVED_AT)
    fleet, _ = setup()
    fleet.record_action_results("n1", [result("failed", "command_failed", REMOVED_AT + 20)], REMOVED_AT + 20)
    [f] = judge(fleet, REMOVED_AT + 25)
    reboot = Decision.from_finding(f, REMOVED_AT + 25, dry_run=False)
    early = gate.judge(reboot, REMOVED_AT + 25, 100, state)
    assert not early.admitted and early.reason == "cooldown"  # proposed again each evaluation
    later = gate.judge(reboot, REMOVED_AT + 901, 100, state)
    assert later.admitted and later.decision.action is Action.REBOOT_NODE
    assert [e["id"] for e in later.decision.evidence["earlier_episodes"]] == ["dec-reset"]
