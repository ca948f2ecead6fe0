"""Fleet scenarios: the YAML that describes a simulated fleet, its jobs, its faults and the answers.

A scenario names the fleet (nodes, GPUs, device profile, topology), the training jobs running on
it, faults injected at scripted simulated times, and the decisions the aggregator is expected to
take. This module validates and resolves that description (node names, ranges, components); it
runs nothing and knows nothing about the agent or the aggregator.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

# A fleet scenario that cannot be used raises the node scenario's error: one ScenarioError.
from vigil.agent.nvml.scenario import FAULT_KINDS, NODE_WIDE_FAULT_KINDS, ScenarioError
from vigil.contract.validation import StrictModel, format_validation_error, read_yaml_file

# The repository's scenarios/, installed as package data of `vigil` (vigil/scenarios links to it).
SCENARIO_DIR = Path(str(resources.files("vigil") / "scenarios"))

# The node-level FakeNvml fault kinds (agent/nvml/scenario.py is the one definition of each kind and
# its fields); the simulator passes these through to each node's FakeNvml unchanged.
NVML_FAULT_KINDS = FAULT_KINDS
NvmlKind = Literal[FAULT_KINDS]  # type: ignore[valid-type]


class Topology(StrictModel):
    """Consecutive nodes share a rack, consecutive racks a row; leaf switches span consecutive
    nodes (a leaf of 32 nodes is a common size). ``rails`` > 1 is a rail-optimised fabric: each
    group of ``nodes_per_leaf`` nodes has one leaf per rail, and HCA r of every node in the group
    cables to the rail-r leaf (labels ``rail<r>_leaf`` = ``leaf-<group>-rail<r>`` instead of
    ``leaf_switch``), so one leaf's fault shows on one HCA of many nodes."""

    nodes_per_rack: int = Field(default=4, ge=1)
    racks_per_row: int = Field(default=8, ge=1)
    nodes_per_leaf: int = Field(default=32, ge=1)
    rails: int = Field(default=1, ge=1, le=16)


class ProfileGroup(StrictModel):
    """Nodes of another GPU model in a mixed fleet (an H200 row beside the H100s)."""

    nodes: NodeSet
    profile: str


class Fleet(StrictModel):
    nodes: int = Field(ge=1, le=100_000)
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    hcas_per_node: int = Field(default=1, ge=0, le=16)
    profile: str = "h100-sxm-80gb"
    # Later groups win where they overlap; nodes in none have ``profile``.
    profiles: list[ProfileGroup] = Field(default_factory=list)
    # Nodes between jobs: their GPUs idle (utilization 0, memory free), as FakeNvml answers for
    # an idle GPU (power-saving clocks, a PCIe link trained down to save power); None: every
    # node at ``load``. A job may not run on them.
    idle: NodeSet | None = None
    # The PCIe generation idle GPUs' links retrain to (FakeNvml's load.pcie_idle_link_generation):
    # boards that drop to a low performance state at idle; None: they hold their maximum, as every
    # recorded HGX board does in persistence mode (agent/nvml/scenario.py Load).
    pcie_idle_link_generation: int | None = Field(default=None, ge=1, le=6)
    # The compute fabric: InfiniBand, or RoCE ("Ethernet" link layer, as the kernel names it).
    link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"
    load: float = Field(default=0.9, ge=0, le=1)  # GPU utilization of the healthy fleet
    name_format: str = "node-{:04d}"
    topology: Topology = Topology()

    @model_validator(mode="after")
    def _name_format_works(self) -> Fleet:
        from vigil.agent.nvml.scenario import ALL_PROFILES

        for i, profile in enumerate([self.profile, *(g.profile for g in self.profiles)]):
            if profile not in ALL_PROFILES:
                where = "profile" if i == 0 else f"profiles.{i - 1}.profile"
                raise ValueError(f"{where}: {profile!r} is not one of {sorted(ALL_PROFILES)}")
        try:
            first = self.name_format.format(0)
        except (IndexError, KeyError, ValueError) as exc:
            raise ValueError(f"name_format {self.name_format!r} cannot format an index: {exc}") from None
        if first == self.name_format.format(1):
            raise ValueError(f"name_format {self.name_format!r} gives every node the same name")
        if self.topology.rails > 1 and self.topology.rails > self.hcas_per_node:
            raise ValueError(f"topology.rails: {self.topology.rails} rails need as many HCAs a node "
                             f"(hcas_per_node is {self.hcas_per_node})")
        return self


class Phases(StrictModel):
    """Share of a healthy step spent in each phase (they must sum to 1)."""

    compute: float = Field(default=0.75, ge=0, le=1)
    comm: float = Field(default=0.2, ge=0, le=1)
    data: float = Field(default=0.05, ge=0, le=1)

    @model_validator(mode="after")
    def _sums_to_one(self) -> Phases:
        total = self.compute + self.comm + self.data
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"compute + comm + data must be 1, got {total:g}")
        return self


class Noise(StrictModel):
    """Per-step jitter of each rank's compute time: multiplicative lognormal (heavy right tail,
    what step-time histograms of real jobs look like) or additive gaussian (relative sigma)."""

    kind: Literal["lognormal", "gaussian"] = "lognormal"
    sigma: float = Field(default=0.02, ge=0, le=1)


NodeSet = str | list[str]  # "all", "node-0000..node-0099", or a list of names


class Pause(StrictModel):
    """A phase in which every rank stops stepping with its process alive: a checkpoint save or an
    evaluation pass, ``seconds`` long, every ``every_seconds`` from ``first_at_seconds``."""

    kind: Literal["checkpoint", "evaluation"]
    every_seconds: float = Field(gt=0)
    seconds: float = Field(gt=0)
    first_at_seconds: float = Field(default=0.0, ge=0)
    # The ranks say so as the heartbeat client's ``hb.checkpointing()`` / ``hb.evaluating()`` do (a
    # heartbeat repeating the last step with the phase), so the hang detector applies the phase's
    # own, longer limit. False: a job that does not announce it, so the pause looks like a stall.
    announced: bool = True
    # An uninstrumented job's GPUs during the pause (mean utilization.gpu; None: the kind's own,
    # PAUSE_GPU_UTILIZATION): a checkpoint save idles them while the host writes, an evaluation
    # pass runs forward passes only, short kernels with gaps (assumed, stated in docs/simulator.md).
    gpu_utilization: float | None = Field(default=None, ge=0, le=1)
    # Bytes per second each node of an uninstrumented job sends over its RDMA ports during the
    # pause (storage on the compute fabric: a checkpoint written to a parallel filesystem over
    # InfiniBand); 0: the fabric is quiet.
    rdma_bytes_per_second: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _shorter_than_its_period(self) -> Pause:
        if self.seconds >= self.every_seconds:
            raise ValueError("seconds must be shorter than every_seconds (a job that never steps is a hang)")
        return self


# An uninstrumented job's GPUs during a pause of each kind (Pause.gpu_utilization): a checkpoint
# save leaves them idle while the host serialises and writes; an evaluation pass (forward only,
# small batches, metrics gathered on the host) keeps them busy about 60% of the time (assumed).
PAUSE_GPU_UTILIZATION = {"checkpoint": 0.0, "evaluation": 0.6}
# An uninstrumented job's name is the Slurm job id the simulated agent reads from its processes'
# cgroups (agent/attribution.py job_key): the key its GPUs carry (GpuState.job).
SLURM_JOB_ID = re.compile(r"^[0-9]{1,12}$")


class Job(StrictModel):
    name: str = Field(min_length=1, max_length=128)
    nodes: NodeSet = "all"
    ranks_per_node: int = Field(default=8, ge=1, le=16)
    step_seconds: float = Field(gt=0)
    noise: Noise = Noise()
    phases: Phases = Phases()
    start_seconds: float = Field(default=0.0, ge=0)
    # The job finishes (its ranks exit and send nothing more); None: it runs to the end.
    end_seconds: float | None = Field(default=None, gt=0)
    pauses: list[Pause] = Field(default_factory=list)
    # Mixed hardware: a node's ranks compute this many times as long on nodes of a profile
    # (fleet.profile / fleet.profiles) as ``step_seconds`` x ``phases.compute`` says; absent: 1.
    # ``{h100-sxm-80gb: 1.12}`` in an H200 job: its H100 nodes compute 12% longer by design.
    profile_compute_factor: dict[str, float] = Field(default_factory=dict)
    # The goodput ledger's cost of one restart of this job (requeue, rendezvous, checkpoint load,
    # warm-up), in seconds of the whole job; None: ``goodput.restart_seconds``.
    restart_seconds: float | None = Field(default=None, ge=0)
    # False: an uninstrumented job. Its ranks send no heartbeats; its processes sit on its GPUs in
    # Slurm job ``name``'s cgroup (the agent attributes the GPUs to it, so ``name`` must be a Slurm
    # job id), its steps drive its GPUs' utilization (1 - the rank's data share of the step: a rank
    # waiting in the collective keeps its kernel resident) and its nodes' RDMA data counters.
    heartbeats: bool = True
    # Bytes each node of the job sends, and receives, over its RDMA ports per step (an
    # uninstrumented job's gradient all-reduce; spread evenly over the node's HCAs). The default,
    # 4 GB, is a ring all-reduce of a ~2 GB bf16 gradient (a 1B-parameter model): 2 (N-1)/N of it
    # each way, about 8% of one 400 Gb/s port over a 1 s step.
    rdma_bytes_per_step: float = Field(default=4e9, ge=0)

    def checkpoint_every_seconds(self) -> float | None:
        """The cadence of the job's checkpoint pause, or None when it has none."""
        return next((p.every_seconds for p in self.pauses if p.kind == "checkpoint"), None)

    @model_validator(mode="after")
    def _ends_after_it_starts(self) -> Job:
        if self.end_seconds is not None and self.end_seconds <= self.start_seconds:
            raise ValueError("end_seconds must be after start_seconds")
        if not self.heartbeats and not SLURM_JOB_ID.match(self.name):
            raise ValueError(f"an uninstrumented job (heartbeats: false) is named by its Slurm job id, as the "
                             f"agent's attribution names it: {self.name!r} is not one")
        from vigil.agent.nvml.scenario import ALL_PROFILES

        for profile, factor in self.profile_compute_factor.items():
            if profile not in ALL_PROFILES:
                raise ValueError(f"profile_compute_factor: {profile!r} is not one of {sorted(ALL_PROFILES)}")
            if not 0 < factor <= 100:
                raise ValueError(f"profile_compute_factor: {profile}: {factor:g} is not in (0, 100]")
        return self


class Goodput(StrictModel):
    """What the goodput ledger (sim/goodput.py) assumes about the jobs' recovery, and what real
    time the scenario's faults stand for. Every default is cited or stated as an assumption in
    docs/simulator.md ("Goodput")."""

    # A job without a checkpoint pause checkpoints this often (stated assumption: 30 min; a job's
    # ``pauses`` of kind checkpoint override it). Work since the last checkpoint is lost on a restart.
    checkpoint_every_seconds: float = Field(default=1800.0, gt=0)
    # One restart of a job (requeue, rendezvous, checkpoint load, warm-up): the cluster guide this
    # project follows puts the whole recovery at "5-10 minutes" (issue 40); its upper end.
    restart_seconds: float = Field(default=600.0, ge=0)
    # A lost rank leaves the others blocked in a collective until NCCL's watchdog aborts them:
    # torch.distributed's default process-group timeout for NCCL is 10 min (600 s).
    watchdog_seconds: float = Field(default=600.0, gt=0)
    # Without vigil: a person finds the node behind a crashed job this long after the crash
    # (stated assumption); until then each restart lands on the node and fails again.
    person_crash_seconds: float = Field(default=3600.0, ge=0)
    # Without vigil: a person finds a straggler this long after its onset (stated assumption);
    # None: never found (nobody excludes it when the job restarts: it slows the job to the end).
    person_straggler_seconds: float | None = Field(default=86400.0, ge=0)
    # A spare is free when a job restarts without a node (it keeps its size at once); false: the
    # job waits ``node_return_seconds`` (reboot and verification) for the node or a repaired one.
    spare_available: bool = True
    node_return_seconds: float = Field(default=3600.0, ge=0)
    # What real time and fleet the scenario's faults stand for (week-in-the-life: a week of a
    # 1,024-node cluster at Llama 3's interruption rate); None: the scenario's own run.
    represents_seconds: float | None = Field(default=None, gt=0)
    represents_nodes: int | None = Field(default=None, gt=0)
    # Interruption rates (per 1,000 nodes a day) the ledger also accounts at, besides the scenario's
    # own: the 1-2 a day per 1,000 nodes.
    rates_per_1000_node_days: list[float] = Field(default_factory=lambda: [1.0, 2.0])


class _FaultBase(StrictModel):
    at_seconds: float = Field(ge=0)
    # Target: one node, several (names or a "a..b" range), or every node under a component
    # (a topology label value, e.g. a leaf switch name).
    node: str | None = None
    nodes: NodeSet | None = None
    component: str | None = None

    @model_validator(mode="after")
    def _one_target(self) -> _FaultBase:
        given = [k for k in ("node", "nodes", "component") if getattr(self, k) is not None]
        if len(given) != 1 and not self._target_optional():
            raise ValueError(f"give exactly one of node, nodes, component (got {given or 'none'})")
        return self

    @classmethod
    def _target_optional(cls) -> bool:
        return False


class NvmlFault(_FaultBase):
    """A fault of the node's FakeNvml (agent/nvml/scenario.py); the kind's own fields (``code``,
    ``rate_per_second``, ``link``, ...) are given beside it and validated by that model."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: NvmlKind
    gpu: int | None = Field(default=None, ge=0)

    def node_fault(self, at_seconds: float | None = None) -> dict[str, Any]:
        """The fault as the node scenario declares it (times relative to the node's start)."""
        out: dict[str, Any] = {"kind": self.kind, "at_seconds": self.at_seconds if at_seconds is None
                               else at_seconds, **(self.model_extra or {})}
        if self.kind not in NODE_WIDE_FAULT_KINDS or (self.kind == "config_drift" and self.gpu is not None):
            out["gpu"] = self.gpu if self.gpu is not None else 0
        return out


class KernelXid(_FaultBase):
    """An NVRM Xid line written to the node's kernel log (what the xid collector tails)."""

    kind: Literal["kernel_xid"]
    gpu: int = Field(default=0, ge=0)
    # Several GPUs of each target node at once ("all", or indexes): an application's illegal
    # access (Xid 13, 31, 43) kills every rank of the job and each GPU logs it; overrides ``gpu``.
    gpus: Literal["all"] | list[int] | None = None
    code: int = Field(ge=1)
    text: str = ""  # the driver's trailing message; a default per well-known code otherwise
    # The same line again ``repeat`` more times, ``every_seconds`` apart (a job relaunched by its
    # scheduler hits its bug again; a failing GPU logs its Xid again).
    repeat: int = Field(default=0, ge=0, le=10_000)
    every_seconds: float = Field(default=60.0, gt=0)

    def gpu_indexes(self, gpus_per_node: int) -> list[int]:
        if self.gpus is None:
            return [self.gpu]
        return list(range(gpus_per_node)) if self.gpus == "all" else list(self.gpus)


# The amdgpu events a ``kernel_amdgpu`` fault writes (sim/fleet.py amdgpu_lines writes each as the
# real driver prints it: tests/fixtures/kernel-log/amdgpu); gpu_hang is a ring timeout whose GPU
# reset fails (the hung GPU).
AmdgpuEvent = Literal["ras_uncorrectable", "ras_correctable", "ras_deferred", "ras_fatal", "poison_consumed",
                      "bad_page_threshold", "ring_timeout", "ring_timeout_recovered", "gpu_hang"]


class KernelAmdgpu(_FaultBase):
    """amdgpu (AMD GPU) driver lines written to the node's kernel log (what the xid collector tails):
    RAS error counts in a block, the fatal RAS interrupt, poison, the bad-page threshold, ring
    timeouts and a hung GPU, in the real driver's formats."""

    kind: Literal["kernel_amdgpu"]
    gpu: int = Field(default=0, ge=0)
    event: AmdgpuEvent
    # The RAS block of a ras_* event (amdgpu's names: umc is HBM, xgmi_wafl the XGMI links).
    block: str = Field(default="umc", pattern=r"^(?:umc|sdma|gfx|mmhub|athub|pcie_bif|hdp|xgmi_wafl|df|smn|sem|mp0|"
                                             r"mp1|fuse|mca|vcn|jpeg|ih|mpio)$")
    count: int = Field(default=1, ge=1, le=1_000_000)  # errors in the RAS count, or bad pages saved
    repeat: int = Field(default=0, ge=0, le=10_000)
    every_seconds: float = Field(default=60.0, gt=0)


class PortDown(_FaultBase):
    """The HCA port's link goes down (state DOWN, phys_state Disabled/Polling), for good or for
    ``duration_seconds``."""

    kind: Literal["port_down"]
    hca: int = Field(default=0, ge=0)
    duration_seconds: float | None = Field(default=None, gt=0)


class PcieDevice(_FaultBase):
    """A PCIe function as sysfs shows it (sim/fabric.py): an HCA's link trained down to ``width``
    and/or ``generation`` (a GPU's link is NVML's: FakeNvml's ``pcie_link_degraded``), and/or
    ``aer_count`` AER errors of ``aer_severity`` on an HCA or a GPU, once or every
    ``aer_every_seconds``."""

    kind: Literal["pcie_device"]
    device: Literal["hca", "gpu"] = "hca"
    index: int = Field(default=0, ge=0)
    width: int | None = Field(default=None, ge=1, le=32)
    generation: int | None = Field(default=None, ge=1, le=6)
    aer_severity: Literal["correctable", "nonfatal", "fatal"] | None = None
    aer_count: int = Field(default=1, ge=1, le=1_000_000)
    aer_every_seconds: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _something_and_links_of_hcas(self) -> PcieDevice:
        if self.width is None and self.generation is None and self.aer_severity is None:
            raise ValueError("a pcie_device fault sets width, generation or aer_severity")
        if self.device == "gpu" and (self.width is not None or self.generation is not None):
            raise ValueError("a GPU's link comes from NVML: use the NVML fault pcie_link_degraded")
        return self


class PortFlap(_FaultBase):
    """The link goes down and comes back ``count`` times, ``period_seconds`` apart."""

    kind: Literal["port_flap"]
    hca: int = Field(default=0, ge=0)
    count: int = Field(default=3, ge=1, le=100_000)
    period_seconds: float = Field(default=20.0, gt=0)
    # How long each drop lasts (default: half the period). A port that drops for 2 s every 6
    # minutes is the field's slow flap; most of its life it looks healthy.
    down_seconds: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _down_within_period(self) -> PortFlap:
        if self.down_seconds is not None and self.down_seconds >= self.period_seconds:
            raise ValueError("down_seconds must be shorter than period_seconds")
        return self


class PortErrors(_FaultBase):
    """Link-integrity errors: ``counter`` grows by ``per_second`` from ``at_seconds`` on."""

    kind: Literal["port_errors"]
    hca: int = Field(default=0, ge=0)
    counter: str = "symbol_error"
    per_second: float = Field(default=50.0, gt=0)
    until_seconds: float | None = None


class _RankScope(StrictModel):
    """Which ranks of each target node a fault hits: all (default), the node-local ``ranks``, or
    the ranks driving the node's ``gpus`` (a rank's GPU is its local rank modulo the GPU count)."""

    ranks: list[int] | None = None
    gpus: list[int] | None = None

    @model_validator(mode="after")
    def _one_scope(self) -> _RankScope:
        if self.ranks is not None and self.gpus is not None:
            raise ValueError("give ranks or gpus, not both")
        for name in ("ranks", "gpus"):
            values = getattr(self, name)
            if values is not None and (not values or min(values) < 0):
                raise ValueError(f"{name}: a non-empty list of indexes >= 0")
        return self


class RoceCongestion(_FaultBase):
    """Congestion on a RoCE port (link layer Ethernet): the counters DCQCN and PFC leave behind
    grow at the given rates from ``at_seconds`` to ``until_seconds``: ECN-marked packets and
    CNPs sent where the port is the notification point, CNPs handled where it is the reaction
    point, PFC pause frames received (and the time paused) on ``priority``. An incast or a hot
    spine looks like this on every port it touches; one port's own fault rarely does."""

    kind: Literal["roce_congestion"]
    hca: int = Field(default=0, ge=0)
    ecn_marked_per_second: float = Field(default=0.0, ge=0)
    cnp_sent_per_second: float = Field(default=0.0, ge=0)
    cnp_handled_per_second: float = Field(default=0.0, ge=0)
    pfc_pause_per_second: float = Field(default=0.0, ge=0)
    priority: int = Field(default=3, ge=0, le=7)
    until_seconds: float | None = None

    def rates(self) -> dict[str, float]:
        """Counter name (hw_counters/ or ethtool -S) -> increase per second."""
        p = self.priority
        out = {"np_ecn_marked_roce_packets": self.ecn_marked_per_second, "np_cnp_sent": self.cnp_sent_per_second,
               "rp_cnp_handled": self.cnp_handled_per_second, f"rx_prio{p}_pause": self.pfc_pause_per_second,
               # a pause frame holds the sender for up to 65,535 quanta (~84 us at 400 Gb/s); call it 50 us
               f"rx_prio{p}_pause_duration": self.pfc_pause_per_second * 50.0}
        return {k: v for k, v in out.items() if v > 0}


class SlowNode(_FaultBase, _RankScope):
    """The ranks on the node (or some of them) compute ``factor`` times slower (a throttled or
    degraded GPU that reports nothing wrong: only the step times show it). With
    ``period_seconds``, intermittently: slow for ``slow_seconds`` at the start of every period."""

    kind: Literal["slow_node"]
    factor: float = Field(default=1.1, gt=1.0, le=100.0)
    until_seconds: float | None = None
    period_seconds: float | None = Field(default=None, gt=0)
    slow_seconds: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _intermittent(self) -> SlowNode:
        if (self.period_seconds is None) != (self.slow_seconds is None):
            raise ValueError("give period_seconds and slow_seconds together")
        if self.period_seconds is not None and self.slow_seconds is not None \
                and self.slow_seconds >= self.period_seconds:
            raise ValueError("slow_seconds must be shorter than period_seconds")
        return self

    def active(self, elapsed: float) -> bool:
        """Whether the slowdown is on ``elapsed`` simulated seconds into the run."""
        if elapsed < self.at_seconds or (self.until_seconds is not None and elapsed >= self.until_seconds):
            return False
        if self.period_seconds is None or self.slow_seconds is None:
            return True
        return (elapsed - self.at_seconds) % self.period_seconds < self.slow_seconds


class DataStall(_FaultBase):
    """The job waits on its data loader: with no target every rank alike (a slow shared
    filesystem); with a node target only those nodes' ranks (their local cache or storage
    path), a partial stall."""

    kind: Literal["data_stall"]
    job: str
    extra_seconds: float = Field(gt=0)
    until_seconds: float | None = None

    @classmethod
    def _target_optional(cls) -> bool:
        return True


class Hang(_FaultBase, _RankScope):
    """The ranks on the target node stop stepping (process alive). The job's other ranks go on
    with the work that does not need them (gradient-accumulation micro-steps, pipeline stages)
    for ``others_continue_seconds``, then block in the next collective that includes them;
    0 stops the whole job at once."""

    kind: Literal["hang"]
    job: str
    others_continue_seconds: float = Field(default=60.0, ge=0)
    until_seconds: float | None = None  # the job is restarted then and steps again

    @classmethod
    def _target_optional(cls) -> bool:
        return True  # no target: every rank of the job stops at once (a software bug)


class UninstrumentedHang(_FaultBase):
    """Every rank of an uninstrumented job (``heartbeats: false``) stops inside a collective at
    once (a peer that never posts its send): the job steps no more, every GPU of every node of the
    job busy-spins in NCCL's polling kernel (FakeNvml.set_busy_spin) and its RDMA data counters go
    flat, until ``until_seconds`` (the job restarted) or the end."""

    kind: Literal["uninstrumented_hang"]
    job: str
    until_seconds: float | None = None

    @classmethod
    def _target_optional(cls) -> bool:
        return True  # the whole job; a target is refused (Scenario validation)


class UninstrumentedStraggler(_FaultBase):
    """The target node of an uninstrumented job is starved by its host (a contended CPU, a slow
    local data path): each step its ranks wait ``extra_seconds`` more for their next batch with no
    kernel on the GPU, so its GPUs' utilization drops while its peers' stays pinned (they wait in
    the collective, NCCL's kernel resident) and the whole job slows by as much."""

    kind: Literal["uninstrumented_straggler"]
    job: str
    extra_seconds: float = Field(gt=0)
    until_seconds: float | None = None


class Reboot(_FaultBase):
    """The node reboots: silent for ``down_seconds``, then back with a new boot id and a fresh
    agent, InfiniBand counters at zero and an empty kernel log. ``clears``: the reboot fixed
    what was wrong with its GPUs (a driver state); otherwise (default) the hardware fault is
    still there, e.g. a GPU that fell off the bus is still missing."""

    kind: Literal["reboot"]
    down_seconds: float = Field(default=180.0, gt=0)
    clears: bool = False


class Silence(_FaultBase):
    """The node stops reporting (power loss, kernel panic, network partition)."""

    kind: Literal["silence"]
    until_seconds: float | None = None


class UnderLoad(_FaultBase):
    """A fault that shows only under load, so only in a probe (active validation, issue 39): the
    node's passive reports stay exactly a healthy node's (no Xid, no throttle at idle, no port
    errors), its probes fail. ``what``: ``hbm`` (a marginal HBM stack: the memory probe's pattern
    test finds errors, DCGM's memory test fails), ``power`` (the GPU throttles only at full power:
    the compute burn's clocks sag and its throttle reasons show it), ``nvlink`` (NVLink errs only at
    line rate: the P2P copies from and to the GPU fail), ``rdma`` (the HCA port errs only at line
    rate: ib_write_bw and the collective fall short). ``reboot_clears``: whether a reboot fixes it;
    None (default): as the reboot fixes the node's other faults (``remediation.clears``, a scripted
    reboot's ``clears``)."""

    kind: Literal["probe_only"]
    what: Literal["hbm", "power", "nvlink", "rdma"]
    gpu: int = Field(default=0, ge=0)
    hca: int = Field(default=0, ge=0)
    until_seconds: float | None = None
    reboot_clears: bool | None = None


class ProbeSlow(_FaultBase):
    """A node slow by a few per cent that reports nothing wrong: its compute probe measures
    ``factor`` times less than its hardware class does (on ``gpus``, default all). Below a
    straggler detector's removal floor in a job (script the job's side with a ``slow_node`` of the
    same factor); a probe against the class's baseline confirms it. ``reboot_clears`` as
    ``probe_only``'s."""

    kind: Literal["probe_slow"]
    factor: float = Field(default=1.04, gt=1.0, le=100.0)
    gpus: list[int] | None = None
    until_seconds: float | None = None
    reboot_clears: bool | None = None


# The fault kinds that only a probe sees (sim/probes.py answers run_probes with them).
PROBE_FAULTS = (UnderLoad, ProbeSlow)


Fault = Annotated[
    NvmlFault | KernelXid | KernelAmdgpu | PortDown | PcieDevice | PortFlap | PortErrors | RoceCongestion | SlowNode
    | DataStall | Hang | Silence | Reboot | UnderLoad | ProbeSlow | UninstrumentedHang | UninstrumentedStraggler,
    Field(discriminator="kind"),
]


# The probes' simulated durations (``probes.seconds``), from the agent's defaults (agent/probes/
# context.py ProbesConfig) where they fix one, else stated assumptions:
# - gpu_compute: 5 passes of 4 s (burn_passes x burn_pass_seconds), every GPU at once: 20 s.
# - gpu_memory: copies and a pattern test over a 1 GiB buffer per GPU: well under a second of
#   transfers at ~2.8 TB/s; 10 s with allocation, several passes and the CUDA context (assumed).
# - gpu_p2p: 56 ordered pairs of 8 GPUs, a few 1 GiB copies each (~3 ms at ~370 GB/s): 10 s with
#   the peer-access set-up (assumed).
# - dcgm_diag: ``dcgmi diag -r 2`` (the agent's default level) takes about 2 minutes on an 8-GPU
#   node (NVIDIA DCGM user guide, "Run levels": level 2 a couple of minutes, 3 about 30 minutes).
# - rdma_bw: ib_write_bw for rdma_seconds (5 s) per HCA and its connection set-up: 10 s (assumed,
#   HCAs tested in turn would take 5 s x HCAs; the simulated probe is per node).
# - collective: 20 iterations of a 64 MiB all-reduce and the rendezvous: 15 s (assumed).
DEFAULT_PROBE_SECONDS: dict[str, float] = {
    "gpu_compute": 20.0, "gpu_memory": 10.0, "gpu_p2p": 10.0, "dcgm_diag": 120.0, "rdma_bw": 10.0,
    "collective": 15.0,
}


class SimIsolation(StrictModel):
    """``isolations``: a group-testing isolation the simulator starts at ``at_seconds`` through the
    real prober's ``start_isolation``, as ``POST /v1/probes/isolations`` does (a freshly repaired
    set): ``nodes`` (names or a range), about ``d_hint`` of them expected faulty."""

    at_seconds: float = Field(ge=0)
    nodes: NodeSet
    d_hint: int = Field(default=1, ge=1)
    note: str = Field(default="", max_length=500)


class SimProbes(StrictModel):
    """``probes``: how the simulated agents answer ``run_probes`` (sim/probes.py): each probe's
    duration on the simulated clock, and the relative noise of every measured figure (healthy
    hardware of one class repeats a matmul burn or a copy within about 1%)."""

    seconds: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_PROBE_SECONDS))
    noise: float = Field(default=0.01, ge=0, le=0.5)
    # Whether the nodes have DCGM (dcgmi): without it dcgm_diag is skipped at once, as the agent's
    # probe does where dcgmi is not installed.
    dcgm_installed: bool = True

    @model_validator(mode="after")
    def _known_probes(self) -> SimProbes:
        from vigil.agent.probes import PROBES

        unknown = sorted(set(self.seconds) - set(PROBES))
        if unknown:
            raise ValueError(f"seconds: unknown probe(s) {unknown} (one of {sorted(PROBES)})")
        bad = sorted(k for k, v in self.seconds.items() if not 0 < v <= 7200)
        if bad:
            raise ValueError(f"seconds: {bad} outside (0, 7200]")
        return self

    def duration(self, probe: str) -> float:
        if probe == "dcgm_diag" and not self.dcgm_installed:
            return 0.0
        return self.seconds.get(probe, DEFAULT_PROBE_SECONDS[probe])


class Remediation(StrictModel):
    """The simulator as the actuator: an ADMITTED ``reboot_node`` decision makes the simulator
    reboot that node itself, as a scripted ``kind: reboot`` fault does: silent for
    ``reboot_seconds`` from the decision, then back with a new boot id and a fresh agent.
    ``clears``: whether the reboot fixes the node's GPU faults (a driver state) or not (a GPU
    that fell off the bus is still missing); true or false for every node, or the nodes (a
    name, "a..b" range, list or "all") whose reboot fixes it, the others' does not. A refused
    decision reboots nothing; nor does one for a node that is down already."""

    # 180 s: the down time the scripted reboot scenarios use (POST, kernel, driver load and the
    # agent's start on an 8-GPU server take minutes).
    reboot_seconds: float = Field(default=180.0, gt=0)
    clears: bool | NodeSet = False
    # GPU resets, carried out as the real path does (aggregator/outbox.py, agent/node_action_runner.py):
    # with ``reset_seconds`` set, the aggregator runs with agent resets on (``actuators.slurm.reset_gpu``);
    # an ADMITTED ``reset_gpu`` is taken as drained at once, becomes the outbox's signed request,
    # offered in the answer to the node's next report; the node's own NodeActionRunner handles it
    # ``reset_seconds`` later (the reset's duration: nvidia-smi --gpu-reset takes seconds) through the
    # NVML backend's ``reset_gpu`` over its FakeNvml, and the result goes back in the node's next
    # report. None: reset_gpu decisions change nothing on the simulated nodes.
    reset_seconds: float | None = Field(default=None, gt=0, le=600)
    # Whether the reset fixes the GPU (FakeNvml clears its lost / reset-required state), true or
    # false for every node or the nodes whose reset does; on the others nvidia-smi --gpu-reset fails
    # (exit 1, the GPU keeps its fault) and the agent reports the reset ``failed``, so the recovery
    # detector escalates to reboot_node (then ``clears`` decides the reboot's outcome).
    reset_clears: bool | NodeSet = True

    @model_validator(mode="after")
    def _reset_keys_together(self) -> Remediation:
        if "reset_clears" in self.model_fields_set and self.reset_seconds is None:
            raise ValueError("reset_clears needs reset_seconds (without it no reset is carried out)")
        return self


# Action classes that cost a job or a node (DESIGN.md section 3); the scorer judges each on its
# own: a drain where a reset was right is as wrong as a drain of the wrong node.
REMOVAL_ACTIONS = ("drain", "reset_gpu", "reboot_node", "inspect_hardware", "restart_job", "hold_job")
ACTIONS = ("observe", "alert", *REMOVAL_ACTIONS, "resume")
# What answers a whole job's fault: never a node's removal (a job's bug is the job's).
JOB_ACTIONS = ("restart_job", "hold_job", "alert")

ActionName = Literal["observe", "alert", "drain", "reset_gpu", "reboot_node", "inspect_hardware", "restart_job",
                     "hold_job", "resume"]


class Expectation(StrictModel):
    """A decision the aggregator must take: on ``node`` (or ``component``, or ``job``), one of
    ``action``, within ``within_seconds`` of ``after_seconds`` (default: the first fault on that
    subject). The same expectation justifies later decisions of those classes on that subject
    (repeats and escalations), and nothing else."""

    node: str | None = None
    component: str | None = None
    job: str | None = None
    action: ActionName | list[ActionName]
    within_seconds: float = Field(gt=0)
    after_seconds: float | None = Field(default=None, ge=0)
    # A node expectation about one GPU: a decision naming another GPU does not answer it.
    gpu: int | None = Field(default=None, ge=0)
    # A component expectation: removals of the component's own nodes answer it too (a rack that
    # lost power is its nodes' problem). Off by default: a bad leaf switch is inspected, its
    # nodes are not drained.
    include_nodes: bool = False

    @model_validator(mode="after")
    def _one_subject(self) -> Expectation:
        if sum(x is not None for x in (self.node, self.component, self.job)) != 1:
            raise ValueError("give exactly one of node, component, job")
        if self.job is not None and not set(self.actions) <= set(JOB_ACTIONS):
            raise ValueError(f"a job expectation takes only {list(JOB_ACTIONS)}: a job's own fault is never "
                             "answered by removing one of its nodes")
        if self.include_nodes and self.component is None:
            raise ValueError("include_nodes applies to a component expectation only")
        if self.gpu is not None and self.node is None:
            raise ValueError("gpu applies to a node expectation only")
        return self

    @property
    def actions(self) -> tuple[str, ...]:
        return (self.action,) if isinstance(self.action, str) else tuple(self.action)

    @property
    def subject(self) -> str:
        return next(str(x) for x in (self.node, self.component, self.job) if x is not None)


class Allow(StrictModel):
    """Removals that may happen but need not (the breaker trips before every faulty node is
    drained): on ``nodes``, of ``action`` classes, each only after that node's own injected
    fault began; or a ``job``'s restart once one of its nodes has a fault of its own (a lost GPU
    kills the job it ran). Nothing outside an expectation or an allowance is justified."""

    nodes: NodeSet | None = None
    job: str | None = None
    action: ActionName | list[ActionName]

    @model_validator(mode="after")
    def _one_subject(self) -> Allow:
        if (self.nodes is None) == (self.job is None):
            raise ValueError("give exactly one of nodes, job")
        if self.job is not None and not set(self.actions) <= set(JOB_ACTIONS):
            raise ValueError(f"a job allowance takes only {list(JOB_ACTIONS)}")
        return self

    @property
    def actions(self) -> tuple[str, ...]:
        return (self.action,) if isinstance(self.action, str) else tuple(self.action)


class Forbid(StrictModel):
    """What must not happen: an admitted decision of ``action`` (default: every removal class) on
    ``nodes``, on the nodes under ``component``, or on the nodes of (or naming) ``job``; with no
    subject, anywhere. A forbidden decision fails the run even where an expectation would have
    justified it, so a scenario can say "whatever else happens, not this"."""

    nodes: NodeSet | None = None
    component: str | None = None
    job: str | None = None
    action: ActionName | list[ActionName] | None = None
    reason: str = ""  # why, printed with a violation

    @model_validator(mode="after")
    def _at_most_one_subject(self) -> Forbid:
        if sum(x is not None for x in (self.nodes, self.component, self.job)) > 1:
            raise ValueError("give at most one of nodes, component, job")
        return self

    @property
    def actions(self) -> tuple[str, ...]:
        if self.action is None:
            return REMOVAL_ACTIONS
        return (self.action,) if isinstance(self.action, str) else tuple(self.action)


class Scenario(StrictModel):
    name: str = ""
    description: str = ""
    seed: int = 0
    duration_seconds: float = Field(gt=0, le=30 * 86400)
    report_interval_seconds: float = Field(default=10.0, gt=0)
    # Each agent reports at its own phase within the interval (drawn per node from the seed), as
    # agents started at different moments do; "lockstep": every agent at the interval's end.
    agent_phases: Literal["independent", "lockstep"] = "independent"
    # Heartbeats fed per rank and report: every step when a window holds fewer, else an even
    # sample ending at the last step (1,000 nodes x 8 ranks at one step a second would otherwise
    # cost more than everything else together); the summary's step count stays exact.
    heartbeats_per_rank: int = Field(default=4, ge=1)
    # On a node whose source of a collector has no fault injected (no NVML fault for `gpu`, no
    # port fault for `rdma`, no kernel-log line for `xid`), run that collector this often
    # instead of every report; its last result rides every report meanwhile, as with a real
    # agent whose collector interval is longer than its report interval. Costly collectors on
    # quiet nodes are what bounds a 1,000-node run; the faulty nodes always run every report.
    quiet_collector_intervals: dict[str, float] = Field(default_factory=dict)
    # The training collector's /metrics samples on every simulated node: built every report for a
    # scrape the simulator never makes (no report, detector or score reads them; about a third of
    # the simulated agent's tick). "auto": built, except in a healthy-fleet statistics run (no
    # faults, expectations, allowed removals, expected breaker, remediation or probes), where only
    # what the aggregator judges is built (docs/simulator.md "Speed").
    agent_metrics: Literal["auto", "on", "off"] = "auto"
    fleet: Fleet
    # Hardware faults reach the jobs on the node: a thermal or power-brake throttle slows the
    # ranks on that GPU by its clock ratio, a lost GPU stops its ranks (the job blocks in its
    # next collective), a port down stops the node's ranks while it is down.
    hardware_disrupts_jobs: bool = False
    # The goodput ledger's assumptions (checkpoint cadence, restart cost, baselines, real time).
    goodput: Goodput = Goodput()
    jobs: list[Job] = Field(default_factory=list)
    faults: list[Fault] = Field(default_factory=list)
    expect: list[Expectation] = Field(default_factory=list)
    allow: list[Allow] = Field(default_factory=list)
    forbid: list[Forbid] = Field(default_factory=list)
    # At most this many removals (distinct subject and action class, restart_job included) in
    # the whole run; None: no cap beyond every removal being justified.
    max_removals: int | None = Field(default=None, ge=0)
    # "tripped": the scenario passes only if the gate's cluster circuit breaker trips.
    expect_breaker: Literal["tripped", "closed", "any"] = "any"
    # The simulator carries out admitted reboot_node (and, with reset_seconds, reset_gpu) decisions
    # itself; None: decisions change nothing on the simulated nodes (the gate runs in dry run), only scripted faults do.
    remediation: Remediation | None = None
    # How the simulated agents answer the aggregator's run_probes requests (aggregator config
    # ``probes.enabled`` turns the prober on; sim/probes.py runs them).
    probes: SimProbes = SimProbes()
    # Group-testing isolations started during the run (they need aggregator ``probes.enabled``).
    isolations: list[SimIsolation] = Field(default_factory=list)
    # Passed through to the real configurations: the agent's (for every simulated node), the
    # aggregator's (detector thresholds, fleet windows) and the gate's (always in dry run here).
    agent: dict[str, Any] = Field(default_factory=dict)
    aggregator: dict[str, Any] = Field(default_factory=dict)
    gate: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _references_resolve(self) -> Scenario:
        names = set(self.node_names())
        components = set(self.components())
        jobs = {j.name for j in self.jobs}
        if len(jobs) != len(self.jobs):
            raise ValueError("jobs: two jobs share a name")
        for i, job in enumerate(self.jobs):
            _check_nodeset(job.nodes, names, self.fleet.name_format, f"jobs.{i}.nodes")
        for i, group in enumerate(self.fleet.profiles):
            _check_nodeset(group.nodes, names, self.fleet.name_format, f"fleet.profiles.{i}.nodes")
        if self.fleet.idle is not None:
            _check_nodeset(self.fleet.idle, names, self.fleet.name_format, "fleet.idle")
            idle = set(self.resolve_nodes(self.fleet.idle))
            for i, job in enumerate(self.jobs):
                busy = sorted(idle & set(self.resolve_nodes(job.nodes)))
                if busy:
                    raise ValueError(f"jobs.{i}.nodes: {busy[:3]} are idle (fleet.idle): a job keeps its GPUs busy")
        for i, iso in enumerate(self.isolations):
            _check_nodeset(iso.nodes, names, self.fleet.name_format, f"isolations.{i}.nodes")
            probes = self.aggregator.get("probes")
            if not (isinstance(probes, dict) and probes.get("enabled") is True):
                raise ValueError(f"isolations.{i}: an isolation needs aggregator probes.enabled: true")
        for i, fault in enumerate(self.faults):
            where = f"faults.{i}"
            if fault.node is not None and fault.node not in names:
                raise ValueError(f"{where}.node: unknown node {fault.node!r}")
            if fault.nodes is not None:
                _check_nodeset(fault.nodes, names, self.fleet.name_format, f"{where}.nodes")
            if fault.component is not None and fault.component not in components:
                raise ValueError(f"{where}.component: unknown component {fault.component!r}")
            if isinstance(fault, NvmlFault):
                _check_node_fault(fault, self.fleet, where)
            if isinstance(fault, DataStall | Hang | UninstrumentedHang | UninstrumentedStraggler) \
                    and fault.job not in jobs:
                raise ValueError(f"{where}.job: unknown job {fault.job!r}")
            if isinstance(fault, UninstrumentedHang | UninstrumentedStraggler):
                job = next(j for j in self.jobs if j.name == fault.job)
                if job.heartbeats:
                    raise ValueError(f"{where}: {fault.kind} is a fault of an uninstrumented job "
                                     f"(heartbeats: false); {fault.job!r} sends heartbeats")
                if isinstance(fault, UninstrumentedHang) and (fault.node or fault.nodes or fault.component):
                    raise ValueError(f"{where}: uninstrumented_hang stops the whole job: give no node, nodes "
                                     "or component")
                if isinstance(fault, UninstrumentedStraggler) and not set(self.fault_nodes(fault)) \
                        <= set(self.resolve_nodes(job.nodes)):
                    raise ValueError(f"{where}: the straggler must be a node of job {fault.job!r}")
            if isinstance(fault, UnderLoad) and fault.gpu >= self.fleet.gpus_per_node:
                raise ValueError(f"{where}.gpu: {fault.gpu} >= gpus_per_node {self.fleet.gpus_per_node}")
            if isinstance(fault, UnderLoad) and fault.what == "rdma" and fault.hca >= self.fleet.hcas_per_node:
                raise ValueError(f"{where}.hca: {fault.hca} >= hcas_per_node {self.fleet.hcas_per_node}")
            if isinstance(fault, ProbeSlow) and fault.gpus is not None \
                    and (not fault.gpus or not all(0 <= g < self.fleet.gpus_per_node for g in fault.gpus)):
                raise ValueError(f"{where}.gpus: a non-empty list of indexes below gpus_per_node "
                                 f"{self.fleet.gpus_per_node}")
            if isinstance(fault, NvmlFault | KernelXid | KernelAmdgpu) and fault.gpu is not None \
                    and fault.gpu >= self.fleet.gpus_per_node:
                raise ValueError(f"{where}.gpu: {fault.gpu} >= gpus_per_node {self.fleet.gpus_per_node}")
            if isinstance(fault, SlowNode | Hang):
                _check_scope(fault, self.fleet.gpus_per_node, max((j.ranks_per_node for j in self.jobs), default=0),
                             where)
            if isinstance(fault, KernelXid) and any(g >= self.fleet.gpus_per_node or g < 0
                                                    for g in fault.gpu_indexes(self.fleet.gpus_per_node)):
                raise ValueError(f"{where}.gpus: {fault.gpus} outside 0..{self.fleet.gpus_per_node - 1}")
            if isinstance(fault, RoceCongestion) and self.fleet.link_layer != "Ethernet":
                raise ValueError(f"{where}: roce_congestion needs fleet.link_layer Ethernet")
            if isinstance(fault, PortDown | PortFlap | PortErrors | RoceCongestion) and fault.component is not None:
                rail = self.component_rail(fault.component)
                if rail is not None and fault.hca != rail:
                    raise ValueError(f"{where}.hca: {fault.component} carries HCA {rail} of its nodes, not {fault.hca}")
            if isinstance(fault, PortDown | PortFlap | PortErrors | RoceCongestion) \
                    and fault.hca >= self.fleet.hcas_per_node:
                raise ValueError(f"{where}.hca: {fault.hca} >= hcas_per_node {self.fleet.hcas_per_node}")
            if fault.at_seconds > self.duration_seconds:
                raise ValueError(f"{where}.at_seconds: {fault.at_seconds:g} is after duration_seconds")
        for i, exp in enumerate(self.expect):
            if exp.node is not None and exp.node not in names:
                raise ValueError(f"expect.{i}.node: unknown node {exp.node!r}")
            if exp.component is not None and exp.component not in components:
                raise ValueError(f"expect.{i}.component: unknown component {exp.component!r}")
            if exp.job is not None and exp.job not in jobs:
                raise ValueError(f"expect.{i}.job: unknown job {exp.job!r}")
            if exp.gpu is not None and exp.gpu >= self.fleet.gpus_per_node:
                raise ValueError(f"expect.{i}.gpu: {exp.gpu} >= gpus_per_node {self.fleet.gpus_per_node}")
        for i, allow in enumerate(self.allow):
            if allow.nodes is not None:
                _check_nodeset(allow.nodes, names, self.fleet.name_format, f"allow.{i}.nodes")
            if allow.job is not None and allow.job not in jobs:
                raise ValueError(f"allow.{i}.job: unknown job {allow.job!r}")
        for i, forbid in enumerate(self.forbid):
            if forbid.nodes is not None:
                _check_nodeset(forbid.nodes, names, self.fleet.name_format, f"forbid.{i}.nodes")
            if forbid.component is not None and forbid.component not in components:
                raise ValueError(f"forbid.{i}.component: unknown component {forbid.component!r}")
            if forbid.job is not None and forbid.job not in jobs:
                raise ValueError(f"forbid.{i}.job: unknown job {forbid.job!r}")
        if self.remediation is not None and not isinstance(self.remediation.clears, bool):
            _check_nodeset(self.remediation.clears, names, self.fleet.name_format, "remediation.clears")
        if self.remediation is not None and not isinstance(self.remediation.reset_clears, bool):
            _check_nodeset(self.remediation.reset_clears, names, self.fleet.name_format, "remediation.reset_clears")
        return self

    # -- resolution -----------------------------------------------------------------------------

    def node_names(self) -> list[str]:
        return [self.fleet.name_format.format(i) for i in range(self.fleet.nodes)]

    def profile_of(self, node: str) -> str:
        """The node's GPU model (``fleet.profiles`` over ``fleet.profile``)."""
        out = self.fleet.profile
        for group in self.fleet.profiles:
            if node in self.resolve_nodes(group.nodes):
                out = group.profile
        return out

    def topology_of(self, index: int) -> dict[str, str]:
        t = self.fleet.topology
        rack = index // t.nodes_per_rack
        group = index // t.nodes_per_leaf
        out = {"row": f"row-{rack // t.racks_per_row:02d}", "rack": f"rack-{rack:03d}"}
        if t.rails == 1:
            out["leaf_switch"] = f"leaf-{group:03d}"
        else:
            out.update({f"rail{r}_leaf": f"leaf-{group:03d}-rail{r}" for r in range(t.rails)})
        return out

    def component_rail(self, component: str) -> int | None:
        """The rail a rail-optimised leaf carries (its HCA index on every node), else None."""
        head, sep, rail = component.rpartition("-rail")
        return int(rail) if sep and head.startswith("leaf-") and rail.isdigit() else None

    def components(self) -> dict[str, list[str]]:
        """Every topology label value -> the nodes under it."""
        out: dict[str, list[str]] = {}
        for i, name in enumerate(self.node_names()):
            for value in self.topology_of(i).values():
                out.setdefault(value, []).append(name)
        return out

    def resolve_nodes(self, nodeset: NodeSet) -> list[str]:
        return _resolve_nodeset(nodeset, self.node_names(), self.fleet.name_format)

    def fault_nodes(self, fault: Any) -> list[str]:
        """The nodes a fault acts on (a job-wide fault without a target: the job's nodes)."""
        if fault.node is not None:
            return [fault.node]
        if fault.nodes is not None:
            return self.resolve_nodes(fault.nodes)
        if fault.component is not None:
            return list(self.components()[fault.component])
        job = next(j for j in self.jobs if j.name == fault.job)
        return self.resolve_nodes(job.nodes)

    def subject_fault_time(self, exp: Expectation) -> float | None:
        """When the fault an expectation answers began: ``after_seconds`` or the first fault on
        its node (or component, or any node under it)."""
        if exp.after_seconds is not None:
            return exp.after_seconds
        times = []
        for fault in self.faults:
            if exp.component is not None:
                hit = fault.component == exp.component
            elif exp.job is not None:
                hit = getattr(fault, "job", None) == exp.job and fault.node is None and fault.nodes is None
            else:
                targeted = fault.node is not None or fault.nodes is not None or fault.component is not None
                hit = targeted and exp.node in self.fault_nodes(fault)
            if hit:
                times.append(fault.at_seconds)
        if not times and exp.component is not None:
            # No fault of the component itself: the first fault of a node under it.
            times = [f.at_seconds for f in self.faults if exp.component in self._fault_components(f)]
        return min(times) if times else None

    def own_fault_time(self, node: str) -> float | None:
        """When the first fault aimed at ``node`` itself began (by ``node`` or ``nodes``; a fault
        of its switch or of its whole job is not the node's own)."""
        times = [f.at_seconds for f in self.faults
                 if (f.node is not None or f.nodes is not None) and f.kind not in ("data_stall", "reboot")
                 and node in self.fault_nodes(f)]
        return min(times) if times else None

    def reboot_clears(self, node: str) -> bool:
        """Whether a reboot the simulator carries out (``remediation``) fixes ``node``'s faults."""
        if self.remediation is None:
            return False
        clears = self.remediation.clears
        return clears if isinstance(clears, bool) else node in self.resolve_nodes(clears)

    def reset_clears(self, node: str) -> bool:
        """Whether a GPU reset the simulator carries out (``remediation.reset_seconds``) fixes ``node``."""
        if self.remediation is None or self.remediation.reset_seconds is None:
            return False
        clears = self.remediation.reset_clears
        return clears if isinstance(clears, bool) else node in self.resolve_nodes(clears)

    def job_nodes(self, job: str) -> list[str]:
        return self.resolve_nodes(next(j for j in self.jobs if j.name == job).nodes)

    def _fault_components(self, fault: Any) -> set[str]:
        index = {n: i for i, n in enumerate(self.node_names())}
        out: set[str] = set()
        for n in self.fault_nodes(fault):
            out.update(self.topology_of(index[n]).values())
        return out


def _check_scope(fault: SlowNode | Hang, gpus: int, ranks: int, where: str) -> None:
    if fault.gpus is not None and max(fault.gpus) >= gpus:
        raise ValueError(f"{where}.gpus: {max(fault.gpus)} >= gpus_per_node {gpus}")
    if fault.ranks is not None and max(fault.ranks) >= ranks:
        raise ValueError(f"{where}.ranks: {max(fault.ranks)} >= ranks_per_node {ranks}")


def _check_node_fault(fault: NvmlFault, fleet: Fleet, where: str) -> None:
    # The node-level model is the one definition of each kind's fields: validate against it.
    from vigil.agent.nvml.scenario import parse_node_scenario

    try:
        parse_node_scenario({"profile": fleet.profile, "gpus": fleet.gpus_per_node,
                             "faults": [fault.node_fault()]})
    except ScenarioError as exc:
        detail = str(exc).split("\n", 1)[-1].strip().replace("faults.0.", f"{where}.")
        raise ValueError(detail) from None


_RANGE_RE = re.compile(r"^\s*(\S+)\s*\.\.\s*(\S+)\s*$")


def _resolve_nodeset(nodeset: NodeSet, names: Sequence[str], name_format: str) -> list[str]:
    if isinstance(nodeset, list):
        return list(nodeset)
    if nodeset == "all":
        return list(names)
    m = _RANGE_RE.match(nodeset)
    if m is None:
        return [nodeset]
    index = {n: i for i, n in enumerate(names)}
    first, last = index[m.group(1)], index[m.group(2)]
    return list(names[first:last + 1])


def _check_nodeset(nodeset: NodeSet, names: set[str], name_format: str, where: str) -> None:
    if isinstance(nodeset, list):
        unknown = [n for n in nodeset if n not in names]
        if unknown:
            raise ValueError(f"{where}: unknown node(s) {unknown[:3]}")
        if not nodeset:
            raise ValueError(f"{where}: empty")
        return
    if nodeset == "all":
        return
    m = _RANGE_RE.match(nodeset)
    ends = [m.group(1), m.group(2)] if m else [nodeset]
    for end in ends:
        if end not in names:
            raise ValueError(f"{where}: unknown node {end!r} (give 'all', a name, 'first..last' or a list)")
    if m and sorted(ends) != ends:
        raise ValueError(f"{where}: range {nodeset!r} runs backwards")


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"invalid scenario {source}: the top level must be a mapping, "
                            f"got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(format_validation_error(exc, f"invalid scenario {source}", Scenario)) from None


def load_scenario(path_or_name: str | Path) -> Scenario:
    """Load a scenario file, or a shipped one by name (``slow-node-1024``)."""
    path = Path(path_or_name)
    if not path.exists() and not path.suffix:
        path = SCENARIO_DIR / f"{path_or_name}.yaml"
    scenario = parse_scenario(read_yaml_file(path, "scenario", ScenarioError), str(path))
    if not scenario.name:
        scenario = scenario.model_copy(update={"name": path.stem})
    return scenario


def shipped_scenarios() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.yaml"))


def shortened(scenario: Scenario, duration_seconds: float) -> Scenario:
    """The first ``duration_seconds`` of a scenario: faults after it are dropped, and so are the
    expectations that could not be judged within it (their deadline falls after the end)."""
    if duration_seconds >= scenario.duration_seconds:
        return scenario
    faults = [f for f in scenario.faults if f.at_seconds <= duration_seconds]
    kept = scenario.model_copy(update={"faults": faults, "duration_seconds": duration_seconds})
    expect = []
    for exp in scenario.expect:
        start = scenario.subject_fault_time(exp) or 0.0
        if start + exp.within_seconds <= duration_seconds:
            expect.append(exp)
    data = kept.model_dump(exclude_defaults=False)
    data["expect"] = [e.model_dump(exclude_none=True) for e in expect]
    data["allow"] = [a.model_dump(exclude_none=True) for a in scenario.allow]
    data["forbid"] = [f.model_dump(exclude_none=True) for f in scenario.forbid]
    data["faults"] = [_fault_dump(f) for f in faults]
    return Scenario.model_validate(data)


def _fault_dump(fault: Any) -> dict[str, Any]:
    data = fault.model_dump(exclude_none=True)
    data.update(fault.model_extra or {})
    return dict(data)
