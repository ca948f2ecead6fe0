"""GPU collector: every GPU's identity, load, clocks, temperatures, power, memory errors, PCIe and
NVLink counters and health, NVLink fabric registration, PCIe link and the driver's recovery action,
read through a GpuBackend (PynvmlBackend on NVIDIA, AmdSmiBackend on AMD: agent/gpu_backend.py), plus
Xid events from NVML's event API (amdsmi's event notifications on AMD, counted by kind).

It emits one series per GPU (labels ``gpu``, ``uuid``), a ``GpuState`` per GPU for the Report, and
urgent events (gpu_lost, xid) once per occurrence. A GPU in MIG mode also gets one info series per
MIG device and that device's memory, labelled with the parent's ``gpu``/``uuid`` and its instance
ids. A GPU that stops answering becomes health ``lost`` alone; the others keep reporting. It does
not parse the kernel log (the xid collector owns ``vigil_gpu_xid_errors_total``) and judges nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from pydantic import Field

from vigil.agent.attribution import PROCESS_INFO, PodResolver, ProcessAttribution, process_samples
from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.collectors.xid import PAGED_XID_CODES
from vigil.agent.gpu_backend import GpuBackend, GpuNotification
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.nvml.backend import GpuIdentity, GpuReading, NvLinkReading
from vigil.agent.pod_names import BUNDLE_TEMPLATES, BundlePodNames
from vigil.contract.wire import Event, GpuHealth, GpuState, GpuVendor

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

log = logging.getLogger(__name__)

HEALTH_STATES = ("ok", "lost", "reset_required", "unavailable")


class GpuConfig(CollectorConfig):
    # One read per report: the reporter sends every 2.5 s (aggregator.interval_seconds) and a report
    # carries the latest read, Prometheus scrapes every 15 s, and every series read here is a gauge
    # of the moment or a counter (GPM's rates then span the report's whole interval, not its last
    # second). A 1 s cadence read ~60% of the values for nobody: ~1.4 ms of an idle agent's CPU a
    # second on the 2-core test VM (docs/architecture.md section 9). A GPU fault does not wait for
    # it: Xids come through NVML's event thread and the kernel log as they happen.
    interval_seconds: float = Field(default=2.5, gt=0)
    # NVLink state and error counters are 4 NVML queries per link (72 per H100) and move slowly;
    # a link that fails mid-cycle also raises Xid 74 through the event API at once. The energy
    # counter is read on this cadence too (3-12 ms a call on a real H100, half of a read's NVML
    # time: tests/fixtures/nvml-real/); its series keeps its last value in between.
    nvlink_interval_seconds: float = Field(default=10.0, gt=0)
    xid_events: bool = True  # listen to NVML's Xid event API in a worker thread
    event_wait_ms: int = Field(default=500, ge=10, le=10_000)  # worker's wait; bounds close()
    # Which job uses each GPU (agent.attribution): processes start and stop rarely.
    job_attribution_interval_seconds: float = Field(default=10.0, gt=0)
    # The process table job attribution reads (/proc/<pid>/cgroup, environ); None: the agent's
    # (/proc). A test or a containerised agent with the host's /proc mounted elsewhere sets it.
    proc_root: str | None = None
    # Container runtime bundles ({id}: the container id of a process's cgroup) whose CRI annotations
    # name a GPU process's pod, namespace and container (agent.pod_names): containerd's, then
    # CRI-O's. A containerised agent needs them mounted read-only at these paths; [] names no pod.
    pod_name_bundles: list[str] = Field(default_factory=lambda: list(BUNDLE_TEMPLATES))


_G = ("gpu", "uuid")
_Labels = tuple[tuple[str, str], ...]
G = MetricKind.GAUGE
C = MetricKind.COUNTER

INFO = MetricSpec("vigil_gpu_info", MetricKind.INFO,
                  "GPU identity: vendor (nvidia, amd), model, PCI bus id, serial, VBIOS, driver.",
                  ("gpu", "uuid", "name", "pci_bus_id", "serial", "vbios_version", "driver_version",
                   "cuda_driver_version", "vendor"))
HEALTH = MetricSpec("vigil_gpu_health", G, "1 for the GPU's current health state (NVML's or amdsmi's), 0 for the "
                    "others.", (*_G, "state"))
# Named for NVML, they stand for the node's GPU library, whichever it is (amdsmi on AMD: docs/amd.md).
NVML_AVAILABLE = MetricSpec("vigil_gpu_nvml_available", G,
                            "1 when the GPU library (NVML, or amdsmi on AMD) answers on this node, else 0.")
NVML_ERRORS = MetricSpec("vigil_gpu_nvml_errors_total", C,
                         "GPU library (NVML or amdsmi) calls that failed other than with NotSupported, by error.",
                         ("reason",))
UTILIZATION = MetricSpec("vigil_gpu_utilization_ratio", G, "Share of the last sample period a kernel ran, 0..1.",
                         _G, "ratio")
MEMORY_UTILIZATION = MetricSpec("vigil_gpu_memory_utilization_ratio", G,
                                "Share of the last sample period device memory was read or written.", _G, "ratio")
MEMORY_USED = MetricSpec("vigil_gpu_memory_used_bytes", G,
                         "Device memory in use, the driver's reserve included (NVML v1 `used`).", _G, "bytes")
MEMORY_RESERVED = MetricSpec("vigil_gpu_memory_reserved_bytes", G,
                             "Device memory the driver and firmware reserve (part of used; NVML memory info v2).",
                             _G, "bytes")
ENCODER_UTILIZATION = MetricSpec("vigil_gpu_encoder_utilization_ratio", G,
                                 "Share of NVML's sampling period the video encoder (NVENC) was busy, 0..1.", _G,
                                 "ratio")
DECODER_UTILIZATION = MetricSpec("vigil_gpu_decoder_utilization_ratio", G,
                                 "Share of NVML's sampling period the video decoder (NVDEC) was busy, 0..1.", _G,
                                 "ratio")
MEMORY_TOTAL = MetricSpec("vigil_gpu_memory_total_bytes", G, "Device memory installed.", _G, "bytes")
SM_CLOCK = MetricSpec("vigil_gpu_sm_clock_hertz", G, "SM clock.", _G, "hertz")
SM_CLOCK_MAX = MetricSpec("vigil_gpu_sm_clock_max_hertz", G, "Maximum SM clock.", _G, "hertz")
MEMORY_CLOCK = MetricSpec("vigil_gpu_memory_clock_hertz", G, "Memory clock.", _G, "hertz")
MEMORY_CLOCK_MAX = MetricSpec("vigil_gpu_memory_clock_max_hertz", G, "Maximum memory clock.", _G, "hertz")
TEMPERATURE = MetricSpec("vigil_gpu_temperature_celsius", G, "GPU core temperature.", _G, "celsius")
MEMORY_TEMPERATURE = MetricSpec("vigil_gpu_memory_temperature_celsius", G, "HBM temperature.", _G, "celsius")
SLOWDOWN_TEMPERATURE = MetricSpec("vigil_gpu_slowdown_temperature_celsius", G,
                                  "Core temperature at which the GPU slows its clocks.", _G, "celsius")
SHUTDOWN_TEMPERATURE = MetricSpec("vigil_gpu_shutdown_temperature_celsius", G,
                                  "Core temperature at which the GPU shuts down.", _G, "celsius")
MAX_OPERATING_TEMPERATURE = MetricSpec("vigil_gpu_max_operating_temperature_celsius", G,
                                       "Highest core temperature for normal operation.", _G, "celsius")
MEMORY_MAX_TEMPERATURE = MetricSpec("vigil_gpu_memory_max_operating_temperature_celsius", G,
                                    "Highest HBM temperature for normal operation.", _G, "celsius")
POWER = MetricSpec("vigil_gpu_power_watts", G, "Power draw.", _G, "watts")
POWER_LIMIT = MetricSpec("vigil_gpu_power_limit_watts", G, "Enforced power limit.", _G, "watts")
ENERGY = MetricSpec("vigil_gpu_energy_joules_total", C, "Energy used since the driver was loaded.", _G, "joules")
PSTATE = MetricSpec("vigil_gpu_performance_state", G, "Performance state: 0 (P0, fastest) to 15.", _G)
CLOCK_EVENT = MetricSpec("vigil_gpu_clock_event_active", G,
                         "1 while this reason holds the clocks down (NVML clock event reasons).", (*_G, "reason"))
ECC_ERRORS = MetricSpec("vigil_gpu_ecc_errors_total", C,
                        "ECC errors; `counter` volatile resets with the driver, aggregate persists.",
                        (*_G, "error_type", "counter"))
RETIRED_PAGES = MetricSpec("vigil_gpu_retired_pages_total", C,
                           "Device memory pages retired, by cause (sbe: repeated single-bit, dbe: double-bit).",
                           (*_G, "cause"))
RETIRED_PAGES_PENDING = MetricSpec("vigil_gpu_retired_pages_pending", G,
                                   "1 when a page retirement waits for the next driver reload.", _G)
REMAPPED_ROWS = MetricSpec("vigil_gpu_remapped_rows_total", C,
                           "HBM rows remapped, by the error that caused it.", (*_G, "error_type"))
REMAP_PENDING = MetricSpec("vigil_gpu_row_remap_pending", G, "1 when a row remap waits for a GPU reset.", _G)
REMAP_FAILURE = MetricSpec("vigil_gpu_row_remap_failure", G,
                           "1 when a row remap failed (no spare rows): the GPU needs inspection.", _G)
PCIE_REPLAY = MetricSpec("vigil_gpu_pcie_replay_total", C, "PCIe replays since the last reset.", _G)
PCIE_THROUGHPUT = MetricSpec("vigil_gpu_pcie_throughput_bytes_per_second", G,
                             "PCIe throughput by direction: NVML GPM over the collector interval on Hopper and "
                             "later (absent in the first cycle), else NVML's last 20 ms sample.", (*_G, "direction"))
FAN_SPEED = MetricSpec("vigil_gpu_fan_speed_ratio", G, "Fan speed as a share of its maximum.", _G, "ratio")
NVLINK_STATE = MetricSpec("vigil_gpu_nvlink_state", G, "1 when the NVLink is active, 0 when down.",
                          (*_G, "link"))
NVLINK_ERRORS = MetricSpec("vigil_gpu_nvlink_errors_total", C,
                           "NVLink data-link errors: crc (flit CRC), replay, recovery.",
                           (*_G, "link", "error_type"))
NVLINK_DATA = MetricSpec("vigil_gpu_nvlink_data_bytes_total", C,
                         "NVLink payload bytes (protocol overhead excluded) over all links since the driver "
                         "loaded, by direction; read every nvlink_interval_seconds.", (*_G, "direction"), "bytes")
# NVML GPM profiling metrics (Hopper and later): averaged over the collector interval, absent on
# older GPUs (never 0) and in the first cycle.
_GPM = "NVML GPM, over the collector interval; absent before Hopper."
GRAPHICS_ACTIVE = MetricSpec("vigil_gpu_graphics_engine_active_ratio", G,
                             f"Share of time any compute or graphics work ran. {_GPM}", _G, "ratio")
SM_ACTIVE = MetricSpec("vigil_gpu_sm_active_ratio", G, f"Share of SMs busy (at least one warp). {_GPM}", _G,
                       "ratio")
SM_OCCUPANCY = MetricSpec("vigil_gpu_sm_occupancy_ratio", G,
                          f"Resident warps over the SMs' theoretical maximum. {_GPM}", _G, "ratio")
TENSOR_ACTIVE = MetricSpec("vigil_gpu_tensor_active_ratio", G,
                           f"Share of time the SMs ran any tensor-core operation. {_GPM}", _G, "ratio")
DRAM_ACTIVE = MetricSpec("vigil_gpu_dram_active_ratio", G,
                         f"Device memory (HBM) bandwidth used over its theoretical maximum. {_GPM}", _G, "ratio")
FP16_ACTIVE = MetricSpec("vigil_gpu_fp16_active_ratio", G, f"Share of time the SMs ran non-tensor FP16. {_GPM}",
                         _G, "ratio")
FP32_ACTIVE = MetricSpec("vigil_gpu_fp32_active_ratio", G, f"Share of time the SMs ran non-tensor FP32. {_GPM}",
                         _G, "ratio")
FP64_ACTIVE = MetricSpec("vigil_gpu_fp64_active_ratio", G, f"Share of time the SMs ran non-tensor FP64. {_GPM}",
                         _G, "ratio")
NVLINK_TX = MetricSpec("vigil_gpu_nvlink_tx_bytes_per_second", G, f"NVLink traffic sent, all links. {_GPM}", _G,
                       "bytes_per_second")
NVLINK_RX = MetricSpec("vigil_gpu_nvlink_rx_bytes_per_second", G, f"NVLink traffic received, all links. {_GPM}",
                       _G, "bytes_per_second")
# MIG (Ampere and later): absent where the GPU has no MIG. The MIG device series carry the parent's
# gpu/uuid and the instance ids vigil_gpu_process_info carries, so a process joins to its MIG device.
_MIG = (*_G, "gpu_instance_id", "compute_instance_id")
MIG_MODE = MetricSpec("vigil_gpu_mig_mode_enabled", G, "1 when the GPU is in MIG mode, 0 when not; absent before "
                      "Ampere.", _G)
MIG_MODE_PENDING = MetricSpec("vigil_gpu_mig_mode_pending_enabled", G,
                              "MIG mode after the GPU's next reset; differs from vigil_gpu_mig_mode_enabled while "
                              "a mode change waits for that reset.", _G)
MIG_DEVICE_INFO = MetricSpec("vigil_gpu_mig_device_info", MetricKind.INFO,
                             "A MIG device of the GPU (gpu, uuid: the parent's): its UUID, GPU and compute "
                             "instance ids and GPU instance profile (e.g. 1g.10gb).",
                             (*_MIG, "mig_uuid", "profile"))
MIG_MEMORY_USED = MetricSpec("vigil_gpu_mig_memory_used_bytes", G,
                             "Device memory in use in the MIG device (NVML v1 `used` on its handle).", _MIG, "bytes")
MIG_MEMORY_TOTAL = MetricSpec("vigil_gpu_mig_memory_total_bytes", G, "Device memory of the MIG device.", _MIG,
                              "bytes")
# Issue 44: the NVLink fabric registration (NVSwitch systems), the PCIe link as trained, and the
# driver's recovery action. The fabric and the link are read on the slow (nvlink_interval) cadence
# and held in between; StateSets have a series per state, absent where NVML has no answer.
FABRIC_STATES = ("not_started", "in_progress", "completed")
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")
FABRIC_STATE = MetricSpec("vigil_gpu_fabric_state", G,
                          "1 for the GPU's NVLink fabric registration state with Fabric Manager, 0 for the others; "
                          "absent without an NVSwitch fabric. Read every nvlink_interval_seconds.", (*_G, "state"))
PCIE_LINK_GENERATION = MetricSpec("vigil_gpu_pcie_link_generation", G,
                                  "PCIe generation the GPU's link is trained at now (may be lower at idle on boards "
                                  "that save power so). Read every nvlink_interval_seconds.", _G)
PCIE_LINK_GENERATION_MAX = MetricSpec("vigil_gpu_pcie_link_generation_max", G,
                                      "Highest PCIe generation the GPU and its slot allow together.", _G)
PCIE_LINK_WIDTH = MetricSpec("vigil_gpu_pcie_link_width", G, "PCIe lanes the GPU's link is trained at now.", _G)
PCIE_LINK_WIDTH_MAX = MetricSpec("vigil_gpu_pcie_link_width_max", G,
                                 "Most PCIe lanes the GPU and its slot allow together.", _G)
RECOVERY_ACTION = MetricSpec("vigil_gpu_recovery_action", G,
                             "1 for the recovery the driver names for this GPU now "
                             "(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), 0 for the others; absent where the driver "
                             "predates the field.", (*_G, "action"))
NVML_XID = MetricSpec("vigil_gpu_nvml_xid_events_total", C,
                      "Xid critical errors delivered by NVML's event API, by Xid code.", (*_G, "code"))
# Vendor-specific (issue 46, docs/amd.md): absent on NVIDIA.
EDGE_TEMPERATURE = MetricSpec("vigil_gpu_edge_temperature_celsius", G,
                              "AMD: the die's edge sensor (vigil_gpu_temperature_celsius is the junction there); "
                              "absent where the board has none (MI300X).", _G, "celsius")
ECC_BLOCK_ERRORS = MetricSpec("vigil_gpu_ecc_block_errors_total", C,
                              "AMD: ECC errors since the driver loaded, by RAS block (umc: HBM, xgmi_wafl: the XGMI "
                              "links, gfx, sdma, mmhub, pcie_bif, ...); read every nvlink_interval_seconds.",
                              (*_G, "block", "error_type"))
DEVICE_EVENTS = MetricSpec("vigil_gpu_device_events_total", C,
                           "AMD: amdsmi event notifications, by kind (vmfault, thermal_throttle, gpu_pre_reset, "
                           "gpu_post_reset, ring_hang).", (*_G, "event"))

SPECS: tuple[MetricSpec, ...] = (
    INFO, HEALTH, NVML_AVAILABLE, NVML_ERRORS, UTILIZATION, MEMORY_UTILIZATION, MEMORY_USED, MEMORY_TOTAL,
    SM_CLOCK, SM_CLOCK_MAX, MEMORY_CLOCK, MEMORY_CLOCK_MAX, TEMPERATURE, MEMORY_TEMPERATURE,
    SLOWDOWN_TEMPERATURE, SHUTDOWN_TEMPERATURE, MAX_OPERATING_TEMPERATURE, MEMORY_MAX_TEMPERATURE, POWER,
    POWER_LIMIT, ENERGY, PSTATE, CLOCK_EVENT, ECC_ERRORS, RETIRED_PAGES, RETIRED_PAGES_PENDING, REMAPPED_ROWS,
    REMAP_PENDING, REMAP_FAILURE, PCIE_REPLAY, PCIE_THROUGHPUT, FAN_SPEED, NVLINK_STATE, NVLINK_ERRORS, NVML_XID,
    MEMORY_RESERVED, ENCODER_UTILIZATION, DECODER_UTILIZATION, NVLINK_DATA, GRAPHICS_ACTIVE, SM_ACTIVE,
    SM_OCCUPANCY, TENSOR_ACTIVE, DRAM_ACTIVE, FP16_ACTIVE, FP32_ACTIVE, FP64_ACTIVE,
    NVLINK_TX, NVLINK_RX, PROCESS_INFO, MIG_MODE, MIG_MODE_PENDING, MIG_DEVICE_INFO, MIG_MEMORY_USED,
    MIG_MEMORY_TOTAL, FABRIC_STATE, PCIE_LINK_GENERATION, PCIE_LINK_GENERATION_MAX, PCIE_LINK_WIDTH,
    PCIE_LINK_WIDTH_MAX, RECOVERY_ACTION, EDGE_TEMPERATURE, ECC_BLOCK_ERRORS, DEVICE_EVENTS,
)
# GpuReading fields read on the slow cadence and held in between (GpuState's names), and the
# gauges of the PCIe link among them.
_SLOW_FIELDS: tuple[str, ...] = (
    "fabric_state", "fabric_status", "fabric_clique_id", "fabric_cluster_uuid", "fabric_health",
    "pcie_link_generation", "pcie_link_generation_max", "pcie_link_width", "pcie_link_width_max",
)
_PCIE_LINK: tuple[tuple[str, MetricSpec], ...] = (
    ("pcie_link_generation", PCIE_LINK_GENERATION),
    ("pcie_link_generation_max", PCIE_LINK_GENERATION_MAX),
    ("pcie_link_width", PCIE_LINK_WIDTH),
    ("pcie_link_width_max", PCIE_LINK_WIDTH_MAX),
)

# Reading field -> spec, for the plain per-GPU gauges and counters.
_SIMPLE: tuple[tuple[str, MetricSpec], ...] = (
    ("utilization_gpu_ratio", UTILIZATION),
    ("utilization_memory_ratio", MEMORY_UTILIZATION),
    ("memory_used_bytes", MEMORY_USED),
    ("memory_total_bytes", MEMORY_TOTAL),
    ("memory_reserved_bytes", MEMORY_RESERVED),
    ("encoder_utilization_ratio", ENCODER_UTILIZATION),
    ("decoder_utilization_ratio", DECODER_UTILIZATION),
    ("sm_clock_hertz", SM_CLOCK),
    ("memory_clock_hertz", MEMORY_CLOCK),
    ("temperature_celsius", TEMPERATURE),
    ("memory_temperature_celsius", MEMORY_TEMPERATURE),
    ("power_watts", POWER),
    ("power_limit_watts", POWER_LIMIT),
    ("energy_joules", ENERGY),
    ("performance_state", PSTATE),
    ("retired_pages_pending", RETIRED_PAGES_PENDING),
    ("remap_pending", REMAP_PENDING),
    ("remap_failure", REMAP_FAILURE),
    ("pcie_replay_total", PCIE_REPLAY),
    ("fan_speed_ratio", FAN_SPEED),
    ("graphics_active_ratio", GRAPHICS_ACTIVE),
    ("sm_active_ratio", SM_ACTIVE),
    ("sm_occupancy_ratio", SM_OCCUPANCY),
    ("tensor_active_ratio", TENSOR_ACTIVE),
    ("dram_active_ratio", DRAM_ACTIVE),
    ("fp16_active_ratio", FP16_ACTIVE),
    ("fp32_active_ratio", FP32_ACTIVE),
    ("fp64_active_ratio", FP64_ACTIVE),
    ("nvlink_tx_bytes_per_second", NVLINK_TX),
    ("nvlink_rx_bytes_per_second", NVLINK_RX),
    ("edge_temperature_celsius", EDGE_TEMPERATURE),
)
_IDENTITY_SIMPLE: tuple[tuple[str, MetricSpec], ...] = (
    ("sm_clock_max_hertz", SM_CLOCK_MAX),
    ("memory_clock_max_hertz", MEMORY_CLOCK_MAX),
    ("slowdown_temperature_celsius", SLOWDOWN_TEMPERATURE),
    ("shutdown_temperature_celsius", SHUTDOWN_TEMPERATURE),
    ("gpu_max_temperature_celsius", MAX_OPERATING_TEMPERATURE),
    ("memory_max_temperature_celsius", MEMORY_MAX_TEMPERATURE),
)
_LABELED: tuple[tuple[str, MetricSpec, tuple[tuple[str, str], ...]], ...] = (
    ("ecc_corrected_volatile", ECC_ERRORS, (("error_type", "corrected"), ("counter", "volatile"))),
    ("ecc_uncorrected_volatile", ECC_ERRORS, (("error_type", "uncorrected"), ("counter", "volatile"))),
    ("ecc_corrected_aggregate", ECC_ERRORS, (("error_type", "corrected"), ("counter", "aggregate"))),
    ("ecc_uncorrected_aggregate", ECC_ERRORS, (("error_type", "uncorrected"), ("counter", "aggregate"))),
    ("ecc_deferred_volatile", ECC_ERRORS, (("error_type", "deferred"), ("counter", "volatile"))),
    ("retired_pages_sbe", RETIRED_PAGES, (("cause", "sbe"),)),
    ("retired_pages_dbe", RETIRED_PAGES, (("cause", "dbe"),)),
    ("remapped_rows_correctable", REMAPPED_ROWS, (("error_type", "correctable"),)),
    ("remapped_rows_uncorrectable", REMAPPED_ROWS, (("error_type", "uncorrectable"),)),
    ("pcie_tx_bytes_per_second", PCIE_THROUGHPUT, (("direction", "tx"),)),
    ("pcie_rx_bytes_per_second", PCIE_THROUGHPUT, (("direction", "rx"),)),
)
# The report's GpuState of a healthy GPU, derived from the field names it shares with the backend's
# types rather than copied by hand: every GpuReading field it has goes over as read, except those
# built here (held slow fields, the clock-event mask in words, memory in float bytes); every
# GpuIdentity field it has and the reading lacks (the maxima and thresholds) from the identity.
_STATE_BUILT = frozenset({"index", "health", "memory_used_bytes", "memory_total_bytes", "clock_event_reasons",
                          *_SLOW_FIELDS})
_READING_FIELDS = frozenset(f.name for f in dataclasses.fields(GpuReading))
_STATE_FROM_READING: tuple[str, ...] = tuple(
    name for name in GpuState.__struct_fields__ if name in _READING_FIELDS and name not in _STATE_BUILT)
_STATE_FROM_IDENTITY: tuple[str, ...] = tuple(
    name for name in GpuState.__struct_fields__
    if name in {f.name for f in dataclasses.fields(GpuIdentity)} and name not in _READING_FIELDS | _STATE_BUILT)


def _state_copier() -> Callable[[GpuState, GpuReading, GpuIdentity], None]:
    """``copy(state, reading, identity)``: the assignments those two lists name, compiled once as
    dataclasses compiles ``__init__`` (a setattr loop costs twice as much per GPU per cycle)."""
    lines = ["def copy(s, r, i):"]
    lines += [f"    s.{name} = r.{name}" for name in _STATE_FROM_READING]
    lines += [f"    s.{name} = i.{name}" for name in _STATE_FROM_IDENTITY]
    namespace: dict[str, Callable[[GpuState, GpuReading, GpuIdentity], None]] = {}
    exec("\n".join(lines), namespace)  # the source is built above from the types' field names only
    return namespace["copy"]


_copy_state = _state_copier()


def _reading_sampler() -> Callable[[list[Sample], GpuReading, _Labels, tuple[_Labels, ...]], None]:
    """``sample(out, reading, labels, labeled)``: a Sample into ``out`` for each _SIMPLE, then each
    _LABELED field of the reading that has a value (``labeled``: _LABELED's label sets in order),
    compiled once like _state_copier: the getattr loop over those 42 fields took 7.2-7.6 us for an
    H100's 36 samples against 4.3-5.1 us (timeit, shared 2-core machine)."""
    lines = ["def sample(out, r, labels, labeled):", "    append = out.append"]
    for attr, spec in _SIMPLE:
        lines += [f"    v = r.{attr}", "    if v is not None:",
                  f"        append(Sample({spec.name!r}, float(v), labels))"]
    for i, (attr, spec, _) in enumerate(_LABELED):
        lines += [f"    v = r.{attr}", "    if v is not None:",
                  f"        append(Sample({spec.name!r}, float(v), labeled[{i}]))"]
    namespace: dict[str, Callable[[list[Sample], GpuReading, _Labels, tuple[_Labels, ...]], None]] = {}
    # The source is built from the field names and metric names above only.
    exec("\n".join(lines), {"Sample": Sample}, namespace)
    return namespace["sample"]


_sample_reading = _reading_sampler()


# What each library answers for a lost GPU (agent/amdsmi/backend.py STATUS_HEALTH).
_LOST_ERROR = {"nvml": "NVML_ERROR_GPU_IS_LOST", "amdsmi": "AMDSMI_STATUS_NOT_FOUND"}

# Reason masks whose clock-event samples a GPU keeps built; a GPU shows a handful (idle, a power
# cap, a slowdown), so past this the cache starts again rather than grow.
_CLOCK_EVENT_MASKS_KEPT = 64


class _Gpu:
    """What the collector remembers about one GPU between cycles."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.identity: GpuIdentity | None = None
        self.labels: tuple[tuple[str, str], ...] = (("gpu", str(index)), ("uuid", ""))
        self.health = "ok"
        self.static_samples: list[Sample] = []
        self.nvlink_samples: list[Sample] = []
        self.nvlink_state: dict[str, int | tuple[int, ...] | None] = {}
        self.energy_joules: float | None = None  # the last slow-cadence read of the energy counter
        # link -> (state labels, (crc, replay, recovery) error labels); cleared when labels change
        self.link_label_cache: dict[int, tuple[_Labels, tuple[_Labels, ...]]] = {}
        # The last links read and what they made: (labels, links, their samples without the
        # traffic counters, nvlink_state); reused while the links read the same.
        self.link_memo: tuple[_Labels, tuple[NvLinkReading, ...], list[Sample],
                              dict[str, int | tuple[int, ...] | None]] | None = None
        # Built once per identity (labels): the health samples of each health state, the
        # clock-event samples of each reason mask, and _LABELED's label sets in its order.
        self.health_samples: dict[str, list[Sample]] = {}
        self.clock_event_samples: dict[int, list[Sample]] = {}
        self.labeled: tuple[_Labels, ...] = tuple(self.labels + extra for _, _, extra in _LABELED)
        # The fabric and PCIe link of the last slow read (GpuState field -> value) and their samples,
        # held until the next; the recovery action's StateSet samples by action, built once.
        self.slow_state: dict[str, object] = {}
        self.slow_samples: list[Sample] = []
        self.recovery_samples: dict[str, list[Sample]] = {}
        self.block_samples: list[Sample] = []  # AMD's ECC counts per RAS block, held between slow reads

    def identify(self, ident: GpuIdentity) -> None:
        self.identity = ident
        self.labels = (("gpu", str(self.index)), ("uuid", ident.uuid))
        self.link_label_cache = {}
        self.health_samples = {}
        self.clock_event_samples = {}
        self.recovery_samples = {}
        self.labeled = tuple(self.labels + extra for _, _, extra in _LABELED)
        info = Sample.of(INFO, 1, gpu=self.index, uuid=ident.uuid, name=ident.name, pci_bus_id=ident.pci_bus_id,
                         serial=ident.serial or "", vbios_version=ident.vbios_version or "",
                         driver_version=ident.driver_version or "",
                         cuda_driver_version=ident.cuda_driver_version or "", vendor=ident.vendor)
        self.static_samples = [info]
        for attr, spec in _IDENTITY_SIMPLE:
            value = getattr(ident, attr)
            if value is not None:
                self.static_samples.append(Sample(spec.name, value, self.labels))


class GpuCollector:
    name = "gpu"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: GpuConfig, backend: GpuBackend | None, clock: Callable[[], float],
                 attribution: ProcessAttribution | None = None) -> None:
        self._config = config
        self._attribution = attribution
        self._backend = backend
        self._clock = clock
        self._gpus: list[_Gpu] | None = None
        self._nvml_available: bool | None = None
        self._nvml_errors: dict[str, int] = {}
        self._nvlink_due = float("-inf")
        self._xid_counts: dict[tuple[int, int], int] = {}
        self._xid_queue: deque[tuple[float, int, int]] = deque()
        # (counts, each GPU's labels, the samples they made): _node_samples' Xid counters, rebuilt
        # only when a count or a GPU's labels changed.
        self._xid_memo: tuple[dict[tuple[int, int], int], tuple[_Labels, ...], list[Sample]] | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        words = backend.reason_words if backend is not None else ()
        self._reason_labels = tuple((name, ("reason", name)) for name in words)
        # AMD event notifications: (gpu index, kind) -> count, and those not yet counted.
        self._notification_counts: dict[tuple[int, str], int] = {}
        self._notification_queue: deque[GpuNotification] = deque()
        self._source = "nvml" if backend is None or backend.vendor == "nvidia" else "amdsmi"

    # --- the cycle -----------------------------------------------------------------------------

    def collect(self, now: float) -> Collection:
        backend = self._backend
        events: list[Event] = []
        if backend is None:
            self._set_available(False, now, events, "NVML could not be initialised on this node")
            return Collection([Sample(NVML_AVAILABLE.name, 0.0)], events, {"gpus": [], "nvml_available": False})
        if self._gpus is None:
            try:
                count = backend.device_count()
            except backend.library_errors as exc:  # the library gone: count it, report unavailable, never crash
                self._count_error(backend.error_reason(exc))
                self._set_available(False, now, events, f"nvmlDeviceGetCount failed: {exc}")
                return Collection(self._node_samples(False), events, {"gpus": [], "nvml_available": False})
            self._gpus = [_Gpu(i) for i in range(count)]
        slow = now >= self._nvlink_due  # this cycle also reads NVLink and the energy counter
        if slow:
            self._nvlink_due = now + self._config.nvlink_interval_seconds
        samples: list[Sample] = []
        states: list[GpuState] = []
        jobs = self._attribution.jobs([g.index for g in self._gpus], now) if self._attribution else {}
        processes = self._attribution.processes([g.index for g in self._gpus], now) if self._attribution else {}
        for gpu in self._gpus:
            reading = self._read(backend, gpu, slow)
            self._transition(gpu, reading.health, now, events)
            samples.extend(self._gpu_samples(gpu, reading, slow))
            states.append(self._gpu_state(gpu, reading))
            states[-1].job = jobs.get(gpu.index)
            states[-1].processes = processes.get(gpu.index, ())
            samples.extend(process_samples(gpu.labels, states[-1].processes))
        available = not self._gpus or any(g.health != "unavailable" for g in self._gpus)
        self._set_available(available, now, events, "every NVML call fails: driver or library gone")
        if available and self._config.xid_events and self._worker is None and not self._stop.is_set():
            self._start_worker(backend)
        events.extend(self._drain_xids())
        samples.extend(self._node_samples(available))
        return Collection(samples, events, {"gpus": states, "nvml_available": available})

    def _read(self, backend: GpuBackend, gpu: _Gpu, slow: bool) -> GpuReading:
        if gpu.identity is None:
            try:
                gpu.identify(backend.identity(gpu.index))
            except backend.library_errors as exc:  # a GPU that cannot be named yet: health says why
                self._count_error(backend.error_reason(exc))
                return GpuReading(index=gpu.index, health=backend.health_of(exc) or "unavailable")
        reading = backend.read(gpu.index, slow=slow)
        for _, reason in reading.errors:
            self._count_error(reason)
        # The energy counter is read on the slow cadence (3-12 ms a call on a real H100): between
        # reads its last value stands, as a counter scraped less often would.
        if slow or reading.health != "ok":
            gpu.energy_joules = reading.energy_joules
        else:
            reading.energy_joules = gpu.energy_joules
        return reading

    def _transition(self, gpu: _Gpu, health: str, now: float, events: list[Event]) -> None:
        previous, gpu.health = gpu.health, health
        if health == previous:
            return
        ident = gpu.identity
        log.warning("GPU %d (%s): health %s -> %s", gpu.index, ident.uuid if ident else "?", previous, health)
        if health == "lost":
            events.append(Event(
                kind="gpu_lost", ts=now, urgent=True, gpu=gpu.index, source=self._source,
                uuid=ident.uuid if ident else None, pci_bus_id=ident.pci_bus_id if ident else None,
                message=f"GPU {gpu.index} is lost ({_LOST_ERROR[self._source]}): fell off the bus or hung"))

    def _set_available(self, available: bool, now: float, events: list[Event], why: str) -> None:
        if available == self._nvml_available:
            return
        if not available:
            log.error("NVML unavailable: %s; no GPU samples until it answers again", why)
            events.append(Event(kind="nvml_unavailable", ts=now, source=self._source, message=why))
        self._nvml_available = available

    def _count_error(self, reason: str) -> None:
        self._nvml_errors[reason] = self._nvml_errors.get(reason, 0) + 1

    # --- samples and report --------------------------------------------------------------------

    def _gpu_samples(self, gpu: _Gpu, r: GpuReading, nvlinks_read: bool) -> list[Sample]:
        labels = gpu.labels
        health = gpu.health_samples.get(r.health)
        if health is None:
            health = gpu.health_samples[r.health] = [
                Sample(HEALTH.name, 1.0 if state == r.health else 0.0, (*labels, ("state", state)))
                for state in HEALTH_STATES]
        out = list(health)
        if r.health != "ok":
            gpu.nvlink_samples = []
            gpu.nvlink_state = {}
            gpu.slow_samples = []
            gpu.slow_state = {}
            gpu.block_samples = []
            out.extend(gpu.static_samples[:1])  # keep the identity of a lost GPU visible
            return out
        out.extend(gpu.static_samples)
        _sample_reading(out, r, labels, gpu.labeled)
        mask = r.clock_event_reasons
        if mask is not None:
            reasons = gpu.clock_event_samples.get(mask)
            if reasons is None:
                if len(gpu.clock_event_samples) >= _CLOCK_EVENT_MASKS_KEPT:
                    gpu.clock_event_samples.clear()
                names = set(self._backend.reason_names(mask)) if self._backend else set()
                reasons = gpu.clock_event_samples[mask] = [
                    Sample(CLOCK_EVENT.name, 1.0 if name in names else 0.0, (*labels, pair))
                    for name, pair in self._reason_labels]
            out.extend(reasons)
        if nvlinks_read:
            self._remember_nvlinks(gpu, r)
            if r.xgmi_corrected_errors is not None or r.xgmi_uncorrected_errors is not None:
                # AMD keeps XGMI errors per GPU (RAS block XGMI_WAFL), not per link: they are the
                # link totals (corrected: retried on the link, as NVLink replays; uncorrected: lost,
                # as NVLink recoveries), so the NVLink detector judges XGMI unchanged (docs/amd.md).
                gpu.nvlink_state["nvlink_replay_errors_total"] = r.xgmi_corrected_errors
                gpu.nvlink_state["nvlink_recovery_errors_total"] = r.xgmi_uncorrected_errors
            gpu.block_samples = [
                Sample(ECC_BLOCK_ERRORS.name, float(count), (*gpu.labels, ("block", block), ("error_type", kind)))
                for block, corrected, uncorrected in r.ecc_blocks
                for kind, count in (("corrected", corrected), ("uncorrected", uncorrected))]
            self._remember_slow(gpu, r)
        out.extend(gpu.nvlink_samples)
        out.extend(gpu.slow_samples)
        out.extend(gpu.block_samples)
        action = r.recovery_action
        if action is not None:
            recovery = gpu.recovery_samples.get(action)
            if recovery is None:
                recovery = gpu.recovery_samples[action] = [
                    Sample(RECOVERY_ACTION.name, 1.0 if word == action else 0.0, (*labels, ("action", word)))
                    for word in RECOVERY_ACTIONS]
            out.extend(recovery)
        if r.mig_mode_current is not None:
            out.append(Sample(MIG_MODE.name, 1.0 if r.mig_mode_current else 0.0, labels))
        if r.mig_mode_pending is not None:
            out.append(Sample(MIG_MODE_PENDING.name, 1.0 if r.mig_mode_pending else 0.0, labels))
        for mig in r.mig_devices:
            d = mig.device
            mig_labels = (*labels, ("gpu_instance_id", str(d.gpu_instance_id)),
                          ("compute_instance_id", str(d.compute_instance_id)))
            out.append(Sample(MIG_DEVICE_INFO.name, 1.0, (*mig_labels, ("mig_uuid", d.uuid), ("profile", d.profile))))
            if mig.memory_used_bytes is not None:
                out.append(Sample(MIG_MEMORY_USED.name, float(mig.memory_used_bytes), mig_labels))
            if mig.memory_total_bytes is not None:
                out.append(Sample(MIG_MEMORY_TOTAL.name, float(mig.memory_total_bytes), mig_labels))
        return out

    @staticmethod
    def _remember_slow(gpu: _Gpu, r: GpuReading) -> None:
        """The fabric and PCIe link of this slow read: their state and samples until the next."""
        state = {name: getattr(r, name) for name in _SLOW_FIELDS}
        if state == gpu.slow_state and gpu.slow_samples:
            return  # as they were (a healthy GPU's never move): the same samples
        labels = gpu.labels
        samples: list[Sample] = []
        if r.fabric_state is not None:
            samples.extend(Sample(FABRIC_STATE.name, 1.0 if word == r.fabric_state else 0.0,
                                  (*labels, ("state", word))) for word in FABRIC_STATES)
        for attr, spec in _PCIE_LINK:
            value = state[attr]
            if value is not None:
                samples.append(Sample(spec.name, float(cast(int, value)), labels))
        gpu.slow_state = state
        gpu.slow_samples = samples

    @staticmethod
    def _remember_nvlinks(gpu: _Gpu, r: GpuReading) -> None:
        data = [Sample(NVLINK_DATA.name, float(value), (*gpu.labels, ("direction", direction)))
                for direction, value in (("tx", r.nvlink_data_tx_bytes), ("rx", r.nvlink_data_rx_bytes))
                if value is not None]  # read with the links: held, with them, until the next slow cycle
        memo = gpu.link_memo
        if memo is not None and memo[0] is gpu.labels and memo[1] == r.nvlinks:
            # Links as they were (a healthy GPU's states and error counters rarely move): the same
            # samples and state; only the traffic counters are new.
            gpu.nvlink_samples = memo[2] + data
            gpu.nvlink_state = dict(memo[3])
            return
        samples: list[Sample] = []
        sums = {"crc": 0, "replay": 0, "recovery": 0}
        seen = {"crc": False, "replay": False, "recovery": False}
        down: list[int] = []
        active = 0
        cache = gpu.link_label_cache
        for link in r.nvlinks:
            labels = cache.get(link.link)
            if labels is None:  # 18 links x 4 series per H100: build each label set once
                state_labels = (*gpu.labels, ("link", str(link.link)))
                labels = cache[link.link] = (state_labels, tuple(
                    (*state_labels, ("error_type", kind)) for kind in ("crc", "replay", "recovery")))
            state_labels, (crc_labels, replay_labels, recovery_labels) = labels
            if link.active is not None:
                samples.append(Sample(NVLINK_STATE.name, 1.0 if link.active else 0.0, state_labels))
                if link.active:
                    active += 1
                else:
                    down.append(link.link)
            for kind, value, error_labels in (("crc", link.crc_errors, crc_labels),
                                              ("replay", link.replay_errors, replay_labels),
                                              ("recovery", link.recovery_errors, recovery_labels)):
                if value is not None:
                    samples.append(Sample(NVLINK_ERRORS.name, float(value), error_labels))
                    sums[kind] += value
                    seen[kind] = True
        state: dict[str, int | tuple[int, ...] | None] = {
            "nvlink_crc_errors_total": sums["crc"] if seen["crc"] else None,
            "nvlink_replay_errors_total": sums["replay"] if seen["replay"] else None,
            "nvlink_recovery_errors_total": sums["recovery"] if seen["recovery"] else None,
            "nvlink_links_active": active if r.nvlinks else None,
            "nvlink_links_down": tuple(down),
        }
        gpu.link_memo = (gpu.labels, r.nvlinks, samples, state)
        gpu.nvlink_samples = samples + data
        gpu.nvlink_state = dict(state)

    def _gpu_state(self, gpu: _Gpu, r: GpuReading) -> GpuState:
        ident = gpu.identity
        # The backend's health words are GpuHealth's (the runner checks every state it builds).
        state = GpuState(index=gpu.index, uuid=ident.uuid if ident else "", health=cast(GpuHealth, r.health),
                         name=ident.name if ident else None, pci_bus_id=ident.pci_bus_id if ident else None,
                         vendor=cast(GpuVendor, ident.vendor) if ident else None)
        if r.health != "ok" or ident is None:
            return state
        _copy_state(state, r, ident)
        state.memory_used_bytes = None if r.memory_used_bytes is None else float(r.memory_used_bytes)
        state.memory_total_bytes = None if r.memory_total_bytes is None else float(r.memory_total_bytes)
        if r.clock_event_reasons is not None and self._backend is not None:
            state.clock_event_reasons = tuple(self._backend.reason_names(r.clock_event_reasons))
        for key, value in gpu.nvlink_state.items():
            setattr(state, key, value)
        for key, slow_value in gpu.slow_state.items():
            setattr(state, key, slow_value)
        return state

    def _node_samples(self, available: bool) -> list[Sample]:
        out = [Sample(NVML_AVAILABLE.name, 1.0 if available else 0.0)]
        for reason, count in sorted(self._nvml_errors.items()):
            out.append(Sample(NVML_ERRORS.name, float(count), (("reason", reason),)))
        # One counter a GPU and paged code (~200 on 8 GPUs), none of which moves on a healthy node:
        # the samples built last time stand while the counts and the GPUs' labels are the same.
        gpus = self._gpus or []
        labels_now = tuple(g.labels for g in gpus)
        memo = self._xid_memo
        if memo is None or memo[0] != self._xid_counts or memo[1] != labels_now:
            xid_samples = []
            for (index, code), count in sorted(self._xid_counts.items()):
                labels = labels_now[index] if index < len(labels_now) else (("gpu", str(index)), ("uuid", ""))
                xid_samples.append(Sample(NVML_XID.name, float(count), (*labels, ("code", str(code)))))
            memo = self._xid_memo = (dict(self._xid_counts), labels_now, xid_samples)
        out.extend(memo[2])
        while self._notification_queue:
            note = self._notification_queue.popleft()
            key = (note.index, note.kind)
            self._notification_counts[key] = self._notification_counts.get(key, 0) + 1
            log.warning("GPU %d: amdsmi event %s: %s", note.index, note.kind, note.message)
        for (index, kind), count in sorted(self._notification_counts.items()):
            labels = labels_now[index] if 0 <= index < len(labels_now) else (("gpu", str(index)), ("uuid", ""))
            out.append(Sample(DEVICE_EVENTS.name, float(count), (*labels, ("event", kind))))
        return out

    # --- Xid events ----------------------------------------------------------------------------

    def _start_worker(self, backend: GpuBackend) -> None:
        indices = [g.index for g in self._gpus or () if g.identity is not None]
        if not indices or not backend.open_events(indices):
            return
        for index in indices:  # the paged codes start at 0, so increase() sees their first Xid (xid.py)
            for code in PAGED_XID_CODES:
                self._xid_counts.setdefault((index, code), 0)
        self._worker = threading.Thread(target=self._listen, args=(backend,), name="vigil-nvml-xid", daemon=True)
        self._worker.start()

    def _listen(self, backend: GpuBackend) -> None:
        while not self._stop.is_set():
            try:
                event = backend.wait_xid(self._config.event_wait_ms)
            except backend.library_errors as exc:  # the library went away mid-wait: count, back off, listen on
                self._count_error(backend.error_reason(exc))
                self._stop.wait(1.0)
                continue
            if isinstance(event, GpuNotification):
                self._notification_queue.append(event)
            elif event is not None:
                self._xid_queue.append((self._clock(), event.index, event.code))

    def _drain_xids(self) -> list[Event]:
        events = []
        while self._xid_queue:
            ts, index, code = self._xid_queue.popleft()
            key = (index, code)
            self._xid_counts[key] = self._xid_counts.get(key, 0) + 1
            ident = self._gpus[index].identity if self._gpus and index < len(self._gpus) else None
            events.append(Event(kind="xid", ts=ts, urgent=True, code=code, gpu=index, source="nvml",
                                uuid=ident.uuid if ident else None, pci_bus_id=ident.pci_bus_id if ident else None,
                                message=f"NVML Xid {code} on GPU {index}"))
        return events

    def close(self) -> None:
        self._stop.set()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.join(timeout=self._config.event_wait_ms / 1000.0 + 2.0)
            if self._backend is not None:
                self._backend.close_events()


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = GpuConfig


def build(config: AgentConfig, seams: Seams, resolver: PodResolver | None = None) -> GpuCollector:
    proc_root = Path(config.collectors.gpu.proc_root) if config.collectors.gpu.proc_root else seams.proc_root
    if resolver is None and config.collectors.gpu.pod_name_bundles:
        resolver = BundlePodNames(config.collectors.gpu.pod_name_bundles)
    attribution = ProcessAttribution(seams.nvml, proc_root=proc_root, resolver=resolver,
                                     interval_seconds=config.collectors.gpu.job_attribution_interval_seconds)
    return GpuCollector(config.collectors.gpu, seams.nvml, seams.clock, attribution)
