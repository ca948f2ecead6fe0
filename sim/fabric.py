"""Simulated RDMA HCAs: a ``/sys/class/infiniband`` tree per node that the real rdma collector
reads through ``Seams.sysfs_root``, and the ``ethtool -S`` answers of RoCE ports' netdevs
through ``Seams.run``.

The layout and value formats follow a real ConnectX-7 NDR node (``hca_type`` MT4129,
``ports/1/state`` "4: ACTIVE", ``rate`` "400 Gb/sec (4X NDR)", IB PMA ``counters/*``; a RoCE
port adds ``hw_counters/*``, its netdev under ``class/net`` and mlx5's per-priority PFC pause
counters; see tests/fixtures/sim/PROVENANCE.md). Port faults (link down, flaps, error and
congestion counters) are written into the tree as the kernel would show them. Nodes without
port faults share one read-only tree. It emits nothing itself and judges nothing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

# IB PMA port counters (IBTA spec vol. 1, PortCounters attribute) as the mlx5 driver exposes
# them under ports/N/counters; a healthy idle port shows them at 0.
COUNTERS = (
    "symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
    "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors", "port_xmit_discards",
    "port_xmit_constraint_errors", "port_rcv_constraint_errors", "local_link_integrity_errors",
    "excessive_buffer_overrun_errors", "VL15_dropped", "port_xmit_data", "port_rcv_data",
    "port_xmit_packets", "port_rcv_packets", "port_xmit_wait", "unicast_xmit_packets",
    "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets",
)
# PMA error counters are narrow and saturate rather than wrap (IBTA vol. 1, PortCounters:
# SymbolErrorCounter and PortRcvErrors 16 bits, LinkErrorRecovery and LinkDowned 8 bits,
# LocalLinkIntegrityErrors and ExcessiveBufferOverrunErrors 4 bits).
_SATURATE = {
    "symbol_error": 65535, "port_rcv_errors": 65535, "link_error_recovery": 255, "link_downed": 255,
    "local_link_integrity_errors": 15, "excessive_buffer_overrun_errors": 15,
}
# hw_counters/ of a RoCE port: the names of a real ConnectX-7 RoCE port's directory
# (tests/fixtures/sysfs/h100, mlx5_bond_0) and the congestion-control counters mlx5 adds where
# DCQCN runs (NVIDIA "Understanding mlx5 Linux Counters": np_* at the notification point,
# rp_* at the reaction point).
HW_COUNTERS = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer", "out_of_sequence",
    "packet_seq_err", "req_cqe_error", "req_cqe_flush_error", "req_remote_access_errors",
    "req_remote_invalid_request", "resp_cqe_error", "resp_cqe_flush_error", "resp_local_length_error",
    "resp_remote_access_errors", "rnr_nak_retry_err", "roce_adp_retrans", "roce_adp_retrans_to",
    "roce_slow_restart", "roce_slow_restart_cnps", "roce_slow_restart_trans", "rx_atomic_requests",
    "rx_dct_connect", "rx_icrc_encapsulated", "rx_read_requests", "rx_write_requests",
    "np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled", "rp_cnp_ignored",
)
# PFC pause counters per priority as mlx5's ethtool -S names them (kernel mlx5 counters.rst;
# durations in microseconds).
PFC_COUNTERS = tuple(f"{d}_prio{p}_pause{x}" for p in range(8) for d in ("rx", "tx") for x in ("", "_duration"))
ACTIVE = ("4: ACTIVE", "5: LinkUp")
DOWN = ("1: DOWN", "3: Disabled")
# A port renegotiating after a flap passes through Polling before LinkUp (IBTA vol. 2 PortPhysicalState).
POLLING = ("2: INIT", "2: Polling")


def device_name(hca: int) -> str:
    return f"mlx5_{hca}"


def netdev_name(hca: int) -> str:
    """The Ethernet netdev carrying RoCE HCA ``hca`` (mlx5's predictable name, port 0)."""
    return f"ens{hca + 1}f0np0"


def build_tree(root: Path, hcas: int, link_layer: str = "InfiniBand") -> Path:
    """Write a healthy tree for ``hcas`` single-port NDR HCAs under ``root``; returns ``root``
    (the value for ``Seams.sysfs_root``). ``link_layer`` "Ethernet": RoCE ports, each with its
    netdev and ``hw_counters/``."""
    roce = link_layer == "Ethernet"
    for hca in range(hcas):
        dev = root / "class" / "infiniband" / device_name(hca)
        port = dev / "ports" / "1"
        (port / "counters").mkdir(parents=True, exist_ok=True)
        (dev / "hca_type").write_text("MT4129\n")
        (dev / "fw_ver").write_text("28.41.1000\n")
        (dev / "board_id").write_text("MT_0000000838\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text(f"{link_layer}\n")
        _write_state(port, ACTIVE)
        for counter in COUNTERS:
            (port / "counters" / counter).write_text("0\n")
        if roce:
            (port / "hw_counters").mkdir(exist_ok=True)
            (port / "hw_counters" / "lifespan").write_text("10\n")
            for counter in HW_COUNTERS:
                (port / "hw_counters" / counter).write_text("0\n")
            (port / "gid_attrs" / "ndevs").mkdir(parents=True, exist_ok=True)
            (port / "gid_attrs" / "ndevs" / "0").write_text(netdev_name(hca) + "\n")
            net = root / "class" / "net" / netdev_name(hca)
            net.mkdir(parents=True, exist_ok=True)
            (net / "carrier_changes").write_text("0\n")
    return root


def _port(root: Path, hca: int) -> Path:
    return root / "class" / "infiniband" / device_name(hca) / "ports" / "1"


def _write_state(port: Path, state: tuple[str, str]) -> None:
    (port / "state").write_text(state[0] + "\n")
    (port / "phys_state").write_text(state[1] + "\n")


class NodeFabric:
    """One node's writable HCA tree, driven by the simulator's port faults, and its RoCE
    netdevs' PFC counters (what ``ethtool -S`` prints)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pfc: dict[str, dict[str, int]] = {}  # netdev -> ethtool counter -> value

    def reset(self, hcas: int, link_layer: str) -> None:
        """Counters back to zero, every port up (a reboot reloads the driver)."""
        build_tree(self.root, hcas, link_layer)
        self.pfc.clear()

    def set_link(self, hca: int, up: bool, *, polling: bool = False) -> None:
        port = _port(self.root, hca)
        was_up = (port / "state").read_text().strip() == ACTIVE[0]
        if up:
            _write_state(port, ACTIVE)
        else:
            if was_up:
                # Every transition out of LinkUp counts once in link_downed (IBTA PortCounters).
                self.add_counter(hca, "link_downed", 1)
            _write_state(port, POLLING if polling else DOWN)
        carrier = self.root / "class" / "net" / netdev_name(hca) / "carrier_changes"
        if was_up != up and carrier.exists():  # a RoCE netdev counts every carrier transition
            carrier.write_text(f"{int(carrier.read_text().strip() or 0) + 1}\n")

    def add_counter(self, hca: int, counter: str, amount: int) -> None:
        """Grow a ``counters/`` or ``hw_counters/`` file, or a PFC counter of the port's netdev."""
        if counter in PFC_COUNTERS:
            stats = self.pfc.setdefault(netdev_name(hca), {})
            stats[counter] = stats.get(counter, 0) + amount
            return
        port = _port(self.root, hca)
        sub = "hw_counters" if counter in HW_COUNTERS else "counters"
        path = port / sub / counter
        value = int(path.read_text().strip() or 0) + amount
        path.write_text(f"{min(value, _SATURATE.get(counter, 2**64 - 1))}\n")


class Ethtool:
    """The node's ``ethtool -S <netdev>`` (``Seams.run``): mlx5's output format, the PFC pause
    counters of its RoCE netdevs (zero until a congestion fault grows them). Any other command
    fails as a missing binary would; nothing is executed."""

    def __init__(self, fabric: NodeFabric | None, hcas: int) -> None:
        self._fabric = fabric
        self._netdevs = {netdev_name(h) for h in range(hcas)}

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        if len(argv) != 3 or argv[0] != "ethtool" or argv[1] != "-S" or argv[2] not in self._netdevs:
            raise subprocess.CalledProcessError(1, list(argv), "", "no such device")
        stats = self._fabric.pfc.get(argv[2], {}) if self._fabric is not None else {}
        lines = ["NIC statistics:", *(f"     {name}: {stats.get(name, 0)}" for name in PFC_COUNTERS)]
        return "\n".join(lines) + "\n"
