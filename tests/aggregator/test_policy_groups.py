"""Policy groups: selectors, group resolution, the gate's modes and per-group budgets, and the fleet
end to end: a group in alert mode takes no action while its neighbours' identical faults are acted on."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import OPERATOR, Gate, GateConfig, GateState
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.policy_groups import (
    DEFAULT_GROUP,
    GroupResolver,
    Membership,
    PolicyGroup,
    Selector,
    resolve,
    static_labels,
)
from vigil.aggregator.service import Accepted, AggregatorService
from vigil.aggregator.store import Store
from vigil.contract.validation import ConfigError

T0 = 1_700_000_000.0


SELECT_KEYS = ("nodes", "labels", "reported")


def group(name: str, mode: str = "act", **keys: Any) -> PolicyGroup:
    """A group from selector keys (nodes, labels, reported) and group keys (breaker_*) alike."""
    select = {k: v for k, v in keys.items() if k in SELECT_KEYS}
    rest = {k: v for k, v in keys.items() if k not in SELECT_KEYS}
    return PolicyGroup.model_validate({"name": name, "mode": mode, "select": select,
                                       "trust_reported_labels": bool(select.get("reported")), **rest})


# -- selectors and resolution ------------------------------------------------------------------------


def test_a_selector_needs_every_condition_it_names() -> None:
    sel = Selector(nodes=["gpu-a*"], labels={"partition": "h200"}, reported={"rack": "r1*"})
    assert sel.matches("gpu-a1", {"partition": "h200"}, {"rack": "r12"})
    assert not sel.matches("gpu-b1", {"partition": "h200"}, {"rack": "r12"})  # name
    assert not sel.matches("gpu-a1", {"partition": "h100"}, {"rack": "r12"})  # static label
    assert not sel.matches("gpu-a1", {}, {"rack": "r12"})  # static label missing
    assert not sel.matches("gpu-a1", {"partition": "h200"}, {"rack": "r2"})  # reported label
    assert not sel.matches("gpu-a1", {"partition": "h200"}, {})


def test_an_empty_selector_is_refused() -> None:
    with pytest.raises(ValidationError, match="needs nodes, labels or reported"):
        Selector()


def test_a_group_selecting_by_sender_labels_needs_the_operators_consent() -> None:
    with pytest.raises(ValidationError, match="reports assert"):
        PolicyGroup.model_validate({"name": "h200", "mode": "alert", "select": {"reported": {"gpu_model": "*H200*"}}})
    # ... even beside a trusted condition: within the glob, the node still chooses
    with pytest.raises(ValidationError, match="trust_reported_labels"):
        PolicyGroup.model_validate({"name": "h200", "mode": "alert",
                                    "select": {"nodes": ["gpu-*"], "reported": {"rack": "r1"}}})
    ok = PolicyGroup.model_validate({"name": "h200", "mode": "alert", "select": {"reported": {"gpu_model": "*H200*"}},
                                     "trust_reported_labels": True})
    assert ok.select.reported == {"gpu_model": "*H200*"}


def test_group_names_are_bounded_unique_and_not_the_default() -> None:
    with pytest.raises(ValidationError, match="nodes in no group"):
        group(DEFAULT_GROUP, nodes=["*"])
    with pytest.raises(ValidationError, match="pattern"):
        group("Canary Nodes", nodes=["*"])
    with pytest.raises(ConfigError, match="defined twice"):
        parse_config({"gate": {"groups": [{"name": "a", "select": {"nodes": ["x*"]}},
                                          {"name": "a", "select": {"nodes": ["y*"]}}]}})
    with pytest.raises(ConfigError, match="groups"):
        parse_config({"gate": {"groups": [{"name": f"g{i}", "select": {"nodes": ["*"]}} for i in range(33)]}})


def test_the_first_matching_group_wins_in_config_order() -> None:
    groups = [group("canary", nodes=["gpu-a1"]), group("rack-a", "alert", nodes=["gpu-a*"]),
              group("everything", "dry_run", nodes=["*"])]
    assert resolve(groups, "gpu-a1", {}, {}) is groups[0]
    assert resolve(groups, "gpu-a2", {}, {}) is groups[1]
    assert resolve(groups, "gpu-b1", {}, {}) is groups[2]
    assert resolve(groups[:2], "gpu-b1", {}, {}) is None


def test_static_labels_come_from_the_aggregators_map_first_value_wins() -> None:
    node_labels = {"partition": {"h200": ["h200-*"], "h100": ["h100-*", "h200-9*"]}, "site": {"east": ["*"]}}
    assert static_labels("h200-91", node_labels) == {"partition": "h200", "site": "east"}
    assert static_labels("h100-1", node_labels) == {"partition": "h100", "site": "east"}


def test_the_resolver_counts_recent_members_and_follows_relabelled_and_departed_nodes() -> None:
    resolver = GroupResolver([group("r1", "alert", reported={"rack": "r1"})], {})
    m = resolver.membership([("a", {"rack": "r1"}, True), ("b", {"rack": "r1"}, False), ("c", {"rack": "r2"}, True)])
    assert m.group_of == {"a": "r1", "b": "r1", "c": ""}
    assert m.members == {"r1": 1, DEFAULT_GROUP: 1}  # b reported before the window: known, not counted
    m = resolver.membership([("a", {"rack": "r2"}, True)])  # a moved racks; b and c are gone
    assert m.group_of == {"a": ""} and m.members == {"r1": 0, DEFAULT_GROUP: 1}


# -- the gate, per mode ------------------------------------------------------------------------------


def proposal(node: str | None, action: Action = Action.DRAIN, id: str | None = None, detector: str = "memory",
             job: str | None = None) -> Decision:
    return Decision(id=id or f"d-{node}-{action.value}", ts=T0, node=node, job=job, action=action,
                    reason="GPU 0: 2 uncorrectable ECC errors", detector=detector, gpu=0 if node else None,
                    dry_run=False, since=T0)


GROUPS = GateConfig(breaker_floor_nodes=3, breaker_startup_grace_seconds=0, groups=[
    group("canary", nodes=["a*"], breaker_max_nodes=1),
    group("watch", "alert", nodes=["b*"]),
    group("trial", "dry_run", nodes=["c*"]),
])
MEMBERS = Membership({"a1": "canary", "a2": "canary", "b1": "watch", "b2": "watch", "c1": "trial", "d1": ""},
                     {"canary": 2, "watch": 2, "trial": 1, DEFAULT_GROUP: 1})


def judge(gate: Gate, state: GateState, d: Decision, membership: Membership | None = MEMBERS, now: float = T0):
    verdict = gate.judge(d, now, 100, state, membership)
    state.apply(verdict, now)
    return verdict


def test_an_act_group_drains_and_its_evidence_names_the_group() -> None:
    gate, state = Gate(GROUPS), GateState()
    v = judge(gate, state, proposal("a1"))
    assert v.admitted and v.decision.action is Action.DRAIN and not v.decision.dry_run
    assert v.decision.evidence["policy"] == {"group": "canary", "mode": "act"}
    assert (v.group, v.mode) == ("canary", "act")
    assert state.node("a1").condition == "removed"


def test_an_alert_group_gets_an_alert_and_nothing_changes() -> None:
    gate, state = Gate(GROUPS), GateState()
    v = judge(gate, state, proposal("b1"))
    assert v.admitted and v.reason == "group_alert" and v.mode == "alert"
    d = v.decision
    assert d.action is Action.ALERT and d.id == "d-b1-drain" and not d.dry_run
    assert d.evidence["would_action"] == "drain" and d.evidence["policy"] == {"group": "watch", "mode": "alert"}
    assert "group watch in alert mode" in d.reason
    assert state.node("b1").condition == "in_service" and state.removals == [] and state.history == {}
    # an actuator that drains takes no alert
    assert not SlurmActuator(SlurmConfig(), run=refuse_to_run).handles(d)


def refuse_to_run(argv: Any, timeout_seconds: float) -> str:
    raise AssertionError(f"nothing may run scontrol here: {argv}")


def test_a_dry_run_group_records_the_action_as_dry_and_nothing_changes() -> None:
    gate, state = Gate(GROUPS), GateState()
    v = judge(gate, state, proposal("c1", Action.RESET_GPU))
    assert v.admitted and v.reason == "group_dry_run" and v.decision.action is Action.RESET_GPU
    assert v.decision.dry_run and v.decision.evidence["would_action"] == "reset_gpu"
    assert state.node("c1").condition == "in_service" and state.node("c1").remediations == []


def test_groups_that_do_not_act_spend_no_budget_and_trip_no_breaker() -> None:
    gate, state = Gate(GROUPS.model_copy(update={"breaker_floor_nodes": 1, "breaker_max_share": 0.01})), GateState()
    for i in range(5):
        assert judge(gate, state, proposal(f"b{i}", id=f"b{i}"), Membership({f"b{i}": "watch"})).reason == "group_alert"
        assert judge(gate, state, proposal(f"c{i}", id=f"c{i}"), Membership({f"c{i}": "trial"})).reason == \
            "group_dry_run"
    assert not state.breaker.tripped and state.removals == []
    assert judge(gate, state, proposal("d1")).admitted  # the one removal the budget allows


def test_an_operators_resume_is_never_relaxed_and_an_automatic_one_is() -> None:
    gate, state = Gate(GROUPS), GateState()
    state.nodes["b1"] = state.node("b1")
    state.nodes["b1"].condition, state.nodes["b1"].last_removal, state.nodes["b1"].last_removal_ts = \
        "removed", Action.DRAIN, T0 - 7200
    auto = judge(gate, state, proposal("b1", Action.RESUME, detector="recovery"))
    assert auto.reason == "group_alert" and state.node("b1").condition == "removed"
    by_hand = judge(gate, state, proposal("b1", Action.RESUME, id="r2", detector=OPERATOR))
    assert by_hand.admitted and by_hand.decision.action is Action.RESUME and state.node("b1").condition == "in_service"


def test_a_job_level_decision_takes_the_default_mode() -> None:
    gate, state = Gate(GateConfig(default_mode="alert")), GateState()
    v = judge(gate, state, proposal(None, Action.RESTART_JOB, job="4242"))
    assert v.reason == "group_alert" and v.decision.action is Action.ALERT and v.decision.job == "4242"
    assert state.restarts == []


def test_a_node_the_fleet_does_not_know_resolves_by_name_and_static_labels() -> None:
    cfg = GateConfig(node_labels={"partition": {"h200": ["h200-*"]}},
                     groups=[group("h200", "alert", labels={"partition": "h200"})])
    gate = Gate(cfg)
    # Alertmanager proposes for a node that has not reported yet: no sender labels, the map still applies
    assert judge(gate, GateState(), proposal("h200-7", detector="alertmanager"), Membership()).reason == "group_alert"
    assert judge(gate, GateState(), proposal("h100-7", detector="alertmanager"), Membership()).admitted


def test_without_groups_the_gate_and_its_evidence_are_as_before() -> None:
    v = judge(Gate(GateConfig()), GateState(), proposal("a1"))
    assert v.admitted and "policy" not in v.decision.evidence and (v.group, v.mode) == (DEFAULT_GROUP, "act")


# -- per-group breaker ----------------------------------------------------------------------------


def test_a_groups_budget_stops_its_nodes_only_and_alerts_each_refused_fault_once() -> None:
    gate, state = Gate(GROUPS), GateState()
    assert judge(gate, state, proposal("a1")).admitted
    v = judge(gate, state, proposal("a2"))
    assert not v.admitted and v.reason == "group_budget" and "group budget 1" in v.detail
    (alert,) = v.alerts
    assert alert.action is Action.ALERT and alert.evidence["group"] == "canary"
    assert alert.evidence["removed_nodes"] == ["a1"]
    again = gate.judge(proposal("a2"), T0 + 60, 100, state, MEMBERS)
    assert again.reason == "group_budget" and again.alerts[0].id == alert.id  # one alert, however often proposed
    assert not state.breaker.tripped
    assert judge(gate, state, proposal("d1")).admitted  # another group's node: the global budget has room
    # the window frees the group's slot
    later = T0 + GROUPS.breaker_window_seconds + 1
    state.prune(later, GROUPS)
    assert gate.judge(proposal("a2"), later, 100, state, MEMBERS).admitted


def test_a_group_share_budget_counts_its_reporting_members() -> None:
    g = group("big", nodes=["*"], breaker_max_share=0.1)
    assert g.budget(50) == 5 and g.budget(5) == 1  # the floor lets a small group act at all
    assert group("capped", nodes=["*"], breaker_max_share=0.5, breaker_max_nodes=2).budget(100) == 2
    assert group("none", nodes=["*"]).budget(100) is None


# -- the fleet, end to end --------------------------------------------------------------------------


class Notifier:
    """A notifier as the store routes it (Alertmanager's shape: every action but observe, in dry run too)."""

    name = "alertmanager"
    notify_in_dry_run = True
    timeout_seconds = 1.0

    def handles(self, decision: Decision) -> bool:
        return decision.action is not Action.OBSERVE

    def deliver(self, decision: Decision) -> str:
        raise AssertionError("routing only")

    def check(self) -> str:
        return "reachable"

    def close(self) -> None:
        pass


CONFIG = {
    "dry_run": False,
    "detectors": {"topology": {"enabled": False}},
    "gate": {
        "breaker_startup_grace_seconds": 0,
        "node_labels": {"partition": {"batch-b": ["gpu-b*"]}},
        "groups": [
            {"name": "canary", "select": {"nodes": ["gpu-a*"]}, "mode": "act", "breaker_max_nodes": 2},
            {"name": "watch", "select": {"labels": {"partition": "batch-b"}}, "mode": "alert"},
            {"name": "trial", "select": {"nodes": ["gpu-c*"]}, "mode": "dry_run"},
            {"name": "h200", "select": {"reported": {"gpu_model": "*H200*"}}, "mode": "alert",
             "trust_reported_labels": True},
        ],
    },
}


def fleet_service(clock: list[float]) -> AggregatorService:
    config = parse_config(CONFIG)
    ledger = Ledger(Gate(config.gate), Store(":memory:"),
                    actuators={"slurm": SlurmActuator(SlurmConfig(), run=refuse_to_run), "alertmanager": Notifier()})
    return AggregatorService(config, Engine(config, ledger), ledger, clock=lambda: clock[0])


def test_an_alert_group_takes_no_action_while_its_neighbours_identical_faults_are_acted_on() -> None:
    clock = [T0]
    service = fleet_service(clock)
    nodes = [FakeNode(n, gpus=2, ports=1, topology={"rack": "r1"})
             for n in ("gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2", "gpu-c1", "gpu-d1", "gpu-e1")]
    nodes[5].config = {"gpu_model": "NVIDIA H200"}  # its own report puts it in group h200
    for node in nodes:
        assert isinstance(service.take(node.report(clock[0])), Accepted)
    assert service.evaluate_now() == []
    # The same fault at the same moment on one node of each group (and one in no group).
    faulty = {"gpu-a1", "gpu-b1", "gpu-c1", "gpu-d1", "gpu-e1"}
    clock[0] += 2.5
    for node in nodes:
        if node.name in faulty:
            node.gpus[0]["ecc_uncorrected_volatile"] = 2
        assert isinstance(service.take(node.report(clock[0])), Accepted)
    service.evaluate_now()

    store = service.ledger.store
    by_node = {r.decision.node: r for r in store.decisions(limit=100) if r.decision.detector == "memory"}
    assert set(by_node) == faulty  # the healthy neighbours: nothing

    def routed(node: str) -> dict[str, str]:
        return {x.actuator: x.state for x in store.deliveries(by_node[node].decision.id)}

    # act: drained, queued for Slurm
    a1 = by_node["gpu-a1"].decision
    assert a1.action is Action.DRAIN and a1.evidence["policy"] == {"group": "canary", "mode": "act"}
    assert routed("gpu-a1") == {"slurm": "pending", "alertmanager": "pending"}
    assert store.state.node("gpu-a1").condition == "removed"
    # no group: the gate's default, act
    assert by_node["gpu-e1"].decision.action is Action.DRAIN and routed("gpu-e1")["slurm"] == "pending"
    # alert (selected by the aggregator's own label map, and by the node's GPU model): an alert, nothing for Slurm
    for name, grp in (("gpu-b1", "watch"), ("gpu-d1", "h200")):
        d = by_node[name].decision
        assert d.action is Action.ALERT and d.evidence["would_action"] == "drain"
        assert d.evidence["policy"] == {"group": grp, "mode": "alert"}
        assert routed(name) == {"alertmanager": "pending"}
        assert store.state.node(name).condition == "in_service"
    # dry_run: the drain recorded, Slurm's delivery never made
    c1 = by_node["gpu-c1"].decision
    assert c1.action is Action.DRAIN and c1.dry_run
    assert routed("gpu-c1")["slurm"] == "dry_run" and store.state.node("gpu-c1").condition == "in_service"
    assert store.state.removed_nodes_since(T0) == {"gpu-a1", "gpu-e1"}

    gate = service.ledger.gate_state(clock[0], service.reporting())
    groups = {g["name"]: g for g in gate["policy"]["groups"]}  # type: ignore[index]
    assert {n: (g["mode"], g["members"]) for n, g in groups.items()} == {
        "canary": ("act", 2), "watch": ("alert", 2), "trial": ("dry_run", 1), "h200": ("alert", 1),
        DEFAULT_GROUP: ("act", 1)}
    assert groups["canary"]["breaker"] == {"budget": 2, "removed_nodes": ["gpu-a1"], "removals_in_window": 1,
                                           "exhausted": False}
    metrics = service.metrics.render().decode()
    assert 'vigil_gate_group_nodes{group="watch",mode="alert"} 2.0' in metrics
    assert 'vigil_gate_decisions_total{group="watch",mode="alert",verdict="group_alert"} 1.0' in metrics
    assert 'vigil_gate_decisions_total{group="trial",mode="dry_run",verdict="group_dry_run"} 1.0' in metrics
    assert 'vigil_gate_decisions_total{group="canary",mode="act",verdict="admitted"} 1.0' in metrics
    assert 'vigil_gate_group_budget_nodes{group="canary"} 2.0' in metrics

    # Judged again while the fault persists: nothing new is recorded or routed.
    clock[0] += 2.5
    for node in nodes:
        service.take(node.report(clock[0]))
    service.evaluate_now()
    assert routed("gpu-b1") == {"alertmanager": "pending"}
    assert 'verdict="group_alert"} 1.0' in service.metrics.render().decode()
