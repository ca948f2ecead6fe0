"""Host collector: the basics an operator checks first on a GPU node, read through psutil.

Emits CPU, memory, load, uptime, swap and root-filesystem usage, and the kernel release, and
contributes ``HostFacts`` to the report. It does not judge any of them; the aggregator does.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psutil
from pydantic import Field

from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.wire import HostFacts

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.agent.seams import Seams


class HostConfig(CollectorConfig):
    interval_seconds: float = Field(default=5.0, gt=0)
    filesystem: str = "/"


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
HOST_INFO = MetricSpec("vigil_host_info", MetricKind.INFO, "The host's kernel.", labels=("kernel",))

SPECS = (CPU_UTILIZATION, LOAD1, CPUS, MEMORY_TOTAL, MEMORY_AVAILABLE, SWAP_USED, UPTIME, FS_FREE, FS_SIZE,
         HOST_INFO)


class HostCollector:
    name = "host"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: HostConfig, *, ps: ModuleType | Any = psutil, kernel: str | None = None) -> None:
        self._config = config
        self._ps = ps
        self._kernel = kernel if kernel is not None else platform.release()
        # The first cpu_percent(None) call primes psutil's counters and returns 0.0: discard it.
        self._ps.cpu_percent(None)

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
            Sample.of(HOST_INFO, 1, kernel=self._kernel),
        ]
        try:
            du = ps.disk_usage(self._config.filesystem)
        except OSError:
            pass  # a missing mount is reported as absent series, not as zero free space
        else:
            samples.append(Sample.of(FS_FREE, du.free, mountpoint=self._config.filesystem))
            samples.append(Sample.of(FS_SIZE, du.total, mountpoint=self._config.filesystem))
        facts = HostFacts(
            cpu_utilization_ratio=cpu_ratio,
            load1=load1,
            memory_used_bytes=float(mem.total - mem.available),
            memory_total_bytes=float(mem.total),
            uptime_seconds=uptime,
        )
        return Collection(samples=samples, report={"host": facts})

    def close(self) -> None:
        pass


def build(config: AgentConfig, seams: Seams) -> HostCollector:
    del seams  # psutil reads /proc itself; tests pass a fake `ps` to HostCollector directly
    return HostCollector(config.collectors.host, kernel=os.uname().release)
