"""Shadow rules: a second instance of a detector with another threshold records its findings as
decisions marked shadow, compared with the acting rule's, and never acts (not even by an alert)."""

from __future__ import annotations

import pytest

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import Gate, GateConfig, GateState
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.service import Accepted, AggregatorService
from vigil.aggregator.store import Store
from vigil.contract.validation import ConfigError

T0 = 1_700_000_000.0
# The acting memory detector sends a GPU with 60 retired pages to inspection (its default, NVIDIA's
# Dynamic Page Retirement guide); the shadow rule tries 40.
SHADOW = {"dry_run": False, "gate": {"breaker_startup_grace_seconds": 0},
          "shadow": [{"name": "retired-40", "detector": "memory", "config": {"retired_pages_limit": 40}}]}


def no_scontrol(argv: object, timeout_seconds: float) -> str:
    raise AssertionError(f"nothing may run scontrol here: {argv}")


def test_a_shadow_rule_names_a_detector_and_keys_its_section_takes() -> None:
    with pytest.raises(ConfigError, match="unknown detector 'memroy'"):
        parse_config({"shadow": [{"name": "x", "detector": "memroy"}]})
    with pytest.raises(ConfigError, match="retired_pages_limt"):
        parse_config({"shadow": [{"name": "x", "detector": "memory", "config": {"retired_pages_limt": 40}}]})
    with pytest.raises(ConfigError, match="retired_pages_limit"):
        parse_config({"shadow": [{"name": "x", "detector": "memory", "config": {"retired_pages_limit": 0}}]})
    with pytest.raises(ConfigError, match="defined twice"):
        parse_config({"shadow": [{"name": "x", "detector": "memory"}, {"name": "x", "detector": "xid"}]})
    rule = parse_config(SHADOW).shadow[0]
    section = rule.section(parse_config(SHADOW).detectors.memory)
    assert section.retired_pages_limit == 40  # type: ignore[attr-defined]
    # a rule may shadow a detector the site has not enabled yet
    off = parse_config({"detectors": {"memory": {"enabled": False}}}).detectors.memory
    assert rule.section(off).enabled  # type: ignore[attr-defined]


def test_the_gate_records_a_shadow_decision_and_admits_none_not_even_an_alert() -> None:
    gate, state = Gate(GateConfig()), GateState()
    for action in (Action.DRAIN, Action.ALERT, Action.RESUME):
        d = Decision(id=f"s-{action.value}", ts=T0, node="n1", action=action, reason="r",
                     detector="shadow:retired-40", dry_run=False)
        v = gate.judge(d, T0, 100, state)
        assert not v.admitted and v.reason == "shadow" and v.alerts == ()
        state.apply(v, T0)
    assert state.nodes == {} and state.recent == {}


def test_a_lower_threshold_in_shadow_records_the_lookalike_and_never_acts() -> None:
    clock = [T0]
    config = parse_config(SHADOW)
    ledger = Ledger(Gate(config.gate), Store(":memory:"),
                    actuators={"slurm": SlurmActuator(SlurmConfig(), run=no_scontrol)})
    service = AggregatorService(config, Engine(config, ledger), ledger, clock=lambda: clock[0])
    worn, failing, healthy = (FakeNode(n, gpus=2, ports=1) for n in ("worn", "failing", "healthy"))
    worn.gpus[0]["retired_pages_sbe"] = 50  # the lookalike: under the acting limit, over the shadow's
    failing.gpus[0]["retired_pages_sbe"] = 70
    for _ in range(2):
        for node in (worn, failing, healthy):
            assert isinstance(service.take(node.report(clock[0])), Accepted)
        service.evaluate_now()
        clock[0] += 2.5

    store = ledger.store
    rows = store.decisions(limit=100)
    acting = [r for r in rows if r.decision.detector == "memory"]
    shadow = [r for r in rows if r.decision.detector == "shadow:retired-40"]
    assert [(r.decision.node, r.decision.action, r.admitted) for r in acting] == \
        [("failing", Action.INSPECT_HARDWARE, True)]
    assert sorted((r.decision.node, r.verdict, r.admitted) for r in shadow) == \
        [("failing", "shadow", False), ("worn", "shadow", False)]
    for r in shadow:
        assert r.decision.evidence["shadow"] == {"rule": "retired-40", "detector": "memory",
                                                 "overrides": {"retired_pages_limit": 40}}
        assert store.deliveries(r.decision.id) == []  # never routed to any actuator
    assert store.state.node("worn").condition == "in_service"
    # the shadow's findings are no node's state: the worn node is ok, its standing untouched
    assert [f.node for f in service.engine.last_findings] == ["failing"]
    assert service.state_counts() == {"ok": 2, "failing": 1}

    assert ledger.gate_state(clock[0], 3)["shadow"] == [{
                          "rule": "retired-40", "detector": "memory", "overrides": {"retired_pages_limit": 40},
                          "episodes": 2, "both": 1, "shadow_only_count": 1, "acting_only_count": 0,
                          "shadow_only": ["worn/gpu0"], "acting_only": []}]
    metrics = service.metrics.render().decode()
    # recorded once each, however often judged
    assert ('vigil_aggregator_decisions_total{action="inspect_hardware",detector="shadow:retired-40",'
            'verdict="shadow"} 2.0') in metrics
    assert 'vigil_gate_shadow_subjects{agreement="shadow_only",rule="retired-40"} 1.0' in metrics
    assert 'vigil_gate_decisions_total{group="default",mode="act",verdict="shadow"} 2.0' in metrics
