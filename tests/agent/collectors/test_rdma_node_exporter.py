"""Cross-check: Debian's prometheus-node-exporter (infiniband collector) and our RDMA collector read
the same real sysfs trees (an H100 node's, and node_exporter's own fixture tree with mlx4
``counters_ext/``) and must agree on every value both of them read."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vigil.agent.collectors.rdma import RdmaCollector, RdmaConfig

SYSFS_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sysfs"
BINARY = "prometheus-node-exporter"  # Debian's package name; upstream calls it node_exporter
START_TIMEOUT_SECONDS = 10.0

# node_exporter series name -> (our series name, factor to apply to ours). node_exporter 1.5.0
# already reports data in bytes (words * 4), as we do; its rate is in bytes per second.
SAME_VALUE: dict[str, tuple[str, float]] = {
    "node_infiniband_excessive_buffer_overrun_errors_total":
        ("vigil_rdma_port_excessive_buffer_overrun_errors_total", 1),
    "node_infiniband_link_downed_total": ("vigil_rdma_port_link_downed_total", 1),
    "node_infiniband_link_error_recovery_total": ("vigil_rdma_port_link_error_recoveries_total", 1),
    "node_infiniband_local_link_integrity_errors_total": ("vigil_rdma_port_local_link_integrity_errors_total", 1),
    "node_infiniband_multicast_packets_received_total": ("vigil_rdma_port_multicast_packets_received_total", 1),
    "node_infiniband_multicast_packets_transmitted_total": ("vigil_rdma_port_multicast_packets_transmitted_total", 1),
    "node_infiniband_port_constraint_errors_received_total": ("vigil_rdma_port_receive_constraint_errors_total", 1),
    "node_infiniband_port_constraint_errors_transmitted_total":
        ("vigil_rdma_port_transmit_constraint_errors_total", 1),
    "node_infiniband_port_data_received_bytes_total": ("vigil_rdma_port_data_received_bytes_total", 1),
    "node_infiniband_port_data_transmitted_bytes_total": ("vigil_rdma_port_data_transmitted_bytes_total", 1),
    "node_infiniband_port_discards_transmitted_total": ("vigil_rdma_port_transmit_discards_total", 1),
    "node_infiniband_port_discards_received_total": ("vigil_rdma_port_receive_discards_total", 1),
    "node_infiniband_port_errors_received_total": ("vigil_rdma_port_receive_errors_total", 1),
    "node_infiniband_port_packets_received_total": ("vigil_rdma_port_packets_received_total", 1),
    "node_infiniband_port_packets_transmitted_total": ("vigil_rdma_port_packets_transmitted_total", 1),
    "node_infiniband_port_receive_remote_physical_errors_total":
        ("vigil_rdma_port_receive_remote_physical_errors_total", 1),
    "node_infiniband_port_receive_switch_relay_errors_total":
        ("vigil_rdma_port_receive_switch_relay_errors_total", 1),
    "node_infiniband_port_transmit_wait_total": ("vigil_rdma_port_transmit_wait_total", 1),
    "node_infiniband_symbol_error_total": ("vigil_rdma_port_symbol_errors_total", 1),
    "node_infiniband_unicast_packets_received_total": ("vigil_rdma_port_unicast_packets_received_total", 1),
    "node_infiniband_unicast_packets_transmitted_total": ("vigil_rdma_port_unicast_packets_transmitted_total", 1),
    "node_infiniband_vl15_dropped_total": ("vigil_rdma_port_vl15_dropped_total", 1),
    "node_infiniband_state_id": ("vigil_rdma_port_state", 1),
    "node_infiniband_physical_state_id": ("vigil_rdma_port_physical_state", 1),
    "node_infiniband_rate_bytes_per_second": ("vigil_rdma_port_rate_bytes_per_second", 1),
}
# node_exporter's series of the 64-bit counters_ext/ files, and the counters/ series each one is
# the 64-bit twin of. Where a port has both, we report the 64-bit value (the counters/ twin may
# be 32 bits wide or stay 0), so ours must equal the legacy series and the twin is not compared.
LEGACY: dict[str, str] = {
    "node_infiniband_legacy_data_received_bytes_total": "node_infiniband_port_data_received_bytes_total",
    "node_infiniband_legacy_data_transmitted_bytes_total": "node_infiniband_port_data_transmitted_bytes_total",
    "node_infiniband_legacy_packets_received_total": "node_infiniband_port_packets_received_total",
    "node_infiniband_legacy_packets_transmitted_total": "node_infiniband_port_packets_transmitted_total",
    "node_infiniband_legacy_unicast_packets_received_total": "node_infiniband_unicast_packets_received_total",
    "node_infiniband_legacy_unicast_packets_transmitted_total": "node_infiniband_unicast_packets_transmitted_total",
    "node_infiniband_legacy_multicast_packets_received_total": "node_infiniband_multicast_packets_received_total",
    "node_infiniband_legacy_multicast_packets_transmitted_total":
        "node_infiniband_multicast_packets_transmitted_total",
}
# Compared by labels below; node_exporter reads no hw_counters in 1.5.0.
OTHER_NODE_SERIES = {"node_infiniband_info"}


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_node_exporter(binary: str, sysfs: Path) -> str:
    port = _free_loopback_port()
    proc = subprocess.Popen(
        [binary, f"--path.sysfs={sysfs}", "--collector.disable-defaults", "--collector.infiniband",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    return str(resp.read().decode())
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        proc.kill()  # our own child, by its pid
        proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.external
@pytest.mark.parametrize(("tree", "expected_compared"), [
    # 3 ports x 24 series + 3 info series: the whole real tree was compared, not an empty scrape.
    ("h100", 3 * 24 + 3),
    # i40iw0: state, physical state, rate (its counters read "N/A (no PMA)" for both of us);
    # mlx4_0 port 1: 22 series, port 2: 10 (node_exporter's count of series for the port, less
    # the counters/ twins its legacy series replace), and 2 info series.
    ("node-exporter-infiniband", 3 + 22 + 10 + 2),
])
def test_node_exporter_and_vigil_agree_on_every_common_value(tmp_path: Path, tree: str,
                                                            expected_compared: int) -> None:
    binary = shutil.which(BINARY)
    if binary is None:
        pytest.skip(f"{BINARY} is not installed (Debian: apt-get install prometheus-node-exporter)")
    sysfs = tmp_path / "sys"
    shutil.copytree(SYSFS_FIXTURES / tree, sysfs)
    exposition = _scrape_node_exporter(binary, sysfs)

    collector = RdmaCollector(RdmaConfig(), sysfs_root=sysfs)
    try:
        ours_samples = collector.collect(time.time()).samples
    finally:
        collector.close()
    ours: dict[tuple[str, str, str], float] = {}
    for s in ours_samples:
        device, port = s.label("device"), s.label("port")
        if device is not None and port is not None and s.label("counter") is None:
            ours[(s.name, device, port)] = s.value
    our_info = {s.label("device"): s for s in ours_samples if s.name == "vigil_rdma_device_info"}

    node: dict[tuple[str, str, str], float] = {}
    compared = 0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if not sample.name.startswith("node_infiniband_"):
                continue
            if sample.name == "node_infiniband_info":
                info = our_info[sample.labels["device"]]
                assert (info.label("hca_type"), info.label("fw_ver"), info.label("board_id")) == (
                    sample.labels["hca_type"], sample.labels["firmware_version"], sample.labels["board_id"])
                compared += 1
                continue
            node[(sample.name, sample.labels["device"], sample.labels["port"])] = sample.value
    replaced = {(LEGACY[name], device, port) for name, device, port in node if name in LEGACY}
    for (name, device, port), value in node.items():
        if (name, device, port) in replaced:
            continue  # the 64-bit twin was compared instead
        mapped = SAME_VALUE.get(LEGACY.get(name, name))
        assert mapped is not None, f"node_exporter reads {name}; map it to ours"
        our_name, factor = mapped
        key = (our_name, device, port)
        assert key in ours, f"we do not read what node_exporter's {name}{{{device}, {port}}} reads"
        assert ours[key] * factor == value, (name, device, port, ours[key], value)
        compared += 1
    names = {name for name, _, _ in node} | {"node_infiniband_info"}
    if tree == "h100":
        assert names - OTHER_NODE_SERIES == set(SAME_VALUE) - {"node_infiniband_port_discards_received_total"}
    assert compared == expected_compared


def test_counters_ext_replaces_its_counters_twin(tmp_path: Path) -> None:
    # mlx4_0 port 2 of node_exporter's tree: counters/port_rcv_data reads 0, counters_ext/ has
    # 4631917 words; the report carries the 64-bit value under the counters/ name.
    collector = RdmaCollector(RdmaConfig(), sysfs_root=SYSFS_FIXTURES / "node-exporter-infiniband")
    try:
        report = collector.collect(1.0).report["ports"]
    finally:
        collector.close()
    port2 = next(p for p in report if (p.device, p.port) == ("mlx4_0", 2))
    assert port2.counters["port_rcv_data"] == 4631917 * 4
    assert port2.counters["unicast_xmit_packets"] == 61239
    assert not any(name.endswith("_64") for name in port2.counters)
    port1 = next(p for p in report if (p.device, p.port) == ("mlx4_0", 1))
    assert port1.counters["port_rcv_discards"] == 0 and port1.counters["port_xmit_discards"] == 5
