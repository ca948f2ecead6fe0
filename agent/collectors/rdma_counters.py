"""The RDMA collector's vocabulary: IBTA port counters, their metrics, sysfs and ethtool formats.

Declares every metric the ``rdma`` collector emits (each counters/ file with its IBTA width and
scale, the counters_ext/ 64-bit twins) and parses a port's state and rate files and ``ethtool -S``
output. It reads no file and keeps no state: ``agent.collectors.rdma`` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vigil.agent.metric import MetricKind, MetricSpec

# IBTA port states (PortInfo.PortState) and physical states (PortInfo.PortPhysicalState) as the
# kernel prints them ("4: ACTIVE", "5: LinkUp"); a port is up only when both say so.
STATE_ACTIVE = 4
PHYS_STATE_LINK_UP = 5

_PORT_LABELS = ("device", "port")

DEVICE_INFO = MetricSpec("vigil_rdma_device_info", MetricKind.INFO,
                         "RDMA device (HCA) identity.", labels=("device", "hca_type", "fw_ver", "board_id"))
PORT_INFO = MetricSpec("vigil_rdma_port_info", MetricKind.INFO,
                       "RDMA port link layer (InfiniBand or Ethernet for RoCE) and its netdev, if any.",
                       labels=("device", "port", "link_layer", "netdev"))
PORT_STATE = MetricSpec("vigil_rdma_port_state", MetricKind.GAUGE,
                        "IBTA logical port state code (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER); "
                        "the label carries its name.", labels=("device", "port", "state"))
PORT_PHYSICAL_STATE = MetricSpec("vigil_rdma_port_physical_state", MetricKind.GAUGE,
                                 "IBTA physical port state code (2 Polling, 3 Disabled, 5 LinkUp, "
                                 "6 LinkErrorRecovery, ...); the label carries its name.",
                                 labels=("device", "port", "physical_state"))
PORT_RATE = MetricSpec("vigil_rdma_port_rate_bytes_per_second", MetricKind.GAUGE,
                       "Port data rate as the kernel reports it (its Gb/sec divided by 8: Prometheus' base "
                       "unit is bytes, as node_exporter's node_infiniband_rate_bytes_per_second).",
                       labels=_PORT_LABELS, unit="bytes_per_second")
COUNTER_SATURATED = MetricSpec("vigil_rdma_port_stat_saturated", MetricKind.GAUGE,
                               "1 when a fixed-width IBTA PortCounters counter sits at its maximum and "
                               "stopped counting (its increase is then unknown), else 0.",
                               labels=("device", "port", "counter"))
COUNTER_RESETS = MetricSpec("vigil_rdma_port_stat_resets_total", MetricKind.COUNTER,
                            "Times a port counter went backwards (driver reload, counter reset, wrap).",
                            labels=_PORT_LABELS)
DRIVER_COUNTER = MetricSpec("vigil_rdma_port_driver_stat_total", MetricKind.COUNTER,
                            "A counters/ or hw_counters/ file with no dedicated metric, by file name.",
                            labels=("device", "port", "counter"))
CARRIER_CHANGES = MetricSpec("vigil_rdma_port_carrier_changes_total", MetricKind.COUNTER,
                             "Carrier up/down transitions of a RoCE port's netdev.", labels=_PORT_LABELS)
PFC_PAUSE_FRAMES = MetricSpec("vigil_rdma_port_pfc_pause_frames_total", MetricKind.COUNTER,
                              "PFC pause frames per priority (ethtool -S rx/tx_prio<p>_pause).",
                              labels=("device", "port", "priority", "direction"))
PFC_PAUSE_DURATION = MetricSpec("vigil_rdma_port_pfc_pause_duration_seconds_total", MetricKind.COUNTER,
                                "Time paused by PFC per priority (ethtool -S rx/tx_prio<p>_pause_duration).",
                                labels=("device", "port", "priority", "direction"), unit="seconds")
READ_ERRORS = MetricSpec("vigil_rdma_read_errors_total", MetricKind.COUNTER,
                         "sysfs files or ethtool output that could not be used, by reason "
                         "(unreadable, empty, malformed, ethtool_failed, ethtool_malformed).",
                         labels=("device", "reason"))


@dataclass(frozen=True, slots=True)
class CounterDef:
    """A sysfs counter file with a dedicated metric."""

    spec: MetricSpec
    # Width in bits of the IBTA PortCounters field behind the file: such a counter stops at
    # 2**width - 1 instead of wrapping. None where the width is not fixed (64-bit extended
    # counters, mlx5 hw_counters).
    width_bits: int | None = None
    # Raw value * scale = the metric's unit (data counters count 4-byte words).
    scale: int = 1


def _counter(name: str, help_: str, width_bits: int | None = None, scale: int = 1, unit: str = "") -> CounterDef:
    return CounterDef(MetricSpec(name, MetricKind.COUNTER, help_, labels=_PORT_LABELS, unit=unit), width_bits, scale)


# counters/: the IBTA PortCounters / PortCountersExtended attributes. Widths from the IBTA spec's
# PortCounters attribute as the kernel decodes it (drivers/infiniband/core/sysfs.c, PORT_PMA_ATTR
# width column: symbol_error 16, link_error_recovery 8, link_downed 8, port_rcv_errors 16, ...,
# local_link_integrity_errors 4, excessive_buffer_overrun_errors 4, VL15_dropped 16,
# port_xmit_wait 32). Data and packet counters are 64 bits wide when the HCA supports
# PortCountersExtended (every ConnectX since ConnectX-3), so no saturation value is assumed.
# PortXmitData/PortRcvData count octets divided by 4 (IBTA PortCounters), hence scale=4.
COUNTERS: dict[str, CounterDef] = {
    "symbol_error": _counter("vigil_rdma_port_symbol_errors_total",
                             "Minor link errors detected on one or more physical lanes.", 16),
    "link_error_recovery": _counter("vigil_rdma_port_link_error_recoveries_total",
                                    "Times the link error recovery process completed successfully.", 8),
    "link_downed": _counter("vigil_rdma_port_link_downed_total",
                            "Times the link error recovery process failed and the link went down.", 8),
    "port_rcv_errors": _counter("vigil_rdma_port_receive_errors_total",
                                "Received packets containing an error.", 16),
    "port_rcv_remote_physical_errors": _counter("vigil_rdma_port_receive_remote_physical_errors_total",
                                                "Received packets marked with the EBP delimiter.", 16),
    "port_rcv_switch_relay_errors": _counter("vigil_rdma_port_receive_switch_relay_errors_total",
                                             "Received packets discarded because they could not be forwarded.",
                                             16),
    "port_xmit_discards": _counter("vigil_rdma_port_transmit_discards_total",
                                   "Outbound packets discarded (port down or congested).", 16),
    # Not in the kernel's IBTA PortCounters table; some drivers (mlx4, as node_exporter's fixture
    # tree shows) add it to counters/. Its width is not documented, so no saturation is assumed.
    "port_rcv_discards": _counter("vigil_rdma_port_receive_discards_total",
                                  "Inbound packets discarded by the port (port down or congested)."),
    "port_xmit_constraint_errors": _counter("vigil_rdma_port_transmit_constraint_errors_total",
                                            "Outbound packets not sent because of partition/raw constraints.", 8),
    "port_rcv_constraint_errors": _counter("vigil_rdma_port_receive_constraint_errors_total",
                                           "Inbound packets discarded because of partition/raw constraints.", 8),
    "local_link_integrity_errors": _counter("vigil_rdma_port_local_link_integrity_errors_total",
                                            "Times local physical errors exceeded the LocalPhyErrors threshold.",
                                            4),
    "excessive_buffer_overrun_errors": _counter("vigil_rdma_port_excessive_buffer_overrun_errors_total",
                                                "Times consecutive flow-control update periods had overruns.", 4),
    "VL15_dropped": _counter("vigil_rdma_port_vl15_dropped_total",
                             "Incoming VL15 (subnet management) packets dropped for lack of buffers.", 16),
    "port_xmit_wait": _counter("vigil_rdma_port_transmit_wait_total",
                               "Ticks during which the port had data to send but sent none (congestion).", 32),
    "port_xmit_data": _counter("vigil_rdma_port_data_transmitted_bytes_total",
                               "Data bytes transmitted, all VLs.", scale=4, unit="bytes"),
    "port_rcv_data": _counter("vigil_rdma_port_data_received_bytes_total",
                              "Data bytes received, all VLs.", scale=4, unit="bytes"),
    "port_xmit_packets": _counter("vigil_rdma_port_packets_transmitted_total", "Packets transmitted, all VLs."),
    "port_rcv_packets": _counter("vigil_rdma_port_packets_received_total", "Packets received, all VLs."),
    "unicast_xmit_packets": _counter("vigil_rdma_port_unicast_packets_transmitted_total",
                                     "Unicast packets transmitted."),
    "unicast_rcv_packets": _counter("vigil_rdma_port_unicast_packets_received_total", "Unicast packets received."),
    "multicast_xmit_packets": _counter("vigil_rdma_port_multicast_packets_transmitted_total",
                                       "Multicast packets transmitted."),
    "multicast_rcv_packets": _counter("vigil_rdma_port_multicast_packets_received_total",
                                      "Multicast packets received."),
    # hw_counters/ (mlx5): the RoCE transport and congestion-control counters the aggregator reads.
    # Names and meanings: NVIDIA "Understanding mlx5 Linux Counters".
    "out_of_sequence": _counter("vigil_rdma_port_out_of_sequence_total",
                                "Out-of-sequence packets received (a dropped packet upstream)."),
    "packet_seq_err": _counter("vigil_rdma_port_packet_sequence_errors_total",
                               "NAK sequence error packets received."),
    "local_ack_timeout_err": _counter("vigil_rdma_port_local_ack_timeout_errors_total",
                                      "Times a sender's QP ack timer expired (lost packets or acks)."),
    "roce_adp_retrans": _counter("vigil_rdma_port_adaptive_retransmissions_total",
                                 "RoCE adaptive retransmissions."),
    "out_of_buffer": _counter("vigil_rdma_port_out_of_buffer_drops_total",
                              "Packets dropped for lack of a posted receive WQE."),
    "np_ecn_marked_roce_packets": _counter("vigil_rdma_port_ecn_marked_packets_total",
                                           "RoCE packets received with an ECN congestion mark."),
    "np_cnp_sent": _counter("vigil_rdma_port_cnp_sent_total",
                            "Congestion notification packets sent (this port was the notification point)."),
    "rp_cnp_handled": _counter("vigil_rdma_port_cnp_handled_total",
                               "Congestion notification packets handled by the sender (reaction point)."),
}

# counters_ext/: the 64-bit PortCountersExtended values that mlx4 and other older drivers keep
# beside counters/ (Linux drivers/infiniband/hw/mlx4/sysfs.c and the procfs/node_exporter
# "legacy" counters), while their counters/ twin is 32 bits wide or stays 0. When both exist the
# 64-bit file is read: it keeps counting where a 32-bit PortCounters field stops (2**32 words of
# data is 16 GiB, a minute at 200 Gb/s), and one source per counter means a value never jumps
# between two files. Each maps to the counters/ name whose metric it feeds.
EXT_COUNTERS: dict[str, str] = {
    "port_xmit_data_64": "port_xmit_data",
    "port_rcv_data_64": "port_rcv_data",
    "port_xmit_packets_64": "port_xmit_packets",
    "port_rcv_packets_64": "port_rcv_packets",
    "port_unicast_xmit_packets": "unicast_xmit_packets",
    "port_unicast_rcv_packets": "unicast_rcv_packets",
    "port_multicast_xmit_packets": "multicast_xmit_packets",
    "port_multicast_rcv_packets": "multicast_rcv_packets",
}

# hw_counters/lifespan is the kernel's cache lifetime of hw_counters in ms: a setting, not a count.
NOT_COUNTERS = frozenset({"lifespan"})

SPECS: tuple[MetricSpec, ...] = (
    DEVICE_INFO, PORT_INFO, PORT_STATE, PORT_PHYSICAL_STATE, PORT_RATE, COUNTER_SATURATED, COUNTER_RESETS,
    DRIVER_COUNTER, CARRIER_CHANGES, PFC_PAUSE_FRAMES, PFC_PAUSE_DURATION, READ_ERRORS,
    *(d.spec for d in COUNTERS.values()),
)

_STATE_RE = re.compile(r"^(\d+):\s*(\S.*)$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*Gb/sec")
_ETHTOOL_LINE_RE = re.compile(r"^\s*([^:\s]+):\s*(-?\d+)\s*$")
PFC_RE = re.compile(r"^(rx|tx)_prio([0-7])_pause(_duration)?$")
PAUSE_DURATION_UNIT_SECONDS = 1e-6  # mlx5 *_pause_duration counters count microseconds (kernel mlx5 counters.rst)


def parse_state(text: str) -> tuple[int, str]:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``; raises ValueError on anything else."""
    m = _STATE_RE.match(text.strip())
    if m is None:
        raise ValueError(f"not a '<code>: <name>' state: {text!r}")
    return int(m.group(1)), m.group(2).strip()


def parse_rate_bits_per_second(text: str) -> float:
    """``"400 Gb/sec (4X NDR)"`` -> ``4e11``; raises ValueError on anything else."""
    m = _RATE_RE.match(text.strip())
    if m is None:
        raise ValueError(f"not a '<n> Gb/sec' rate: {text!r}")
    return float(m.group(1)) * 1e9


def parse_ethtool_stats(text: str) -> dict[str, int]:
    """Parse ``ethtool -S`` output ("NIC statistics:" then "name: value" lines) into a dict.

    Raises ValueError when the header is missing; lines that are not "name: integer" are skipped.
    """
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    if first.strip() != "NIC statistics:":
        raise ValueError("not ethtool -S output (no 'NIC statistics:' header)")
    stats: dict[str, int] = {}
    for line in lines:
        m = _ETHTOOL_LINE_RE.match(line)
        if m is not None:
            stats[m.group(1)] = int(m.group(2))
    return stats
