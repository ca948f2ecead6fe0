"""What the simulator can express beyond one fault on one node: mixed fleets, reboots that do or
do not clear a fault, Xids on every GPU of a job, slow port flaps. Each runs the real agent
pipeline; a recording engine keeps the reports the aggregator would have received."""

from __future__ import annotations

from typing import Any

import pytest

from vigil.contract.wire import Report
from vigil.sim.clock import SimClock
from vigil.sim.run import Simulation
from vigil.sim.scenario import Scenario, parse_scenario


class Recorder:
    """Keeps every report the agents send (the simulator's ``observe`` seam)."""

    def __init__(self) -> None:
        self.reports: list[Report] = []

    def ingest(self, report: Report, now: float) -> None:
        self.reports.append(report)

    def of(self, node: str) -> list[Report]:
        return [r for r in self.reports if r.node == node]


def _run(data: dict[str, Any]) -> Recorder:
    base = {"duration_seconds": 60, "report_interval_seconds": 5, "fleet": {"nodes": 4, "gpus_per_node": 4}}
    sc: Scenario = parse_scenario({**base, **data})
    rec = Recorder()
    Simulation(sc, observe=rec.ingest).run()
    return rec


def test_mixed_gpu_profiles_in_one_fleet() -> None:
    rec = _run({"fleet": {"nodes": 4, "gpus_per_node": 4,
                          "profiles": [{"nodes": "node-0002..node-0003", "profile": "h200-sxm-141gb"}]}})
    names = {r.node: r.gpus[0].name for r in rec.reports if r.gpus}
    assert "H100" in (names["node-0000"] or "") and "H200" in (names["node-0003"] or "")
    totals = {r.node: r.gpus[0].memory_total_bytes for r in rec.reports if r.gpus}
    assert totals["node-0003"] > totals["node-0000"]  # type: ignore[operator]


def test_xid_on_every_gpu_of_the_job_repeats() -> None:
    rec = _run({"faults": [{"kind": "kernel_xid", "nodes": "node-0000..node-0003", "gpus": "all", "code": 13,
                            "at_seconds": 10, "repeat": 1, "every_seconds": 20}]})
    for node in ("node-0000", "node-0003"):
        xids = [(e.gpu, e.code) for r in rec.of(node) for e in r.events if e.kind == "xid"
                for _ in range(e.count)]
        assert sorted(xids) == sorted([(g, 13) for g in range(4)] * 2), node


def _gpu3(report: Report) -> str:
    return next(g.health for g in report.gpus if g.index == 3)


def test_a_reboot_that_does_not_clear_a_lost_gpu() -> None:
    rec = _run({"duration_seconds": 120,
                "faults": [{"kind": "gpu_lost", "node": "node-0001", "gpu": 3, "at_seconds": 10},
                           {"kind": "reboot", "node": "node-0001", "at_seconds": 30, "down_seconds": 40}]})
    reports = rec.of("node-0001")
    boots = list(dict.fromkeys(r.boot_id for r in reports))
    assert len(boots) == 2
    assert not [r for r in reports if 30 < r.ts - reports[0].ts + 5 < 70]  # silent while rebooting
    after = [r for r in reports if r.boot_id == boots[1]]
    assert after[0].seq == 0 and _gpu3(after[-1]) == "lost"
    # the new boot's kernel log starts empty: the Xid 79 is not read again
    assert not [e for r in after for e in r.events if e.kind == "xid"]


def test_a_reboot_that_clears_the_fault_and_resets_port_counters() -> None:
    rec = _run({"duration_seconds": 120,
                "faults": [{"kind": "reset_required", "node": "node-0001", "gpu": 3, "at_seconds": 10},
                           {"kind": "port_errors", "node": "node-0001", "per_second": 10, "at_seconds": 5,
                            "until_seconds": 25},
                           {"kind": "reboot", "node": "node-0001", "at_seconds": 30, "down_seconds": 40,
                            "clears": True}]})
    reports = rec.of("node-0001")
    before = [r for r in reports if r.boot_id == reports[0].boot_id]
    after = [r for r in reports if r.boot_id != reports[0].boot_id]
    assert _gpu3(before[-1]) != "ok" and _gpu3(after[-1]) == "ok"
    assert before[-1].ports[0].counters["symbol_error"] >= 150
    assert after[-1].ports[0].counters["symbol_error"] == 0


def test_a_port_that_drops_for_two_seconds_every_six_minutes() -> None:
    rec = _run({"duration_seconds": 1200, "report_interval_seconds": 10,
                "faults": [{"kind": "port_flap", "node": "node-0002", "at_seconds": 61, "count": 10,
                            "period_seconds": 360, "down_seconds": 2}]})
    reports = rec.of("node-0002")
    downs = [r.ports[0].counters["link_downed"] for r in reports]
    assert downs[-1] == 4  # at 61, 421, 781, 1141 s
    # every report outside the 2 s drops (its agent reports at its own phase) sees the port up:
    # only the counter tells
    start = SimClock().start
    down = [any(d <= r.ts - start < d + 2 for d in (61, 421, 781, 1141)) for r in reports]
    assert [r.ports[0].state in ("ACTIVE", "4: ACTIVE") for r in reports] == [not d for d in down]


def test_slow_burn_gpu_faults_through_the_real_backend() -> None:
    from vigil.agent.nvml.backend import PynvmlBackend
    from vigil.agent.nvml.fake import FakeNvml
    from vigil.agent.nvml.scenario import load_node_scenario

    clock = type("C", (), {"t": 0.0, "__call__": lambda self: self.t})()
    backend = PynvmlBackend(FakeNvml(load_node_scenario("slow-burn-h100"), clock, start=0.0, seed=3))
    backend.init()
    for i in range(8):
        backend.identity(i)
    clock.t = 59.0
    before = {i: backend.read(i) for i in (0, 1, 4, 6)}
    clock.t = 60.0 + 2 * 3600.0
    after = {i: backend.read(i) for i in (0, 1, 4, 6)}
    # 30 degrees an hour for two hours, on GPU 1 only (GPU 0 is the same model at the same load)
    assert after[1].temperature_celsius - after[0].temperature_celsius >= 59  # type: ignore[operator]
    assert abs(before[1].temperature_celsius - before[0].temperature_celsius) <= 5  # type: ignore[operator]
    assert after[4].memory_temperature_celsius - after[0].memory_temperature_celsius >= 14  # type: ignore[operator]
    assert after[6].pcie_replay_total - before[6].pcie_replay_total == 5 * 7200  # type: ignore[operator]
    assert after[0].pcie_replay_total == before[0].pcie_replay_total


def test_slow_burn_faults_in_a_fleet_scenario() -> None:
    rec = _run({"duration_seconds": 120, "faults": [
        {"kind": "pcie_replay", "node": "node-0001", "gpu": 2, "at_seconds": 20, "rate_per_second": 10},
        {"kind": "hot_hbm", "node": "node-0001", "gpu": 3, "at_seconds": 20, "extra_celsius": 20}]})
    last = rec.of("node-0001")[-1]
    first = rec.of("node-0001")[0]
    g2 = next(g for g in last.gpus if g.index == 2)
    g2_first = next(g for g in first.gpus if g.index == 2)
    assert g2.pcie_replay_total - g2_first.pcie_replay_total >= 900  # type: ignore[operator]
    g3, g0 = (next(g for g in last.gpus if g.index == i) for i in (3, 0))
    assert g3.memory_temperature_celsius - g0.memory_temperature_celsius >= 15  # type: ignore[operator]


def test_large_fleets_keep_their_hcas_and_read_them_by_path() -> None:
    from vigil.sim.run import agent_config

    small = parse_scenario({"duration_seconds": 10, "fleet": {"nodes": 16, "hcas_per_node": 8}})
    large = parse_scenario({"duration_seconds": 10, "fleet": {"nodes": 4096, "hcas_per_node": 8}})
    assert agent_config(small).collectors.rdma.keep_files_open is True
    assert agent_config(large).collectors.rdma.keep_files_open is False
    told = large.model_copy(update={"agent": {"collectors": {"rdma": {"keep_files_open": True}}}})
    assert agent_config(told).collectors.rdma.keep_files_open is True
    # by path, the ports still report, and a port fault still shows
    rec = _run({"agent": {"collectors": {"rdma": {"keep_files_open": False}}},
                "fleet": {"nodes": 4, "hcas_per_node": 4},
                "faults": [{"kind": "port_down", "node": "node-0002", "hca": 3, "at_seconds": 20}]})
    last = rec.of("node-0002")[-1]
    assert len(last.ports) == 4 and "DOWN" in (last.ports[3].state or "") and "ACTIVE" in (last.ports[0].state or "")


def test_roce_congestion_counters_reach_the_report() -> None:
    rec = _run({"fleet": {"nodes": 4, "gpus_per_node": 4, "hcas_per_node": 2, "link_layer": "Ethernet"},
                "agent": {"collectors": {"rdma": {"ethtool_interval_seconds": 5}}},
                "faults": [{"kind": "roce_congestion", "node": "node-0001", "hca": 1, "at_seconds": 10,
                            "until_seconds": 40, "ecn_marked_per_second": 1000, "cnp_sent_per_second": 200,
                            "cnp_handled_per_second": 150, "pfc_pause_per_second": 40}]})
    last = rec.of("node-0001")[-1]
    port = next(p for p in last.ports if p.device == "mlx5_1")
    assert port.link_layer == "Ethernet" and port.netdev == "ens2f0np0"
    assert port.counters["np_ecn_marked_roce_packets"] == 30_000
    assert port.counters["np_cnp_sent"] == 6_000 and port.counters["rp_cnp_handled"] == 4_500
    quiet = next(p for p in last.ports if p.device == "mlx5_0")
    assert quiet.counters["np_ecn_marked_roce_packets"] == 0
    assert rec.of("node-0000")[-1].ports[1].counters["np_cnp_sent"] == 0
    # PFC pauses come from ethtool -S through the run seam
    assert port.counters["rx_prio3_pause"] == 1_200 and port.counters["rx_prio3_pause_duration"] == 60_000
    assert quiet.counters["rx_prio3_pause"] == 0


def test_ethtool_answers_only_for_its_netdevs() -> None:
    import subprocess
    import tempfile
    from pathlib import Path

    from vigil.sim.fabric import Ethtool, NodeFabric, build_tree

    with tempfile.TemporaryDirectory() as tmp:
        fab = NodeFabric(build_tree(Path(tmp), 2, "Ethernet"))
        fab.add_counter(1, "rx_prio3_pause", 7)
        fab.set_link(1, False)
        fab.set_link(1, True)
        run = Ethtool(fab, 2)
        text = run(["ethtool", "-S", "ens2f0np0"], 2.0)
        assert text.startswith("NIC statistics:\n") and "     rx_prio3_pause: 7\n" in text
        assert "     rx_prio3_pause: 0\n" in run(["ethtool", "-S", "ens1f0np0"], 2.0)
        assert (Path(tmp) / "class/net/ens2f0np0/carrier_changes").read_text() == "2\n"
        with pytest.raises(subprocess.CalledProcessError):
            run(["ethtool", "-S", "eth9"], 2.0)
        with pytest.raises(subprocess.CalledProcessError):
            run(["rm", "-rf", "/"], 2.0)


def test_rail_optimised_fabric_a_leaf_shows_on_one_hca_of_its_nodes() -> None:
    topo = {"nodes_per_leaf": 2, "rails": 4}
    rec = _run({"fleet": {"nodes": 4, "gpus_per_node": 4, "hcas_per_node": 4, "topology": topo},
                "faults": [{"kind": "port_errors", "component": "leaf-001-rail2", "hca": 2, "per_second": 20,
                            "at_seconds": 10}]})
    first = rec.of("node-0002")[-1]
    assert first.topology["rail2_leaf"] == "leaf-001-rail2" and "leaf_switch" not in first.topology
    assert rec.of("node-0000")[-1].topology["rail0_leaf"] == "leaf-000-rail0"
    for node in ("node-0002", "node-0003"):
        counts = {p.device: p.counters["symbol_error"] for p in rec.of(node)[-1].ports}
        assert counts["mlx5_2"] >= 900 and counts["mlx5_0"] == counts["mlx5_1"] == counts["mlx5_3"] == 0
    assert all(p.counters["symbol_error"] == 0 for p in rec.of("node-0001")[-1].ports)
    from vigil.sim.scenario import ScenarioError

    with pytest.raises(ScenarioError, match="carries HCA 2 of its nodes"):
        parse_scenario({"duration_seconds": 60, "fleet": {"nodes": 4, "hcas_per_node": 4, "topology": topo},
                        "faults": [{"kind": "port_down", "component": "leaf-001-rail2", "hca": 0, "at_seconds": 1}]})
