"""The fleet keeps what it holds most of (a sample per report of every GPU and port, the latest
states) out of the cyclic garbage collector's walks: a collection stops intake and judging for
as long as it walks, and its length grows with the objects tracked. Counted on a fleet with full
sample rings, and per object for the samples and the states."""

from __future__ import annotations

import gc

from tests.aggregator.conftest import FakeNode, set_training
from vigil.aggregator.fleet import Fleet, FleetConfig

NODES = 10
# More reports than the sample rings hold (FleetConfig.state_history_reports, 32): rings full.
ROUNDS = 40
# Samples alone are 32 per GPU and per port: 512 for a node of 8 GPUs and 8 ports, each of them
# tracked when samples were NamedTuples (~620 tracked objects per node in all). What stays tracked
# is the per-GPU/port/rank bookkeeping (histories, their rings and counter baselines, the lists of
# the latest states): ~110 per node.
MAX_TRACKED_PER_NODE = 200


def test_a_fleet_with_full_rings_keeps_few_objects_tracked_by_the_collector() -> None:
    nodes = [FakeNode(f"n{i}") for i in range(NODES)]
    reports = []
    for k in range(ROUNDS):
        set_training(nodes, "job-a", k * 2.5, step=10 * k)
        for node in nodes:
            for gpu in node.gpus.values():
                gpu["utilization_gpu_ratio"] = 0.9 + (k % 5) / 100
                gpu["ecc_corrected_volatile"] += k % 3 == 0
            for port in node.ports.values():
                port["counters"]["symbol_error"] += k % 4 == 0
            reports.append(node.report(k * 2.5))
    config = FleetConfig()
    assert config.state_history_reports < ROUNDS
    gc.collect()
    before = len(gc.get_objects())
    fleet = Fleet(config)
    for report in reports:
        fleet.ingest(report, report.ts)
    gc.collect()
    tracked_per_node = (len(gc.get_objects()) - before) / NODES
    assert tracked_per_node <= MAX_TRACKED_PER_NODE, tracked_per_node

    state = fleet.view().nodes["n0"]
    for gpu_history in state.gpus.values():
        assert len(gpu_history.samples) == config.state_history_reports
        assert not any(gc.is_tracked(s) for s in gpu_history.samples)
        assert not gc.is_tracked(gpu_history.last)
        # Its sequences are tuples (wire.GpuState): the empty one is a shared constant and a full
        # one of names or indices is untracked at the first collection; a list stays tracked.
        assert gpu_history.last.clock_event_reasons == ("sw_power_cap",)
        assert not any(gc.is_tracked(v) for v in (gpu_history.last.clock_event_reasons,
                                                  gpu_history.last.nvlink_links_down,
                                                  gpu_history.last.processes))
    for port_history in state.ports.values():
        assert len(port_history.samples) == config.state_history_reports
        assert not any(gc.is_tracked(s) for s in port_history.samples)
        assert not gc.is_tracked(port_history.last)
    assert state.ranks and not any(gc.is_tracked(r.last) for r in state.ranks.values())
