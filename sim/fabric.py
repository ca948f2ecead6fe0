"""Simulated RDMA HCAs and PCI devices: a ``/sys/class/infiniband`` and ``/sys/bus/pci/devices``
tree per node that the real rdma, pcie and node_config collectors read through
``Seams.sysfs_root``, and the node's commands (``ethtool -S`` of RoCE ports' netdevs, ``systemctl
show`` of the Fabric Manager) through ``Seams.run``.

The layout and value formats follow a real ConnectX-7 NDR node (``hca_type`` MT4129,
``ports/1/state`` "4: ACTIVE", ``rate`` "400 Gb/sec (4X NDR)", IB PMA ``counters/*``; a RoCE
port adds ``hw_counters/*``, its netdev under ``class/net`` and mlx5's per-priority PFC pause
counters; see tests/fixtures/sim/PROVENANCE.md). Port faults (link down, flaps, error and
congestion counters) are written into the tree as the kernel would show them; so are a PCIe
link trained down, AER counts, another HCA firmware or OFED release (tests/fixtures/sysfs/PROVENANCE.md,
"pci/": the file formats). Nodes without such faults share one read-only tree, and its rdma
collectors share one descriptor per attribute (``SharedAttributeFiles``). It emits nothing itself
and judges nothing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from vigil.agent.collectors.rdma import AttributeFiles

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


def build_tree(root: Path, hcas: int, link_layer: str = "InfiniBand", *, gpu_bus_ids: Sequence[str] = (),
               nvswitches: int = 0) -> Path:
    """Write a healthy tree for ``hcas`` single-port NDR HCAs under ``root``; returns ``root``
    (the value for ``Seams.sysfs_root``). ``link_layer`` "Ethernet": RoCE ports, each with its
    netdev and ``hw_counters/``. Each HCA is a PCI function (its ``device`` link); so is each GPU
    of ``gpu_bus_ids`` (NVML's or sysfs's form: a profile's ``pcie_bus_ids``) and each of
    ``nvswitches`` NVSwitches (an HGX baseboard's: what makes the Fabric Manager expected)."""
    roce = link_layer == "Ethernet"
    gpus = [sysfs_bus_id(b) for b in gpu_bus_ids]
    buses = _free_bus_ids(set(gpus), hcas + nvswitches)
    for gpu in gpus:
        _write_pci_function(root, gpu, GPU_PCI)
    for bdf in buses[hcas:]:
        _write_pci_function(root, bdf, NVSWITCH_PCI)
    module = root / "module" / "mlx5_core"
    module.mkdir(parents=True, exist_ok=True)
    (module / "version").write_text(OFED_VERSION + "\n")
    for hca in range(hcas):
        dev = root / "class" / "infiniband" / device_name(hca)
        port = dev / "ports" / "1"
        (port / "counters").mkdir(parents=True, exist_ok=True)
        _write_pci_function(root, buses[hca], HCA_PCI_ETHERNET if roce else HCA_PCI)
        if not (dev / "device").is_symlink():
            (dev / "device").symlink_to(Path("..", "..", "..", "bus", "pci", "devices", buses[hca]))
        (dev / "hca_type").write_text("MT4129\n")
        (dev / "fw_ver").write_text(HCA_FIRMWARE + "\n")
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


# PCI functions as sysfs shows them: vendor, device, class (PCI Code and ID Assignment spec) and
# link. ConnectX-7 (15b3:1021; 0x0207 InfiniBand controller, 0x0200 Ethernet for RoCE) and H100 SXM5
# (10de:2330, 0x0302 3D controller) at PCIe Gen5 x16; an HGX H100 NVSwitch (10de:22a3, 0x0680
# bridge: NVIDIA Fabric Manager user guide, "eight GPUs and four NVSwitches on the PCIe tree").
HCA_PCI = ("0x15b3", "0x1021", "0x020700", 5, 16)
HCA_PCI_ETHERNET = ("0x15b3", "0x1021", "0x020000", 5, 16)
GPU_PCI = ("0x10de", "0x2330", "0x030200", 5, 16)
NVSWITCH_PCI = ("0x10de", "0x22a3", "0x068000", 4, 2)
# Link speed text per generation (the kernel's pci_speed_string).
SPEED_TEXT = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe", 5: "32.0 GT/s PCIe",
              6: "64.0 GT/s PCIe"}
# AER files' error names as kernel 6.x prints them, in order (drivers/pci/pcie/aer.c
# aer_correctable_error_string / aer_uncorrectable_error_string; the real files in
# tests/fixtures/sysfs/pci/), and each file's total line.
AER_COR_NAMES = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
AER_UNCOR_NAMES = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
                   "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
                   "PoisonTLPBlocked")
AER_FILES = {"correctable": ("aer_dev_correctable", AER_COR_NAMES, "TOTAL_ERR_COR"),
             "nonfatal": ("aer_dev_nonfatal", AER_UNCOR_NAMES, "TOTAL_ERR_NONFATAL"),
             "fatal": ("aer_dev_fatal", AER_UNCOR_NAMES, "TOTAL_ERR_FATAL")}
# The error each severity's simulated count is booked under (a bad TLP is the usual correctable
# error of a marginal link; a completion timeout the usual uncorrectable one).
AER_ERROR_OF = {"correctable": "BadTLP", "nonfatal": "CmpltTO", "fatal": "CmpltTO"}
HCA_FIRMWARE = "28.41.1000"
# MLNX_OFED's mlx5_core carries its release in /sys/module/mlx5_core/version (the inbox driver
# has no such file); 23.10-1.1.9 is the driver of MLNX_OFED_LINUX-23.10-1.1.9.0.
OFED_VERSION = "23.10-1.1.9"
# systemd's ActiveState of the nvidia-fabricmanager unit on a healthy NVSwitch node.
FABRIC_MANAGER_ACTIVE = "active"
FABRIC_MANAGER_UNIT = "nvidia-fabricmanager.service"


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` (or sysfs's own form) as sysfs names the device: ``0000:3b:00.0``."""
    domain, rest = bus_id.strip().split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def hca_bus_id(root: Path, hca: int) -> str:
    """The PCI function behind HCA ``hca`` (its ``device`` link's name)."""
    return (root / "class" / "infiniband" / device_name(hca) / "device").readlink().name


def _free_bus_ids(taken: set[str], count: int) -> list[str]:
    """``count`` bus ids for HCAs and NVSwitches that no GPU of the node uses, stable per node."""
    out: list[str] = []
    bus = 0x05
    while len(out) < count:
        bdf = f"0000:{bus:02x}:00.0"
        if bdf not in taken:
            out.append(bdf)
        bus = (bus + 0x0B) % 0x100
    return out


def _write_pci_function(root: Path, bdf: str, spec: tuple[str, str, str, int, int]) -> None:
    vendor, device, pci_class, generation, width = spec
    dev = root / "bus" / "pci" / "devices" / bdf
    dev.mkdir(parents=True, exist_ok=True)
    for name, text in (("vendor", vendor), ("device", device), ("class", pci_class),
                       ("current_link_speed", SPEED_TEXT[generation]), ("max_link_speed", SPEED_TEXT[generation]),
                       ("current_link_width", str(width)), ("max_link_width", str(width))):
        (dev / name).write_text(text + "\n")
    for severity in AER_FILES:
        _write_aer(dev, severity, 0)


def _write_aer(dev: Path, severity: str, total: int) -> None:
    """An ``aer_dev_*`` file with ``total`` errors, all booked under AER_ERROR_OF[severity]."""
    file, names, total_name = AER_FILES[severity]
    lines = [f"{n} {total if n == AER_ERROR_OF[severity] else 0}" for n in names]
    (dev / file).write_text("\n".join([*lines, f"{total_name} {total}"]) + "\n")


def build_proc(root: Path, kernel: str) -> Path:
    """A ``/proc`` holding only what node_config reads (``sys/kernel/osrelease``); returns ``root``
    (the value for ``Seams.proc_root``). A node of a simulated job that reads processes from its
    own ``proc_root`` gets the file written there too."""
    (root / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (root / "sys" / "kernel" / "osrelease").write_text(kernel + "\n")
    return root


def _port(root: Path, hca: int) -> Path:
    return root / "class" / "infiniband" / device_name(hca) / "ports" / "1"


def _write_state(port: Path, state: tuple[str, str]) -> None:
    (port / "state").write_text(state[0] + "\n")
    (port / "phys_state").write_text(state[1] + "\n")


class NodeFabric:
    """One node's writable HCA tree, driven by the simulator's port faults, and its RoCE
    netdevs' PFC counters (what ``ethtool -S`` prints)."""

    def __init__(self, root: Path, *, gpu_bus_ids: Sequence[str] = (), nvswitches: int = 0) -> None:
        self.root = root
        self.pfc: dict[str, dict[str, int]] = {}  # netdev -> ethtool counter -> value
        # The PCI functions besides the HCAs that build_tree wrote (a reset writes them again).
        self._gpu_bus_ids = tuple(gpu_bus_ids)
        self._nvswitches = nvswitches
        # systemd's ActiveState of the Fabric Manager unit (what ``systemctl show`` answers).
        self.fabric_manager_state = FABRIC_MANAGER_ACTIVE

    def reset(self, hcas: int, link_layer: str) -> None:
        """Counters back to zero, every port up, PCIe links retrained at their maximum and AER
        counts at zero, the Fabric Manager started again (a reboot reloads the driver). Firmware
        and OFED stay as they were: a reboot does not downgrade them."""
        firmware = {h: (self.root / "class" / "infiniband" / device_name(h) / "fw_ver").read_text()
                    for h in range(hcas) if (self.root / "class" / "infiniband" / device_name(h) / "fw_ver").exists()}
        ofed = self.root / "module" / "mlx5_core" / "version"
        ofed_text = ofed.read_text() if ofed.exists() else None
        build_tree(self.root, hcas, link_layer, gpu_bus_ids=self._gpu_bus_ids, nvswitches=self._nvswitches)
        for h, text in firmware.items():
            (self.root / "class" / "infiniband" / device_name(h) / "fw_ver").write_text(text)
        if ofed_text is None:
            ofed.unlink()
        else:
            ofed.write_text(ofed_text)
        self.pfc.clear()
        self.fabric_manager_state = FABRIC_MANAGER_ACTIVE

    # -- PCIe, firmware, OFED, Fabric Manager ----------------------------------------------------

    def pci_device(self, kind: str, index: int) -> Path:
        """The sysfs directory of HCA ``index`` (kind "hca") or of the node's ``index``-th GPU in
        bus order (kind "gpu")."""
        devices = self.root / "bus" / "pci" / "devices"
        if kind == "hca":
            return devices / hca_bus_id(self.root, index)
        gpus = sorted(d.name for d in devices.iterdir() if (d / "vendor").read_text().strip() == GPU_PCI[0]
                      and (d / "class").read_text().startswith("0x0302"))
        return devices / gpus[index]

    def set_pcie_link(self, kind: str, index: int, *, width: int | None = None, generation: int | None = None) -> None:
        """The device's link trained down (or back up): ``current_link_width`` / ``current_link_speed``
        as the kernel shows them; the maxima stay."""
        dev = self.pci_device(kind, index)
        if width is not None:
            (dev / "current_link_width").write_text(f"{width}\n")
        if generation is not None:
            (dev / "current_link_speed").write_text(SPEED_TEXT[generation] + "\n")

    def add_aer(self, kind: str, index: int, severity: str, amount: int) -> None:
        """``amount`` more AER errors of ``severity`` (correctable, nonfatal, fatal) on the device."""
        dev = self.pci_device(kind, index)
        file, _, total_name = AER_FILES[severity]
        total = next(int(line.split()[-1]) for line in (dev / file).read_text().splitlines()
                     if line.startswith(total_name + " "))
        _write_aer(dev, severity, total + amount)

    def set_hca_firmware(self, version: str, hcas: Sequence[int] | None = None) -> None:
        """Another firmware on the HCAs (all, or those listed): their ``fw_ver``."""
        ib = self.root / "class" / "infiniband"
        for dev in sorted(ib.iterdir()):
            if hcas is None or dev.name in {device_name(h) for h in hcas}:
                (dev / "fw_ver").write_text(version + "\n")

    def set_ofed_version(self, version: str | None) -> None:
        """Another MLNX_OFED release's mlx5_core; None: the inbox driver (no version file)."""
        path = self.root / "module" / "mlx5_core" / "version"
        if version is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(version + "\n")

    def set_fabric_manager(self, state: str) -> None:
        """The Fabric Manager unit's systemd ActiveState: "failed" (it crashed), "inactive"
        (stopped), "activating" (restarting), "active"."""
        self.fabric_manager_state = state

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
    """The node's commands (``Seams.run``): ``ethtool -S <netdev>`` in mlx5's output format, the
    PFC pause counters of its RoCE netdevs (zero until a congestion fault grows them), and
    ``systemctl show nvidia-fabricmanager.service -p ActiveState --value`` (the Fabric Manager's
    state: the node's ``NodeFabric.fabric_manager_state``, "active" on a node without faults).
    Any other command fails as a missing binary would; nothing is executed."""

    def __init__(self, fabric: NodeFabric | None, hcas: int) -> None:
        self._fabric = fabric
        self._netdevs = {netdev_name(h) for h in range(hcas)}

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        if list(argv) == ["systemctl", "show", FABRIC_MANAGER_UNIT, "-p", "ActiveState", "--value"]:
            state = self._fabric.fabric_manager_state if self._fabric is not None else FABRIC_MANAGER_ACTIVE
            return state + "\n"
        if len(argv) != 3 or argv[0] != "ethtool" or argv[1] != "-S" or argv[2] not in self._netdevs:
            raise subprocess.CalledProcessError(1, list(argv), "", "no such device")
        stats = self._fabric.pfc.get(argv[2], {}) if self._fabric is not None else {}
        lines = ["NIC statistics:", *(f"     {name}: {stats.get(name, 0)}" for name in PFC_COUNTERS)]
        return "\n".join(lines) + "\n"


class SharedAttributeFiles(AttributeFiles):
    """The rdma collectors' attribute files on the shared read-only tree: one descriptor per file
    for every node that reads it (``AttributeFiles``: each reader preads at offset 0), held until
    ``close_all``. A 1,000-node fleet's own descriptors (~40 a port, 8 ports a node) would be
    far past the process's limit, so without these its collectors read each counter by path
    (open, read, close: 192 files a node); a shared descriptor keeps them on the agent's usual
    kept-open path (a pread each), with one set of descriptors per tree."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def open(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = super().open(path)
        return fd

    def close(self, fd: int) -> None:
        del fd  # another node may still read it: closed by close_all

    def close_all(self) -> None:
        for fd in self._fds.values():
            super().close(fd)
        self._fds.clear()
