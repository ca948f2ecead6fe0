"""Wire types: the agent's Report to the aggregator, and the heartbeat it accepts from training code.

These msgspec Structs are the one definition of the JSON contract (docs/openapi.yaml documents
the same shapes, and a test checks that they agree). The agent builds them and encodes them with
``encode``; the aggregator decodes incoming JSON with ``decode_report``, strictly: unknown fields,
a float for an int, a string for a number, 1 for a bool, NaN, Infinity, 1e400 and every value
outside the bounds below are refused. A value the hardware does not report is ``None`` (absent),
never 0. Constructing a Struct in Python checks nothing: ``check`` validates one the agent built.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from vigil.contract.limits import REPORT_MAX_EVENTS

# The report version (docs/reports.md, "Compact reports"): one, before the first release. A report
# is whole when it has no ``base_seq`` (an agent's first report, or one after a 409 delta_base);
# otherwise ``base_seq`` names the report of this boot the aggregator accepted last, and each GPU,
# port and rank carries its required fields (its identity) and only the fields that changed
# (port counters: only those that moved); a field that went back to its default (None, an empty
# list, a state word) is named in the report's ``cleared``. So an absent field always means "as in
# the base". Telemetry (below) may wait up to 30 s. A compact port never carries
# ``deltas``/``rates_per_second`` (the aggregator computes its own from the raw counters). An
# absent ``version`` reads as this one (a whole report of an agent from before versions is a
# whole report of this one); any other number is refused (422 unsupported_report_version,
# aggregator/fleet_intake.py). The aggregator's answer lists it in ``report_versions``.
REPORT_VERSION = 3
REPORT_VERSIONS = (REPORT_VERSION,)

# Telemetry: what describes how busy a GPU or a link is and no detector judges. On a busy node
# it moves every report (~13 floats a GPU, ~10 counters a port: over half a compact report's
# bytes and a quarter of the aggregator's CPU per report, bench_ingest), while dashboards read it
# from the agent's own /metrics at scrape resolution. A compact report carries what of it moved
# at most every ``report_telemetry_seconds`` (agent config, 30 s by default); in between the
# aggregator keeps the value it was last sent (docs/reports.md, "Telemetry resolution"). Every
# whole report carries all of it. A detector must never read these (a test keeps the
# detectors' sources free of the GPU names; the network detector's config refuses the counters).
GPU_TELEMETRY_FIELDS = frozenset({
    # NVML utilization and memory use: utilization_gpu_ratio is judged (thermal, gpu_peer), these not.
    "utilization_memory_ratio", "memory_used_bytes", "energy_joules",
    # NVML GPM (Hopper and later) profiling ratios and throughputs.
    "graphics_active_ratio", "sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio", "dram_active_ratio",
    "fp16_active_ratio", "fp32_active_ratio", "fp64_active_ratio",
    "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second", "nvlink_tx_bytes_per_second",
    "nvlink_rx_bytes_per_second"})
# Port counters that count traffic, not faults: the IBTA PortCounters/PortCountersExtended data
# and packet counters (sysfs ports/N/counters), and mlx5's received RDMA operations (ports/N/
# hw_counters, NVIDIA's "Understanding mlx5 Linux Counters"). Errors, link events and congestion
# (port_xmit_wait, ECN marks, CNPs, pauses) are not here: they go in every report that moves them.
PORT_TRAFFIC_COUNTERS = frozenset({
    "port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
    "unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets",
    "rx_read_requests", "rx_write_requests", "rx_atomic_requests", "rx_dct_connect"})

# A node name is what a hostname can be (RFC 1123 section 2.1, RFC 952): dot-separated labels
# of letters, digits and inner hyphens, 1-63 characters each, 253 in all. Nothing else: a
# bracket, comma or space would let a scheduler expand one name into many (``vnode[1-5]``,
# ``a,b``), so this one rule guards reports, Alertmanager input, the CLI and every actuator.
MAX_NODE_NAME_CHARS = 253
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
NODE_NAME_PATTERN = rf"{_LABEL}(?:\.{_LABEL})*"
_NODE_NAME = re.compile(NODE_NAME_PATTERN)


def check_node_name(name: object) -> str:
    """``name`` if it is a valid node name, else ValueError saying why (one rule everywhere)."""
    if not isinstance(name, str):
        raise ValueError("a node name is a string")
    if not 1 <= len(name) <= MAX_NODE_NAME_CHARS:
        raise ValueError(f"a node name has 1..{MAX_NODE_NAME_CHARS} characters, got {len(name)}")
    if _NODE_NAME.fullmatch(name) is None:
        raise ValueError("a node name is a hostname: dot-separated labels of letters, digits and inner "
                         "hyphens, 1-63 characters each (no brackets, commas, spaces or other characters)")
    return name


# vigil loadgen's synthetic nodes (aggregator/synthetic_nodes.py): an aggregator in dry run holds
# them apart and never judges them; one that acts refuses them. No real node may take such a name.
SYNTHETIC_NODE_PREFIX = "loadgen-"


def check_real_node_name(name: object) -> str:
    """``name`` if a real node (an agent, a node token) may use it: check_node_name's rule, and not
    in the synthetic namespace, else ValueError saying why."""
    name = check_node_name(name)
    if name.startswith(SYNTHETIC_NODE_PREFIX):
        raise ValueError(f"node names starting {SYNTHETIC_NODE_PREFIX!r} are reserved for vigil loadgen's synthetic "
                         "nodes, which the aggregator never judges; rename this node")
    return name


# The same rule as check_node_name, as the decoder's pattern (msgspec matches with re.search:
# anchored at both ends, \Z so that a trailing newline is refused too).
NodeName = Annotated[str, Meta(min_length=1, max_length=MAX_NODE_NAME_CHARS, pattern=rf"^(?:{NODE_NAME_PATTERN})\Z")]
# Bounds on what any report may carry: far beyond any real value, short of what breaks
# arithmetic (1e400 or NaN never reaches a detector). msgspec bounds integers within int64, so
# a count is at most 2**63 - 1 (an ECC or replay count never nears it); a port counter, which a
# 64-bit hardware register can hold up to its saturation value, is bounded by MAX_COUNTER in
# Report.__post_init__ instead (check_port_counters).
MAX_COUNT = 2**63 - 1
MAX_COUNTER = 2**64 - 1
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
PortCounter = Annotated[int, Meta(ge=0)]  # <= MAX_COUNTER, checked by Report.__post_init__
Index = Annotated[int, Meta(ge=0, le=1 << 20)]
Pid = Annotated[int, Meta(ge=0, le=1 << 32)]
Num = Annotated[float, Meta(ge=-1e18, le=1e18)]  # finite: a bound refuses NaN and infinity
NonNeg = Annotated[float, Meta(ge=0, le=1e18)]
Ratio = Annotated[float, Meta(ge=0, le=1.0)]
# Wall-clock seconds since the epoch: 1970..2200.
Timestamp = Annotated[float, Meta(ge=0, le=7.3e9)]
Short = Annotated[str, Meta(max_length=256)]
Id = Annotated[str, Meta(min_length=1, max_length=64)]
JobName = Annotated[str, Meta(max_length=128)]
# Free text (a kernel log line) is cut, not refused: an overlong line must not cost its event
# (each model with a Text field cuts it in __post_init__).
MAX_TEXT_CHARS = 4096
Text = str

GpuHealth = Literal["ok", "lost", "reset_required", "unavailable"]
RankState = Literal["running", "hung", "exited"]
# What a job does between steps, as its heartbeat client says; absent means training.
JobPhase = Literal["training", "checkpointing", "evaluating"]
# A training value that is not a finite number, as the heartbeat client spells it (JSON has no
# NaN or Infinity, and the decoder refuses them as numbers): a NaN loss is the signal itself.
NonFinite = Literal["nan", "inf", "-inf"]
# A GPU's NVLink fabric registration with Fabric Manager on NVSwitch systems (NVML's
# nvmlDeviceGetGpuFabricInfoV state, NVML_GPU_FABRIC_STATE_*). None: no NVSwitch fabric
# (NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, or a driver without the call).
FabricState = Literal["not_started", "in_progress", "completed"]
# The driver's own verdict on what recovers a GPU after an error (NVML field
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, values NVML_GPU_RECOVERY_ACTION_*, R550 and later).
RecoveryAction = Literal["none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"]
GpuVendor = Literal["nvidia", "amd"]


class _Wire(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True, gc=False):
    # Unknown keys are refused; a field equal to its default is left out of the JSON (a reader
    # takes the default); keyword construction only. msgspec's JSON decoding is strict: no float
    # for an int, no "1" for a number, no 1 for a bool; NaN and Infinity are not JSON, and 1e400
    # is out of every float's bounds. gc=False: instances stay out of the cyclic garbage
    # collector's walks (a decoded report is a tree of scalars, lists and dicts: it holds no
    # cycle). The aggregator keeps every node's latest GPU, port and rank states; tracked, they
    # lengthened every collection's pause, which stops intake (docs/reports.md).
    pass


class Event(_Wire, kw_only=True):
    """Something that happened, as opposed to a state: an Xid, a link going down, a hang.

    ``kind`` is one of: xid, sxid, gpu_lost, mlx5_error, link_down, link_up, link_flap,
    counter_reset, hang, rank_exit, nvml_unavailable, and from training logs nccl_timeout, cuda_error,
    nccl_warn (agent/app_log.py) and nccl_ras (agent/nccl_ras.py: ``rank`` and ``peer`` are the rank
    and node NCCL's RAS reports unresponsive or dead), and amdgpu_<event> (AMD GPU driver events,
    ``code`` the RAS block's number: aggregator/amdgpu_catalog.py). Subject fields that do not apply are None.
    ``count`` > 1 means identical events were collapsed (a flood is counted, not forwarded line
    by line); ``ts`` is then the first occurrence and ``last_ts`` the latest.
    """

    kind: Short
    ts: Timestamp
    urgent: bool = False
    message: Text = ""
    code: Count | None = None
    gpu: Index | None = None
    uuid: Short | None = None
    pci_bus_id: Short | None = None
    device: Short | None = None
    port: Index | None = None
    job: Short | None = None
    rank: Index | None = None
    count: Annotated[int, Meta(ge=1, le=MAX_COUNT)] = 1
    last_ts: Timestamp | None = None
    # Which reader saw it ("kmsg", "nvml", "sysfs", "heartbeat"): an Xid seen by both the kernel
    # log and NVML's event API is one fault, and the aggregator dedups by (gpu, code, time).
    source: Short = ""
    # A training log line that names a peer ("NCCL WARN ... peer 10.0.0.7", "connection to
    # gpu-17 closed"): the host or address it names, as written (the aggregator resolves it).
    peer: Short | None = None

    def __post_init__(self) -> None:
        if len(self.message) > MAX_TEXT_CHARS:
            self.message = self.message[:MAX_TEXT_CHARS]


# At most this many compute processes per GPU are carried in a report and exported as
# vigil_gpu_process_info (agent.attribution): one per GPU is the common case, a handful under MPS
# or time-slicing; the rest are counted, not listed.
GPU_PROCESSES_MAX = 8


class GpuProcess(_Wire, kw_only=True):
    """One compute process on a GPU and whom it belongs to (agent.attribution); a field is None
    when unknown (no job, not in a pod, no name resolver, not on a MIG instance)."""

    pid: Pid
    job: JobName | None = None  # as GpuState.job
    slurm_job: Short | None = None  # from the process's cgroup alone
    pod_uid: Short | None = None
    container_id: Short | None = None
    namespace: Short | None = None
    pod: Short | None = None
    container: Short | None = None
    gpu_instance_id: Index | None = None  # MIG GPU instance (NVML gpuInstanceId)
    compute_instance_id: Index | None = None  # MIG compute instance


class GpuState(_Wire, kw_only=True):
    """One GPU's state and counters at report time (NVLink counters summed over its links)."""

    index: Index
    uuid: Short
    health: GpuHealth = "ok"
    name: Short | None = None
    pci_bus_id: Short | None = None
    # Whose GPU (issue 46): "nvidia" (NVML) or "amd" (amdsmi); None from an agent before it. With
    # ``name`` (the model) it is the GPU's hardware class (docs/amd.md).
    vendor: GpuVendor | None = None
    utilization_gpu_ratio: Ratio | None = None
    utilization_memory_ratio: Ratio | None = None
    memory_used_bytes: NonNeg | None = None
    memory_total_bytes: NonNeg | None = None
    sm_clock_hertz: NonNeg | None = None
    sm_clock_max_hertz: NonNeg | None = None
    memory_clock_hertz: NonNeg | None = None
    temperature_celsius: Num | None = None
    memory_temperature_celsius: Num | None = None
    slowdown_temperature_celsius: Num | None = None
    shutdown_temperature_celsius: Num | None = None
    memory_max_temperature_celsius: Num | None = None
    power_watts: NonNeg | None = None
    power_limit_watts: NonNeg | None = None
    energy_joules: NonNeg | None = None
    performance_state: Count | None = None
    # Active clock-event (throttle) reasons by our short name, e.g. ["hw_thermal_slowdown"]. The
    # GPU's sequences are tuples, decoded as such: an empty one is a shared constant and a full one
    # is left alone by the garbage collector, where a list per field per GPU per held report was
    # one more object for every collection to walk (docs/reports.md, garbage collection).
    clock_event_reasons: Annotated[tuple[Short, ...], Meta(max_length=64)] = ()
    ecc_corrected_volatile: Count | None = None
    ecc_uncorrected_volatile: Count | None = None
    ecc_corrected_aggregate: Count | None = None
    ecc_uncorrected_aggregate: Count | None = None
    retired_pages_sbe: Count | None = None
    retired_pages_dbe: Count | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: Count | None = None
    remapped_rows_uncorrectable: Count | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    pcie_replay_total: Count | None = None
    nvlink_crc_errors_total: Count | None = None
    nvlink_replay_errors_total: Count | None = None
    nvlink_recovery_errors_total: Count | None = None
    nvlink_links_active: Count | None = None
    nvlink_links_down: Annotated[tuple[Index, ...], Meta(max_length=64)] = ()
    # NVLink fabric (nvmlDeviceGetGpuFabricInfoV; NVSwitch systems only, else all None/empty):
    # Fabric Manager's registration state; the registration's error as NVML names its return
    # code (``fabric_status``, None when it succeeded or is not done); the NVLink clique and
    # cluster (GB200-class multi-node NVLink); and the unhealthy conditions of the fabric health
    # mask, in words: degraded_bandwidth, route_recovery, route_unhealthy, access_timeout_recovery.
    fabric_state: FabricState | None = None
    fabric_status: Short | None = None
    fabric_clique_id: Count | None = None
    fabric_cluster_uuid: Short | None = None
    fabric_health: Annotated[tuple[Short, ...], Meta(max_length=16)] = ()
    # The GPU's PCIe link as trained now and the most the GPU and its slot allow together
    # (nvmlDeviceGetCurrPcieLinkGeneration/Width, nvmlDeviceGetMaxPcieLinkGeneration/Width).
    pcie_link_generation: Count | None = None
    pcie_link_generation_max: Count | None = None
    pcie_link_width: Count | None = None
    pcie_link_width_max: Count | None = None
    # What the driver says recovers this GPU now (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).
    recovery_action: RecoveryAction | None = None
    # NVML GPM profiling (Hopper and later), averaged over the agent's collector interval; absent
    # on older GPUs and before the agent has a pair of samples.
    graphics_active_ratio: Ratio | None = None
    sm_active_ratio: Ratio | None = None
    sm_occupancy_ratio: Ratio | None = None
    tensor_active_ratio: Ratio | None = None
    dram_active_ratio: Ratio | None = None
    fp16_active_ratio: Ratio | None = None
    fp32_active_ratio: Ratio | None = None
    fp64_active_ratio: Ratio | None = None
    pcie_tx_bytes_per_second: NonNeg | None = None
    pcie_rx_bytes_per_second: NonNeg | None = None
    nvlink_tx_bytes_per_second: NonNeg | None = None
    nvlink_rx_bytes_per_second: NonNeg | None = None
    # The job whose processes use this GPU (agent.attribution): a Slurm job id, a torchrun run id,
    # or "pod/<uid>" on Kubernetes; None when no process or no job is known.
    job: JobName | None = None
    # Its compute processes and their job/pod (at most GPU_PROCESSES_MAX, the first NVML lists).
    processes: Annotated[tuple[GpuProcess, ...], Meta(max_length=GPU_PROCESSES_MAX)] = ()


class PortState(_Wire, kw_only=True):
    """One RDMA port. ``counters`` are raw (data counters already in bytes). ``deltas`` and
    ``rates_per_second`` are since the agent's previous cycle and list only counters that moved
    (absent: unchanged); a counter that went backwards or sits at its saturation value has none
    and is named in ``flags`` ("reset" or "saturated") instead. The aggregator judges over its
    own window from the raw counters; these are for a reader of a single report."""

    device: Short
    port: Index
    state: Short | None = None
    phys_state: Short | None = None
    rate_bits_per_second: NonNeg | None = None
    link_layer: Short | None = None
    netdev: Short | None = None
    # Counter names are sysfs file names, bounded by the body limit: a length check on each of
    # the ~400 keys of a report costs 15% of the ingest rate (bench/bench_ingest.py).
    counters: Annotated[dict[str, PortCounter], Meta(max_length=256)] = {}
    deltas: Annotated[dict[str, PortCounter], Meta(max_length=256)] = {}
    rates_per_second: Annotated[dict[str, NonNeg], Meta(max_length=256)] = {}
    flags: Annotated[dict[str, Short], Meta(max_length=256)] = {}


class RankSummary(_Wire, kw_only=True):
    """One training rank over the report window: not every step, a summary of them."""

    job: Short
    rank: Index
    gpu: Index | None = None
    pid: Pid | None = None
    state: RankState = "running"
    window_seconds: NonNeg
    # The end of the complete window [window_end_ts - window_seconds, window_end_ts) on the agent's
    # clock that ``steps`` and the quantiles cover; summaries of one window repeat it, so the
    # aggregator counts each window once. None: an agent summarising a sliding window.
    window_end_ts: Timestamp | None = None
    steps: Count
    last_step: Count
    last_progress_ts: Timestamp
    step_seconds_p50: NonNeg | None = None
    step_seconds_p90: NonNeg | None = None
    compute_seconds_p50: NonNeg | None = None
    compute_seconds_p90: NonNeg | None = None
    comm_seconds_p50: NonNeg | None = None
    comm_seconds_p90: NonNeg | None = None
    data_seconds_p50: NonNeg | None = None
    data_seconds_p90: NonNeg | None = None
    phase: JobPhase | None = None  # the rank's latest heartbeat's phase (None: training)
    # The lowest step in the window: below an earlier window's ``last_step``, the job restarted
    # (from a checkpoint) in between.
    first_step: Count | None = None
    # Application signals (heartbeat ``loss`` / ``grad_norm``, optional): the window's median and
    # latest finite loss, the median and largest finite gradient norm, and the steps whose loss or
    # gradient norm was NaN or infinite (with the first such step).
    loss_p50: Num | None = None
    loss_last: Num | None = None
    grad_norm_p50: NonNeg | None = None
    grad_norm_max: NonNeg | None = None
    nonfinite_steps: Count = 0
    nonfinite_first_step: Count | None = None
    # Of those, the steps whose loss itself was NaN or infinite (a gradient norm alone overflows
    # routinely under AMP's loss scaling; a non-finite loss is the training diverging).
    nonfinite_loss_steps: Count = 0
    # The rank's latest completed announced checkpoint (``hb.checkpointing()`` ended): the step it
    # saved, when it ended (agent clock) and how long the save took.
    checkpoint_step: Count | None = None
    checkpoint_ts: Timestamp | None = None
    checkpoint_seconds: NonNeg | None = None


# What a rank's collective can be doing, as PyTorch's Flight Recorder records it
# (torch/csrc/distributed/c10d/FlightRecorder: "scheduled", "started", "completed").
CollectiveStage = Literal["scheduled", "started", "completed"]
# At most this many collective states in one report: a rank per GPU, a handful of process groups
# each (data, tensor, pipeline parallel), on the largest nodes (16 GPUs x 64).
COLLECTIVES_MAX = 1024


class CollectiveState(_Wire, kw_only=True):
    """One rank's progress through one process group's collectives, read from a PyTorch Flight
    Recorder dump on this node (agent/collectors/flight_recorder.py): the newest collective the
    rank entered and the newest it completed. ``job`` is the scheduler's job key, bound by the
    agent from the process that wrote the dump (its cgroup), never taken from the dump's text."""

    job: Short
    rank: Index  # the global rank
    group: Short  # the process group as the dump names it (its pg name / uid)
    group_size: Count | None = None
    # Sequence ids (collective_seq_id) of the newest collective entered (scheduled or started) and
    # the newest completed; None: none yet in the dump's ring.
    last_entered_seq: Count | None = None
    last_completed_seq: Count | None = None
    # The newest entered collective: its op ("allreduce", "broadcast", ...), its stage and its
    # input size in bytes, where the dump has them.
    op: Short | None = None
    stage: CollectiveStage | None = None
    size_bytes: Count | None = None
    # When the dump was written (the file's mtime, on the agent's clock) and why, as the dump says
    # ("timeout", "watchdog", "on_demand", ...; "" unknown).
    dump_ts: Timestamp
    reason: Short = ""


class PcieDevice(_Wire, kw_only=True):
    """One PCIe device's link and AER error counters, from sysfs (/sys/bus/pci/devices/<bdf>):
    every HCA, and every GPU for its AER counters (a GPU's link comes from NVML, in GpuState).
    ``pci_bus_id`` is sysfs's form, ``0000:18:00.0`` (NVML writes the domain with 8 digits)."""

    pci_bus_id: Short
    kind: Literal["gpu", "hca"]
    name: Short | None = None  # an HCA's RDMA device name (mlx5_0)
    link_generation: Count | None = None  # from current_link_speed (2.5 GT/s = 1 ... 64 GT/s = 6)
    link_generation_max: Count | None = None  # from max_link_speed
    link_width: Count | None = None  # current_link_width
    link_width_max: Count | None = None  # max_link_width
    aer_correctable_total: Count | None = None  # aer_dev_correctable TOTAL_ERR_COR
    aer_nonfatal_total: Count | None = None  # aer_dev_nonfatal TOTAL_ERR_NONFATAL
    aer_fatal_total: Count | None = None  # aer_dev_fatal TOTAL_ERR_FATAL


class NodeConfig(_Wire, kw_only=True):
    """A node's configuration facts: what every node of a job should have alike. Sent whole in
    a report when any fact changed, left out otherwise (the aggregator keeps the last). A fact
    the node cannot read is None. Per-GPU and per-HCA facts carry the first device's value;
    those on which the node's own devices disagree are named in ``mixed``."""

    driver_version: Short | None = None  # nvmlSystemGetDriverVersion: 535.161.08
    cuda_driver_version: Short | None = None  # nvmlSystemGetCudaDriverVersion_v2: 12.2
    kernel: Short | None = None  # /proc/sys/kernel/osrelease
    gpu_model: Short | None = None  # nvmlDeviceGetName
    gpu_count: Count | None = None
    vbios_version: Short | None = None
    gpu_inforom_version: Short | None = None  # nvmlDeviceGetInforomImageVersion: the GPU firmware image
    ecc_mode: Literal["enabled", "disabled"] | None = None  # current ECC mode
    persistence_mode: Literal["enabled", "disabled"] | None = None
    mig_mode: Literal["enabled", "disabled"] | None = None  # current MIG mode
    power_limit_watts: NonNeg | None = None  # enforced power limit
    application_sm_clock_hertz: NonNeg | None = None
    application_memory_clock_hertz: NonNeg | None = None
    hca_count: Count | None = None
    hca_board_id: Short | None = None  # /sys/class/infiniband/<hca>/board_id
    hca_firmware: Short | None = None  # /sys/class/infiniband/<hca>/fw_ver
    hca_link_rate_bits_per_second: NonNeg | None = None  # the first active port's rate
    ofed_version: Short | None = None  # MLNX_OFED / DOCA-OFED release, where installed
    rdma_core_version: Short | None = None
    mixed: Annotated[tuple[Short, ...], Meta(max_length=32)] = ()


class HostFacts(_Wire, kw_only=True):
    cpu_utilization_ratio: Ratio | None = None
    load1: NonNeg | None = None
    memory_used_bytes: NonNeg | None = None
    memory_total_bytes: NonNeg | None = None
    uptime_seconds: NonNeg | None = None
    # The NVIDIA Fabric Manager service on an NVSwitch system, as systemd names its state
    # (active, activating, deactivating, inactive, failed); None where it is not expected to run.
    fabric_manager_state: Short | None = None


# Node actions (contract/node_actions.py holds their table and the signing): the signed request the
# aggregator sends in its answer to a report, and the agent's result in a following report.
NodeActionName = Literal["reset_gpu", "request_reboot", "run_probes"]  # keys of NODE_ACTIONS (a test keeps them equal)

# At most this many requests in one answer, and results in one report: far above what one node
# ever has in flight (one per GPU), so a flood cannot ride on either.
MAX_REQUESTS_PER_RESPONSE = 16
MAX_RESULTS_PER_REPORT = 16
SIGNATURE_HEX_CHARS = 64


# Active validation (agent/probes/: the table of probes and what each measures; docs/probes.md):
# the probes a ``run_probes`` request may name (keys of agent.probes.PROBES, a test keeps them equal).
ProbeName = Literal["gpu_compute", "gpu_memory", "gpu_p2p", "dcgm_diag", "rdma_bw", "collective"]
# pass: measured and within every absolute check the agent can make itself (errors, throttling
# under load, a failed diagnostic); the aggregator then judges ``value`` against the baseline of
# the node's hardware class. fail: an absolute check failed. error: the probe could not run to the
# end (a timeout, a crash, a peer that never joined). skipped: not applicable or not installed
# on this node (no dcgmi, no perftest, one GPU for P2P): neither evidence of health nor of a fault.
ProbeStatus = Literal["pass", "fail", "error", "skipped"]
# Bounds: one result per probe and GPU (8-16 GPUs, 6 probes) and a handful of figures each.
MAX_PROBES_PER_REQUEST = 8
MAX_PROBE_RESULTS = 64
MAX_PROBE_METRICS = 16
MAX_PROBE_GROUP = 4096


class ProbeGroup(_Wire, kw_only=True):
    """Where a probe that needs other nodes meets them: a collective's rendezvous (every member gets
    the same ``group`` and ``rendezvous``, its own ``rank``), or an RDMA test's partner (the
    known-healthy node whose ``ib_write_bw`` server this node connects to, or serves)."""

    group: Id  # the run's id, the same on every member
    rank: Annotated[int, Meta(ge=0, lt=MAX_PROBE_GROUP)] = 0
    world_size: Annotated[int, Meta(ge=1, le=MAX_PROBE_GROUP)] = 1
    rendezvous: Short = ""  # host:port of rank 0's store (collective)
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: NCCL where CUDA is, gloo elsewhere
    partner: Short | None = None  # rdma_bw: the partner's address; None with ``serve``: be the server
    serve: bool = False


class ProbeResult(_Wire, kw_only=True):
    """One probe's measurement on one node (one GPU, where the probe is per GPU): ``value`` in
    ``unit`` (higher is better: TFLOP/s, GB/s, Gb/s) is what the aggregator judges against the
    baseline of the node's hardware class; ``metrics`` are the figures recorded during it (clocks,
    power, throttle reasons, the coefficient of variation across passes, error counts)."""

    probe: ProbeName
    gpu: Index | None = None
    status: ProbeStatus
    reason: Short = ""  # a machine word: ok, throttled, pattern_errors, diag_failed, timeout, not_installed ...
    detail: Text = ""
    value: NonNeg | None = None
    unit: Short = ""
    metrics: Annotated[dict[Short, Num], Meta(max_length=MAX_PROBE_METRICS)] = {}
    seconds: NonNeg = 0.0

    def __post_init__(self) -> None:
        if len(self.detail) > MAX_TEXT_CHARS:
            self.detail = self.detail[:MAX_TEXT_CHARS]


class NodeActionRequest(_Wire, kw_only=True):
    """One signed request for one node. ``id`` is the aggregator's idempotency key (the decision
    id): an agent carries out an id at most once and answers a repeat with its first result."""

    id: Id
    action: NodeActionName
    node: NodeName
    boot_id: Id  # the boot it was issued for: a reboot voids it
    gpu: Index | None = None
    gpu_uuid: Short | None = None
    issued_at: Timestamp
    expires_at: Timestamp
    reason: Text = ""
    # run_probes only: which probes (the agent's table, in this order), and the group a
    # collective or RDMA probe meets, and whether the probes may run while a job holds a GPU
    # (only the non-intrusive ones ever do).
    probes: Annotated[list[ProbeName], Meta(max_length=MAX_PROBES_PER_REQUEST)] = []
    probe_group: ProbeGroup | None = None
    quick: bool = False  # the short variants (fewer passes, smaller buffers): a screen, not a verdict
    signature: Annotated[str, Meta(max_length=SIGNATURE_HEX_CHARS)] = ""

    def __post_init__(self) -> None:
        if len(self.reason) > MAX_TEXT_CHARS:
            self.reason = self.reason[:MAX_TEXT_CHARS]
        if len(set(self.probes)) != len(self.probes):
            raise ValueError("probes lists a probe twice")


NodeActionOutcome = Literal["done", "refused", "failed"]


class NodeActionResult(_Wire, kw_only=True):
    """What the agent did with a request: ``done``, ``refused`` (a check failed, nothing was run:
    ``reason`` says which, e.g. ``busy`` with the holding pids in ``detail``) or ``failed`` (it ran
    and did not succeed)."""

    id: Id
    action: Short
    gpu: Index | None = None
    outcome: NodeActionOutcome
    reason: Short  # a short machine-readable word: done, busy, not_allowed, bad_signature, expired, ...
    detail: Text = ""
    ts: Timestamp
    # run_probes only: each probe's measurement, and the result's HMAC-SHA256 under the node key
    # (contract/node_actions.py sign_result): bound to the request id, node and boot, so a result
    # cannot be replayed for another request or made up by anything without the node's key.
    probes: Annotated[list[ProbeResult], Meta(max_length=MAX_PROBE_RESULTS)] = []
    node: NodeName | None = None
    boot_id: Id | None = None
    signature: Annotated[str, Meta(max_length=SIGNATURE_HEX_CHARS)] = ""

    def __post_init__(self) -> None:
        if len(self.detail) > MAX_TEXT_CHARS:
            self.detail = self.detail[:MAX_TEXT_CHARS]


# The agent's boot id: the kernel's boot id (its first 16 hex digits) and a per-start nonce
# (agent/daemon.py read_boot_id). Counters restart when either changes; only a new kernel part
# is a reboot.
_AGENT_BOOT_ID = re.compile(r"(?P<kernel>[0-9a-f]{16})-[0-9a-f]{8}")


def kernel_boot_id(boot_id: str) -> str:
    """The kernel part of an agent's boot id: an agent restart keeps it, a reboot changes it. A
    boot id of another form (an older agent, the simulator) is taken whole."""
    match = _AGENT_BOOT_ID.fullmatch(boot_id)
    return match.group("kernel") if match else boot_id


class Report(_Wire, kw_only=True):
    """The agent's periodic push (``POST /v1/reports``). ``seq`` increases by one per report
    within a ``boot_id``; a new boot id means counters restarted from zero."""

    # REPORT_VERSION; another number decodes, and the intake refuses it by name (unsupported_report_version).
    version: Annotated[int, Meta(ge=0, le=1 << 16)] = REPORT_VERSION
    node: NodeName
    boot_id: Id
    seq: Count
    ts: Timestamp
    # At most a day: a node that reports less often is not being watched.
    interval_seconds: Annotated[float, Meta(gt=0, le=86400)]
    urgent: bool = False
    topology: Annotated[dict[Short, Short], Meta(max_length=32)] = {}
    nvml_available: bool = True
    # Bounds far above any real node (8-16 GPUs, 8-16 ports, a rank per GPU); the body limit
    # bounds the rest.
    gpus: Annotated[list[GpuState], Meta(max_length=256)] = []
    ports: Annotated[list[PortState], Meta(max_length=256)] = []
    ranks: Annotated[list[RankSummary], Meta(max_length=1024)] = []
    # Flight Recorder progress of the ranks on this node (CollectiveState), whole in every report
    # while their dump is fresh (agent: collectors.flight_recorder.fresh_seconds); not a section:
    # a compact report never leaves it out or completes it from a base.
    collectives: Annotated[list[CollectiveState], Meta(max_length=COLLECTIVES_MAX)] = []
    host: HostFacts | None = None
    # Like ``host``: whole when any of it changed, absent when unchanged (kept by the aggregator).
    config: NodeConfig | None = None
    pcie: Annotated[list[PcieDevice], Meta(max_length=256)] | None = None
    events: Annotated[list[Event], Meta(max_length=REPORT_MAX_EVENTS)] = []
    # Collectors whose last cycle failed, so the aggregator can tell "no data" from "healthy".
    failed_collectors: Annotated[list[Short], Meta(max_length=64)] = []
    # The sender's release (vigil.contract.version), so the aggregator can see version skew; absent
    # from agents older than 0.1.0's packaging change.
    agent_version: Annotated[str, Meta(max_length=64)] | None = None
    # Outcomes of node actions the aggregator asked for (contract/node_actions.py), each reported until
    # a report carrying it is accepted.
    action_results: Annotated[list[NodeActionResult], Meta(max_length=MAX_RESULTS_PER_REPORT)] = []
    # The seq of this boot's report that the fields left out are unchanged since (the last one the
    # aggregator accepted); None: this report is whole.
    base_seq: Count | None = None
    # The fields of the section's i-th entry that went back to their defaults since the base, as
    # [section, i, field]: left out, they would read "unchanged".
    cleared: Annotated[list[tuple[Section, Index, Short]], Meta(max_length=4096)] = []

    def __post_init__(self) -> None:
        if self.ports:
            check_port_counters(self.ports)
        if self.cleared:
            if self.base_seq is None:
                raise ValueError("cleared is only valid in a report relative to a base (base_seq)")
            for section, i, name in self.cleared:
                if i >= len(getattr(self, section)):
                    raise ValueError(f"cleared names {section}[{i}], but the report has {len(getattr(self, section))}")
                if name not in CLEARABLE[section]:
                    raise ValueError(f"cleared names {name!r}, not a field of {section} that may be left out")

    @property
    def is_delta(self) -> bool:
        """Whether fields left out mean "unchanged since ``base_seq``" rather than "absent"."""
        return self.base_seq is not None


def check_port_counters(ports: list[PortState]) -> None:
    """ValueError if a counter of ``ports`` is above MAX_COUNTER: ``max`` over each dict that has
    any (a compact port has one or two counters and no deltas: 1.6 us for 8 ports where one
    chained pass over all the dicts, empty ones included, took 2.7 us)."""
    for port in ports:
        counters, deltas = port.counters, port.deltas
        if (counters and max(counters.values()) > MAX_COUNTER) or (deltas and max(deltas.values()) > MAX_COUNTER):
            raise ValueError(f"a port counter is at most {MAX_COUNTER} (64 bits)")


# A report's sections of entries, each a list of one model (a compact report completes them by identity).
Section = Literal["gpus", "ports", "ranks"]
SECTIONS: dict[str, type[GpuState] | type[PortState] | type[RankSummary]] = {
    "gpus": GpuState, "ports": PortState, "ranks": RankSummary}


def field_defaults(model: type[msgspec.Struct]) -> dict[str, Any]:
    """Each field of ``model`` that has a default, and that default (a fresh one for a mutable
    default): what a field named in ``cleared`` becomes."""
    return {f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            for f in msgspec.structs.fields(model) if not f.required}


# Fields a compact report never leaves out or clears: a port's counters (a compact port lists
# those that moved, and a port whose counter names changed goes whole) and the port fields for a
# reader of one report, never sent relative to a base.
NOT_CLEARABLE = {"gpus": frozenset(), "ports": frozenset({"counters", "deltas", "rates_per_second"}),
                 "ranks": frozenset()}
# The fields of each section a compact report may name in ``cleared``: every field with a default.
CLEARABLE = {section: frozenset(field_defaults(model)) - NOT_CLEARABLE[section] for section, model in SECTIONS.items()}


class Heartbeat(_Wire, kw_only=True):
    """One training step from one rank (UDP datagram or ``POST /v1/heartbeat``)."""

    job: Annotated[str, Meta(min_length=1, max_length=128)]
    rank: Count
    step: Count
    step_seconds: NonNeg
    compute_seconds: NonNeg | None = None
    comm_seconds: NonNeg | None = None
    data_seconds: NonNeg | None = None
    gpu: Index | None = None
    pid: Annotated[int, Meta(ge=1, le=1 << 32)] | None = None
    ts: Num | None = None
    phase: JobPhase | None = None
    # How compute/comm were measured: "cuda_events" (GPU timeline) or "cpu" (host clock, a fallback).
    timing: Literal["cuda_events", "cpu"] | None = None
    # Application signals, optional: the step's loss and global gradient norm, a number or one of
    # "nan", "inf", "-inf" (NonFinite).
    loss: Num | NonFinite | None = None
    grad_norm: NonNeg | NonFinite | None = None


# Encoding and decoding: one encoder, and one strict decoder per type, made once.
_W = TypeVar("_W", bound=msgspec.Struct)
_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}
# What a body that cannot be decoded raises: msgspec.ValidationError (a subclass) when it is JSON
# of the wrong shape, msgspec.DecodeError itself when it is not JSON.
WireError = msgspec.DecodeError
SchemaError = msgspec.ValidationError


def encode(value: Any) -> bytes:
    """``value`` (a wire Struct, or JSON-ready data holding them) as compact JSON."""
    return _ENCODER.encode(value)


def decode(body: bytes | str, model: type[_W]) -> _W:
    """``body`` as a ``model``, strictly validated; raises WireError (SchemaError for a wrong shape)."""
    decoder = _DECODERS.get(model)
    if decoder is None:
        decoder = _DECODERS[model] = msgspec.json.Decoder(model)
    result: _W = decoder.decode(body)
    return result


def decode_report(body: bytes | str) -> Report:
    """The aggregator's intake: ``body`` as a Report, strictly validated."""
    return _REPORT_DECODER.decode(body)


_REPORT_DECODER = msgspec.json.Decoder(Report)


def convert(data: Any, model: type[_W]) -> _W:
    """JSON-ready ``data`` (a dict from a parsed datagram or answer) as a ``model``, validated as
    strictly as ``decode``."""
    return msgspec.convert(data, model)


def to_builtins(value: Any) -> Any:
    """``value`` as JSON-ready Python data (fields equal to their defaults left out)."""
    return msgspec.to_builtins(value)


def to_readable(value: Any, *, absent: bool = False) -> Any:
    """``value`` for a person (an API answer, a state page), as JSON-ready data: every field of
    every Struct in it that has a value, defaults included (``"health": "ok"``), absent (None)
    ones left out unless ``absent``."""
    if isinstance(value, msgspec.Struct):
        return {name: to_readable(item, absent=absent) for name, item in msgspec.structs.asdict(value).items()
                if absent or item is not None}
    if isinstance(value, list | tuple):
        return [to_readable(item, absent=absent) for item in value]
    if isinstance(value, dict):
        return {key: to_readable(item, absent=absent) for key, item in value.items()}
    return value


def check(value: _W) -> _W:
    """A Struct built in Python, validated as the aggregator will (construction checks nothing):
    a validated copy, or SchemaError naming the field."""
    if isinstance(value, PortState):
        try:
            check_port_counters([value])
        except ValueError as exc:
            raise SchemaError(str(exc)) from None
    return decode(encode(value), type(value))


def replace(value: _W, **changes: Any) -> _W:
    """A copy of ``value`` with ``changes`` (unchecked, like construction)."""
    return msgspec.structs.replace(value, **changes)
