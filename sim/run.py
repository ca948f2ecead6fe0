"""The simulation driver: a fleet scenario run through the real agent and aggregator code.

Every report interval of simulated time it steps the training jobs; each node's agent then runs
at its own phase within the interval (a seeded draw, as agents started at different moments
do): the faults due by then happen (FakeNvml keeps its own schedule), its training collector
takes in the heartbeats sent by then, its collectors run and its report goes into the real
engine. The aggregator (detectors, then the gate in dry run over an in-memory store, its
start-up grace counted from the simulation's start as the service counts it from its own)
evaluates at every interval's end and at once after an urgent report; every decision is
recorded with its simulated time. With a scenario's ``remediation`` it also carries out admitted reboots and
GPU resets (the latter through the real outbox and the node's real NodeActionRunner). With the
aggregator's ``probes.enabled`` the real prober (aggregator/prober.py) plans probe runs after every
evaluation, as the app does; its signed run_probes requests go through the real outbox, and each
node's simulated agent (sim/probes.py) answers them after the probes' simulated duration. It scores
nothing (sim.score does) and never sleeps.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import heapq
import json
import logging
import math
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from pydantic import ConfigDict

from vigil.agent.config import AgentConfig, parse_config
from vigil.agent.nvml.scenario import PowerBrake, PowerCap, ThermalThrottle
from vigil.aggregator.decision import Decision
from vigil.aggregator.service import Accepted, AggregatorService
from vigil.contract.seams import Seams
from vigil.contract.validation import ConfigError, format_validation_error
from vigil.contract.wire import (
    MAX_RESULTS_PER_REPORT,
    NodeActionRequest,
    NodeActionResult,
    Report,
    encode,
    replace,
)
from vigil.sim import fabric
from vigil.sim.clock import SimClock
from vigil.sim.fleet import KernelLog, SimHost, SimNode, amdgpu_lines, kernel_xid_line
from vigil.sim.probes import SimHardware, SimProbeAgent, node_rng, probe_seconds
from vigil.sim.scenario import (
    PROBE_FAULTS,
    DataStall,
    Hang,
    KernelAmdgpu,
    KernelXid,
    NvmlFault,
    PcieDevice,
    PortDown,
    PortErrors,
    PortFlap,
    Reboot,
    RoceCongestion,
    Scenario,
    ScenarioError,
    Silence,
    SlowNode,
    UninstrumentedHang,
    UninstrumentedStraggler,
)
from vigil.sim.training import JobFault, JobModel, StepBatch
from vigil.sim.uninstrumented import UninstrumentedJob

if TYPE_CHECKING:
    from vigil.agent.collectors.rdma import RdmaConfig

log = logging.getLogger("vigil.sim")

Progress = Callable[[float, float, int], None]  # (simulated seconds done, total, decisions so far)


# Simulated process ids: job i's rank r runs as (i + 1) * _PID_STRIDE + 1 + r (ranks < 1,000,000).
_PID_STRIDE = 1_000_000
# A heartbeat after its head (job and rank) and before its tail (GPU and pid): one %-format of
# the step and its four times, the bytes an f-string with ``:.6f`` gives at ~0.8 of its CPU.
_HEARTBEAT = '%s%d,"step_seconds":%.6f,"compute_seconds":%.6f,"comm_seconds":%.6f,"data_seconds":%.6f%s'
# The random stream of the agents' report phases (apart from the jobs' and the GPUs' streams).
_PHASE_STREAM = 0x5048_4153

class SimDecision(Decision):
    """A decision the service's gate judged, as its store recorded it, with when (``t``: simulated
    seconds since the start) and what the gate made of it (``admitted``, its ``verdict``)."""

    model_config = ConfigDict(frozen=True)

    t: float
    admitted: bool
    verdict: str

    @classmethod
    def of(cls, d: Decision, t: float, admitted: bool, verdict: str) -> SimDecision:
        """``d`` as judged at ``t``, its evidence as JSON reads it back (a result is written as JSON)."""
        return cls(**{**dict(d), "evidence": json.loads(json.dumps(d.evidence, default=str))}, t=round(t, 3),
                   admitted=admitted, verdict=verdict)

    def to_json(self) -> dict[str, Any]:
        """The result file's form: the simulated time, not the aggregator's clock or the store's fields."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"ts", "dry_run", "since"})


@dataclass(frozen=True)
class Remediated:
    """A remediation the simulator carried out (``remediation``): a reboot for an admitted
    ``reboot_node``, or a GPU reset the node's agent ran for an admitted ``reset_gpu``."""

    t: float  # simulated seconds: the decision (for a reboot, the node going down)
    node: str
    decision_id: str
    back_seconds: float  # reboot: when the node is back with a new boot; reset: when the reset ran
    clears: bool
    action: str = "reboot_node"
    gpu: int | None = None
    outcome: str | None = None  # reset: the agent's result (done, failed, refused) and reason

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ProbeRun:
    """A run_probes request a node's simulated agent answered (``probes``): when it was offered and
    answered (simulated seconds), what it ran and how each probe came out on the agent's side (the
    aggregator's verdict against the baselines is its own: see the decisions)."""

    t: float  # offered to the agent (the report whose answer carried it)
    node: str
    request_id: str
    probes: tuple[str, ...]
    done_seconds: float  # the result ready for the node's next report
    outcome: str  # done, or refused (reason)
    failed: tuple[str, ...] = ()  # "probe[ gpu N]: reason" of every probe result the agent failed or errored
    values: tuple[tuple[str, int | None, float | None], ...] = ()  # (probe, gpu, value) of each result

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class JobTrace:
    """What the plots need of a job: per window, the job's step time and each node's compute."""

    name: str
    nodes: list[str]
    t: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    node_compute_seconds: list[np.ndarray] = field(default_factory=list)


@dataclass
class SimResult:
    scenario: Scenario
    seed: int
    decisions: list[SimDecision]
    simulated_seconds: float
    wall_seconds: float
    reports: int
    heartbeats: int
    heartbeats_rejected: dict[str, int]
    breaker_tripped: bool
    collectors: list[str]
    jobs: list[JobTrace]
    # Per tick: simulated seconds, reporting nodes, silent nodes.
    fleet_t: list[float] = field(default_factory=list)
    fleet_reporting: list[int] = field(default_factory=list)
    fleet_silent: list[int] = field(default_factory=list)
    # The reboots and GPU resets the simulator carried out itself (scenario ``remediation``), in order.
    remediations: list[Remediated] = field(default_factory=list)
    # The run_probes requests the simulated agents answered (aggregator ``probes.enabled``), in order.
    probe_runs: list[ProbeRun] = field(default_factory=list)
    # The prober's group-testing isolations (aggregator/detectors/probe_verdict.IsolationOutcome:
    # finished and running, tests used against the information bound), and the scenario's
    # ``isolations`` the prober refused: (simulated seconds, reason, detail).
    isolations: list[Any] = field(default_factory=list)
    isolations_refused: list[tuple[float, str, str]] = field(default_factory=list)


# What an agent does not do in the simulator: NVML's Xid event API needs a worker thread per node
# that waits in real time, which would make runs depend on the machine's speed. Every Xid the
# driver reports also goes to the kernel log, so the simulator writes NVML Xid faults there and the
# xid collector reads them. (The host collector runs: its psutil is each node's SimHost, its
# ``systemctl`` the node's simulated Fabric Manager.)
_SIM_AGENT_DEFAULTS: dict[str, Any] = {
    "collectors": {"gpu": {"xid_events": False}},
}
# Collectors a real agent runs on a slower cadence than it reports (their config's
# ``interval_seconds``: host 5 s, pcie 10 s, node_config 60 s); the simulator runs them so too on
# every node, the report carrying their last result meanwhile (``quiet_collector_intervals``
# overrides): what they read changes over minutes, and each costs file reads or NVML calls per node.
_SLOW_COLLECTORS = ("host", "pcie", "node_config")
# On a node that shares the read-only sysfs tree and has no NVML fault, nothing the slow
# collectors read can change during the run (no fault writes to that tree, whose Fabric Manager is
# always active; the configuration facts change only by an NVML fault; the host's figures are
# steady). The PCIe and configuration collectors read only those (sysfs files, NVML's fixed
# facts) and the report carries a collector's last result until it runs again, so there they run
# once per agent (at its first cycle, and again after a reboot's restart): each later read gave
# the same result, and cost ~5.9 and ~3.5 ms of CPU a node under cProfile (14% of a profile of
# healthy-1000x1h-10s, at 12 reads a node an hour). The host collector reports the uptime, which moves:
# it runs every ``_UNCHANGING_SECONDS`` there. A node with its own tree or an NVML fault runs them
# at their configured cadence.
_UNCHANGING_SECONDS = 300.0
_READ_ONCE = ("pcie", "node_config")
# A simulated node was booted this long before the run starts (a fleet in its steady state, past
# every boot grace); a node the simulator reboots boots again when it comes back.
_UPTIME_AT_START_SECONDS = 86400.0
# NVSwitches on the PCI bus of a baseboard whose GPUs join an NVSwitch fabric (profile
# ``nvswitch_fabric``): an HGX H100/H200 baseboard has four (NVIDIA Fabric Manager user guide,
# "eight GPUs and four NVSwitches on the PCIe tree"); they make the host collector expect Fabric
# Manager.
_NVSWITCHES_PER_BASEBOARD = 4
# The kernel release every simulated node runs (/proc/sys/kernel/osrelease; node_config reads it).
SIM_KERNEL = "5.15.0-119-generic"
# The Fabric Manager's systemd state while a ``fabric_manager_down`` fault lasts (it crashed).
_FABRIC_MANAGER_DOWN_STATE = "failed"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Each simulated port's rdma collector keeps about this many sysfs files open (state, rates,
# counters/, hw_counters/) when ``keep_files_open`` is on; a fleet whose ports would need more
# than half of the process's descriptor limit reads them by path instead, as an agent does
# once it reaches its own limit (agent/collectors/rdma.py).
_FILES_PER_PORT = 40


def _descriptor_budget() -> int:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 2


def agent_config(scenario: Scenario) -> AgentConfig:
    """The agent configuration every simulated node shares (name and topology aside)."""
    defaults = _SIM_AGENT_DEFAULTS
    ports = scenario.fleet.nodes * scenario.fleet.hcas_per_node
    if ports * _FILES_PER_PORT > _descriptor_budget():
        defaults = _merge(defaults, {"collectors": {"rdma": {"keep_files_open": False}}})
    data = _merge(defaults, {"collectors": scenario.agent.get("collectors", {})})
    data = _merge(data, {k: v for k, v in scenario.agent.items() if k != "collectors"})
    data.update({"node": "sim", "nvml": {"backend": "fake"}})
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ScenarioError(f"scenario {scenario.name}: agent: {exc}") from None


# A reset command the simulator runs for a node's backend: (its FakeNvml, argv, timeout) -> output.
ResetCommand = Callable[[Any, Sequence[str], float], str]


def open_fake_backend(node_scenario: Any, clock: SimClock, seed: int, reset: ResetCommand | None = None) -> Any:
    """The node's real GPU backend over its vendor's fake library: PynvmlBackend over FakeNvml for an
    NVIDIA board, AmdSmiBackend over FakeAmdSmi for an AMD one (agent/amdsmi/profiles.py); only the
    vendor's library is left out. ``reset``: what its GPU reset command runs (default: the fake's
    own imitation)."""
    from vigil.agent.nvml.scenario import ALL_PROFILES

    if ALL_PROFILES[node_scenario.profile].vendor == "amd":
        from vigil.agent.amdsmi.backend import AmdSmiBackend
        from vigil.agent.amdsmi.fake import FakeAmdSmi

        amd = FakeAmdSmi(node_scenario, clock, start=clock.start, seed=seed)
        amd_backend = AmdSmiBackend(amd, run=None if reset is None else functools.partial(reset, amd))
        amd_backend.init()
        return amd_backend
    from vigil.agent.nvml.backend import PynvmlBackend
    from vigil.agent.nvml.fake import FakeNvml

    fake = FakeNvml(node_scenario, clock, start=clock.start, seed=seed)
    run = None if reset is None else functools.partial(reset, fake)
    backend = PynvmlBackend(nvml=fake, run=run)
    backend.init()
    return backend


def sim_master_key(seed: int) -> bytes:
    """The node-action master key of a simulated aggregator: 32 bytes, fixed by the seed (a run
    is reproducible; nothing outside the simulation ever holds it)."""
    return hashlib.sha256(f"vigil sim node-action master key {seed}".encode()).digest()


class Simulation:
    """One run of a scenario; ``run()`` returns the result. The aggregator is the service
    operators run (aggregator/service.py), driven on the simulated clock: every report goes
    through its intake, every evaluation through its ``evaluate_now``. ``observe`` sees each
    report an agent sends, with the time it is sent (tests record them)."""

    def __init__(self, scenario: Scenario, *, seed: int | None = None,
                 observe: Callable[[Report, float], None] | None = None,
                 json_round_trip: bool = False, progress: Progress | None = None,
                 workdir: Path | None = None, trace_dir: Path | None = None) -> None:
        self.scenario = scenario
        self.seed = scenario.seed if seed is None else seed
        self.clock = SimClock()
        self._json = json_round_trip
        self._progress = progress
        self._observe = observe
        # Configuration errors surface here, before anything is created on disk.
        self.agent_config = agent_config(scenario)
        remediation = scenario.remediation
        self._resets = remediation is not None and remediation.reset_seconds is not None
        self._probing = probing_enabled(scenario)
        self._master_key = sim_master_key(self.seed)
        self._tmp = tempfile.TemporaryDirectory(prefix="vigil-sim-") if workdir is None else None
        self.workdir = workdir if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        master = None
        try:
            if self._resets or self._probing:
                master = self.workdir / "node-action-master.key"
                master.write_text(self._master_key.hex() + "\n")
            self.service = build_service(scenario, self.clock, node_action_key_file=master,
                                         agent_resets=self._resets, trace_dir=trace_dir)
        except BaseException:
            if self._tmp is not None:
                self._tmp.cleanup()
            raise
        self.engine = self.service.engine
        self.ledger = self.service.ledger
        # The service's node-action outbox (GPU resets, probes; None: the scenario uses neither) and
        # prober (aggregator/prober.py; None: probing off).
        self.outbox = self.service.node_actions if self._resets or self._probing else None
        self.prober = self.service.prober if self._probing else None
        self.nodes: dict[str, SimNode] = {}
        self._faults_by_node: dict[str, list[Any]] = {}
        self._schedule: list[tuple[float, int, Callable[[], None]]] = []  # a heap: (t, order, action)
        self._scheduled = 0
        # Per node with a port fault: its counters' growth (start, end, hca, counter, per second),
        # grown when its agent reads them; since when (its last reboot zeroed them), and how much
        # each growth has added since then.
        self._port_rates: dict[str, list[tuple[float, float, int, str, float]]] = {}
        self._port_since: dict[str, float] = {}
        self._port_added: dict[tuple[str, int], int] = {}
        # Per node, the heartbeats its ranks sent that its agent has not taken in yet: (ts, payload).
        self._inbox: dict[str, list[tuple[float, bytes]]] = {}
        # Per job (by its place in ``jobs``), each rank's heartbeat head and tail (``_feed``).
        self._frames: dict[int, list[tuple[str, str]]] = {}
        # The rdma collectors' descriptors on the shared read-only sysfs trees (closed after the run).
        self._shared_files = fabric.SharedAttributeFiles()
        self.jobs: list[JobModel] = []
        # The uninstrumented jobs (``heartbeats: false``), by their model's place in ``jobs``.
        self._uninstrumented: dict[int, UninstrumentedJob] = {}
        self._boots = 0
        self._nvml_setup: dict[str, tuple[int, str, list[dict[str, Any]]]] = {}
        self._healthy: dict[tuple[str, bool], Any] = {}  # (profile, idle) -> the healthy node scenario
        self._idle = set(scenario.resolve_nodes(scenario.fleet.idle)) if scenario.fleet.idle is not None else set()
        self._store_seq = 0
        self._down: dict[str, list[tuple[float, float]]] = {}  # node -> its reboots' [down, back)
        self._remediated: list[Remediated] = []
        # GPU resets: admitted reset_gpu decisions waiting for the outbox (by id); per node, its
        # agent's NodeActionRunner for the current boot, the request ids it is handling, and the
        # results its next report carries (as agent/reporter.py keeps them).
        self._reset_decisions: dict[str, Any] = {}
        self._runners: dict[str, tuple[str, Any]] = {}
        self._handling: dict[str, set[str]] = {}
        self._results: dict[str, list[NodeActionResult]] = {}
        # Probes: each node's probe-only faults (a reboot that clears them removes them), its
        # simulated agent's probe side, the runs answered, and each probe group's members so far
        # (group id -> node -> its collective factor; a collective runs at its slowest member's).
        self._probe_faults: dict[str, list[Any]] = {}
        self._probe_agents: dict[str, SimProbeAgent] = {}
        self._probe_runs: list[ProbeRun] = []
        self._isolations_refused: list[tuple[float, str, str]] = []
        self._groups: dict[str, dict[str, float]] = {}

    # -- set-up ---------------------------------------------------------------------------------

    def _build(self) -> None:
        sc = self.scenario
        names = sc.node_names()
        for fault in sc.faults:
            for n in sc.fault_nodes(fault):
                self._faults_by_node.setdefault(n, []).append(fault)
                if isinstance(fault, PROBE_FAULTS):
                    self._probe_faults.setdefault(n, []).append(fault)
        base = self.agent_config
        from vigil.agent.daemon import build_collectors
        from vigil.agent.nvml.scenario import ALL_PROFILES as PROFILES

        link_layer = sc.fleet.link_layer
        hcas = sc.fleet.hcas_per_node

        def pci(profile: str) -> dict[str, Any]:
            """The PCI devices besides the HCAs on a node of ``profile``: its GPUs and NVSwitches."""
            board = PROFILES[profile]
            return {"gpu_bus_ids": board.pcie_bus_ids[:sc.fleet.gpus_per_node],
                    "nvswitches": _NVSWITCHES_PER_BASEBOARD if board.nvswitch_fabric else 0}

        # Nodes without faults of their fabric share one read-only tree per GPU model (the GPUs'
        # PCI bus ids are the board's).
        shared_sysfs: dict[str, Path] = {}
        shared_ethtool = fabric.Ethtool(None, hcas)
        shared_proc = fabric.build_proc(self.workdir / "proc-shared", SIM_KERNEL)
        quiet_log = self.workdir / "kern-quiet.log"
        quiet_log.touch()
        # Collectors run once per report (a real agent collects more often than it reports; the
        # report carries only the latest result, so the aggregator sees the same thing).
        intervals: dict[str, float] = {}
        profiles = {n: g.profile for g in sc.fleet.profiles for n in sc.resolve_nodes(g.nodes)}
        # Nodes of uninstrumented jobs: their own process table and HCA tree (the job's processes
        # and RDMA traffic), their GPU and RDMA collectors every report.
        quiet_jobs = {n for j in sc.jobs if not j.heartbeats for n in sc.resolve_nodes(j.nodes)}
        proc_roots: dict[str, Path] = {}
        metrics = agent_metrics(sc)
        # On the shared read-only tree the rdma collector's periodic rescan (every 60 s: longer
        # than a report, shorter than a quiet node's 5-minute reads, so every read rescanned)
        # finds what the first found: it rescans there only when the device list it compares
        # every cycle changes. A rescan stats and lists ~370 files of 8 HCAs, half a quiet read.
        # And its collectors keep their files open as an agent does, one descriptor per file
        # shared by every node that reads the tree (``self._shared_files``), where their own
        # descriptors would pass the process's limit and each counter was read by path (open,
        # read, close: 192 files a node, ~2 ms a quiet read), unless the scenario says otherwise.
        rdma = cast("RdmaConfig", base.collectors.rdma)
        keep_open = sc.agent.get("collectors", {}).get("rdma", {}).get("keep_files_open", True)
        shared_tree_collectors = base.collectors.model_copy(update={"rdma": rdma.model_copy(
            update={"rescan_interval_seconds": max(rdma.rescan_interval_seconds, 2 * sc.duration_seconds),
                    "keep_files_open": keep_open})})
        for i, name in enumerate(names):
            faults = self._faults_by_node.get(name, [])
            profile = profiles.get(name, sc.fleet.profile)
            nvml_faults = [f.node_fault() for f in faults if isinstance(f, NvmlFault)]
            self._nvml_setup[name] = (i, profile, nvml_faults)
            ports_faulty = any(isinstance(f, PortDown | PortFlap | PortErrors | RoceCongestion | Reboot | PcieDevice)
                               or (isinstance(f, NvmlFault) and f.kind in _FABRIC_MANAGER_FAULTS) for f in faults)
            own_tree = ports_faulty or name in quiet_jobs
            if own_tree:
                sysfs = fabric.build_tree(self.workdir / "sysfs" / name, hcas, link_layer, **pci(profile))
            else:
                if profile not in shared_sysfs:
                    shared_sysfs[profile] = fabric.build_tree(self.workdir / "sysfs-shared" / profile, hcas,
                                                              link_layer, **pci(profile))
                sysfs = shared_sysfs[profile]
            node_fabric = fabric.NodeFabric(sysfs, **pci(profile)) if own_tree else None
            kern = quiet_log
            if any(isinstance(f, KernelXid | KernelAmdgpu) or (isinstance(f, NvmlFault) and f.kind in _LOGGED)
                   for f in faults):
                kern = self._kern_path(name)
            config = base.model_copy(update={"node": name, "topology": sc.topology_of(i),
                                             **({} if own_tree else {"collectors": shared_tree_collectors})})
            node_intervals = dict(intervals)
            for collector in _SLOW_COLLECTORS:
                seconds = getattr(config.collectors, collector).interval_seconds
                if seconds > sc.report_interval_seconds:
                    node_intervals[collector] = seconds
            if not own_tree and not nvml_faults:
                node_intervals.update(dict.fromkeys(_SLOW_COLLECTORS, _UNCHANGING_SECONDS))
                node_intervals.update(dict.fromkeys(_READ_ONCE, math.inf))
            noisy = {"gpu": bool(nvml_faults) or name in quiet_jobs, "rdma": own_tree, "xid": kern != quiet_log}
            for collector, seconds in sc.quiet_collector_intervals.items():
                if not noisy.get(collector, False):
                    node_intervals[collector] = seconds
            ethtool = fabric.Ethtool(node_fabric, sc.fleet.hcas_per_node) if node_fabric else shared_ethtool
            if name in quiet_jobs:
                proc_roots[name] = fabric.build_proc(self.workdir / "proc" / name, SIM_KERNEL)
            host = SimHost(booted_at=self.clock.start - _UPTIME_AT_START_SECONDS)
            seams = Seams(nvml=self._nvml(name, nvml_faults), sysfs_root=sysfs, kmsg=kern, clock=self.clock,
                          run=ethtool, extra={"pid_alive": self._pid_alive, "psutil": host,
                                              "training_samples": metrics,
                                              **({} if own_tree else {"rdma_files": self._shared_files})},
                          proc_root=proc_roots.get(name, shared_proc))
            node = SimNode(config, seams, build_collectors(config, seams), boot_id=self._boot_id(),
                           kernel_log=KernelLog(kern), fabric=node_fabric,
                           intervals=node_intervals, report_interval_seconds=sc.report_interval_seconds)
            node.pci_bus_ids = [_log_bus_id(b) for b in PROFILES[profile].pcie_bus_ids]
            self.nodes[name] = node
        self._schedule_faults()
        if self.prober is not None:
            self._schedule_isolations()
        for job in sc.jobs:
            job_faults: list[JobFault] = []
            fault_nodes: dict[int, list[str]] = {}
            for f in sc.faults:
                if isinstance(f, SlowNode) or (isinstance(f, DataStall | Hang) and f.job == job.name):
                    fault_nodes[len(job_faults)] = sc.fault_nodes(f)
                    job_faults.append(f)
                elif isinstance(f, UninstrumentedHang | UninstrumentedStraggler) and f.job == job.name:
                    fault_nodes[len(job_faults)] = sc.fault_nodes(f)
                    job_faults.append(uninstrumented_impact(f))
                elif sc.hardware_disrupts_jobs:
                    felt = job_impact(f, job.name)
                    if felt is not None:
                        fault_nodes[len(job_faults)] = sc.fault_nodes(f)
                        job_faults.append(felt)
            job_nodes = sc.resolve_nodes(job.nodes)
            self.jobs.append(JobModel(job, job_nodes, job_faults, fault_nodes, seed=self.seed, start=self.clock.start,
                                      gpus_per_node=sc.fleet.gpus_per_node,
                                      profiles=[profiles.get(n, sc.fleet.profile) for n in job_nodes]))
            if not job.heartbeats:
                start = self.clock.start
                hangs = [(start + f.at_seconds, start + f.until_seconds if f.until_seconds is not None else math.inf)
                         for f in sc.faults if isinstance(f, UninstrumentedHang) and f.job == job.name]
                index = len(self.jobs) - 1
                self._uninstrumented[index] = UninstrumentedJob(
                    self.jobs[index], pid_base=(index + 1) * _PID_STRIDE + 1, gpus_per_node=sc.fleet.gpus_per_node,
                    hcas=sc.fleet.hcas_per_node, proc_roots=proc_roots, hangs=hangs, start=start)

    def _nvml(self, name: str, nvml_faults: list[dict[str, Any]]) -> Any:
        from vigil.agent.nvml.scenario import NodeScenario

        sc = self.scenario
        index, profile, _ = self._nvml_setup[name]
        idle = name in self._idle
        load: dict[str, Any] = {"utilization": 0.0, "noise": 0.0, "memory_used_ratio": 0.0} if idle \
            else {"utilization": sc.fleet.load, "noise": 0.05, "memory_used_ratio": 0.8}
        load["pcie_idle_link_generation"] = sc.fleet.pcie_idle_link_generation
        node_sc = self._healthy.get((profile, idle))
        if node_sc is None or nvml_faults:
            node_sc = NodeScenario.model_validate({"profile": profile, "gpus": sc.fleet.gpus_per_node, "load": load,
                                                   "faults": [*self._fleet_driver(profile), *nvml_faults]})
            if not nvml_faults:
                self._healthy[(profile, idle)] = node_sc
        reset = functools.partial(self._nvidia_smi, name) if self._resets else None
        return open_fake_backend(node_sc, self.clock, seed=self.seed * 100_003 + index, reset=reset)

    def _fleet_driver(self, profile: str) -> list[dict[str, Any]]:
        """A node of another GPU model than the fleet's runs the fleet's driver (a site installs one
        driver image on every node): the node-level drift to it from the start, where the model's
        profile was recorded with another driver (the H200 profile's 580 beside the H100's 535)."""
        from vigil.agent.nvml.scenario import ALL_PROFILES as PROFILES

        fleet, board = PROFILES[self.scenario.fleet.profile], PROFILES[profile]
        if board.vendor != fleet.vendor:
            return []  # another vendor's GPUs run their own vendor's driver
        if (board.driver_version, board.cuda_driver_version) == (fleet.driver_version, fleet.cuda_driver_version):
            return []
        cuda = fleet.cuda_driver_version
        return [{"kind": "config_drift", "at_seconds": 0.0, "driver_version": fleet.driver_version,
                 "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}"}]

    def _vendor(self, name: str) -> str:
        """Whose GPUs node ``name`` has ("nvidia" or "amd"), from its board's profile."""
        from vigil.agent.nvml.scenario import ALL_PROFILES

        return ALL_PROFILES[self._nvml_setup[name][1]].vendor

    def _nvidia_smi(self, name: str, fake: Any, argv: Sequence[str], timeout_seconds: float) -> str:
        """``nvidia-smi --gpu-reset`` on node ``name``: FakeNvml's imitation (it refuses a GPU that
        processes hold; otherwise the GPU's lost and reset-required faults are cleared) where the
        scenario's reset fixes the node (``remediation.reset_clears``); elsewhere the reset fails as
        nvidia-smi fails on a GPU a reset does not recover (exit 1), and the GPU keeps its fault."""
        if self.scenario.reset_clears(name):
            imitation = fake.amd_smi if self._vendor(name) == "amd" else fake.nvidia_smi
            return str(imitation(argv, timeout_seconds))
        raise subprocess.CalledProcessError(
            1, list(argv), output="", stderr=f"Unable to reset GPU {argv[-1]}: the GPU did not recover "
                                             f"(simulated: remediation.reset_clears)")

    def _kern_path(self, name: str) -> Path:
        kern = self.workdir / "kern" / f"{name}.{self._boots}.log"
        kern.parent.mkdir(parents=True, exist_ok=True)
        kern.touch()
        return kern

    def _reboot(self, node: SimNode, clears: bool) -> None:
        """The node comes back from a reboot: a new boot id and agent (fresh collectors), an empty
        kernel log, InfiniBand counters at zero; its GPU faults still there unless ``clears``
        (faults scripted for after the reboot happen either way)."""
        from vigil.agent.daemon import build_collectors

        now = self.clock.elapsed
        _, _, nvml_faults = self._nvml_setup[node.name]
        if clears:
            nvml_faults = [f for f in nvml_faults if f["at_seconds"] > now]
        # Faults only a probe sees: cleared where their own ``reboot_clears`` (else the reboot's) says.
        self._probe_faults[node.name] = [
            f for f in self._probe_faults.get(node.name, [])
            if f.at_seconds > now or not (clears if f.reboot_clears is None else f.reboot_clears)]
        node.close()
        if node.fabric is not None:
            node.fabric.reset(self.scenario.fleet.hcas_per_node, self.scenario.fleet.link_layer)
            if any(f["kind"] in _FABRIC_MANAGER_FAULTS and f["at_seconds"] <= now
                   and (f.get("duration_seconds") is None or now < f["at_seconds"] + f["duration_seconds"])
                   for f in nvml_faults):
                node.fabric.set_fabric_manager(_FABRIC_MANAGER_DOWN_STATE)  # the reboot did not fix it
            # The counters start again from zero.
            self._port_since[node.name] = now
            self._port_added = {k: v for k, v in self._port_added.items() if k[0] != node.name}
        node.boot_id = self._boot_id()
        kern = self._kern_path(node.name)
        extra = {**node.seams.extra, "psutil": SimHost(booted_at=self.clock.now)}
        seams = Seams(nvml=self._nvml(node.name, nvml_faults), sysfs_root=node.seams.sysfs_root, kmsg=kern,
                      clock=self.clock, run=node.seams.run, extra=extra, proc_root=node.seams.proc_root)
        node.restart(seams, build_collectors(node.config, seams), KernelLog(kern))

    def _boot_id(self) -> str:
        self._boots += 1
        return f"sim-{self.seed}-{self._boots:06d}"

    def _at(self, t: float, action: Callable[[], None]) -> None:
        """Do ``action`` at ``t`` simulated seconds (events at one time in the order scheduled)."""
        self._scheduled += 1
        heapq.heappush(self._schedule, (t, self._scheduled, action))

    def _schedule_reboot(self, node: SimNode, t0: float, down_seconds: float, clears: bool) -> None:
        """A reboot of ``node`` at ``t0``: silent for ``down_seconds``, then back (``_reboot``).
        Scripted (``kind: reboot``) or carried out for an admitted decision (``remediation``)."""
        self._at(t0, lambda: setattr(node, "silent", True))
        self._down.setdefault(node.name, []).append((t0, t0 + down_seconds))

        def up() -> None:
            node.silent = False
            self._reboot(node, clears)
        self._at(t0 + down_seconds, up)

    def _actuate(self, d: SimDecision) -> None:
        """The simulator as the actuator (scenario ``remediation``): an admitted reboot_node
        reboots its node from the decision's time on, unless the node is down already; an admitted
        reset_gpu (with ``reset_seconds``) is drained at once and handed to the outbox, as the
        dispatcher's ``on_delivered`` does once Slurm took the drain."""
        remediation = self.scenario.remediation
        if remediation is None or not d.admitted or d.component is not None:
            return
        if d.action == "reset_gpu":
            decision = self._reset_decisions.pop(d.id, None)
            if self.outbox is not None and decision is not None:
                self.outbox.enqueue(decision, self.clock.now)
            return
        if d.action != "reboot_node" or d.node is None:
            return
        node = self.nodes.get(d.node)
        if node is None or any(down <= d.t < back for down, back in self._down.get(d.node, ())):
            return
        clears = self.scenario.reboot_clears(d.node)
        self._schedule_reboot(node, d.t, remediation.reboot_seconds, clears)
        self._remediated.append(Remediated(d.t, d.node, d.id, round(d.t + remediation.reboot_seconds, 3), clears))
        log.info("remediation: rebooting %s at %g s (decision %s), back at %g s, %s", d.node, d.t, d.id,
                 d.t + remediation.reboot_seconds, "fault cleared" if clears else "fault not cleared")

    # -- node actions (GPU resets), as the app and the agent's reporter carry them --------------

    def _answered(self, node: SimNode, taken: Accepted) -> None:
        """The agent's side of the service's answer (agent/reporter.py): the results its report
        carried are forgotten, the requests due for the node are taken."""
        report = taken.report
        if report.action_results:
            carried = {r.id for r in report.action_results}
            self._results[node.name] = [r for r in self._results.get(node.name, []) if r.id not in carried]
        for request in taken.answer.get("requests", ()):
            self._offer(node, request)

    def _with_results(self, node: SimNode, report: Report) -> Report:
        """The report with the results the node's agent has pending (agent/reporter.py's build_body)."""
        pending = self._results.get(node.name)
        if not pending:
            return report
        return replace(report, action_results=list(pending[:MAX_RESULTS_PER_REPORT]))

    def _offer(self, node: SimNode, request: NodeActionRequest) -> None:
        """The agent takes a request from the answer (unless it is handling it, or its result is on
        the way) and runs it; the run takes ``reset_seconds`` (nvidia-smi --gpu-reset), then its
        result waits for the node's next report."""
        handling = self._handling.setdefault(node.name, set())
        if request.id in handling or any(r.id == request.id for r in self._results.get(node.name, ())):
            return
        if request.action == "run_probes":
            self._offer_probes(node, request, handling)
            return
        handling.add(request.id)
        remediation = self.scenario.remediation
        assert remediation is not None and remediation.reset_seconds is not None
        boot = node.boot_id

        def run() -> None:
            handling.discard(request.id)
            if node.boot_id != boot or node.silent:
                return  # the node rebooted meanwhile: that agent and its request are gone
            result = self._runner(node).handle(request)
            self._results.setdefault(node.name, []).append(result)
            clears = result.outcome == "done" and self.scenario.reset_clears(node.name)
            self._remediated.append(Remediated(
                round(request.issued_at - self.clock.start, 3), node.name, request.id,
                round(self.clock.elapsed, 3), clears, action=request.action, gpu=request.gpu,
                outcome=f"{result.outcome} ({result.reason})"))
            log.info("remediation: %s of GPU %s on %s at %g s (decision %s): %s (%s)", request.action, request.gpu,
                     node.name, self.clock.elapsed, request.id, result.outcome, result.reason)
        self._at(self.clock.elapsed + remediation.reset_seconds, run)

    def _offer_probes(self, node: SimNode, request: NodeActionRequest, handling: set[str]) -> None:
        """The node's simulated agent takes a run_probes request: refused at once (signed, in the
        next report) when a check fails or a job holds the node; else its probes run one after
        another for their simulated durations (``probes.seconds``) and the signed result waits for
        the node's next report. A reboot meanwhile ends the run (that agent is gone)."""
        agent = self._probe_agent(node.name)
        now = self.clock.now
        t0 = self.clock.elapsed
        refused = agent.check(request, node.boot_id, now, self._busy(node.name))
        if refused is not None:
            self._results.setdefault(node.name, []).append(refused)
            self._probe_runs.append(ProbeRun(round(t0, 3), node.name, request.id, tuple(request.probes),
                                             round(t0, 3), f"refused ({refused.reason})"))
            log.info("probes: %s refused %s (%s): %s", node.name, request.id, refused.reason, refused.detail)
            return
        handling.add(request.id)
        boot = node.boot_id
        group = request.probe_group
        if group is not None:  # this member joins its group's collective now
            members = self._groups.setdefault(group.group, {})
            members[node.name] = self._hardware(node.name).collective_factor()

        def done() -> None:
            handling.discard(request.id)
            if node.boot_id != boot or node.silent:
                return  # the node rebooted meanwhile: that agent and its run are gone
            busbw = None
            if group is not None and "collective" in request.probes:
                members = self._groups.get(group.group, {})
                if len(members) >= group.world_size:
                    from vigil.sim.probes import COLLECTIVE_GB_PER_S_PER_HCA

                    busbw = COLLECTIVE_GB_PER_S_PER_HCA * max(1, self.scenario.fleet.hcas_per_node) \
                        * min(members.values())
            result = agent.run(request, boot, self.clock.now, self._hardware(node.name), busbw)
            self._results.setdefault(node.name, []).append(result)
            failed = tuple(f"{p.probe}{'' if p.gpu is None else f' gpu {p.gpu}'}: {p.reason}"
                           for p in result.probes if p.status in ("fail", "error"))
            self._probe_runs.append(ProbeRun(
                round(t0, 3), node.name, request.id, tuple(request.probes), round(self.clock.elapsed, 3),
                result.outcome, failed, tuple((p.probe, p.gpu, p.value) for p in result.probes)))
            log.info("probes: %s ran %s (%s) from %g s to %g s: %s", node.name, request.id, ", ".join(request.probes),
                     t0, self.clock.elapsed, "; ".join(failed) or "every probe passed on the agent's side")
        self._at(t0 + probe_seconds(request, self.scenario.probes), done)

    def _probe_agent(self, name: str) -> SimProbeAgent:
        agent = self._probe_agents.get(name)
        if agent is None:
            index = self._nvml_setup[name][0]
            agent = self._probe_agents[name] = SimProbeAgent(name, self._master_key, self.scenario.probes,
                                                             node_rng(self.seed, index))
        return agent

    def _hardware(self, name: str) -> SimHardware:
        """The node's hardware under a probe's load now: its profile, its probe-only faults."""
        _, profile, _ = self._nvml_setup[name]
        fleet = self.scenario.fleet
        return SimHardware(profile, fleet.gpus_per_node, fleet.hcas_per_node, self._probe_faults.get(name, []),
                           self.clock.elapsed, self.scenario.probes.noise, self._probe_agent(name).rng)

    def _busy(self, name: str) -> str | None:
        """Why the node is busy (a job's processes hold its GPUs), or None: a job that covers the
        node has started and not ended, and the node has not rebooted since it started (a reboot
        ends the node's processes; the simulated job is not restarted on it)."""
        t = self.clock.elapsed
        for model in self.jobs:
            job = model.job
            if name not in model.nodes or t < job.start_seconds or (job.end_seconds is not None
                                                                    and t >= job.end_seconds):
                continue
            if any(down >= job.start_seconds for down, _ in self._down.get(name, ())):
                continue
            return f"job {job.name} holds the node's GPUs"
        return None

    def _runner(self, node: SimNode) -> Any:
        """The node's NodeActionRunner for its current boot (a reboot starts a new agent): reset_gpu
        allowed, its node key (derived from the simulated aggregator's master key) in a file."""
        from vigil.agent.node_action_runner import NodeActionRunner, NodeActionsConfig
        from vigil.contract.node_actions import node_key

        held = self._runners.get(node.name)
        if held is not None and held[0] == node.boot_id:
            return held[1]
        key_file = self.workdir / "node-keys" / f"{node.name}.key"
        if not key_file.exists():
            key_file.parent.mkdir(parents=True, exist_ok=True)
            key_file.write_text(node_key(self._master_key, node.name).hex() + "\n")
        runner = NodeActionRunner(NodeActionsConfig(allow=["reset_gpu"], key_file=str(key_file)), node=node.name,
                                  boot_id=node.boot_id, nvml=node.seams.nvml, clock=self.clock)
        self._runners[node.name] = (node.boot_id, runner)
        return runner

    def _schedule_isolations(self) -> None:
        """Each scenario ``isolations`` entry, started at its time through the prober (as the
        operator route does): refused ones are kept for the score."""
        for iso in self.scenario.isolations:
            nodes = self.scenario.resolve_nodes(iso.nodes)

            def start(nodes: list[str] = nodes, d_hint: int = iso.d_hint, note: str = iso.note) -> None:
                from vigil.aggregator.prober import IsolationRefused

                assert self.prober is not None and self.engine is not None
                try:
                    self.prober.start_isolation(nodes, d_hint, self.engine.view(), self.clock.now, source="sim",
                                                note=note)
                except IsolationRefused as exc:
                    self._isolations_refused.append((round(self.clock.elapsed, 3), exc.reason, exc.detail))

            self._at(iso.at_seconds, start)

    def _schedule_faults(self) -> None:
        for fault in self.scenario.faults:
            for name in self.scenario.fault_nodes(fault):
                node = self.nodes[name]
                self._schedule_fault(fault, node)

    def _schedule_fault(self, fault: Any, node: SimNode) -> None:
        t0 = fault.at_seconds
        if isinstance(fault, KernelXid):
            lines = [kernel_xid_line(node.pci_bus_ids[g], fault.code, fault.text)
                     for g in fault.gpu_indexes(self.scenario.fleet.gpus_per_node)]
            for k in range(fault.repeat + 1):
                self._at(t0 + k * fault.every_seconds, lambda: node.kernel_log.write_lines(
                    self.clock.elapsed + 60.0, lines))
        elif isinstance(fault, KernelAmdgpu):
            amd = amdgpu_lines(node.pci_bus_ids[fault.gpu], fault.event, fault.block, fault.count)
            for k in range(fault.repeat + 1):
                self._at(t0 + k * fault.every_seconds, lambda: node.kernel_log.write_lines(
                    self.clock.elapsed + 60.0, amd))
        elif isinstance(fault, PortDown):
            assert node.fabric is not None
            fab = node.fabric
            self._at(t0, lambda: fab.set_link(fault.hca, False))
            if fault.duration_seconds is not None:
                self._at(t0 + fault.duration_seconds, lambda: fab.set_link(fault.hca, True))
        elif isinstance(fault, PortFlap):
            assert node.fabric is not None
            fab = node.fabric
            down_for = fault.down_seconds if fault.down_seconds is not None else fault.period_seconds / 2
            for k in range(fault.count):
                down = t0 + k * fault.period_seconds
                if down > self.scenario.duration_seconds:
                    break
                self._at(down, lambda: fab.set_link(fault.hca, False, polling=True))
                self._at(down + down_for, lambda: fab.set_link(fault.hca, True))
        elif isinstance(fault, PcieDevice):
            assert node.fabric is not None
            fab, pcie = node.fabric, fault
            if pcie.width is not None or pcie.generation is not None:
                self._at(t0, lambda: fab.set_pcie_link(pcie.device, pcie.index, width=pcie.width,
                                                       generation=pcie.generation))
            if pcie.aer_severity is not None:
                severity = pcie.aer_severity
                every = pcie.aer_every_seconds or math.inf
                t = t0
                while t <= self.scenario.duration_seconds:
                    self._at(t, lambda: fab.add_aer(pcie.device, pcie.index, severity, pcie.aer_count))
                    t += every
        elif isinstance(fault, PortErrors):
            end = fault.until_seconds if fault.until_seconds is not None else math.inf
            self._port_rates.setdefault(node.name, []).append((t0, end, fault.hca, fault.counter, fault.per_second))
        elif isinstance(fault, RoceCongestion):
            end = fault.until_seconds if fault.until_seconds is not None else math.inf
            for counter, per_second in fault.rates().items():
                self._port_rates.setdefault(node.name, []).append((t0, end, fault.hca, counter, per_second))
        elif isinstance(fault, Silence):
            self._at(t0, lambda: setattr(node, "silent", True))
            if fault.until_seconds is not None:
                def back() -> None:
                    node.silent = False
                    node.reboot(self._boot_id())
                    node.seams.extra["psutil"].booted_at = self.clock.now
                self._at(fault.until_seconds, back)
        elif isinstance(fault, Reboot):
            self._schedule_reboot(node, t0, fault.down_seconds, fault.clears)
        elif isinstance(fault, NvmlFault) and fault.kind in _FABRIC_MANAGER_FAULTS:
            # FakeNvml takes the GPUs' fabric registration away; the service is down on the host.
            assert node.fabric is not None
            fab = node.fabric
            self._at(t0, lambda: fab.set_fabric_manager(_FABRIC_MANAGER_DOWN_STATE))
            duration = (fault.model_extra or {}).get("duration_seconds")
            if duration is not None:
                self._at(t0 + float(duration), lambda: fab.set_fabric_manager(fabric.FABRIC_MANAGER_ACTIVE))
        elif isinstance(fault, NvmlFault) and fault.kind in _LOGGED_AMD and self._vendor(node.name) == "amd":
            amd_faulty = amdgpu_lines(node.pci_bus_ids[fault.gpu or 0], _LOGGED_AMD[fault.kind], "umc",
                                      int((fault.model_extra or {}).get("count", 1)))
            self._at(t0, lambda: node.kernel_log.write_lines(self.clock.elapsed + 60.0, amd_faulty))
        elif isinstance(fault, NvmlFault) and fault.kind in _LOGGED and self._vendor(node.name) != "amd":
            code = int((fault.model_extra or {}).get("code", 0)) if fault.kind == "xid" else _LOGGED[fault.kind]
            line = kernel_xid_line(node.pci_bus_ids[fault.gpu or 0], code, "")
            self._at(t0, lambda: node.kernel_log.write(self.clock.elapsed + 60.0, line))
        # NVML faults run inside FakeNvml; slow nodes, stalls and hangs inside the job model.

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        try:
            self._build()
            with service_gc():
                result = self._loop(wall0)
        finally:
            if self.service.trace is not None:  # ``trace_dir``: the trace complete on disk
                self.service.trace.close()
            for node in self.nodes.values():
                node.close()
            self._shared_files.close_all()
            if self._tmp is not None:
                self._tmp.cleanup()
        return result

    def _loop(self, wall0: float) -> SimResult:
        """Interval k covers ((k-1)*dt, k*dt]: the jobs step to its end, each node's agent reports
        once at its own phase within it (its heartbeats up to that moment delivered first), the
        aggregator evaluates at its end and, as the service's urgent wake does, at once after a
        report with an urgent event."""
        sc = self.scenario
        dt = sc.report_interval_seconds
        ticks = max(1, math.ceil(sc.duration_seconds / dt - 1e-9))
        decisions: list[SimDecision] = []
        traces = [JobTrace(j.job.name, j.nodes) for j in self.jobs]
        reports = heartbeats = 0
        fleet_t: list[float] = []
        reporting: list[int] = []
        silent: list[int] = []
        fleet_nodes = len(self.nodes)
        offsets = report_offsets(sc, self.seed)
        # Earliest first within an interval (each node reports at k*dt - its offset).
        order = sorted(self.nodes.values(), key=lambda n: -offsets[n.name])
        for k in range(1, ticks + 1):
            t = min(k * dt, sc.duration_seconds)
            for model, trace in zip(self.jobs, traces, strict=True):
                batch = model.advance(self.clock.start + t)
                self._feed(model, batch)
                _trace(trace, model, batch, t)
            n_reporting = 0
            for node in order:
                t_node = k * dt - offsets[node.name]
                if t_node > sc.duration_seconds + 1e-9:
                    continue  # the run ends before this agent's cycle comes round
                self._advance(t_node)
                if node.silent:
                    self._deliver(node, self.clock.now, drop=True)  # an agent that is down hears nothing
                    continue
                heartbeats += self._deliver(node, self.clock.now)
                self._grow_port_counters(node.name, t_node)
                now = self.clock.now
                for quiet in self._uninstrumented.values():
                    quiet.apply(node.name, node.seams.nvml, node.fabric, now)
                report = node.tick(now)
                if report is None:
                    continue
                if self.outbox is not None:
                    report = self._with_results(node, report)
                if self._observe is not None:
                    self._observe(report, now)
                taken = self.service.receive(encode(report)) if self._json else self.service.take(report)
                if isinstance(taken, Accepted) and self.outbox is not None:
                    self._answered(node, taken)
                n_reporting += 1
                if t_node < t and self.service.wake.is_set():  # an urgent report: judged at once
                    decisions.extend(self._judge(now, fleet_nodes))
            reports += n_reporting
            self._advance(t)
            decisions.extend(self._judge(self.clock.now, fleet_nodes))
            fleet_t.append(t)
            reporting.append(n_reporting)
            silent.append(sum(1 for n in self.nodes.values() if n.silent))
            if self._progress is not None:
                self._progress(t, sc.duration_seconds, len(decisions))
        rejected: dict[str, int] = {}
        for node in self.nodes.values():
            for reason, n in getattr(node.training, "_rejected", {}).items():
                if n:
                    rejected[reason] = rejected.get(reason, 0) + n
        return SimResult(
            scenario=sc, seed=self.seed, decisions=decisions, simulated_seconds=self.clock.elapsed,
            wall_seconds=time.perf_counter() - wall0, reports=reports, heartbeats=heartbeats,
            heartbeats_rejected=rejected, breaker_tripped=self._breaker_tripped(decisions),
            collectors=sorted({c.name for n in self.nodes.values() for c in n.collectors}),
            jobs=traces, fleet_t=fleet_t, fleet_reporting=reporting, fleet_silent=silent,
            remediations=list(self._remediated), probe_runs=list(self._probe_runs),
            isolations=list(self.prober.isolations) if self.prober is not None else [],
            isolations_refused=list(self._isolations_refused))

    def _advance(self, t: float) -> None:
        """Simulated time to ``t`` seconds: the scheduled events due by then happen in order, the
        clock moves."""
        while self._schedule and self._schedule[0][0] <= t:
            at, _, action = heapq.heappop(self._schedule)
            self._move_to(at)
            action()
        self._move_to(t)

    def _move_to(self, t: float) -> None:
        if t > self.clock.elapsed:
            self.clock.advance_to(t)

    def _judge(self, now: float, fleet_nodes: int) -> list[SimDecision]:
        """One evaluation of the aggregator, and what the simulator carries out of it."""
        self.service.wake.clear()
        out = self._evaluate(now, fleet_nodes)
        for d in out:
            self._actuate(d)
        return out

    def _grow_port_counters(self, name: str, t: float) -> None:
        """The node's faulty port counters as of ``t`` (just before its agent reads them): each
        growth's whole count from its start (or the node's last reboot) to ``t``, so the pieces
        add up to rate x duration whatever the agents' phases."""
        rates = self._port_rates.get(name)
        fab = self.nodes[name].fabric
        if not rates or fab is None:
            return
        since = self._port_since.get(name, 0.0)
        for i, (start, end, hca, counter, per_second) in enumerate(rates):
            a, b = max(since, start), min(t, end)
            if b <= a:
                continue
            total = int(per_second * (b - a) + 1e-6)
            added = self._port_added.get((name, i), 0)
            if total > added:
                fab.add_counter(hca, counter, total - added)
                self._port_added[(name, i)] = total

    def _feed(self, model: JobModel, batch: StepBatch) -> None:
        """Put each node's ranks' heartbeats for the window in its inbox (its agent takes them in
        up to its own report time, ``_deliver``): every step when there are few, else an even
        sample that keeps the last step (the window summary's step count comes from step
        numbers, its quantiles from the sample)."""
        quiet = self._uninstrumented.get(self.jobs.index(model))
        if quiet is not None:
            quiet.observe(batch)  # no heartbeats: its GPUs and fabric say what it does
            return
        k = len(batch.step)
        if k == 0 and not batch.announcements:
            return
        per_window = self.scenario.heartbeats_per_rank
        rows = np.arange(k) if k <= per_window else np.unique(
            np.linspace(0, k - 1, per_window).round().astype(int))
        # Announced pauses (rare): each goes in between the steps before and after it, as the
        # client's hb.checkpointing() sends it, from every rank still running at that moment.
        notes = [(ts, step, phase, ~model.stopped_at(ts)) for ts, step, phase in batch.announcements]
        job = model.job.name
        # Each rank's process id, as the heartbeat client sends it: unique per job and rank.
        pid_base = (self.jobs.index(model) + 1) * _PID_STRIDE + 1
        r_per = model.ranks_per_node
        gpus = self.scenario.fleet.gpus_per_node
        # As Python lists, by rank: an element of a list costs a fraction of a numpy scalar's, and
        # formats the same.
        steps = [int(s) for s in batch.step[rows].tolist()]
        ends = [float(e) for e in batch.end_ts[rows].tolist()]
        step_s = batch.step_seconds[rows].T.tolist()
        comp = batch.compute_seconds[rows].T.tolist()
        comm = batch.comm_seconds[rows].T.tolist()
        data = batch.data_seconds[rows].T.tolist()
        alive = batch.alive[rows].T.tolist()
        n_rows = len(rows)
        # Each rank's heartbeat head and tail, formatted once per job (every interval used to
        # format them again for each of its ranks: 8,000 at 1,000 nodes).
        index = self.jobs.index(model)
        frames = self._frames.get(index)
        if frames is None:
            frames = self._frames[index] = [
                (f'{{"job":"{job}","rank":{rank},"step":', f',"gpu":{rank % r_per % gpus},"pid":{pid_base + rank}}}')
                for rank in range(len(model.nodes) * r_per)]
        for i, name in enumerate(model.nodes):
            # Rank by rank, each rank's in time order (an agent takes them in in this order).
            box = self._inbox.setdefault(name, [])
            for local in range(r_per):
                rank = i * r_per + local
                pending = [nt for nt in notes if nt[3][rank]] if notes else []
                rank_step, rank_comp, rank_comm = step_s[rank], comp[rank], comm[rank]
                rank_data, rank_alive = data[rank], alive[rank]
                head, tail = frames[rank]
                for j in range(n_rows):
                    end = ends[j]
                    while pending and pending[0][0] < end:
                        box.append(self._note(job, rank, local % gpus, pid_base + rank, pending.pop(0)))
                    if not rank_alive[j]:
                        continue
                    payload = (_HEARTBEAT % (head, steps[j], rank_step[j], rank_comp[j], rank_comm[j],
                                             rank_data[j], tail)).encode()
                    box.append((end, payload))
                for note in pending:
                    box.append(self._note(job, rank, local % gpus, pid_base + rank, note))

    def _deliver(self, node: SimNode, now: float, drop: bool = False) -> int:
        """The node's training collector takes in the heartbeats sent by ``now`` (each at its own
        time, as the socket receives them; ``drop``: lost, the agent is down); later ones wait
        for its next cycle."""
        box = self._inbox.get(node.name)
        if not box:
            return 0
        due = [hb for hb in box if hb[0] <= now]
        if len(due) < len(box):
            self._inbox[node.name] = [hb for hb in box if hb[0] > now]
        else:
            del self._inbox[node.name]
        if drop:
            return 0
        node.ingest_heartbeats(due)
        return len(due)

    @staticmethod
    def _note(job: str, rank: int, gpu: int, pid: int, note: tuple[float, int, str, np.ndarray]) -> tuple[float, bytes]:
        ts, step, phase, _ = note
        return ts, (f'{{"job":"{job}","rank":{rank},"step":{step},"step_seconds":0,'
                    f'"phase":"{phase}","gpu":{gpu},"pid":{pid}}}').encode()

    def _pid_alive(self, pid: int) -> bool:
        """The nodes' process table (the training collector's ``pid_alive`` seam): a rank's process
        lives until its job has finished, as the real client's pid does."""
        index = pid // _PID_STRIDE - 1
        if not 0 <= index < len(self.jobs):
            return True
        model = self.jobs[index]
        end = model.job.end_seconds
        # The job model runs to each interval's end; an agent asking earlier sees it still running.
        return not (model.finished and end is not None and self.clock.elapsed >= end)

    def _evaluate(self, now: float, fleet_nodes: int) -> list[SimDecision]:
        """The service's evaluation (forgetting departed nodes, the detectors, the gate, the
        prober's round), and every verdict the gate recorded in it."""
        t = now - self.clock.start
        store = self.ledger.store
        before = self._store_seq
        self.service.evaluate_now()
        rows = _rows_after(store, before)
        if rows:
            self._store_seq = max(r.seq for r in rows)
        if self._resets:
            self._reset_decisions.update((r.decision.id, r.decision) for r in rows
                                         if r.admitted and str(r.decision.action) == "reset_gpu")
        return [SimDecision.of(r.decision, t, r.admitted, r.verdict) for r in sorted(rows, key=lambda r: r.seq)]

    def _breaker_tripped(self, decisions: list[SimDecision]) -> bool:
        return bool(self.ledger.store.breaker().tripped)


# NVML faults that lower a GPU's SM clock, by the node-level model that defines their fields.
_THROTTLES: dict[str, Any] = {"thermal_throttle": ThermalThrottle, "power_brake": PowerBrake, "power_cap": PowerCap}


@contextlib.contextmanager
def service_gc() -> Iterator[None]:
    """The aggregator service's garbage-collector policy (aggregator/app.py ``tune_gc``: what
    exists at start-up frozen out of the collector's way, collections every ``GC_THRESHOLDS``
    allocations) while the simulation runs, the caller's restored after it. The simulated fleet's
    agents, FakeNvml and detectors are millions of long-lived objects; at CPython's default
    thresholds the collector re-walks them every 700 allocations and costs more than the
    simulation itself (bench/bench_sim.py). Cycles are still collected: less often."""
    from vigil.aggregator.app import GC_THRESHOLDS

    thresholds = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if frozen_before == 0:  # what the caller froze stays frozen
            gc.unfreeze()


def report_offsets(scenario: Scenario, seed: int) -> dict[str, float]:
    """How long before each interval's end each node's agent reports: a phase drawn uniformly in
    [0, report interval) per node, fixed by the seed (agents started at different moments report
    at different moments of every cycle; a real agent's training windows are aligned on the clock,
    so each agent reads the same windows at its own moment), or 0 everywhere with
    ``agent_phases: lockstep``. A rebooted node's new agent keeps its node's phase."""
    names = scenario.node_names()
    if scenario.agent_phases == "lockstep":
        return dict.fromkeys(names, 0.0)
    dt = scenario.report_interval_seconds
    drawn = np.random.default_rng([seed, _PHASE_STREAM]).uniform(0.0, dt, size=len(names))
    # Rounded to the millisecond (decision times stay short numbers), still within [0, dt).
    return {n: round(float(o), 3) % dt for n, o in zip(names, drawn, strict=True)}


def job_impact(fault: Any, job: str) -> JobFault | None:
    """What a hardware fault does to a job on its node (``hardware_disrupts_jobs``): the job
    model's own fault with the same target and time, or None for faults a job does not feel."""
    target = {"node": fault.node, "nodes": fault.nodes, "component": fault.component, "at_seconds": fault.at_seconds}
    if isinstance(fault, NvmlFault) and fault.kind in _THROTTLES:
        # The node-level model's own fields and defaults (clock ratio, duration).
        throttle = _THROTTLES[fault.kind].model_validate(fault.node_fault())
        if throttle.clock_ratio >= 1.0:
            return None
        until = None if throttle.duration_seconds is None else fault.at_seconds + throttle.duration_seconds
        # Compute-bound kernels slow in proportion to the SM clock.
        return SlowNode(kind="slow_node", gpus=[fault.gpu or 0], factor=min(100.0, 1.0 / throttle.clock_ratio),
                        until_seconds=until, **target)
    lost = (isinstance(fault, NvmlFault) and fault.kind == "gpu_lost") or (isinstance(fault, KernelXid)
                                                                          and fault.code == 79)
    if lost:
        # The rank on the lost GPU dies; the others block in their next collective.
        return Hang(kind="hang", job=job, gpus=[fault.gpu or 0], others_continue_seconds=0, **target)
    if isinstance(fault, Reboot):
        return Hang(kind="hang", job=job, others_continue_seconds=0,
                    until_seconds=fault.at_seconds + fault.down_seconds, **target)
    if isinstance(fault, PortDown):
        # Without its fabric port the node's ranks cannot reach the others' collectives.
        until = None if fault.duration_seconds is None else fault.at_seconds + fault.duration_seconds
        return Hang(kind="hang", job=job, others_continue_seconds=0, until_seconds=until, **target)
    return None


def uninstrumented_impact(fault: UninstrumentedHang | UninstrumentedStraggler) -> JobFault:
    """The job model's fault for an uninstrumented job's: every rank stopped in the collective at
    once (a hang with no target), or the starved node's ranks waiting longer for data each step."""
    if isinstance(fault, UninstrumentedHang):
        return Hang(kind="hang", job=fault.job, at_seconds=fault.at_seconds, others_continue_seconds=0,
                    until_seconds=fault.until_seconds)
    return DataStall(kind="data_stall", job=fault.job, at_seconds=fault.at_seconds, node=fault.node,
                     nodes=fault.nodes, component=fault.component, extra_seconds=fault.extra_seconds,
                     until_seconds=fault.until_seconds)


def _trace(trace: JobTrace, model: JobModel, batch: StepBatch, t: float) -> None:
    if len(batch.step) == 0:
        return
    trace.t.append(t)
    trace.step_seconds.append(float(batch.step_seconds[:, 0].mean()))
    per_node = batch.compute_seconds.mean(axis=0).reshape(len(model.nodes), model.ranks_per_node).mean(axis=1)
    trace.node_compute_seconds.append(per_node.astype(np.float32))


def _rows_after(store: Any, seq: int) -> list[Any]:
    """Store rows written after ``seq`` (newest first from the store; fetched in growing pages)."""
    limit = 64
    while True:
        rows = store.decisions(limit=limit)
        if len(rows) < limit or rows[-1].seq <= seq:
            return [r for r in rows if r.seq > seq]
        limit *= 4


# NVML faults of the node's Fabric Manager: the simulator stops its service too (NodeFabric).
_FABRIC_MANAGER_FAULTS = ("fabric_manager_down",)
# NVML faults the driver also writes to the kernel log, with the Xid it logs for them (NVIDIA
# Xid catalog: 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus).
_LOGGED = {"xid": 0, "ecc_uncorrectable": 48, "row_remap_pending": 63, "row_remap_failure": 64,
           "nvlink_down": 74, "gpu_lost": 79}
# The node-scenario faults the amdgpu driver writes to the kernel log on an AMD board, as the event
# whose lines sim/fleet.py amdgpu_lines writes: an uncorrectable UMC (HBM) error is logged with its
# RAS count and a GPU reset (tests/fixtures/kernel-log/amdgpu). An XGMI link down or a lost GPU has no
# line of its own in the real logs found: the backend's link status and health carry them.
_LOGGED_AMD = {"ecc_uncorrectable": "ras_uncorrectable"}


def _log_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as the driver's log writes it: "0000:3b:00"."""
    parts = nvml_bus_id.lower().split(":")
    if len(parts) != 3:
        return nvml_bus_id.lower()
    return f"{parts[0][-4:]}:{parts[1]}:{parts[2].split('.')[0]}"


def agent_metrics(scenario: Scenario) -> bool:
    """Whether the simulated agents build the training collector's /metrics samples: ``on``,
    ``off``, or (``auto``) everywhere but in a healthy-fleet statistics run, one that expects and
    allows nothing and injects no fault (its verdict is "no removal", judged from the reports
    alone, which the samples never reach)."""
    if scenario.agent_metrics != "auto":
        return scenario.agent_metrics == "on"
    return bool(scenario.faults or scenario.expect or scenario.allow or scenario.expect_breaker != "any"
                or scenario.remediation is not None or scenario.isolations or probing_enabled(scenario))


def probing_enabled(scenario: Scenario) -> bool:
    """Whether the scenario's aggregator probes (``aggregator.probes.enabled``)."""
    probes = scenario.aggregator.get("probes")
    return isinstance(probes, dict) and probes.get("enabled") is True


def build_service(scenario: Scenario, clock: SimClock, *, node_action_key_file: Path | None = None,
                  agent_resets: bool = True, trace_dir: Path | None = None) -> AggregatorService:
    """The real aggregator service, configured by the scenario, the gate in dry run over an
    in-memory store, on the simulated clock (its start-up grace counted from the simulation's
    start, as ``serve`` counts it from its own). Configuration errors name their key path under
    ``aggregator.`` or ``gate.``. ``node_action_key_file``: the master key file of agent resets
    (the simulator carries out GPU resets, ``remediation.reset_seconds``): the aggregator then runs
    with ``actuators.slurm.reset_gpu`` on (no actuator is built here; the simulator delivers the
    drain); with ``agent_resets`` false the key only signs the prober's run_probes requests.
    ``trace_dir``: the service records its trace there (aggregator/trace.py, written at once on the
    simulated clock; ``vigil sim --trace``)."""
    from pydantic import ValidationError

    from vigil.aggregator.config import parse_config as parse_aggregator_config
    from vigil.aggregator.gate import GateConfig

    data: dict[str, Any] = {**scenario.aggregator, "dry_run": True}
    if node_action_key_file is not None:
        data = _merge(data, {"node_actions": {"key_file": str(node_action_key_file)}})
    if node_action_key_file is not None and agent_resets:
        data = _merge(data, {"actuators": {"enabled": True, "slurm": {"enabled": True, "reset_gpu": True}}})
    try:
        config = parse_aggregator_config(data)
    except ConfigError as exc:
        raise ScenarioError(f"scenario {scenario.name}: aggregator: {exc}") from None
    try:
        gate_config = GateConfig.model_validate({**scenario.gate, "dry_run": True})
    except ValidationError as exc:
        raise ScenarioError(format_validation_error(exc, f"invalid scenario {scenario.name} (gate)")) from None
    trace = None
    if trace_dir is not None:
        from vigil.aggregator.service import trace_header
        from vigil.aggregator.trace import TraceConfig, TraceWriter

        header = {**trace_header(config, clock.start, clock()), "source": "sim"}
        trace = TraceWriter(TraceConfig(enabled=True, directory=str(trace_dir)), header, background=False, wall=clock)
    return AggregatorService.in_memory(config, gate_config, clock=clock, started=clock.start, trace=trace)


def run_scenario(scenario: Scenario, *, seed: int | None = None, json_round_trip: bool = False,
                 progress: Progress | None = None, trace_dir: Path | None = None) -> SimResult:
    return Simulation(scenario, seed=seed, json_round_trip=json_round_trip, progress=progress,
                      trace_dir=trace_dir).run()
