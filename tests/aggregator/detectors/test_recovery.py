"""Recovery detector: a node vigil rebooted is given back only once it proved healthy after it.

First the detector alone on a fleet built from fake agents (the removal given as the gate would
record it), then the engine, the gate and the ledger together: Xid 79 -> reboot_node admitted ->
the node reboots -> resume admitted after the persistence and the gate's hysteresis.
"""

from __future__ import annotations

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.detectors.recovery import RecoveryConfig, RecoveryDetector
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet, Removal
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.wire import Event

DETECTOR = RecoveryDetector(RecoveryConfig(enabled=True))
REMOVED_AT = 100.0
REBOOT = Removal(Action.REBOOT_NODE, REMOVED_AT, "dec-reboot", 3, held=False)


def run(fleet: Fleet, node: FakeNode, start: float, end: float, **kw: object) -> float:
    t = start
    while t <= end:
        fleet.ingest(node.report(t, **kw), t)  # type: ignore[arg-type]
        t += node.interval
    return t - node.interval


def rebooted(node: FakeNode, *, down_seconds: float = 120.0, **kw: object) -> tuple[Fleet, float]:
    """Reports 0..REMOVED_AT, silent while it reboots, back with a new boot id. Returns the fleet
    and when the new boot's first report arrived."""
    fleet = Fleet()
    run(fleet, node, 0.0, REMOVED_AT)
    node.reboot()
    back = REMOVED_AT + down_seconds
    run(fleet, node, back, back, **kw)
    return fleet, back


def judge(fleet: Fleet, now: float, removal: Removal = REBOOT, detector: RecoveryDetector = DETECTOR):
    return detector.evaluate(fleet.view({removal_node(fleet): removal}), now)


def removal_node(fleet: Fleet) -> str:
    [name] = fleet.view().nodes
    return name


def test_reboot_that_fixes_resumes_after_the_persistence_only() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node)
    assert judge(fleet, back) == []  # just back: nothing proved yet
    last = run(fleet, node, back + 2.5, back + 55.0)
    assert judge(fleet, last) == []  # 55 s < 60 s
    last = run(fleet, node, last + 2.5, back + 62.5)
    [f] = judge(fleet, last)
    assert f.action is Action.RESUME and f.node == "n1" and f.since == back
    assert f.evidence["removal"] == "dec-reboot" and f.evidence["new_boot"] is True
    assert f.evidence["boot_id"] == "boot-n1-2"
    # The same episode on every evaluation: one decision id.
    last = run(fleet, node, last + 2.5, last + 10.0)
    [again] = judge(fleet, last)
    assert again.since == f.since and again.key == f.key


def test_same_boot_id_means_not_rebooted_yet_so_nothing() -> None:
    node = FakeNode("n1")
    fleet = Fleet()
    last = run(fleet, node, 0.0, REMOVED_AT + 600.0)  # healthy, but never rebooted
    assert judge(fleet, last) == []


def test_an_agent_restart_without_a_reboot_is_no_evidence() -> None:
    """The agent's boot id is the kernel's plus a per-start nonce (agent/daemon.py): a new nonce
    alone means the agent restarted on the same boot, which fixes nothing; a new kernel part is
    the reboot."""
    kernel, fresh_kernel = "0123456789abcdef", "fedcba9876543210"
    node = FakeNode("n1")
    node.boot_id = f"{kernel}-00000001"
    fleet = Fleet()
    run(fleet, node, 0.0, REMOVED_AT)
    node.boot_id = f"{kernel}-00000002"  # `systemctl restart vigil-agent`, no reboot
    last = run(fleet, node, REMOVED_AT + 30.0, REMOVED_AT + 600.0)
    assert judge(fleet, last) == []
    node.boot_id = f"{fresh_kernel}-00000003"  # now the machine rebooted
    back = last + 120.0
    last = run(fleet, node, back, back + 62.5)
    [f] = judge(fleet, last)
    assert f.action is Action.RESUME and f.since == back and f.evidence["new_boot"] is True


def test_a_reboot_before_the_removal_is_not_the_remediation() -> None:
    node = FakeNode("n1")
    fleet = Fleet()
    run(fleet, node, 0.0, 40.0)
    node.reboot()
    last = run(fleet, node, 50.0, REMOVED_AT + 600.0)  # rebooted at 50, removed at 100
    assert judge(fleet, last) == []


def test_a_gpu_fewer_after_the_reboot_goes_to_inspection_and_never_resumes() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node, drop_gpus=(3,))
    last = run(fleet, node, back + 2.5, back + 120.0, drop_gpus=(3,))
    [f] = judge(fleet, last)
    assert f.action is Action.INSPECT_HARDWARE and f.evidence["signal"] == "gpu_missing"
    assert "GPU(s) 3 of 8" in f.evidence["detail"]


def test_a_gpu_renumbered_away_after_the_reboot_is_still_missing() -> None:
    # nvidia-smi renumbers the survivors 0..6: index 7 is the one absent, the count is 7 of 8.
    node = FakeNode("n1")
    fleet, back = rebooted(node, drop_gpus=(7,))
    last = run(fleet, node, back + 2.5, back + 70.0, drop_gpus=(7,))
    [f] = judge(fleet, last)
    assert f.action is Action.INSPECT_HARDWARE and "7 of 8" in f.evidence["detail"]


def test_fatal_xid_again_after_the_reboot_goes_to_inspection() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node)
    xid = Event(kind="xid", ts=back + 20.0, code=79, gpu=3, urgent=True, message="GPU has fallen off the bus")
    fleet.ingest(node.report(back + 20.0, events=[xid]), back + 20.0)
    last = run(fleet, node, back + 22.5, back + 90.0)
    [f] = judge(fleet, last)
    assert f.action is Action.INSPECT_HARDWARE and f.evidence["signal"] == "xid" and "Xid 79" in f.reason


def test_the_xid_that_caused_the_reboot_does_not_count_against_it() -> None:
    node = FakeNode("n1")
    fleet = Fleet()
    run(fleet, node, 0.0, 90.0)
    xid = Event(kind="xid", ts=95.0, code=79, gpu=3, urgent=True)
    fleet.ingest(node.report(95.0, events=[xid]), 95.0)
    node.reboot()
    back = run(fleet, node, 220.0, 220.0)
    last = run(fleet, node, back + 2.5, back + 65.0)
    [f] = judge(fleet, last)
    assert f.action is Action.RESUME


def test_application_xid_after_the_reboot_is_not_a_hardware_fault() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node)
    xid = Event(kind="xid", ts=back + 10.0, code=13, gpu=1)  # a user's kernel fault
    fleet.ingest(node.report(back + 10.0, events=[xid]), back + 10.0)
    last = run(fleet, node, back + 12.5, back + 65.0)
    [f] = judge(fleet, last)
    assert f.action is Action.RESUME


def test_uncorrectable_ecc_or_row_remap_after_the_reboot_goes_to_inspection() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node)
    node.gpus[5]["ecc_uncorrected_volatile"] = 2
    last = run(fleet, node, back + 2.5, back + 70.0)
    [f] = judge(fleet, last)
    assert (f.action, f.evidence["signal"]) == (Action.INSPECT_HARDWARE, "ecc_uncorrected")

    node = FakeNode("n2")
    fleet, back = rebooted(node)
    node.gpus[2]["remap_pending"] = True
    last = run(fleet, node, back + 2.5, back + 70.0)
    [f] = judge(fleet, last)
    assert (f.action, f.evidence["signal"]) == (Action.INSPECT_HARDWARE, "row_remap_pending")


def test_a_port_that_was_up_before_the_reboot_must_come_up_again() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node)
    node.ports[4]["state"] = "DOWN"
    last = run(fleet, node, back + 2.5, back + 90.0)
    assert judge(fleet, last) == []  # waits; not a hardware verdict on its own
    node.ports[4]["state"] = "ACTIVE"
    last = run(fleet, node, last + 2.5, last + 30.0)
    assert judge(fleet, last) == []  # up for 30 s only
    last = run(fleet, node, last + 2.5, last + 35.0)
    [f] = judge(fleet, last)
    assert f.action is Action.RESUME


def test_a_port_never_up_does_not_block() -> None:
    node = FakeNode("n1")
    node.ports[7]["state"] = "DOWN"  # cabled off, in every boot
    fleet, back = rebooted(node)
    last = run(fleet, node, back + 2.5, back + 65.0)
    [f] = judge(fleet, last)
    assert f.action is Action.RESUME


def test_not_verified_for_long_alerts_once_and_stays_out() -> None:
    node = FakeNode("n1")
    node.ports[4]["state"] = "ACTIVE"
    fleet, back = rebooted(node)
    node.ports[4]["state"] = "DOWN"
    last = run(fleet, node, back + 2.5, back + 1800.0)
    [f] = judge(fleet, last)
    assert f.action is Action.ALERT and f.evidence["signal"] == "unverified"
    assert "port mlx5_4/1" in f.evidence["waiting_for"]


def test_a_silent_node_is_not_judged() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node)
    last = run(fleet, node, back + 2.5, back + 65.0)
    assert judge(fleet, last + 30.0) == []


def test_held_drained_inspected_or_unfollowed_removals_are_left_alone() -> None:
    node = FakeNode("n1")
    fleet, back = rebooted(node)
    last = run(fleet, node, back + 2.5, back + 65.0)
    assert judge(fleet, last, REBOOT._replace(held=True)) == []
    assert judge(fleet, last, REBOOT._replace(action=Action.DRAIN)) == []
    assert judge(fleet, last, REBOOT._replace(action=Action.RESET_GPU)) == []  # not followed by default
    resets = RecoveryDetector(RecoveryConfig(enabled=True, follow_actions=[Action.RESET_GPU]))
    [f] = judge(fleet, last, REBOOT._replace(action=Action.RESET_GPU), resets)
    assert f.action is Action.RESUME


def test_reset_gpu_is_judged_from_the_removal_when_there_is_no_reboot() -> None:
    resets = RecoveryDetector(RecoveryConfig(enabled=True, follow_actions=[Action.RESET_GPU]))
    removal = Removal(Action.RESET_GPU, REMOVED_AT, "dec-reset", 2, held=False)
    node = FakeNode("n1")
    fleet = Fleet()
    run(fleet, node, 0.0, REMOVED_AT)
    node.gpus[2]["health"] = "reset_required"  # the reset never happened
    last = run(fleet, node, REMOVED_AT + 2.5, REMOVED_AT + 70.0)
    [f] = judge(fleet, last, removal, resets)
    assert f.action is Action.INSPECT_HARDWARE and f.evidence["signal"] == "gpu_health"
    node2 = FakeNode("n2")
    fleet = Fleet()
    run(fleet, node2, 0.0, REMOVED_AT + 70.0)
    [f] = judge(fleet, REMOVED_AT + 70.0, removal, resets)
    assert f.action is Action.RESUME and f.since == REMOVED_AT


# -- engine, gate and ledger together ------------------------------------------------------------

T0 = 1_700_000_000.0


def stack(recovery: bool, min_removed_seconds: float = 600.0) -> tuple[Engine, Ledger]:
    config = parse_config({"detectors": {"recovery": {"enabled": recovery}},
                           "gate": {"min_removed_seconds": min_removed_seconds}})
    ledger = Ledger(Gate(GateConfig(min_removed_seconds=min_removed_seconds)), Store(":memory:"), {})
    return Engine(config, ledger), ledger


def drive(engine: Engine, nodes: list[FakeNode], start: float, end: float,
          down: tuple[str, float, float] | None = None, events: dict[float, Event] | None = None) -> list[Decision]:
    out: list[Decision] = []
    t = start
    while t <= end:
        for node in nodes:
            if down is not None and node.name == down[0] and down[1] <= t < down[2]:
                continue
            ev = [events[t]] if events and t in events and node.name == "n1" else []
            engine.ingest(node.report(t, events=ev, urgent=bool(ev)), t)
        out.extend(engine.evaluate(t))
        t += 2.5
    return out


def xid79(ts: float) -> dict[float, Event]:
    return {ts: Event(kind="xid", ts=ts, code=79, gpu=3, urgent=True, message="GPU has fallen off the bus")}


def test_end_to_end_reboot_then_resume_after_persistence_and_hysteresis() -> None:
    engine, ledger = stack(recovery=True)
    nodes = [FakeNode(f"n{i}", gpus=8, ports=2) for i in range(1, 5)]
    got = drive(engine, nodes, T0, T0 + 60.0, events=xid79(T0 + 30.0))
    [reboot] = [d for d in got if d.node == "n1"]
    assert reboot.action is Action.REBOOT_NODE
    nodes[0].reboot()  # the site (or the Slurm actuator) reboots it: 120 s without reports
    got = drive(engine, nodes, T0 + 62.5, T0 + 400.0, down=("n1", T0 + 62.5, T0 + 185.0))
    assert [d for d in got if d.action is Action.RESUME] == []  # proved at 245 s, hysteresis until 630 s
    assert ledger.verdicts["hysteresis"] > 0
    got = drive(engine, nodes, T0 + 402.5, T0 + 700.0)
    [resume] = [d for d in got if d.action is Action.RESUME]
    assert resume.node == "n1" and resume.detector == "recovery"
    assert resume.evidence["removal"] == reboot.id
    assert ledger.store.state.node("n1").condition == "in_service"
    # Back in service: nothing more from the recovery detector.
    assert resume.since == T0 + 185.0  # the new boot's first report: the episode vouched for
    later = drive(engine, nodes, T0 + 702.5, T0 + 800.0)
    assert [d for d in later if d.detector == "recovery"] == []


def test_end_to_end_recovery_off_by_default_leaves_the_node_out() -> None:
    engine, ledger = stack(recovery=False)
    nodes = [FakeNode(f"n{i}", gpus=8, ports=2) for i in range(1, 5)]
    drive(engine, nodes, T0, T0 + 60.0, events=xid79(T0 + 30.0))
    nodes[0].reboot()
    got = drive(engine, nodes, T0 + 62.5, T0 + 800.0, down=("n1", T0 + 62.5, T0 + 185.0))
    assert [d for d in got if d.action is Action.RESUME] == []
    assert ledger.store.state.node("n1").condition == "removed"


def test_end_to_end_a_held_node_is_never_resumed() -> None:
    engine, ledger = stack(recovery=True)
    nodes = [FakeNode(f"n{i}", gpus=8, ports=2) for i in range(1, 5)]
    drive(engine, nodes, T0, T0 + 60.0, events=xid79(T0 + 30.0))
    ledger.hold("n1", True, T0 + 61.0, "RMA pending")
    nodes[0].reboot()
    got = drive(engine, nodes, T0 + 62.5, T0 + 800.0, down=("n1", T0 + 62.5, T0 + 185.0))
    assert [d for d in got if d.action is Action.RESUME] == []
    assert ledger.store.state.node("n1").condition == "removed"


def test_the_gate_refuses_a_detectors_resume_of_a_held_node() -> None:
    # Belt and braces: even a detector that proposed it (the recovery detector does not) is refused.
    _, ledger = stack(recovery=True, min_removed_seconds=0.0)
    drain = Decision(id="d1", ts=T0, node="n1", action=Action.REBOOT_NODE, reason="x", detector="xid", dry_run=False)
    assert ledger.submit([drain], T0, 100)
    ledger.hold("n1", True, T0 + 1.0, "RMA")
    resume = Decision(id="r1", ts=T0 + 10.0, node="n1", action=Action.RESUME, reason="verified",
                      detector="recovery", dry_run=False)
    assert ledger.submit([resume], T0 + 10.0, 100) == []
    assert ledger.verdicts["held"] == 1 and ledger.store.state.node("n1").condition == "removed"
    ledger.hold("n1", False, T0 + 20.0)
    resume2 = resume.model_copy(update={"id": "r2", "ts": T0 + 30.0})
    [ok] = ledger.submit([resume2], T0 + 30.0, 100)
    assert ok.action is Action.RESUME


def test_end_to_end_a_gpu_missing_after_the_reboot_goes_to_inspection() -> None:
    engine, ledger = stack(recovery=True)
    nodes = [FakeNode(f"n{i}", gpus=8, ports=2) for i in range(1, 5)]
    drive(engine, nodes, T0, T0 + 60.0, events=xid79(T0 + 30.0))
    nodes[0].reboot()
    del nodes[0].gpus[3]
    got = drive(engine, nodes, T0 + 62.5, T0 + 600.0, down=("n1", T0 + 62.5, T0 + 185.0))
    assert [d for d in got if d.action is Action.RESUME] == []
    assert any(d.action is Action.INSPECT_HARDWARE and d.node == "n1" for d in got)
    assert ledger.store.state.node("n1").condition == "awaiting_inspection"
