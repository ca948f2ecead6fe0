"""The gate: dedup, hysteresis, cooldown, escalation, remediation cap, opt-out, maintenance,
dry run and the cluster circuit breaker (with property tests on its budget)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision
from vigil.aggregator.gate import BreakerRecord, Gate, GateConfig, GateState, MaintenanceWindow
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store

T0 = 1_700_000_000.0


def dec(node: str, action: Action, ts: float = T0, id: str | None = None, **kw: object) -> Decision:
    return Decision(
        id=id or f"{node}-{action.value}-{ts}",
        ts=ts,
        node=node,
        action=action,
        reason=f"test {action.value}",
        detector="test",
        dry_run=False,
        **kw,
    )


def run(gate: Gate, state: GateState, d: Decision, now: float, fleet: int = 100):
    verdict = gate.judge(d, now, fleet, state)
    state.apply(verdict, now)
    return verdict


def test_admits_a_drain_and_refuses_it_again_while_removed() -> None:
    gate, state = Gate(GateConfig(dry_run=False)), GateState()
    v = run(gate, state, dec("n1", Action.DRAIN), T0)
    assert v.admitted and v.decision.action is Action.DRAIN and v.decision.dry_run is False
    again = run(gate, state, dec("n1", Action.DRAIN, id="other-episode"), T0 + 5)
    assert (again.admitted, again.reason) == (False, "duplicate")
    later = run(gate, state, dec("n1", Action.DRAIN, id="third"), T0 + 3600)
    assert (later.admitted, later.reason) == (False, "already_removed")


def test_global_dry_run_marks_every_admitted_decision() -> None:
    gate, state = Gate(GateConfig(dry_run=True)), GateState()
    v = run(gate, state, dec("n1", Action.DRAIN), T0)
    assert v.admitted and v.decision.dry_run is True


def test_escalates_reset_then_reboot_then_inspection_and_caps_remediations() -> None:
    cfg = GateConfig(dry_run=False, dedup_seconds=30, cooldown_seconds=600, max_remediation_attempts=2)
    gate, state = Gate(cfg), GateState()
    first = run(gate, state, dec("n1", Action.RESET_GPU, gpu=3), T0)
    assert first.admitted and first.decision.action is Action.RESET_GPU
    too_soon = run(gate, state, dec("n1", Action.RESET_GPU, T0 + 60, gpu=3), T0 + 60)
    assert (too_soon.admitted, too_soon.reason) == (False, "cooldown")
    second = run(gate, state, dec("n1", Action.RESET_GPU, T0 + 700, gpu=3), T0 + 700)
    assert second.admitted and second.reason == "escalated"
    assert second.decision.action is Action.REBOOT_NODE
    assert second.decision.evidence["escalated_from"] == "reset_gpu"
    third = run(gate, state, dec("n1", Action.RESET_GPU, T0 + 1400, gpu=3), T0 + 1400)
    assert third.admitted and third.decision.action is Action.INSPECT_HARDWARE
    fourth = run(gate, state, dec("n1", Action.REBOOT_NODE, T0 + 5000), T0 + 5000)
    assert (fourth.admitted, fourth.reason) == (False, "awaiting_inspection")


def test_remediations_outside_the_escalation_window_do_not_escalate() -> None:
    cfg = GateConfig(dry_run=False, escalation_window_seconds=3600, history_horizon_seconds=3600,
                     min_removed_seconds=0)
    gate, state = Gate(cfg), GateState()
    assert run(gate, state, dec("n1", Action.RESET_GPU), T0).admitted
    v = run(gate, state, dec("n1", Action.RESET_GPU, T0 + 7200), T0 + 7200)
    assert v.admitted and v.decision.action is Action.RESET_GPU


def test_resume_needs_a_removed_node_and_hysteresis() -> None:
    gate, state = Gate(GateConfig(dry_run=False, min_removed_seconds=1800)), GateState()
    assert run(gate, state, dec("n1", Action.RESUME), T0).reason == "not_removed"
    assert run(gate, state, dec("n1", Action.DRAIN), T0).admitted
    assert run(gate, state, dec("n1", Action.RESUME, T0 + 60), T0 + 60).reason == "hysteresis"
    ok = run(gate, state, dec("n1", Action.RESUME, T0 + 2000), T0 + 2000)
    assert ok.admitted
    assert state.node("n1").condition == "in_service"
    assert run(gate, state, dec("n1", Action.DRAIN, T0 + 2100), T0 + 2100).admitted


def test_opt_out_and_maintenance_refuse_actions_but_not_alerts() -> None:
    window = MaintenanceWindow(
        nodes=["rack7-*"], start=datetime(2023, 11, 14, tzinfo=UTC), end=datetime(2023, 11, 16, tzinfo=UTC)
    )
    gate, state = Gate(GateConfig(dry_run=False, opt_out_nodes=["canary-*"], maintenance=[window])), GateState()
    assert run(gate, state, dec("canary-1", Action.DRAIN), T0).reason == "opt_out"
    assert run(gate, state, dec("rack7-n3", Action.REBOOT_NODE), T0).reason == "maintenance"
    assert run(gate, state, dec("rack7-n3", Action.ALERT), T0).admitted
    assert run(gate, state, dec("rack7-n3", Action.DRAIN, T0 + 3 * 86400), T0 + 3 * 86400).admitted


def test_maintenance_window_rejects_naive_or_reversed_times() -> None:
    with pytest.raises(ValidationError, match="time zone"):
        MaintenanceWindow(nodes=["a"], start=datetime(2024, 1, 1), end=datetime(2024, 1, 2))
    with pytest.raises(ValidationError, match="after start"):
        MaintenanceWindow(nodes=["a"], start=datetime(2024, 1, 2, tzinfo=UTC), end=datetime(2024, 1, 1, tzinfo=UTC))


def test_unknown_gate_key_is_rejected() -> None:
    with pytest.raises(ValidationError, match="cooldown_secnds"):
        GateConfig.model_validate({"cooldown_secnds": 5})


def test_breaker_budget_share_count_and_floor() -> None:
    assert GateConfig(breaker_max_share=0.1).breaker_budget(100) == 10
    assert GateConfig(breaker_max_share=0.1, breaker_max_nodes=4).breaker_budget(100) == 4
    assert GateConfig(breaker_max_share=0.1).breaker_budget(5) == 3  # the floor
    assert GateConfig(breaker_max_share=0.1).breaker_budget(100, in_grace=True) == 3  # start-up: floor only
    assert GateConfig(breaker_max_share=0.1, breaker_floor_nodes=0).breaker_budget(5) == 0


def test_storm_of_40_percent_trips_the_breaker_at_the_share_and_drains_no_more(tmp_path) -> None:
    store = Store(tmp_path / "d.sqlite3")
    sink = Ledger(Gate(GateConfig(dry_run=False, breaker_max_share=0.1)), store, {})
    storm = [dec(f"n{i:03d}", Action.DRAIN, T0 + i) for i in range(40)]  # 40 of 100 nodes
    admitted = []
    for i, d in enumerate(storm):
        admitted += sink.submit([d], T0 + i, fleet_nodes=100)
    drains = [d for d in admitted if d.action is Action.DRAIN]
    trips = [d for d in admitted if d.action is Action.ALERT and not d.id.startswith("breaker-refused-")]
    told = [d for d in admitted if d.id.startswith("breaker-refused-")]
    assert len(drains) == 10
    assert len(trips) == 1 and trips[0].detector == "gate" and "circuit breaker" in trips[0].reason
    assert len(told) == 30  # every fault refused (the one that tripped it too) still reaches a person
    assert store.breaker().tripped
    refused = [r for r in store.decisions(limit=100) if not r.admitted]
    assert {r.verdict for r in refused} == {"breaker_tripped", "breaker_open"}
    assert len(refused) == 30
    # A resume still passes (it returns capacity); the breaker stays open until reset by hand.
    later = T0 + 7200
    assert sink.submit([dec("n000", Action.RESUME, later)], later, 100)[0].action is Action.RESUME
    assert [d.action for d in sink.submit([dec("n050", Action.DRAIN, later)], later, 100)] == [Action.ALERT]
    store.close()

    reopened = Store(tmp_path / "d.sqlite3")  # the breaker survives a restart
    sink = Ledger(Gate(GateConfig(dry_run=False, breaker_max_share=0.1)), reopened, {})
    assert reopened.state.breaker.tripped
    assert [d.action for d in sink.submit([dec("n051", Action.DRAIN, later + 1)], later + 1, 100)] == [Action.ALERT]
    assert sink.reset_breaker() is True
    assert [d.node for d in sink.submit([dec("n052", Action.DRAIN, later + 2)], later + 2, 100)] == ["n052"]
    reopened.close()


ACTIONS = [
    Action.DRAIN,
    Action.RESET_GPU,
    Action.REBOOT_NODE,
    Action.INSPECT_HARDWARE,
    Action.RESUME,
    Action.ALERT,
    Action.RESTART_JOB,
]


@settings(max_examples=200, deadline=None)
@given(
    fleet=st.integers(min_value=1, max_value=60),
    share=st.floats(min_value=0.01, max_value=0.5),
    max_nodes=st.one_of(st.none(), st.integers(min_value=1, max_value=10)),
    ops=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=59),  # node
            st.sampled_from([*ACTIONS, "reset_breaker"]),
            st.floats(min_value=0, max_value=900),  # seconds since the previous op
        ),
        max_size=80,
    ),
)
def test_breaker_budget_is_never_exceeded_whatever_the_sequence(fleet, share, max_nodes, ops) -> None:
    cfg = GateConfig(
        dry_run=False,
        breaker_max_share=share,
        breaker_max_nodes=max_nodes,
        breaker_window_seconds=3600,
        cooldown_seconds=60,
        min_removed_seconds=120,
        dedup_seconds=30,
    )
    gate, state = Gate(cfg), GateState()
    budget = cfg.breaker_budget(fleet)
    now = T0
    removals: list[tuple[float, str]] = []
    for i, (node_index, action, dt) in enumerate(ops):
        now += dt
        if action == "reset_breaker":
            state.breaker = BreakerRecord()  # what the store's reset does
            continue
        node = f"n{node_index % fleet}"
        verdict = run(gate, state, dec(node, action, now, id=f"d{i}"), now, fleet)
        if verdict.admitted and verdict.decision.action in REMOVING_ACTIONS:
            removals.append((now, node))
            in_window = {n for ts, n in removals if ts >= now - cfg.breaker_window_seconds}
            assert len(in_window) <= budget
        state.prune(now, cfg)
