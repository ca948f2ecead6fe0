"""The simulator end to end: real collectors, report builder, engine and gate on a simulated clock."""

from __future__ import annotations

import numpy as np
import pytest

from sim.run import run_scenario
from sim.scenario import ScenarioError, load_scenario, parse_scenario, shipped_scenarios, shortened
from sim.score import score, summary
from tests.sim.conftest import horizon, raw, small_slow_node

BIG = {"slow-node-1024", "healthy-1000x24h", "week-in-the-life"}
CI_SCENARIOS = [p for p in shipped_scenarios() if p.stem not in BIG]


def test_same_seed_same_run_other_seed_other_noise(quick_xid) -> None:
    a = run_scenario(quick_xid)
    b = run_scenario(quick_xid)
    c = run_scenario(quick_xid, seed=quick_xid.seed + 1)
    strip = [(d.t, d.node, d.action, d.detector, d.id, d.admitted) for d in a.decisions]
    assert strip == [(d.t, d.node, d.action, d.detector, d.id, d.admitted) for d in b.decisions]
    assert a.reports == b.reports and a.heartbeats == b.heartbeats
    assert np.array_equal(np.vstack(a.jobs[0].node_compute_seconds), np.vstack(b.jobs[0].node_compute_seconds))
    assert not np.array_equal(np.vstack(a.jobs[0].node_compute_seconds),
                              np.vstack(c.jobs[0].node_compute_seconds))


def test_the_real_pipeline_ran(quick_xid) -> None:
    r = run_scenario(quick_xid)
    assert set(r.collectors) >= {"gpu", "xid", "rdma", "training"}
    assert r.reports == quick_xid.fleet.nodes * 24  # 120 s at one report each 5 s
    assert r.heartbeats > 0 and not r.heartbeats_rejected
    xid = [d for d in r.decisions if d.detector == "xid"]
    assert xid and xid[0].node == "node-0005" and xid[0].gpu == 3 and xid[0].t == 90.0


def test_json_round_trip_of_reports_changes_nothing(quick_xid) -> None:
    a = run_scenario(quick_xid)
    b = run_scenario(quick_xid, json_round_trip=True)
    assert [d.id for d in a.decisions] == [d.id for d in b.decisions]


@pytest.mark.parametrize("path", CI_SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenario_passes(path) -> None:
    sc = load_scenario(path)
    result = run_scenario(shortened(sc, horizon(sc)))
    s = score(result)
    report = summary(result, s)
    assert s.passed, {k: report[k] for k in ("expectations", "false_drain_decisions", "breaker")}


def test_slow_node_flagged_in_time_on_a_ci_sized_fleet() -> None:
    s = score(run_scenario(small_slow_node()))
    assert s.passed
    assert s.latencies[0] <= 30


def test_a_broken_detector_fails_the_scenario() -> None:
    # The straggler detector told to want a 1000-sigma outlier: the slow node goes unnoticed.
    sc = small_slow_node(detectors={"straggler": {"z_threshold": 1000}})
    s = score(run_scenario(sc))
    assert not s.passed
    assert s.recall == 0.0 and s.expectations[0].decision is None


def test_a_trigger_happy_detector_fails_with_false_drains() -> None:
    # Any rank 0.1% slower than the median, in one window: healthy noise gets nodes drained.
    data = raw("data-loader-stall")
    data["aggregator"] = {"detectors": {"straggler": {"z_threshold": 0.5, "min_excess_ratio": 0.001,
                                                     "persistence_windows": 1, "max_outlier_node_share": 1.0}}}
    data["gate"] = {"breaker_max_share": 1.0}
    s = score(run_scenario(shortened(parse_scenario(data), 60)))
    assert s.false_drains and not s.passed


def test_aggregator_and_gate_config_errors_name_their_key_path(quick_xid) -> None:
    bad = quick_xid.model_copy(update={"aggregator": {"detectors": {"straggler": {"z_treshold": 3}}}})
    with pytest.raises(ScenarioError, match=r"detectors\.straggler\.z_treshold: unknown key"):
        run_scenario(bad)
    bad = quick_xid.model_copy(update={"gate": {"breaker_max_share": 7}})
    with pytest.raises(ScenarioError, match="breaker_max_share"):
        run_scenario(bad)
    bad = quick_xid.model_copy(update={"agent": {"collectors": {"training": {"window_secs": 3}}}})
    with pytest.raises(ScenarioError, match=r"collectors\.training\.window_secs: unknown key"):
        run_scenario(bad)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BIG))
def test_big_scenario_passes(name: str) -> None:
    path = next((p for p in shipped_scenarios() if p.stem == name), None)
    assert path is not None, f"{name} is not shipped"
    sc = load_scenario(path)
    # The 24-hour fleet runs its first simulated hour here; `make bench` measures the rest.
    s = score(run_scenario(shortened(sc, min(horizon(sc), 3600))))
    assert s.passed
