"""Cross-check: Debian's prometheus-node-exporter (infiniband collector) and our RDMA collector read
the same real sysfs tree and must agree on every value both of them read."""

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

from agent.collectors.rdma import RdmaCollector, RdmaConfig

FIXTURE_ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "sysfs" / "h100"
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
def test_node_exporter_and_vigil_agree_on_every_common_value(tmp_path: Path) -> None:
    binary = shutil.which(BINARY)
    if binary is None:
        pytest.skip(f"{BINARY} is not installed (Debian: apt-get install prometheus-node-exporter)")
    sysfs = tmp_path / "sys"
    shutil.copytree(FIXTURE_ROOT, sysfs)
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

    compared = 0
    node_names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if not sample.name.startswith("node_infiniband_"):
                continue
            node_names.add(sample.name)
            if sample.name == "node_infiniband_info":
                info = our_info[sample.labels["device"]]
                assert (info.label("hca_type"), info.label("fw_ver"), info.label("board_id")) == (
                    sample.labels["hca_type"], sample.labels["firmware_version"], sample.labels["board_id"])
                compared += 1
                continue
            assert sample.name in SAME_VALUE, f"node_exporter reads {sample.name}; map it to ours"
            our_name, factor = SAME_VALUE[sample.name]
            key = (our_name, sample.labels["device"], sample.labels["port"])
            assert key in ours, f"we do not read what node_exporter's {sample.name}{sample.labels} reads"
            assert ours[key] * factor == sample.value, (sample.name, sample.labels)
            compared += 1
    assert node_names - OTHER_NODE_SERIES == set(SAME_VALUE), "a mapped node_exporter series went missing"
    # 3 ports x 24 series + 3 info series: the whole real tree was compared, not an empty scrape
    assert compared == 3 * len(SAME_VALUE) + 3
