"""One fleet, two vendors, end to end (issue 46): 48 H100 and 16 MI300X nodes, each node's agent
over its own vendor's backend and fake library, one aggregator; an AMD uncorrectable ECC error, an
AMD XGMI link down and an NVIDIA Xid 79 get exactly their three decisions and nothing else."""

from __future__ import annotations

from vigil.aggregator.decision import REMOVING_ACTIONS
from vigil.contract.wire import Report
from vigil.sim.run import Simulation
from vigil.sim.scenario import load_scenario
from vigil.sim.score import score

MI300X_NODES = {f"node-{i:04d}" for i in range(48, 64)}


def test_mixed_h100_mi300x_fleet_gets_exactly_the_three_decisions() -> None:
    scenario = load_scenario("mixed-h100-mi300x-64")
    vendors: dict[str, set[tuple[str | None, str | None]]] = {}

    def observe(report: Report, now: float) -> None:
        for g in report.gpus:
            if g.name is not None or g.vendor is not None:
                vendors.setdefault(report.node, set()).add((g.vendor, g.name))

    result = Simulation(scenario, observe=observe).run()
    card = score(result)
    assert card.passed, card
    admitted = sorted((d.node, d.gpu, d.detector) for d in result.decisions
                      if d.admitted and d.action in REMOVING_ACTIONS)
    assert admitted == [("node-0011", 4, "xid"), ("node-0050", 2, "amdgpu"), ("node-0057", 5, "pcie_nvlink")]
    # Every MI300X node's agent read AMD GPUs through amdsmi, every other node NVIDIA's through NVML.
    assert {n for n, seen in vendors.items() if seen == {("amd", "AMD Instinct MI300X")}} == MI300X_NODES
    assert all(seen == {("nvidia", "NVIDIA H100 80GB HBM3")} for n, seen in vendors.items() if n not in MI300X_NODES)
    assert len(vendors) == 64


def test_amd_kernel_faults_and_their_lookalikes_on_the_real_pipeline() -> None:
    # An MI300X fleet: a hung GPU (ring timeout, reset failed), a poison consumption, and the
    # lookalikes that must not act: a soft-recovered timeout, a correctable XGMI count, a user's
    # ring timeout once (the driver reset it and succeeded).
    from vigil.sim.scenario import parse_scenario

    data = {
        "description": "amdgpu kernel faults", "seed": 7, "duration_seconds": 120, "report_interval_seconds": 5,
        "quiet_collector_intervals": {"gpu": 60, "rdma": 60},
        "fleet": {"nodes": 6, "gpus_per_node": 8, "hcas_per_node": 1, "profile": "mi300x-oam-192gb"},
        "jobs": [{"name": "train", "nodes": "all", "ranks_per_node": 8, "step_seconds": 2.0}],
        "faults": [
            {"kind": "kernel_amdgpu", "node": "node-0001", "gpu": 3, "event": "gpu_hang", "at_seconds": 40},
            {"kind": "kernel_amdgpu", "node": "node-0002", "gpu": 1, "event": "poison_consumed", "at_seconds": 40},
            {"kind": "kernel_amdgpu", "node": "node-0003", "gpu": 0, "event": "ring_timeout_recovered",
             "at_seconds": 40, "repeat": 3, "every_seconds": 15},
            {"kind": "kernel_amdgpu", "node": "node-0004", "gpu": 6, "event": "ras_correctable", "block": "xgmi_wafl",
             "count": 1533, "at_seconds": 40},
            {"kind": "kernel_amdgpu", "node": "node-0005", "gpu": 2, "event": "ring_timeout", "at_seconds": 40},
        ],
        "expect": [{"node": "node-0001", "action": "reboot_node", "within_seconds": 10},
                   {"node": "node-0002", "gpu": 1, "action": "reset_gpu", "within_seconds": 10}],
        "max_removals": 2,
    }
    result = Simulation(parse_scenario(data, "amd-kernel.yaml")).run()
    assert score(result).passed
    removed = {d.node for d in result.decisions if d.admitted and d.action in REMOVING_ACTIONS}
    assert removed == {"node-0001", "node-0002"}
    seen = {(d.node, str(d.action)) for d in result.decisions}
    assert ("node-0005", "observe") in seen  # the user's ring timeout: recorded, nobody removed
