"""What the simulator's shortcuts leave the same: the PCIe and configuration collectors, read once
on a node that shares the read-only sysfs tree and has no NVML fault, read the same later (so
every report carries what a read at the configured cadence would give); a node with an NVML
fault still reads them at their cadence; the heartbeats' one-format bytes are the f-string's; the
rdma collectors sharing the read-only tree's descriptors report what reads by path report."""

from __future__ import annotations

import math
import random

from vigil.agent.daemon import build_collectors
from vigil.agent.runner import collect_once
from vigil.contract.wire import Report, encode
from vigil.sim.run import _HEARTBEAT, Simulation
from vigil.sim.scenario import parse_scenario

READ_ONCE = ("pcie", "node_config")


def test_read_once_collectors_read_the_same_later() -> None:
    sc = parse_scenario({
        "name": "read-once", "duration_seconds": 330, "report_interval_seconds": 10,
        "fleet": {"nodes": 3, "gpus_per_node": 2, "hcas_per_node": 2},
        "jobs": [{"name": "j", "nodes": "node-0000..node-0002", "step_seconds": 2.0}],
        "faults": [{"kind": "thermal_throttle", "node": "node-0002", "at_seconds": 100, "gpu": 0,
                    "duration_seconds": 60, "clock_ratio": 0.5}]})
    compared: list[str] = []
    sim: Simulation

    def observe(report: Report, now: float) -> None:
        node = sim.nodes[report.node]
        due = node._next_due
        if report.node != "node-0002":
            assert all(due.get(name) == math.inf for name in READ_ONCE)  # read once, at the first cycle
        else:
            assert all(due.get(name, 0.0) < math.inf for name in READ_ONCE)  # an NVML fault: at its cadence
        if now - sim.clock.start < 300 or report.node == "node-0002":
            return
        # A fresh read now, by new collectors over the node's seams: what the report carries.
        fresh = {c.name: collect_once(c, now) for c in build_collectors(node.config, node.seams)
                 if c.name in READ_ONCE}
        for name, result in fresh.items():
            assert result.success, result.error
            for key, value in result.collection.report.items():
                assert encode(getattr(report, key)) == encode(value), (report.node, name, key)
            compared.append(name)

    sim = Simulation(sc, observe=observe)
    sim.run()
    assert sorted(set(compared)) == sorted(READ_ONCE) and len(compared) >= 2 * 2 * 2


def test_heartbeat_format_is_the_f_strings() -> None:
    rng = random.Random(5)
    head, tail = '{"job":"llm-a","rank":17,"step":', ',"gpu":1,"pid":1000018}'
    values = [0.0, -0.0, 1e-7, 5e-7, 0.0000005, 2.5, 123456.7654321, math.nan, math.inf]
    for _ in range(2000):
        step = rng.randrange(0, 10**7)
        times = [rng.choice([*values, rng.lognormvariate(0, 2), rng.uniform(0, 10)]) for _ in range(4)]
        want = (f'{head}{step},"step_seconds":{times[0]:.6f},"compute_seconds":{times[1]:.6f},'
                f'"comm_seconds":{times[2]:.6f},"data_seconds":{times[3]:.6f}{tail}')
        assert _HEARTBEAT % (head, step, *times, tail) == want


def _reports(data: dict[str, object]) -> tuple[list[bytes], int]:
    """Every report of a run of ``data``, and how many descriptors the shared tree held at most."""
    reports: list[bytes] = []
    held = [0]
    sim: Simulation

    def observe(report: Report, now: float) -> None:
        reports.append(encode(report))
        held[0] = max(held[0], len(sim._shared_files._fds))

    sim = Simulation(parse_scenario(data), observe=observe)
    sim.run()
    assert not sim._shared_files._fds  # closed after the run
    return reports, held[0]


def test_shared_tree_descriptors_give_the_reports_of_reads_by_path() -> None:
    # The rdma collectors of nodes on the shared read-only tree keep their files open on one
    # descriptor per file between them; read by path (open, read, close each counter: what a
    # large fleet did before) every report is the same. RoCE, so the netdev's carrier_changes
    # and the ethtool PFC counters are read too; node-0002's flapping port has its own tree.
    data: dict[str, object] = {
        "name": "shared-descriptors", "duration_seconds": 200, "report_interval_seconds": 5,
        "quiet_collector_intervals": {"rdma": 20},
        "fleet": {"nodes": 4, "gpus_per_node": 2, "hcas_per_node": 2, "link_layer": "Ethernet"},
        "jobs": [{"name": "j", "nodes": "node-0000..node-0003", "step_seconds": 2.0}],
        "faults": [{"kind": "port_flap", "node": "node-0002", "hca": 1, "at_seconds": 60, "count": 3,
                    "period_seconds": 20}]}
    shared, held = _reports(data)
    by_path, none_held = _reports({**data, "agent": {"collectors": {"rdma": {"keep_files_open": False}}}})
    assert len(shared) == len(by_path) == 4 * 40
    assert shared == by_path
    # One node's files (2 ports: state, physical state, rate, each counter, carrier_changes), once.
    assert 2 * 10 < held < 2 * 60 and none_held == 0
