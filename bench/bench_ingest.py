"""Aggregator ingest rate: JSON bytes -> ``Report.model_validate_json`` -> ``Engine.ingest``.

Realistic 8-GPU reports (8 H100s with every counter, 8 NDR ports with their sysfs and hw
counters, 8 training ranks) from a fleet of nodes, each report a later one of its node's boot,
so counter deltas, ring buffers and job membership all do their work. One thread, one core.
"""

from __future__ import annotations

import gc
import time

from agent.wire import Event, GpuState, PortState, RankSummary, Report
from aggregator.app import tune_gc
from aggregator.config import AggregatorConfig
from aggregator.engine import Engine
from aggregator.sink import RecordingSink
from bench.measure import Measurement

NODES = 500
ROUNDS = 8
INTERVAL_SECONDS = 2.5

_PORT_COUNTERS = (
    "symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors", "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors", "port_xmit_discards", "port_xmit_constraint_errors",
    "port_rcv_constraint_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
    "VL15_dropped", "port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
    "unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets",
    "port_xmit_wait", "np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled", "out_of_sequence",
    "packet_seq_err", "local_ack_timeout_err", "rnr_nak_retry_err", "out_of_buffer", "duplicate_request",
)


def _report(node: int, seq: int, ts: float) -> Report:
    name = f"gpu-{node:05d}"
    gpus = [GpuState(
        index=i, uuid=f"GPU-{node:05d}-{i}", name="NVIDIA H100 80GB HBM3", pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
        utilization_gpu_ratio=0.97, utilization_memory_ratio=0.41, memory_used_bytes=7.1e10, memory_total_bytes=8.5e10,
        sm_clock_hertz=1.98e9, sm_clock_max_hertz=1.98e9, memory_clock_hertz=2.619e9, temperature_celsius=61.0 + i,
        memory_temperature_celsius=70.0, slowdown_temperature_celsius=87.0, shutdown_temperature_celsius=92.0,
        memory_max_temperature_celsius=95.0, power_watts=640.0 + i, power_limit_watts=700.0,
        energy_joules=1.0e9 + seq * 1600.0, performance_state=0, clock_event_reasons=["sw_power_cap"],
        ecc_corrected_volatile=seq // 40, ecc_uncorrected_volatile=0, ecc_corrected_aggregate=12 + seq // 40,
        ecc_uncorrected_aggregate=0, retired_pages_sbe=0, retired_pages_dbe=0, retired_pages_pending=False,
        remapped_rows_correctable=0, remapped_rows_uncorrectable=0, remap_pending=False, remap_failure=False,
        pcie_replay_total=40 + seq // 100, nvlink_crc_errors_total=0, nvlink_replay_errors_total=0,
        nvlink_recovery_errors_total=0, nvlink_links_active=18) for i in range(8)]
    ports = []
    for p in range(8):
        counters = {c: 0 for c in _PORT_COUNTERS}
        counters.update(port_xmit_data=seq * 10**11, port_rcv_data=seq * 10**11, port_xmit_packets=seq * 10**7,
                        port_rcv_packets=seq * 10**7, port_xmit_wait=seq * 1000)
        ports.append(PortState(device=f"mlx5_{p}", port=1, state="ACTIVE", phys_state="LinkUp",
                               rate_bits_per_second=4e11, link_layer="InfiniBand", counters=counters,
                               deltas={"port_xmit_data": 10**11}, rates_per_second={"port_xmit_data": 4e10}))
    ranks = [RankSummary(job="llm-405b", rank=node * 8 + r, gpu=r, pid=4000 + r, window_seconds=INTERVAL_SECONDS,
                         steps=2, last_step=seq * 2, last_progress_ts=ts, step_seconds_p50=1.21,
                         step_seconds_p90=1.25, compute_seconds_p50=0.91, compute_seconds_p90=0.95,
                         comm_seconds_p50=0.28, comm_seconds_p90=0.31, data_seconds_p50=0.02,
                         data_seconds_p90=0.03) for r in range(8)]
    events = [Event(kind="xid", ts=ts, code=13, gpu=3, message="Graphics SM Warp Exception", source="kmsg")] \
        if (node + seq) % 97 == 0 else []
    return Report(node=name, boot_id=f"{node:032x}", seq=seq, ts=ts, interval_seconds=INTERVAL_SECONDS,
                  topology={"row": f"row-{node // 256}", "rack": f"rack-{node // 8}",
                            "leaf_switch": f"leaf-{node // 32}"},
                  gpus=gpus, ports=ports, ranks=ranks, events=events)


def payloads() -> list[tuple[float, bytes]]:
    out: list[tuple[float, bytes]] = []
    for seq in range(1, ROUNDS + 1):
        ts = 1.7e9 + seq * INTERVAL_SECONDS
        out.extend((ts, _report(n, seq, ts).model_dump_json(exclude_none=True).encode()) for n in range(NODES))
    return out


def measure() -> list[Measurement]:
    bodies = payloads()
    # The service's own collector settings (aggregator.app.serve applies the same).
    thresholds = gc.get_threshold()
    tune_gc()
    size = sum(len(b) for _, b in bodies) / len(bodies)
    engine = Engine(AggregatorConfig(), RecordingSink())
    validate = Report.model_validate_json
    ingest = engine.ingest
    # Warm-up: the first round creates every node's state; steady state is what the budget is about.
    warm = NODES
    for ts, body in bodies[:warm]:
        ingest(validate(body), ts)
    started = time.process_time()
    for ts, body in bodies[warm:]:
        ingest(validate(body), ts)
    cpu = time.process_time() - started
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    rate = (len(bodies) - warm) / cpu
    return [Measurement("aggregator ingest, 8-GPU reports, one core", round(rate), "reports/s", 5000,
                        higher_is_better=True,
                        note=f"{size / 1024:.1f} KiB JSON each; validate + ingest, {NODES} nodes x "
                             f"{ROUNDS - 1} rounds, CPU time")]


if __name__ == "__main__":
    for m in measure():
        print(m)
