"""The telemetry hang detector: a job with no heartbeats whose GPUs busy-spin on every node while its
RDMA ports move no data is alerted after the window and restarted after the longer one; the
lookalikes (a checkpoint write, an evaluation, a data stall, the pause between steps, one node
flat while its peers move, missing GPM readings, a job with heartbeats) get no decision."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
from pydantic import ValidationError

from tests.aggregator.conftest import FakeNode, rank_summary
from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors import REGISTRY
from vigil.aggregator.detectors.telemetry_hang import TelemetryHangConfig, TelemetryHangDetector
from vigil.aggregator.fleet import Fleet

INTERVAL = 2.5
JOB = "4242"
GB = 1e9

# What an H100 shows, by phase (NVML and GPM fields as the agent reports them).
TRAINING = {"utilization_gpu_ratio": 0.97, "sm_clock_hertz": 1.98e9, "power_watts": 640.0, "dram_active_ratio": 0.38,
            "pcie_tx_bytes_per_second": 1.2e9, "pcie_rx_bytes_per_second": 0.7e9,
            "nvlink_tx_bytes_per_second": 40 * GB, "nvlink_rx_bytes_per_second": 40 * GB}
# NCCL's kernels polling for a peer: resident all the time at boost clock, few SMs, no traffic.
SPIN = {"utilization_gpu_ratio": 1.0, "sm_clock_hertz": 1.98e9, "power_watts": 150.0, "dram_active_ratio": 0.0,
        "pcie_tx_bytes_per_second": 1e5, "pcie_rx_bytes_per_second": 1e5,
        "nvlink_tx_bytes_per_second": 0.0, "nvlink_rx_bytes_per_second": 0.0}
# A checkpoint write: the GPUs idle at low clock and power while the host copies state out.
CHECKPOINT = {**SPIN, "utilization_gpu_ratio": 0.05, "sm_clock_hertz": 0.345e9, "power_watts": 110.0,
              "pcie_tx_bytes_per_second": 3 * GB}
# An evaluation pass: forward only, GPUs busy with DRAM traffic, no gradient all-reduce.
EVALUATION = {**TRAINING, "power_watts": 480.0, "dram_active_ratio": 0.45, "nvlink_tx_bytes_per_second": 0.0,
              "nvlink_rx_bytes_per_second": 0.0}
# A data stall: nothing to compute.
DATA_STALL = {**SPIN, "utilization_gpu_ratio": 0.0, "sm_clock_hertz": 0.345e9, "power_watts": 95.0}

Readings = Mapping[str, float | None]
Phase = Callable[[float, str], tuple[Readings, float]]


def make_nodes(n: int = 4) -> list[FakeNode]:
    nodes = [FakeNode(f"n{i}", gpus=4, ports=2) for i in range(n)]
    for node in nodes:
        for g in node.gpus.values():
            g.update(job=JOB, power_limit_watts=700.0)
        for p in node.ports.values():
            p["counters"].update(port_xmit_data=0, port_rcv_data=0)
    return nodes


def run(phase: Phase, until: float, *, nodes: list[FakeNode] | None = None,
        detector: TelemetryHangDetector | None = None,
        heartbeats: bool = False) -> tuple[list[tuple[float, Finding]], TelemetryHangDetector]:
    """Each report round, ``phase(t, node)`` gives the node's GPU readings and its ports' bytes per
    second each way; the detector evaluates after every round, as the aggregator does. Returns
    every (time, finding)."""
    nodes = nodes or make_nodes()
    detector = detector or TelemetryHangDetector(TelemetryHangConfig())
    fleet = Fleet()
    found: list[tuple[float, Finding]] = []
    t = 0.0
    while t <= until:
        for node in nodes:
            readings, port_rate = phase(t, node.name)
            for g in node.gpus.values():
                g.update(readings)
            for p in node.ports.values():
                for c in ("port_xmit_data", "port_rcv_data"):
                    p["counters"][c] += int(port_rate * INTERVAL)
            node.ranks = [rank_summary(JOB, 0, compute=1.0, comm=0.2, ts=t)] if heartbeats else []
            fleet.ingest(node.report(t), t)
        found.extend((t, f) for f in detector.evaluate(fleet.view(), t))
        t += INTERVAL
    return found, detector


def hang_from(t0: float, healthy: Readings = TRAINING) -> Phase:
    return lambda t, _node: (SPIN, 0.0) if t >= t0 else (healthy, 5 * GB)


def test_registered_and_on_by_default() -> None:
    assert REGISTRY["telemetry_hang"] is TelemetryHangDetector
    assert TelemetryHangConfig().enabled


def test_a_whole_job_busy_spinning_with_flat_rdma_is_alerted_then_restarted() -> None:
    found, _ = run(hang_from(30.0), 30.0 + 330.0)
    alerts = [t for t, f in found if f.action is Action.ALERT]
    restarts = [(t, f) for t, f in found if f.action is Action.RESTART_JOB]
    # Seen flat from the first report after the stop; alerted once the window has passed.
    window = TelemetryHangConfig().alert_seconds
    assert alerts and 30.0 + window <= alerts[0] <= 30.0 + window + 2 * INTERVAL
    assert restarts and 30.0 + 300.0 <= restarts[0][0] <= 30.0 + 300.0 + 2 * INTERVAL
    f = restarts[0][1]
    assert (f.node, f.job, f.key, f.detector) == (WHOLE_JOB, JOB, "hang", "telemetry_hang")
    assert f.evidence["signal"] == "telemetry_hang"
    assert f.evidence["culprit_nodes"] == [] and f.evidence["job_nodes"] == ["n0", "n1", "n2", "n3"]
    assert (f.evidence["gpus"], f.evidence["nodes"], f.evidence["ports"]) == (16, 4, 8)
    n0 = f.evidence["per_node"]["n0"]
    assert n0["min_utilization_ratio"] == 1.0 and n0["max_dram_active_ratio"] == 0.0
    assert n0["max_power_limit_ratio"] == pytest.approx(150 / 700) and n0["rdma_bytes_since"] == 0.0
    # One episode: every finding since the same moment.
    assert len({f.since for _, f in found}) == 1


def test_a_job_with_heartbeats_is_left_to_the_hang_detector() -> None:
    found, _ = run(hang_from(30.0), 400.0, heartbeats=True)
    assert found == []


@pytest.mark.parametrize(("name", "readings", "port_rate"), [
    # Storage over the fabric (or host copies): GPUs idle, ports busy; and with storage elsewhere.
    ("checkpoint to storage on the fabric", CHECKPOINT, 2 * GB),
    ("checkpoint to local NVMe", CHECKPOINT, 0.0),
    ("evaluation", EVALUATION, 0.0),
    ("data stall", DATA_STALL, 0.0),
])
def test_lookalikes_for_ten_minutes_get_no_decision(name: str, readings: Readings, port_rate: float) -> None:
    found, _ = run(lambda t, _n: (readings, port_rate) if t >= 30.0 else (TRAINING, 5 * GB), 630.0)
    assert found == [], name


def test_the_pause_between_steps_is_shorter_than_the_window() -> None:
    # Every 20 s the job sits 15 s in a collective with nothing moving, then a step moves data.
    def phase(t: float, _node: str) -> tuple[Readings, float]:
        return (SPIN, 0.0) if t % 20.0 < 15.0 else (TRAINING, 5 * GB)

    found, _ = run(phase, 600.0)
    assert found == []


def test_a_trickle_of_data_counts_as_flat_and_a_burst_does_not() -> None:
    found, _ = run(lambda t, _n: (SPIN, 0.5e6) if t >= 10.0 else (TRAINING, 5 * GB), 100.0)
    assert any(f.action is Action.ALERT for _, f in found)  # keep-alives: 0.5 MB/s
    # One burst at 25 s, inside the first window, restarts it: alerted a window after it, not before.
    window = TelemetryHangConfig().alert_seconds
    assert 10.0 + window > 25.0
    found, _ = run(lambda t, _n: (SPIN, 50e6 if t == 25.0 else 0.0) if t >= 10.0 else (TRAINING, 5 * GB), 130.0)
    first = min(t for t, _ in found)
    assert 25.0 + window <= first <= 25.0 + window + 2 * INTERVAL


def test_one_node_flat_while_its_peers_move_is_not_a_job_hang() -> None:
    found, _ = run(lambda t, node: (SPIN, 0.0) if node == "n2" and t >= 30.0 else (TRAINING, 5 * GB), 600.0)
    assert found == []


def test_one_gpu_off_the_signature_keeps_the_job_unjudged_as_hung() -> None:
    nodes = make_nodes()
    # GPU 3 of n1 is idle (its rank waits on the host, not in a kernel): not the busy-spin signature.
    def phase(t: float, node: str) -> tuple[Readings, float]:
        return (SPIN, 0.0) if t >= 30.0 else (TRAINING, 5 * GB)

    found: list[tuple[float, Finding]] = []
    detector = TelemetryHangDetector(TelemetryHangConfig())
    fleet = Fleet()
    t = 0.0
    while t <= 400.0:
        for node in nodes:
            readings, rate = phase(t, node.name)
            for i, g in node.gpus.items():
                g.update(DATA_STALL if (node.name, i) == ("n1", 3) and t >= 30.0 else readings)
            for p in node.ports.values():
                for c in ("port_xmit_data", "port_rcv_data"):
                    p["counters"][c] += int(rate * INTERVAL)
            fleet.ingest(node.report(t), t)
        found.extend((t, f) for f in detector.evaluate(fleet.view(), t))
        t += INTERVAL
    assert found == []


def test_missing_gpm_readings_mean_no_judgement_and_say_so() -> None:
    no_gpm = {**SPIN, "dram_active_ratio": None, "pcie_tx_bytes_per_second": None, "pcie_rx_bytes_per_second": None}
    found, detector = run(lambda t, _n: (no_gpm, 0.0), 400.0)
    assert found == []
    assert "no GPM readings" in detector.unjudged[JOB]


def test_a_single_node_job_is_not_judged() -> None:
    found, _ = run(hang_from(30.0), 400.0, nodes=make_nodes(1))
    assert found == []


def test_a_late_node_restarts_the_window() -> None:
    nodes = make_nodes()
    detector = TelemetryHangDetector(TelemetryHangConfig())
    fleet = Fleet()
    found: list[tuple[float, Finding]] = []
    t = 0.0
    while t <= 200.0:
        for node in nodes:
            if node.name == "n3" and 60.0 <= t < 90.0:
                continue  # its reports stop for 30 s: nothing current is known of it
            readings, _ = hang_from(10.0)(t, node.name)
            for g in node.gpus.values():
                g.update(readings)
            fleet.ingest(node.report(t), t)
        found.extend((t, f) for f in detector.evaluate(fleet.view(), t))
        if 72.5 <= t < 90.0:
            assert "report" in detector.unjudged.get(JOB, "")
        t += INTERVAL
    # Alerted before the gap; after it the window starts again from the node's return.
    window = TelemetryHangConfig().alert_seconds
    assert found and min(t for t, _ in found) < 60.0
    after = [t for t, _ in found if t >= 72.5]
    assert after and min(after) >= 90.0 + window


def test_restart_must_not_come_before_the_alert() -> None:
    with pytest.raises(ValidationError, match="restart_seconds"):
        TelemetryHangConfig(alert_seconds=120, restart_seconds=60)
