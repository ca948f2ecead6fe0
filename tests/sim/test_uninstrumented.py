"""Uninstrumented jobs in the simulator: no heartbeats; the job's processes, GPUs and RDMA counters
say what it does, through the real agent's attribution and collectors and the real aggregator."""

from __future__ import annotations

from typing import Any

import pytest

from vigil.aggregator.detectors.telemetry_hang import TelemetryHangConfig
from vigil.aggregator.job_telemetry import job_nodes
from vigil.sim.run import Simulation, run_scenario
from vigil.sim.scenario import ScenarioError, parse_scenario
from vigil.sim.uninstrumented import slurm_cgroup


def _scenario(**over: Any) -> Any:
    data: dict[str, Any] = {
        "name": "quiet", "seed": 3, "duration_seconds": 200, "report_interval_seconds": 10,
        "fleet": {"nodes": 4, "gpus_per_node": 8, "hcas_per_node": 2},
        "jobs": [{"name": "7001", "heartbeats": False, "step_seconds": 1.0, "rdma_bytes_per_step": 4e9,
                  "pauses": [{"kind": "checkpoint", "first_at_seconds": 60, "every_seconds": 1000, "seconds": 60},
                             {"kind": "checkpoint", "first_at_seconds": 140, "every_seconds": 1000, "seconds": 40,
                              "rdma_bytes_per_second": 1e9}]}],
    }
    data.update(over)
    return parse_scenario(data)


class _Probe:
    """Records, after each simulated interval, what the aggregator's fleet view holds."""

    def __init__(self) -> None:
        self.sim: Simulation | None = None
        self.seen: dict[float, dict[str, Any]] = {}

    def __call__(self, t: float, total: float, decisions: int) -> None:
        assert self.sim is not None
        view = self.sim.engine.view()
        per_node: dict[str, Any] = {}
        for name, node in view.nodes.items():
            utilization = [g.last.utilization_gpu_ratio for g in node.gpus.values()]
            data = sum(p.last.counters.get("port_xmit_data", 0) + p.last.counters.get("port_rcv_data", 0)
                       for p in node.ports.values())
            per_node[name] = {"utilization": utilization, "rdma_bytes": data,
                              "jobs": {g.last.job for g in node.gpus.values()}}
        self.seen[t] = {"nodes": per_node, "job_nodes": {j: sorted(n) for j, n in job_nodes(view).items()},
                        "instrumented": sorted(view.jobs)}


def _run(sc: Any) -> tuple[Any, _Probe]:
    probe = _Probe()
    sim = Simulation(sc, progress=probe)
    probe.sim = sim
    return sim.run(), probe


def test_gpus_carry_the_schedulers_job_key_and_no_heartbeat_is_sent() -> None:
    result, probe = _run(_scenario())
    assert result.heartbeats == 0 and not result.decisions
    at = probe.seen[50.0]
    # The real attribution read each pid's cgroup: the key is the Slurm job id, on every GPU.
    assert at["job_nodes"] == {"7001": ["node-0000", "node-0001", "node-0002", "node-0003"]}
    assert all(n["jobs"] == {"7001"} for n in at["nodes"].values())
    assert at["instrumented"] == []  # no rank ever reported: nothing for the heartbeat detectors


def test_steps_drive_utilization_and_rdma_pauses_quiet_them() -> None:
    _, probe = _run(_scenario())
    node = "node-0001"
    busy = probe.seen[50.0]["nodes"][node]
    # 1 - data share (0.05) of each step, the load's +-0.05 noise around it.
    assert min(busy["utilization"]) >= 0.85
    # Steps move 4 GB each way per node per step (two HCAs, counters in bytes as the agent reports them).
    moved = probe.seen[50.0]["nodes"][node]["rdma_bytes"] - probe.seen[40.0]["nodes"][node]["rdma_bytes"]
    assert 60e9 <= moved <= 100e9  # ~10 steps x 8 GB (xmit + rcv)
    # The quiet checkpoint (60..120 s): GPUs idle, the fabric flat.
    quiet = probe.seen[110.0]["nodes"][node]
    assert max(quiet["utilization"]) == 0.0
    assert quiet["rdma_bytes"] == probe.seen[80.0]["nodes"][node]["rdma_bytes"]
    # The checkpoint written over the fabric (140..180 s): GPUs idle, 1 GB/s sent.
    storage = probe.seen[170.0]["nodes"][node]
    assert max(storage["utilization"]) == 0.0
    assert 15e9 <= storage["rdma_bytes"] - probe.seen[150.0]["nodes"][node]["rdma_bytes"] <= 25e9


def test_hang_spins_every_gpu_and_flattens_the_fabric_then_telemetry_hang_acts() -> None:
    sc = _scenario(duration_seconds=460, jobs=[{"name": "7001", "heartbeats": False, "step_seconds": 1.0}],
                   faults=[{"kind": "uninstrumented_hang", "job": "7001", "at_seconds": 60}])
    result, probe = _run(sc)
    node = "node-0002"
    assert min(probe.seen[100.0]["nodes"][node]["utilization"]) == 1.0  # the polling kernel
    assert probe.seen[200.0]["nodes"][node]["rdma_bytes"] == probe.seen[80.0]["nodes"][node]["rdma_bytes"]
    got = [(d.action, d.detector, d.job, d.node) for d in result.decisions]
    assert got == [("alert", "telemetry_hang", "7001", None), ("restart_job", "telemetry_hang", "7001", None)]
    alert, restart = result.decisions
    window = TelemetryHangConfig().alert_seconds
    assert 60 + window <= alert.t <= 60 + window + 30 + 10 and 60 + 300 <= restart.t <= 60 + 300 + 30 + 10
    assert alert.evidence["signal"] == "telemetry_hang" and alert.evidence["nodes"] == 4


def test_a_hang_that_ends_before_the_alert_decides_nothing() -> None:
    """The lookalike: every rank waits in a collective for 10 s (a fabric hiccup), then the job
    steps again: under the 20 s alert window even as the telemetry sees it, up to 30 s late."""
    sc = _scenario(duration_seconds=300, jobs=[{"name": "7001", "heartbeats": False, "step_seconds": 1.0}],
                   faults=[{"kind": "uninstrumented_hang", "job": "7001", "at_seconds": 60, "until_seconds": 70}])
    assert not run_scenario(sc).decisions


def test_host_starved_node_reads_low_and_its_peers_busy() -> None:
    sc = _scenario(duration_seconds=150, jobs=[{"name": "7001", "heartbeats": False, "step_seconds": 1.0}],
                   faults=[{"kind": "uninstrumented_straggler", "job": "7001", "node": "node-0003",
                            "at_seconds": 20, "extra_seconds": 0.75}])
    result, probe = _run(sc)
    seen = probe.seen[140.0]["nodes"]
    slow = sorted(seen["node-0003"]["utilization"])[4]
    peers = [sorted(seen[n]["utilization"])[4] for n in ("node-0000", "node-0001", "node-0002")]
    # 1 - (0.05 + 0.75) / 1.75 = 0.54 on the starved node; the peers wait: 1 - 0.05 / 1.75 = 0.97.
    assert 0.45 <= slow <= 0.62 and min(peers) >= 0.9
    assert result.jobs[0].step_seconds[-1] > 1.6  # the whole job runs at the starved node's pace
    assert not result.decisions  # 600 s of persistence not reached


def test_slurm_cgroup_is_what_the_agent_parses() -> None:
    from vigil.agent.attribution import job_key, parse_cgroup

    assert job_key(parse_cgroup(slurm_cgroup("7001", 3))) == "7001"


@pytest.mark.parametrize(("over", "message"), [
    ({"jobs": [{"name": "pretrain", "heartbeats": False, "step_seconds": 1.0}]}, "Slurm job id"),
    ({"jobs": [{"name": "7001", "step_seconds": 1.0}],
      "faults": [{"kind": "uninstrumented_hang", "job": "7001", "at_seconds": 10}]}, "sends heartbeats"),
    ({"faults": [{"kind": "uninstrumented_hang", "job": "7001", "node": "node-0001", "at_seconds": 10}]},
     "whole job"),
    ({"jobs": [{"name": "7001", "heartbeats": False, "step_seconds": 1.0, "nodes": "node-0000..node-0002"}],
      "faults": [{"kind": "uninstrumented_straggler", "job": "7001", "node": "node-0003", "at_seconds": 10,
                  "extra_seconds": 0.5}]}, "node of job"),
])
def test_scenario_validation(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        _scenario(**over)
