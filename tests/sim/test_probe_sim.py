"""Faults only a probe sees, in whole simulations: invisible to every passive signal (no decision
at all without probing), and run_probes answered by the simulated agents through the real outbox."""

from __future__ import annotations

from typing import Any

from vigil.sim.run import run_scenario
from vigil.sim.scenario import parse_scenario


def quiet(**over: Any) -> dict[str, Any]:
    """4 nodes of 4 GPUs in one job; node-0001 has every fault only a load shows, from 10 s."""
    data: dict[str, Any] = {
        "name": "probe-only-faults",
        "seed": 11,
        "duration_seconds": 120,
        "report_interval_seconds": 5,
        "hardware_disrupts_jobs": True,
        "fleet": {"nodes": 4, "gpus_per_node": 4, "hcas_per_node": 1},
        "jobs": [{"name": "pretrain", "nodes": "all", "ranks_per_node": 4, "step_seconds": 2.0}],
        "faults": [
            {"kind": "under_load", "what": "hbm", "node": "node-0001", "gpu": 1, "at_seconds": 10},
            {"kind": "under_load", "what": "power", "node": "node-0001", "gpu": 2, "at_seconds": 10},
            {"kind": "under_load", "what": "nvlink", "node": "node-0001", "gpu": 3, "at_seconds": 10},
            {"kind": "under_load", "what": "rdma", "node": "node-0001", "at_seconds": 10},
            {"kind": "probe_slow", "node": "node-0001", "factor": 1.04, "at_seconds": 10},
        ],
        "aggregator": {"detectors": {"recovery": {"enabled": True}}},
    }
    data.update(over)
    return data


def test_faults_only_a_probe_sees_change_nothing_in_the_passive_reports() -> None:
    faulty = run_scenario(parse_scenario(quiet()))
    healthy = run_scenario(parse_scenario(quiet(faults=[])))
    # Nothing decided on either: no Xid, no throttle, no port error, no straggler to see.
    assert faulty.decisions == [] == healthy.decisions
    assert faulty.reports == healthy.reports and faulty.probe_runs == [] == healthy.probe_runs
    # The job is not slowed by them either (a probe_slow is the probe's side only).
    assert faulty.jobs[0].step_seconds == healthy.jobs[0].step_seconds
