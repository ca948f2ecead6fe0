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
