"""Simulated nodes: the real agent pipeline per node, with the world replaced through its seams.

Each ``SimNode`` has a FakeNvml driven by its part of the fleet scenario, a kernel log (a text
stream the real xid collector follows), a sysfs tree of its HCAs and PCI devices (shared read-only
until the node's ports, links or Fabric Manager get a fault), a host that answers the host
collector's psutil calls (``SimHost``), and the registry's real collectors; ``tick`` runs the due collectors
through the runner's ``collect_once`` and builds the Report with the reporter's ``build_report``.
It judges nothing and never reads the wall clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vigil.agent.attribution import IN_PROCESS, Sender
from vigil.agent.collectors.collector import Collector
from vigil.agent.config import AgentConfig
from vigil.agent.reporter import build_report
from vigil.agent.runner import collect_once
from vigil.agent.snapshot import Snapshot
from vigil.contract.seams import Seams
from vigil.contract.wire import Event, Report
from vigil.sim.fabric import NodeFabric

log = logging.getLogger("vigil.sim.fleet")

# Trailing text the driver prints for well-known Xids (NVIDIA Xid catalog, "Xid Errors" r555).
XID_TEXT = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f1c_4e000000",
    43: "Ch 00000010",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to remap row",
    74: "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP!",
}


class KernelLog:
    """The node's kernel log as the xid collector follows it: a file, appended to in dmesg form
    (nodes without kernel faults share one empty file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, uptime_seconds: float, message: str) -> None:
        self.write_lines(uptime_seconds, [message])

    def write_lines(self, uptime_seconds: float, messages: list[str]) -> None:
        with self.path.open("a") as fh:
            fh.writelines(f"[{uptime_seconds:12.6f}] {m}\n" for m in messages)


# A simulated node's host as the host collector's psutil calls see it (``SimHost``): a training
# server busy feeding its GPUs (stated assumptions: 224 CPUs, 2 TiB of memory, a third of the CPUs
# busy, a 3.5 TB root filesystem half full). No detector judges these; only the uptime counts (the
# aggregator's boot time: the fabric detector's boot grace).
SIM_HOST_CPUS = 224
SIM_HOST_CPU_PERCENT = 33.0
SIM_HOST_MEMORY_BYTES = 2 * 1024**4
SIM_HOST_DISK_BYTES = 3_500_000_000_000


@dataclass(frozen=True)
class _Memory:
    total: int
    available: int


@dataclass(frozen=True)
class _Swap:
    used: int


@dataclass(frozen=True)
class _Disk:
    free: int
    total: int


class SimHost:
    """The psutil functions the host collector calls (``Seams.extra["psutil"]``), answered for one
    simulated node: steady figures, and the boot time the simulator sets (``booted_at``, on the
    simulated clock) when the node boots. It reads nothing of the machine it runs on."""

    def __init__(self, booted_at: float) -> None:
        self.booted_at = booted_at

    def cpu_percent(self, interval: float | None = None) -> float:
        del interval
        return SIM_HOST_CPU_PERCENT

    def getloadavg(self) -> tuple[float, float, float]:
        load = SIM_HOST_CPUS * SIM_HOST_CPU_PERCENT / 100.0
        return (load, load, load)

    def virtual_memory(self) -> _Memory:
        return _Memory(total=SIM_HOST_MEMORY_BYTES, available=SIM_HOST_MEMORY_BYTES // 2)

    def swap_memory(self) -> _Swap:
        return _Swap(used=0)

    def boot_time(self) -> float:
        return self.booted_at

    def cpu_count(self) -> int:
        return SIM_HOST_CPUS

    def disk_usage(self, path: str) -> _Disk:
        del path
        return _Disk(free=SIM_HOST_DISK_BYTES // 2, total=SIM_HOST_DISK_BYTES)


class SimNode:
    """One node's agent: collectors over its seams, a snapshot, a report sequence."""

    def __init__(self, config: AgentConfig, seams: Seams, collectors: Sequence[Collector], *,
                 boot_id: str, kernel_log: KernelLog, fabric: NodeFabric | None,
                 intervals: dict[str, float], report_interval_seconds: float) -> None:
        self.name = config.node
        self.config = config
        self.seams = seams
        self.collectors = list(collectors)
        self.training = next((c for c in self.collectors if c.name == "training"), None)
        self.kernel_log = kernel_log
        self.fabric = fabric
        self.boot_id = boot_id
        self.snapshot = Snapshot()
        self.seq = 0
        self.silent = False
        self._intervals = intervals
        self._next_due: dict[str, float] = {}
        self._report_interval = report_interval_seconds
        self._topology = dict(config.topology)
        self.pci_bus_ids: list[str] = []

    def ingest_heartbeat(self, payload: bytes, now: float) -> str | None:
        if self.training is None:
            return "no training collector"
        ingest: Callable[[bytes, float, Sender], str | None] = self.training.ingest  # type: ignore[attr-defined]
        return ingest(payload, now, IN_PROCESS)  # the simulated scheduler's jobs, named by the scenario

    def ingest_heartbeats(self, heartbeats: Sequence[tuple[float, bytes]]) -> None:
        """``ingest_heartbeat`` for each (time, payload) in order, the collector's ingest looked up
        once (a 1,000-node run delivers ~450,000 heartbeats every 300 simulated seconds at 10 s
        reports); what each refusal was is counted by the collector."""
        if self.training is None:
            return
        ingest: Callable[[bytes, float, Sender], str | None] = self.training.ingest  # type: ignore[attr-defined]
        for now, payload in heartbeats:
            ingest(payload, now, IN_PROCESS)

    def tick(self, now: float) -> Report | None:
        """Run every collector that is due and build this cycle's report (None while silent)."""
        if self.silent:
            return None
        events: list[Event] = []
        for collector in self.collectors:
            due = self._next_due.get(collector.name, now)
            if now + 1e-9 < due:
                continue
            result = collect_once(collector, now)
            self.snapshot.put(collector.name, result)
            events.extend(result.collection.events)
            self._next_due[collector.name] = now + self._intervals.get(collector.name, self._report_interval)
        report = build_report(
            self.snapshot, events, node=self.name, boot_id=self.boot_id, seq=self.seq, ts=now,
            interval_seconds=self._report_interval, topology=self._topology,
            urgent=any(e.urgent for e in events))
        self.seq += 1
        return report

    def restart(self, seams: Seams, collectors: Sequence[Collector], kernel_log: KernelLog) -> None:
        """A new agent after a reboot: fresh collectors over the node's new seams, an empty
        snapshot, report sequence from 0 (the caller sets the new boot id)."""
        self.seams = seams
        self.collectors = list(collectors)
        self.training = next((c for c in self.collectors if c.name == "training"), None)
        self.kernel_log = kernel_log
        self.snapshot = Snapshot()
        self._next_due = {}
        self.seq = 0

    def reboot(self, boot_id: str) -> None:
        """Back from silence: a new boot, counters and sequence start again."""
        self.boot_id = boot_id
        self.seq = 0

    def close(self) -> None:
        for collector in self.collectors:
            try:
                collector.close()
            except Exception as exc:  # noqa: BLE001 - closing must reach every collector
                log.warning("closing %s on %s: %s", collector.name, self.name, exc)


def kernel_xid_line(bus_id: str, code: int, text: str, pid: int | None = None) -> str:
    """An NVRM Xid line as drivers R535+ print it."""
    body = text or XID_TEXT.get(code, "")
    pid_text = str(pid) if pid is not None else "'<unknown>'"
    return f"NVRM: Xid (PCI:{bus_id}): {code}, pid={pid_text}, name=python3, {body}".rstrip(", ")


# The RAS event id newer amdgpu drivers print in braces ("{1}"), as on a real MI300X node
# (tests/fixtures/kernel-log/amdgpu/rocm-4021-*); the simulator writes the first event's.
_RAS_EVENT_ID = "{1}"


def amdgpu_lines(bus_id: str, event: str, block: str = "umc", count: int = 1) -> list[str]:
    """The amdgpu driver's lines for ``event`` on the GPU at ``bus_id`` ("0000:05:00"), in the
    formats of the real logs in tests/fixtures/kernel-log/amdgpu."""
    dev = f"amdgpu {bus_id}.0:"
    reset = f"{dev} amdgpu: GPU reset begin!"
    timeout = f"{dev} ring gfx_0.0.0 timeout, signaled seq=57638, emitted seq=57641"
    if event in ("ras_uncorrectable", "ras_correctable", "ras_deferred"):
        severity = event.removeprefix("ras_")
        counted = [f"{dev} {_RAS_EVENT_ID}socket: 0, die: 0, {count} new {severity} hardware errors detected "
                   f"in {block} block",
                   f"{dev} {_RAS_EVENT_ID}socket: 0, die: 0, {count} {severity} hardware errors detected in total "
                   f"in {block} block"]
        return [*counted, reset] if event == "ras_uncorrectable" else counted
    lines = {
        "ras_fatal": [f"{dev} {_RAS_EVENT_ID}uncorrectable hardware error(ERREVENT_ATHUB_INTERRUPT) detected!", reset],
        "poison_consumed": [f"{dev} {_RAS_EVENT_ID}poison is consumed by client 12, kick off gpu reset flow", reset],
        "bad_page_threshold": [f"{dev} amdgpu: Saved bad pages {count} reaches threshold value 128"],
        "ring_timeout": [timeout, f"{dev}  Process python3 pid 4242 thread python3 pid 4242", reset,
                         f"{dev} amdgpu: GPU reset(1) succeeded!"],
        "ring_timeout_recovered": ["[drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx timeout, but soft recovered"],
        "gpu_hang": [timeout, f"{dev}  Process python3 pid 4242 thread python3 pid 4242", reset,
                     f"{dev} amdgpu: GPU reset(2) failed", f"{dev} amdgpu: GPU reset end with ret = -110"],
    }
    return lines[event]
