"""Helpers for the simulator's tests: shipped scenarios trimmed to what a test needs."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from vigil.sim.scenario import SCENARIO_DIR, Scenario, parse_scenario, shortened


def horizon(sc: Scenario) -> float:
    """Enough simulated time to judge every expectation (and a breaker trip) of ``sc``; the whole
    run where something must not happen (``forbid``, ``max_removals``, a breaker that must stay
    closed): a false removal late in the run counts as much as an early one."""
    if sc.forbid or sc.max_removals is not None or sc.expect_breaker == "closed":
        return sc.duration_seconds
    ends = [sc.duration_seconds if not sc.expect and sc.expect_breaker == "any" else 0.0]
    for exp in sc.expect:
        start = sc.subject_fault_time(exp) or 0.0
        ends.append(start + exp.within_seconds + sc.report_interval_seconds)
    if sc.expect_breaker != "any":
        ends.append(max(f.at_seconds for f in sc.faults) + 6 * sc.report_interval_seconds)
    return min(sc.duration_seconds, max(ends))


def next_report(sc: Scenario, node: str, at: float, *, strictly: bool = False) -> float:
    """When ``node``'s agent first reports at or after ``at`` (after it, ``strictly``): each agent
    reports once per interval at its own phase (``report_offsets``); rounded as decision times are."""
    from vigil.sim.run import report_offsets

    dt = sc.report_interval_seconds
    offset = report_offsets(sc, sc.seed)[node]
    k = 1
    while k * dt - offset < at or (strictly and k * dt - offset <= at):
        k += 1
    return round(k * dt - offset, 3)


def raw(name: str) -> dict[str, Any]:
    data = yaml.safe_load((SCENARIO_DIR / f"{name}.yaml").read_text())
    data.setdefault("name", name)
    assert isinstance(data, dict)
    return data


def small_slow_node(**aggregator: Any) -> Scenario:
    """slow-node-1024 on 64 nodes: the same job model, fault and deadline, a CI-sized fleet."""
    data = raw("slow-node-1024")
    data["fleet"]["nodes"] = 64
    data["faults"][0]["node"] = "node-0037"
    data["expect"][0]["node"] = "node-0037"
    data["duration_seconds"] = 155
    if aggregator:
        data["aggregator"] = aggregator
    return parse_scenario(data, "slow-node-64")


@pytest.fixture
def quick_xid() -> Scenario:
    sc = parse_scenario(raw("kernel-xid-79"), "kernel-xid-79")
    return shortened(sc, 120)
