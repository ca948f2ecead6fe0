"""PCIe collector: the link and AER error counters of every HCA and NVIDIA GPU, read from sysfs.

Reads ``<sysfs>/bus/pci/devices/<bdf>/{current,max}_link_{speed,width}`` of each HCA (the PCI
function behind ``class/infiniband/<hca>/device``) and ``aer_dev_{correctable,nonfatal,fatal}``
of each HCA and NVIDIA GPU (vendor 0x10de, class 3D or VGA controller); emits them as samples and
as the report's ``pcie`` section (``PcieDevice``). A GPU's link comes from NVML (GpuState), not
from here. It judges nothing (a link below its maximum is the aggregator's finding) and turns a
file it cannot use into an absent value and a counted read error, never a failed cycle.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.contract.wire import PcieDevice

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

log = logging.getLogger("vigil.agent.collectors.pcie")


class PcieConfig(CollectorConfig):
    # Every 10 s: a link that trained down stays down until the device is reset, and AER counters
    # are judged as increases over minutes; each cycle is ~7 small sysfs reads per device.
    interval_seconds: float = Field(default=10.0, gt=0)
    # Which PCI functions are HCAs and GPUs changes only on hot plug or a driver reload; listing
    # every PCI device's vendor and class (a few hundred files) is done this often, or when a
    # device's directory vanished.
    rescan_interval_seconds: float = Field(default=300.0, gt=0)


_LABELS = ("pci_bus_id", "kind", "device")
LINK_GENERATION = MetricSpec("vigil_pcie_link_generation", MetricKind.GAUGE,
                             "PCIe generation the HCA's link runs at now (current_link_speed: 2.5 GT/s = 1 ... "
                             "64 GT/s = 6).", labels=_LABELS)
LINK_GENERATION_MAX = MetricSpec("vigil_pcie_link_generation_max", MetricKind.GAUGE,
                                 "Highest PCIe generation the HCA's link supports (max_link_speed).", labels=_LABELS)
LINK_WIDTH = MetricSpec("vigil_pcie_link_width", MetricKind.GAUGE,
                        "Lanes the HCA's PCIe link runs with now (current_link_width).", labels=_LABELS)
LINK_WIDTH_MAX = MetricSpec("vigil_pcie_link_width_max", MetricKind.GAUGE,
                            "Lanes the HCA's PCIe link supports (max_link_width).", labels=_LABELS)
AER_ERRORS = MetricSpec("vigil_pcie_aer_errors_total", MetricKind.COUNTER,
                        "PCIe AER errors the device reported since boot (aer_dev_<severity> TOTAL_ERR_*), by "
                        "severity: correctable, nonfatal, fatal.", labels=(*_LABELS, "severity"))
READ_ERRORS = MetricSpec("vigil_pcie_read_errors_total", MetricKind.COUNTER,
                         "PCIe sysfs files that could not be used, by reason (unreadable, empty, malformed, "
                         "out_of_range).", labels=("pci_bus_id", "reason"))
SPECS = (LINK_GENERATION, LINK_GENERATION_MAX, LINK_WIDTH, LINK_WIDTH_MAX, AER_ERRORS, READ_ERRORS)

# The kernel's link speed strings (drivers/pci/probe.c pci_speed_string: "2.5 GT/s PCIe" ...
# "64.0 GT/s PCIe", "Unknown"; kernels before 5.7 printed "8 GT/s" and "Unknown speed") and the
# generation each rate belongs to (PCI-SIG: Gen1 2.5 GT/s, Gen2 5, Gen3 8, Gen4 16, Gen5 32, Gen6 64).
GENERATION_BY_GIGATRANSFERS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_SPEED = re.compile(r"^(\d+(?:\.\d+)?) GT/s(?: PCIe)?$")
_UNKNOWN_SPEED = ("Unknown", "Unknown speed")
# A PCIe link has at most 32 lanes (PCIe base spec, Link Capabilities: x1 ... x32); a wedged device
# answers all-ones (63 in the 6-bit field) and a link that is down 0.
MAX_LINK_WIDTH = 32
# The last line of each AER file (drivers/pci/pcie/aer.c aer_stats_dev_attr; kernel
# Documentation/ABI/testing/sysfs-bus-pci-devices-aer).
AER_FILES = {"correctable": ("aer_dev_correctable", "TOTAL_ERR_COR"),
             "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
             "fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL")}
NVIDIA_VENDOR = "0x10de"
# PCI class codes (PCI Code and ID Assignment spec): 0x0300 VGA-compatible controller (a GPU with a
# display engine enabled), 0x0302 3D controller (data-centre GPUs). An NVSwitch is a bridge (0x0680).
GPU_CLASSES = ("0x0300", "0x0302")
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_READ_BYTES = 4096  # every attribute read here is one sysfs page at most
MAX_DEVICES = 256  # Report.pcie's bound (contract/wire.py): far above a node's 8-16 HCAs and GPUs


class Unusable(Exception):
    """A sysfs attribute that exists but cannot be used; ``reason`` is the error counter's label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_attribute(path: Path | str) -> str | None:
    """A sysfs attribute's text, stripped; None when it does not exist (no such capability or
    device). Raises Unusable("unreadable" | "empty") when it exists but gives nothing usable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        raise Unusable("unreadable") from None
    try:
        data = os.read(fd, _READ_BYTES)
    except OSError:
        raise Unusable("unreadable") from None
    finally:
        os.close(fd)
    text = data.decode("ascii", "replace").strip()
    if not text:
        raise Unusable("empty")
    return text


def link_generation(text: str) -> int | None:
    """``current_link_speed``'s text as a PCIe generation; None for the kernel's "Unknown". Raises
    Unusable("malformed") for anything else."""
    if text in _UNKNOWN_SPEED:
        return None
    match = _SPEED.match(text)
    generation = GENERATION_BY_GIGATRANSFERS.get(float(match.group(1))) if match else None
    if generation is None:
        raise Unusable("malformed")
    return generation


def link_width(text: str) -> int:
    if not text.isdigit():
        raise Unusable("malformed")
    width = int(text)
    if width > MAX_LINK_WIDTH:
        raise Unusable("out_of_range")
    return width


def aer_total(text: str, total_name: str) -> int:
    """The TOTAL_ERR_* count of an ``aer_dev_*`` file; Unusable("malformed") when the line is
    missing (a truncated read) or its value is not a count."""
    for line in reversed(text.splitlines()):
        name, _, value = line.strip().rpartition(" ")
        if name == total_name:
            if not value.isdigit():
                raise Unusable("malformed")
            return int(value)
    raise Unusable("malformed")


def pci_slot_name(device: Path) -> str | None:
    """The PCI function a class device (``class/infiniband/<hca>/device``) belongs to: the name its
    link resolves to, or where the tree was copied without links, its ``uevent``'s PCI_SLOT_NAME."""
    bdf = os.path.basename(os.path.realpath(device))
    if _BDF.match(bdf):
        return bdf
    try:
        uevent = read_attribute(device / "uevent") or ""
    except Unusable:
        return None
    for line in uevent.splitlines():
        key, _, value = line.partition("=")
        if key == "PCI_SLOT_NAME" and _BDF.match(value):
            return value
    return None


def _aer_total_of(total_name: str, text: str) -> int:
    return aer_total(text, total_name)


def nvml_bus_id(bdf: str) -> str:
    """sysfs's ``0000:18:00.0`` as NVML writes it (``00000000:18:00.0``): vigil_gpu_info's pci_bus_id."""
    domain, rest = bdf.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


@dataclass(frozen=True, slots=True)
class _Device:
    bdf: str
    kind: Literal["gpu", "hca"]
    name: str  # the `device` label: an HCA's RDMA name, a GPU's bus id as NVML writes it


class PcieCollector:
    name = "pcie"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: PcieConfig, sysfs_root: Path = Path("/sys")) -> None:
        self._config = config
        self._root = Path(sysfs_root)
        self._pci = self._root / "bus" / "pci" / "devices"
        self._pci_dir = str(self._pci)
        self._devices: list[_Device] = []
        self._scanned_at: float | None = None
        self._errors: Counter[tuple[str, str]] = Counter()

    def _count(self, bdf: str, reason: str) -> None:
        if not self._errors[(bdf, reason)]:
            log.warning("PCIe device %s: a sysfs file is %s; its value is left out (logged once per device "
                        "and reason, counted in vigil_pcie_read_errors_total)", bdf, reason)
        self._errors[(bdf, reason)] += 1

    def _attribute(self, bdf: str, name: str) -> str | None:
        try:
            # Joined as strings: Path joins were a third of a cycle (sysfs names carry no separator).
            return read_attribute(f"{self._pci_dir}/{bdf}/{name}")
        except Unusable as exc:
            self._count(bdf, exc.reason)
            return None

    # -- discovery -----------------------------------------------------------------------------

    def _scan(self) -> list[_Device]:
        devices: dict[str, _Device] = {}
        ib = self._root / "class" / "infiniband"
        for hca in sorted(os.listdir(ib)) if ib.is_dir() else []:
            # A soft-RoCE or other virtual RDMA device has no PCI function: nothing to read.
            bdf = pci_slot_name(ib / hca / "device")
            if bdf is not None and (self._pci / bdf).is_dir() and bdf not in devices:
                devices[bdf] = _Device(bdf, "hca", hca)
        for bdf in sorted(os.listdir(self._pci)) if self._pci.is_dir() else []:
            if bdf in devices or not _BDF.match(bdf):
                continue
            try:
                vendor = read_attribute(self._pci / bdf / "vendor")
                pci_class = read_attribute(self._pci / bdf / "class")
            except Unusable:
                continue  # not ours to count: most of these devices are neither GPUs nor HCAs
            if vendor == NVIDIA_VENDOR and pci_class is not None and pci_class.startswith(GPU_CLASSES):
                devices[bdf] = _Device(bdf, "gpu", nvml_bus_id(bdf))
        # An SR-IOV virtual function (a `physfn` link to its parent) has no link of its own (its Link
        # Status reads 0: "Unknown", x0) and shares the parent's errors: only physical functions count.
        found = sorted((d for d in devices.values() if not (self._pci / d.bdf / "physfn").exists()),
                       key=lambda d: d.bdf)
        if len(found) > MAX_DEVICES:
            log.warning("%d PCIe devices to report; the report holds %d: those past %s are left out", len(found),
                        MAX_DEVICES, found[MAX_DEVICES - 1].bdf)
        return found[:MAX_DEVICES]

    # -- one cycle -----------------------------------------------------------------------------

    def collect(self, now: float) -> Collection:
        if (self._scanned_at is None or now - self._scanned_at >= self._config.rescan_interval_seconds
                or not all(os.path.isdir(f"{self._pci_dir}/{d.bdf}") for d in self._devices)):
            self._devices = self._scan()
            self._scanned_at = now
        out = Collection()
        report: list[PcieDevice] = []
        for dev in self._devices:
            labels = {"pci_bus_id": dev.bdf, "kind": dev.kind, "device": dev.name}
            link: dict[str, int | None] = {}
            if dev.kind == "hca":
                for key, spec, file, parse in (
                        ("link_generation", LINK_GENERATION, "current_link_speed", link_generation),
                        ("link_generation_max", LINK_GENERATION_MAX, "max_link_speed", link_generation),
                        ("link_width", LINK_WIDTH, "current_link_width", link_width),
                        ("link_width_max", LINK_WIDTH_MAX, "max_link_width", link_width)):
                    link[key] = value = self._parse(dev.bdf, file, parse)
                    if value is not None:
                        out.samples.append(Sample.of(spec, value, **labels))
            aer: dict[str, int | None] = {}
            for severity, (file, total_name) in AER_FILES.items():
                aer[severity] = count = self._parse(dev.bdf, file, functools.partial(_aer_total_of, total_name))
                if count is not None:
                    out.samples.append(Sample.of(AER_ERRORS, count, severity=severity, **labels))
            report.append(PcieDevice(
                pci_bus_id=dev.bdf, kind=dev.kind, name=dev.name if dev.kind == "hca" else None,
                aer_correctable_total=aer["correctable"], aer_nonfatal_total=aer["nonfatal"],
                aer_fatal_total=aer["fatal"], **link))
        for (bdf, reason), n in sorted(self._errors.items()):
            out.samples.append(Sample.of(READ_ERRORS, n, pci_bus_id=bdf, reason=reason))
        out.report["pcie"] = report
        return out

    def _parse(self, bdf: str, file: str, parse: Callable[[str], int | None]) -> int | None:
        text = self._attribute(bdf, file)
        if text is None:
            return None
        try:
            return parse(text)
        except Unusable as exc:
            self._count(bdf, exc.reason)
            return None

    def close(self) -> None:
        pass


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = PcieConfig
DESCRIPTION = "Every HCA's PCIe link and every HCA's and GPU's AER counters, from sysfs."


def build(config: AgentConfig, seams: Seams) -> PcieCollector:
    return PcieCollector(config.collectors.section("pcie", PcieConfig), sysfs_root=seams.sysfs_root)
