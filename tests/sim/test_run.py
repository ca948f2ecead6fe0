"""The simulator end to end: real collectors, report builder, engine and gate on a simulated clock."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sim.conftest import horizon, next_report, raw, small_slow_node
from vigil.sim.run import run_scenario
from vigil.sim.scenario import ScenarioError, load_scenario, parse_scenario, shipped_scenarios, shortened
from vigil.sim.score import score, summary

# Too long for `make test` (a thousand nodes, hours, or tens of simulated minutes at 2.5 s):
# `make test-all` runs them whole.
BIG = {"slow-node-1024", "slow-gpu-1024", "healthy-1000x24h", "week-in-the-life", "healthy-2s5-100-node-days",
       "intermittent-straggler", "port-flap-slow", "ecc-repeat", "mixed-h100-h200", "healthy-1000x1h-10s",
       "healthy-1000x1h-2s5", "healthy-2s5-1000-node-days"}
# Of those, the ones run here only in part (simulated seconds); the whole 1,000 node-days run as
# shards in test_healthy_fleet_statistics.py, the 1,000-node hours are make bench's (bench_sim).
BIG_LIMIT_SECONDS = {"healthy-1000x24h": 3600.0, "healthy-1000x1h-10s": 600.0, "healthy-1000x1h-2s5": 300.0,
                     "healthy-2s5-1000-node-days": 300.0}
# Shipped scenarios the scorer fails with the current detectors and gate, each with the reason
# (strict xfail: the day one passes, its line here must go). Empty: every shipped scenario passes.
KNOWN_FAILING: dict[str, str] = {}


def _known(paths: list) -> list:
    return [pytest.param(p, marks=pytest.mark.xfail(reason=KNOWN_FAILING[p.stem], strict=True))
            if p.stem in KNOWN_FAILING else p for p in paths]


CI_SCENARIOS = _known([p for p in shipped_scenarios() if p.stem not in BIG])


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
    # The Xid is logged at 90 s; node-0005's agent reads it at its own first report after that
    # (every 5 s, at its phase), and the urgent report wakes the aggregator at once.
    assert xid and xid[0].node == "node-0005" and xid[0].gpu == 3
    assert xid[0].t == next_report(quick_xid, "node-0005", 90) > 90


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
    assert s.passed, {k: report[k] for k in ("expectations", "false_drain_decisions", "forbid_violations",
                                             "removals", "breaker")}


def test_slow_node_flagged_in_time_on_a_ci_sized_fleet() -> None:
    result = run_scenario(small_slow_node())
    s = score(result)
    report = summary(result, s)
    assert s.passed, {k: report[k] for k in ("expectations", "false_drain_decisions")}
    assert s.latencies[0] <= 30


def test_the_power_cap_lookalike_fails_a_detector_that_takes_the_cap_for_heat() -> None:
    # Counting sw_power_cap among the thermal detector's reasons: every GPU of the job "throttled",
    # which pages (the detector's job-wide guard keeps it from draining); the scenario forbids it.
    sc = shortened(load_scenario("power-cap-lookalike"), 135)
    bad = sc.model_copy(update={"aggregator": {"detectors": {"thermal": {"reasons": ["sw_power_cap", "hw_slowdown"]}}}})
    s = score(run_scenario(bad))
    assert not s.passed and s.violations
    # The thermal findings themselves, or the component the topology pass made of them.
    assert {v.decision.detector for v in s.violations} <= {"thermal", "topology"}
    assert all(v.decision.detector == "thermal" or "thermal" in v.decision.evidence.get("classes", ())
               for v in s.violations)


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
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_FAILING[n], strict=True))
                                  if n in KNOWN_FAILING else n for n in sorted(BIG)])
def test_big_scenario_passes(name: str) -> None:
    path = next((p for p in shipped_scenarios() if p.stem == name), None)
    assert path is not None, f"{name} is not shipped"
    sc = load_scenario(path)
    # The 24-hour fleet at 60 s reports runs its first simulated hour here (the 2.5 s healthy
    # fleet of 100 node-days runs whole).
    limit = BIG_LIMIT_SECONDS.get(name, sc.duration_seconds)
    result = run_scenario(shortened(sc, min(horizon(sc), limit)))
    s = score(result)
    report = summary(result, s)
    assert s.passed, {k: report[k] for k in ("expectations", "false_drain_decisions", "forbid_violations",
                                             "removals", "breaker")}


def test_statistics_runs_leave_out_only_the_agents_metrics() -> None:
    """A healthy-fleet statistics run (no fault, nothing expected) builds no training /metrics
    samples (``agent_metrics: auto``); every report, heartbeat and decision is what the full
    agent gives (``on``), which a scenario with a fault keeps by default."""
    from vigil.contract.wire import encode
    from vigil.sim.run import Simulation, agent_metrics

    sc = shortened(load_scenario("healthy-2s5-fleet"), 150)
    assert not agent_metrics(sc) and agent_metrics(sc.model_copy(update={"agent_metrics": "on"}))
    assert agent_metrics(load_scenario("kernel-xid-79"))
    runs = {}
    for mode in ("auto", "on"):
        sent: list[tuple[bytes, float]] = []
        sim = Simulation(sc.model_copy(update={"agent_metrics": mode}),
                         observe=lambda report, t, sent=sent: sent.append((encode(report), t)))
        result = sim.run()
        training = [n.snapshot.results()["training"].collection for n in sim.nodes.values()]
        runs[mode] = (sent, [(d.t, d.node, d.action, d.detector) for d in result.decisions], result.heartbeats,
                      sum(len(c.samples) for c in training), sum(len(c.report["ranks"]) for c in training))
    lean, full = runs["auto"], runs["on"]
    assert lean[:3] == full[:3] and len(full[0]) == 24 * 60
    assert lean[3] == 0 < full[3] and lean[4] == full[4] == 24 * 8
