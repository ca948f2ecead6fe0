"""The fleet's ingest of issue 44's state: Report.config and Report.pcie kept when absent (with
their change markers), AER counters per PCIe device, the GPUs' fabric and PCIe link marks; the
same whether the agent sends reports whole or compact (agent/report_delta.py)."""

from __future__ import annotations

import pytest

from tests.aggregator.conftest import FakeNode
from tests.aggregator.test_fleet_compact import _compact
from vigil.aggregator.fleet import Fleet, FleetConfig, NodeState
from vigil.contract.wire import REPORT_VERSIONS, Report


def _node() -> FakeNode:
    node = FakeNode("n1", ports=1)
    for g in node.gpus.values():
        g.update(fabric_state="completed", pcie_link_generation=5, pcie_link_generation_max=5, pcie_link_width=16,
                 pcie_link_width_max=16)
    node.host = {"uptime_seconds": 1000.0, "fabric_manager_state": "active"}
    node.config = {"driver_version": "550.54.15", "gpu_count": 8}
    node.pcie = [{"pci_bus_id": "0000:18:00.0", "kind": "gpu", "aer_correctable_total": 0},
                 {"pci_bus_id": "0000:40:00.0", "kind": "hca", "name": "mlx5_0", "link_width": 16,
                  "link_width_max": 16, "aer_nonfatal_total": 0}]
    return node


def _reports() -> list[Report]:
    node = _node()
    out = []
    for k in range(12):
        node.host = {**node.host, "uptime_seconds": 1000.0 + 2.5 * k}
        node.gpus[3]["utilization_gpu_ratio"] = 0.2 if k == 2 else 0.95
        if k == 1:
            node.gpus[3]["pcie_link_width"] = 8
            node.gpus[5]["fabric_state"] = "in_progress"
        if k == 4:
            node.pcie[1] = {**node.pcie[1], "link_width": 8, "aer_nonfatal_total": 2}
            node.config = {**node.config, "driver_version": "535.161.08"}
        if k == 6:
            node.gpus[5]["fabric_state"] = "completed"
            node.gpus[5]["fabric_health"] = ["route_recovery"]
        if k == 8:
            node.gpus[3]["pcie_link_width"] = 16
            node.host = {**node.host, "fabric_manager_state": "failed"}
        out.append(node.report(k * 2.5))
    return out


def _ingest(reports: list[Report], stop: int | None = None) -> NodeState:
    fleet = Fleet()
    for r in reports[:stop]:
        fleet.ingest(r, r.ts)
    return fleet.view().nodes["n1"]


def _marks(node: NodeState) -> tuple:
    runs = {i: (g.link_below.since, list(g.link_below.lows)) for i, g in node.gpus.items() if g.link_below}
    return (node.config, dict(node.fabric_suspect_gpus), node.fabric_manager_down_since, set(node.gpu_links_below),
            runs, {b: (h.last, h.link_below_since, h.counters.sum_since("aer_nonfatal_total", 0.0))
                   for b, h in node.pcie.items()}, set(node.pcie_links_below), node.booted_at)


@pytest.mark.parametrize("version", REPORT_VERSIONS, ids=lambda v: f"v{v}")
def test_compact_reports_leave_the_marks_as_whole_reports_do(version: int) -> None:
    reports = _reports()
    compact = _compact(reports, version)
    assert compact[5].config is None and compact[5].pcie is None  # unchanged: left out
    assert compact[4].config is not None and compact[4].pcie is not None
    for stop in (3, 7, 12):
        assert _marks(_ingest(reports, stop)) == _marks(_ingest(compact, stop))
    mid = _ingest(compact, 7)
    assert mid.config is not None and mid.config.driver_version == "535.161.08"
    assert mid.fabric_suspect_gpus == {5: 2.5}  # in_progress, then completed with a condition: one run
    assert mid.gpu_links_below == {3} and mid.gpus[3].link_below is not None
    assert mid.gpus[3].link_below.loaded_since(0.5) == 7.5  # the report after the dip in load
    assert mid.pcie_links_below == {"0000:40:00.0"} and mid.pcie["0000:40:00.0"].link_below_since == 10.0
    assert mid.pcie["0000:40:00.0"].counters.sum_since("aer_nonfatal_total", 0.0) == 2
    assert mid.booted_at == 0.0 - 1000.0
    end = _ingest(compact)
    assert end.gpu_links_below == set() and end.gpus[3].link_below is None
    assert end.fabric_manager_down_since == 20.0


def test_config_marker_moves_only_on_change() -> None:
    node = _node()
    fleet = Fleet()
    fleet.ingest(node.report(0.0), 0.0)
    first = fleet.view().nodes["n1"].config_revision
    assert first > 0 and fleet.view().config_revision == first
    for t in (2.5, 5.0):  # the same facts again, and none
        if t == 5.0:
            node.config = None
        fleet.ingest(node.report(t), t)
    held = fleet.view().nodes["n1"]
    assert held.config_revision == first and held.config is not None and held.config_since == 0.0
    node.config = {"driver_version": "560.28.03", "gpu_count": 8}
    fleet.ingest(node.report(7.5), 7.5)
    assert fleet.view().nodes["n1"].config_revision > first and fleet.view().config_revision > first


def test_pcie_section_is_whole_bounded_and_bus_ids_normalised() -> None:
    node = _node()
    fleet = Fleet(FleetConfig(max_pcie_devices_per_node=2))
    node.pcie = [*node.pcie, {"pci_bus_id": "0000:41:00.0", "kind": "hca"},
                 {"pci_bus_id": "00000000:18:00.0", "kind": "gpu"}]
    refused = fleet.ingest(node.report(0.0), 0.0)
    assert refused == {"too_many_pcie_devices": 1, "duplicate_pcie_device": 1}
    assert sorted(fleet.view().nodes["n1"].pcie) == ["0000:18:00.0", "0000:40:00.0"]
    node.pcie = node.pcie[1:2]  # a device gone from the section is let go
    fleet.ingest(node.report(2.5), 2.5)
    assert list(fleet.view().nodes["n1"].pcie) == ["0000:40:00.0"]
    node.pcie = None  # left out: kept
    fleet.ingest(node.report(5.0), 5.0)
    assert list(fleet.view().nodes["n1"].pcie) == ["0000:40:00.0"]


def test_a_reboot_restarts_the_aer_baselines_without_an_increase() -> None:
    node = _node()
    node.pcie[1]["aer_nonfatal_total"] = 7
    fleet = Fleet()
    fleet.ingest(node.report(0.0), 0.0)
    node.boot_id = "kernel2-boot"
    node.seq = 0
    node.pcie[1]["aer_nonfatal_total"] = 9  # a new boot's count: not an increase over the last boot's
    node.host = {"uptime_seconds": 5.0, "fabric_manager_state": "active"}
    fleet.ingest(node.report(2.5), 2.5)
    held = fleet.view().nodes["n1"]
    assert held.pcie["0000:40:00.0"].counters.sum_since("aer_nonfatal_total", 0.0) == 0
    assert held.booted_at == 2.5 - 5.0  # the new boot's uptime
