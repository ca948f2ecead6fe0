"""Simulated InfiniBand HCAs: a ``/sys/class/infiniband`` tree per node that the real rdma
collector reads through ``Seams.sysfs_root``.

The layout and value formats follow a real ConnectX-7 NDR node (``hca_type`` MT4129,
``ports/1/state`` "4: ACTIVE", ``rate`` "400 Gb/sec (4X NDR)", IB PMA ``counters/*``; see
tests/fixtures/sim/PROVENANCE.md). Port faults (link down, flaps, error counters) are written
into the tree as the kernel would show them. Nodes without port faults share one read-only tree.
It emits nothing itself and judges nothing.
"""

from __future__ import annotations

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
ACTIVE = ("4: ACTIVE", "5: LinkUp")
DOWN = ("1: DOWN", "3: Disabled")
# A port renegotiating after a flap passes through Polling before LinkUp (IBTA vol. 2 PortPhysicalState).
POLLING = ("2: INIT", "2: Polling")


def device_name(hca: int) -> str:
    return f"mlx5_{hca}"


def build_tree(root: Path, hcas: int) -> Path:
    """Write a healthy tree for ``hcas`` single-port NDR HCAs under ``root``; returns ``root``
    (the value for ``Seams.sysfs_root``)."""
    for hca in range(hcas):
        dev = root / "class" / "infiniband" / device_name(hca)
        port = dev / "ports" / "1"
        (port / "counters").mkdir(parents=True, exist_ok=True)
        (dev / "hca_type").write_text("MT4129\n")
        (dev / "fw_ver").write_text("28.41.1000\n")
        (dev / "board_id").write_text("MT_0000000838\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
        _write_state(port, ACTIVE)
        for counter in COUNTERS:
            (port / "counters" / counter).write_text("0\n")
    return root


def _port(root: Path, hca: int) -> Path:
    return root / "class" / "infiniband" / device_name(hca) / "ports" / "1"


def _write_state(port: Path, state: tuple[str, str]) -> None:
    (port / "state").write_text(state[0] + "\n")
    (port / "phys_state").write_text(state[1] + "\n")


class NodeFabric:
    """One node's writable HCA tree, driven by the simulator's port faults."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def set_link(self, hca: int, up: bool, *, polling: bool = False) -> None:
        port = _port(self.root, hca)
        if up:
            _write_state(port, ACTIVE)
            return
        if (port / "state").read_text().strip() == ACTIVE[0]:
            # Every transition out of LinkUp counts once in link_downed (IBTA PortCounters).
            self.add_counter(hca, "link_downed", 1)
        _write_state(port, POLLING if polling else DOWN)

    def add_counter(self, hca: int, counter: str, amount: int) -> None:
        path = _port(self.root, hca) / "counters" / counter
        value = int(path.read_text().strip() or 0) + amount
        path.write_text(f"{min(value, _SATURATE.get(counter, 2**64 - 1))}\n")
