"""Host collector: the basics an operator checks first on a GPU node, read through psutil, and
whether the NVIDIA Fabric Manager runs where it must.

Emits CPU, memory, load, uptime, swap and root-filesystem usage and, on a node whose PCI bus shows
NVSwitches, the Fabric Manager service's systemd state (``systemctl show`` through ``Seams.run``),
and contributes ``HostFacts`` to the report. It does not judge any of them; the aggregator does.
The kernel release is the node_config collector's (``vigil_node_config_info``).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import psutil
from pydantic import Field, model_validator

from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.collectors.pcie import NVIDIA_VENDOR, Unusable, read_attribute
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.contract.seams import CommandRunner, run_command
from vigil.contract.wire import HostFacts

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams


log = logging.getLogger("vigil.agent.collectors.host")


class HostConfig(CollectorConfig):
    interval_seconds: float = Field(default=5.0, gt=0)
    filesystem: str = "/"
    # Whether the NVIDIA Fabric Manager must run here. auto: where the node's PCI bus shows an
    # NVSwitch (HGX baseboards: NVIDIA's Fabric Manager user guide, "eight GPUs and four NVSwitches on
    # the PCIe tree"), the nodes whose GPUs cannot join the NVLink fabric without it; true/false
    # overrides (e.g. false where the switches are managed elsewhere).
    fabric_manager: bool | Literal["auto"] = "auto"
    # Its state is asked of systemd this often (a subprocess; a stopped Fabric Manager is a fault
    # of hours, NVSentinel #883's of 20 days) ...
    fabric_manager_interval_seconds: float = Field(default=30.0, gt=0)
    # ... within this total deadline (`systemctl show` answers in milliseconds; a hung D-Bus does not).
    fabric_manager_timeout_seconds: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _deadline_inside_cycle(self) -> HostConfig:
        if self.fabric_manager_timeout_seconds >= self.timeout_seconds:
            raise ValueError("fabric_manager_timeout_seconds must be shorter than the collector's timeout_seconds")
        return self


CPU_UTILIZATION = MetricSpec("vigil_host_cpu_utilization_ratio", MetricKind.GAUGE,
                             "Share of CPU time not idle since the previous cycle, 0..1.", unit="ratio")
LOAD1 = MetricSpec("vigil_host_load1", MetricKind.GAUGE, "One-minute load average.")
CPUS = MetricSpec("vigil_host_cpus", MetricKind.GAUGE, "Logical CPUs.")
MEMORY_TOTAL = MetricSpec("vigil_host_memory_total_bytes", MetricKind.GAUGE, "Physical memory.", unit="bytes")
MEMORY_AVAILABLE = MetricSpec("vigil_host_memory_available_bytes", MetricKind.GAUGE,
                              "Memory available to new processes without swapping.", unit="bytes")
SWAP_USED = MetricSpec("vigil_host_swap_used_bytes", MetricKind.GAUGE, "Swap in use.", unit="bytes")
UPTIME = MetricSpec("vigil_host_uptime_seconds", MetricKind.GAUGE, "Seconds since boot.", unit="seconds")
FS_FREE = MetricSpec("vigil_host_filesystem_free_bytes", MetricKind.GAUGE,
                     "Free bytes on the watched filesystem.", labels=("mountpoint",), unit="bytes")
FS_SIZE = MetricSpec("vigil_host_filesystem_size_bytes", MetricKind.GAUGE,
                     "Size of the watched filesystem.", labels=("mountpoint",), unit="bytes")
FABRIC_MANAGER_STATE = MetricSpec(
    "vigil_fabric_manager_state", MetricKind.GAUGE,
    "The NVIDIA Fabric Manager service's systemd state: 1 for the current one, 0 for the others (all 0 while it "
    "cannot be read, or in a state outside these); absent where Fabric Manager is not expected.", labels=("state",))
FABRIC_MANAGER_READ_ERRORS = MetricSpec(
    "vigil_fabric_manager_read_errors_total", MetricKind.COUNTER,
    "Times the Fabric Manager's state could not be read, by reason (timeout, exit_status, not_found, unreadable, "
    "malformed): its state is then unknown, not failed.", labels=("reason",))

SPECS = (CPU_UTILIZATION, LOAD1, CPUS, MEMORY_TOTAL, MEMORY_AVAILABLE, SWAP_USED, UPTIME, FS_FREE, FS_SIZE,
         FABRIC_MANAGER_STATE, FABRIC_MANAGER_READ_ERRORS)

FABRIC_MANAGER_UNIT = "nvidia-fabricmanager.service"  # the unit NVIDIA's fabricmanager packages install
FABRIC_MANAGER_COMMAND = ("systemctl", "show", FABRIC_MANAGER_UNIT, "-p", "ActiveState", "--value")
# The states of vigil_fabric_manager_state, and every ActiveState systemd may answer (systemd's
# org.freedesktop.systemd1 D-Bus API, Unit.ActiveState; maintenance since v245, refreshing v254).
FABRIC_MANAGER_STATES = ("active", "activating", "deactivating", "inactive", "failed")
SYSTEMD_ACTIVE_STATES = frozenset({*FABRIC_MANAGER_STATES, "reloading", "maintenance", "refreshing"})
UNKNOWN = "unknown"  # HostFacts.fabric_manager_state when it is expected and could not be read
# PCI class of a bridge (PCI Code and ID Assignment spec: 0x0680 "other bridge"): what an NVSwitch is.
NVSWITCH_CLASS = "0x0680"


class HostCollector:
    name = "host"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: HostConfig, *, ps: ModuleType | Any = psutil, run: CommandRunner = run_command,
                 sysfs_root: Path = Path("/sys")) -> None:
        self._config = config
        self._ps = ps
        self._run = run
        self._sysfs = Path(sysfs_root)
        # Fabric Manager: expected (with auto, once NVSwitches were found), its last state
        # read, when it was read, and the reads that failed by reason.
        self._fm_expected = config.fabric_manager is True
        self._fm_state: str | None = None
        self._fm_checked_at: float | None = None
        self._fm_errors: Counter[str] = Counter()
        # The first cpu_percent(None) call primes psutil's counters and returns 0.0: discard it.
        self._ps.cpu_percent(None)

    # -- Fabric Manager ------------------------------------------------------------------------

    def _nvswitch_present(self) -> bool:
        devices = self._sysfs / "bus" / "pci" / "devices"
        try:
            names = os.listdir(devices)
        except OSError:
            return False
        for bdf in names:
            try:
                if (read_attribute(devices / bdf / "vendor") == NVIDIA_VENDOR
                        and (read_attribute(devices / bdf / "class") or "").startswith(NVSWITCH_CLASS)):
                    return True
            except Unusable:
                continue
        return False

    def _fabric_manager(self, now: float) -> str | None:
        """The Fabric Manager's state as of its last check (every fabric_manager_interval_seconds);
        None where it is not expected."""
        if self._fm_checked_at is not None and now - self._fm_checked_at < self._config.fabric_manager_interval_seconds:
            return self._fm_state
        self._fm_checked_at = now
        if self._config.fabric_manager == "auto" and not self._fm_expected:
            # auto: looked for again until found (sysfs may be incomplete early in boot); once found it stays.
            self._fm_expected = self._nvswitch_present()
        if not self._fm_expected:
            self._fm_state = None
            return None
        self._fm_state = self._read_fabric_manager()
        return self._fm_state

    def _read_fabric_manager(self) -> str:
        try:
            text = self._run(FABRIC_MANAGER_COMMAND, self._config.fabric_manager_timeout_seconds)
        except subprocess.TimeoutExpired:
            return self._fm_failed("timeout")
        except subprocess.CalledProcessError:
            return self._fm_failed("exit_status")  # e.g. no systemd or D-Bus in this container
        except FileNotFoundError:
            return self._fm_failed("not_found")  # no systemctl
        except (OSError, subprocess.SubprocessError, UnicodeError):
            return self._fm_failed("unreadable")
        state = text.strip()
        if state not in SYSTEMD_ACTIVE_STATES:
            return self._fm_failed("malformed")
        return state

    def _fm_failed(self, reason: str) -> str:
        if not self._fm_errors[reason]:
            log.warning("the Fabric Manager's state could not be read (%s): reported as unknown (logged once per "
                        "reason, counted in vigil_fabric_manager_read_errors_total)", reason)
        self._fm_errors[reason] += 1
        return UNKNOWN

    # -- one cycle -----------------------------------------------------------------------------

    def collect(self, now: float) -> Collection:
        ps = self._ps
        cpu_ratio = ps.cpu_percent(None) / 100.0
        load1 = ps.getloadavg()[0]
        mem = ps.virtual_memory()
        swap = ps.swap_memory()
        uptime = max(0.0, now - ps.boot_time())
        samples = [
            Sample.of(CPU_UTILIZATION, cpu_ratio),
            Sample.of(LOAD1, load1),
            Sample.of(CPUS, ps.cpu_count() or 0),
            Sample.of(MEMORY_TOTAL, mem.total),
            Sample.of(MEMORY_AVAILABLE, mem.available),
            Sample.of(SWAP_USED, swap.used),
            Sample.of(UPTIME, uptime),
        ]
        try:
            du = ps.disk_usage(self._config.filesystem)
        except OSError:
            pass  # a missing mount is reported as absent series, not as zero free space
        else:
            samples.append(Sample.of(FS_FREE, du.free, mountpoint=self._config.filesystem))
            samples.append(Sample.of(FS_SIZE, du.total, mountpoint=self._config.filesystem))
        fabric_manager = self._fabric_manager(now)
        if fabric_manager is not None:
            samples.extend(Sample.of(FABRIC_MANAGER_STATE, int(state == fabric_manager), state=state)
                           for state in FABRIC_MANAGER_STATES)
        samples.extend(Sample.of(FABRIC_MANAGER_READ_ERRORS, n, reason=reason)
                       for reason, n in sorted(self._fm_errors.items()))
        facts = HostFacts(
            cpu_utilization_ratio=cpu_ratio,
            load1=load1,
            memory_used_bytes=float(mem.total - mem.available),
            memory_total_bytes=float(mem.total),
            uptime_seconds=uptime,
            fabric_manager_state=fabric_manager,
        )
        return Collection(samples=samples, report={"host": facts})

    def close(self) -> None:
        pass


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = HostConfig


def build(config: AgentConfig, seams: Seams) -> HostCollector:
    # psutil reads /proc itself; a test or the simulator that wants another machine's figures passes
    # its own as seams.extra["psutil"] (or a fake `ps` to HostCollector directly).
    return HostCollector(config.collectors.section("host", HostConfig), ps=seams.extra.get("psutil", psutil),
                         run=seams.run, sysfs_root=seams.sysfs_root)
