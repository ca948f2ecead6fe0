"""PynvmlBackend: the only code that calls NVML, over the real pynvml module or FakeNvml.

It reads each GPU's identity once and its dynamic state on demand, converts NVML's units (mW, mJ,
MHz, percent, KB/s, KiB) to base units, turns NotSupported into an absent field (None), maps GPU-level
errors to a health state (lost, reset_required, unavailable) and waits on NVML's Xid event API.
On a GPU in MIG mode it also reads the MIG devices (layout on the slow cadence, memory each read);
on the slow cadence the NVLink fabric registration and the PCIe link, every read the driver's
recovery action; on demand the GPU's configuration facts (config_facts).
It does not emit metrics, keep history or decide anything; the GPU collector does the former.
"""

from __future__ import annotations

import ctypes
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import pynvml
from pynvml import NVMLError

from vigil.agent.nvml.fake import FakeNvml
from vigil.contract.seams import CommandRunner, run_command

if TYPE_CHECKING:
    from vigil.agent.config import NvmlConfig

log = logging.getLogger(__name__)

_MHZ = 1_000_000.0
# nvidia-smi --gpu-reset returns within seconds on a healthy board; past this it is stuck
# (the agent passes node_actions.reset_timeout_seconds).
RESET_TIMEOUT_SECONDS = 60.0
_MIB = 1024 * 1024

# Clock-event (throttle) reason bits, our short name -> pynvml constant name. Bits from NVML's
# nvmlClocksEventReasons (NVML API reference, "Clocks Event Reasons"); HW slowdown is set together
# with its thermal or power-brake cause, as `nvidia-smi -q` nests them.
CLOCK_EVENT_REASONS: tuple[tuple[str, str], ...] = (
    ("gpu_idle", "nvmlClocksEventReasonGpuIdle"),
    ("applications_clocks_setting", "nvmlClocksEventReasonApplicationsClocksSetting"),
    ("sw_power_cap", "nvmlClocksEventReasonSwPowerCap"),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown"),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost"),
    ("sw_thermal_slowdown", "nvmlClocksEventReasonSwThermalSlowdown"),
    ("hw_thermal_slowdown", "nvmlClocksEventReasonHwThermalSlowdown"),
    ("hw_power_brake_slowdown", "nvmlClocksEventReasonHwPowerBrakeSlowdown"),
    ("display_clock_setting", "nvmlClocksEventReasonDisplayClockSetting"),
)

# GPM metrics read each cycle: GpuReading field <- pynvml constant. NVML API reference, "GPM Enums"
# (nvmlGpmMetricId_t, https://docs.nvidia.com/deploy/nvml-api/group__nvmlGpmEnums.html) and
# pynvml's NVML_GPM_METRIC_* comments: the *_UTIL metrics are percent 0.0-100.0, the *_PER_SEC
# metrics MiB/s; the backend converts them to a 0..1 ratio and bytes per second.
GPM_PERCENT_METRICS: tuple[tuple[str, str], ...] = (
    ("graphics_active_ratio", "NVML_GPM_METRIC_GRAPHICS_UTIL"),
    ("sm_active_ratio", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy_ratio", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active_ratio", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("dram_active_ratio", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
    ("fp16_active_ratio", "NVML_GPM_METRIC_FP16_UTIL"),
    ("fp32_active_ratio", "NVML_GPM_METRIC_FP32_UTIL"),
    ("fp64_active_ratio", "NVML_GPM_METRIC_FP64_UTIL"),
)
# PCIe throughput, too: over the whole interval, where nvmlDeviceGetPcieThroughput samples 20 ms and
# blocks for them (21 ms a call on a real H100, tests/fixtures/nvml-real/costs-before-pcie-fix.json:
# two calls a GPU, 0.34 s of every cycle on an 8-GPU node). On a GPU with GPM the backend
# therefore never calls it.
GPM_MIB_PER_SECOND_METRICS: tuple[tuple[str, str], ...] = (
    ("pcie_tx_bytes_per_second", "NVML_GPM_METRIC_PCIE_TX_PER_SEC"),
    ("pcie_rx_bytes_per_second", "NVML_GPM_METRIC_PCIE_RX_PER_SEC"),
    ("nvlink_tx_bytes_per_second", "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC"),
    ("nvlink_rx_bytes_per_second", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC"),
)

# NVLink payload counters (protocol overhead excluded), KiB since the driver loaded: nvml.h, "NVLink
# throughput counters field values" (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, R450+). scopeId names
# one link, or UINT_MAX for the sum over all links, which is what the backend asks (and what DCGM
# asks for DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL: dcgmlib/src/DcgmCacheManager.cpp,
# ReadAndCacheNvLinkBandwidth). A GPU without NVLink is never asked.
NVLINK_ALL_LINKS = 0xFFFFFFFF
_KIB = 1024

NVLINK_ERROR_COUNTERS: tuple[tuple[str, str], ...] = (
    ("crc", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
)


# NVLink fabric (NVSwitch systems, Hopper and later): Fabric Manager's registration state,
# nvmlGpuFabricState_t (nvml.h: NVML_GPU_FABRIC_STATE_NOT_SUPPORTED 0, _NOT_STARTED 1, _IN_PROGRESS 2,
# _COMPLETED 3) -> the wire's FabricState; NOT_SUPPORTED is no fabric (None).
FABRIC_STATES: tuple[tuple[str, str], ...] = (
    ("not_started", "NVML_GPU_FABRIC_STATE_NOT_STARTED"),
    ("in_progress", "NVML_GPU_FABRIC_STATE_IN_PROGRESS"),
    ("completed", "NVML_GPU_FABRIC_STATE_COMPLETED"),
)
# The health mask of nvmlGpuFabricInfo_v2_t (nvmlDeviceGetGpuFabricInfoV only): 2-bit fields, each
# NOT_SUPPORTED 0, TRUE 1, FALSE 2, at the shifts nvml.h gives (NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_*
# 0/2/4/6 and _WIDTH_* 0x3, as pynvml 13.615 carries them): our word <- the field's name in those
# constants. A condition is reported only when its field says TRUE.
FABRIC_HEALTH_CONDITIONS: tuple[tuple[str, str], ...] = (
    ("degraded_bandwidth", "DEGRADED_BW"),
    ("route_recovery", "ROUTE_RECOVERY"),
    ("route_unhealthy", "ROUTE_UNHEALTHY"),
    ("access_timeout_recovery", "ACCESS_TIMEOUT_RECOVERY"),
)
# The driver's recovery action after an error: field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230 in
# nvml.h and pynvml 13.615), values nvmlDeviceGpuRecoveryAction_t -> the wire's RecoveryAction. nvml.h
# of newer drivers adds RECOVER_IMEX_DOMAIN (5), BUS_RESET (6) and SYSTEM_REBOOT (7), which the wire
# has no word for: such a value is counted as an error (recovery_action_<n>) and the field left absent.
RECOVERY_ACTIONS: tuple[tuple[str, str], ...] = (
    ("none", "NVML_GPU_RECOVERY_ACTION_NONE"),
    ("gpu_reset", "NVML_GPU_RECOVERY_ACTION_GPU_RESET"),
    ("node_reboot", "NVML_GPU_RECOVERY_ACTION_NODE_REBOOT"),
    ("drain_p2p", "NVML_GPU_RECOVERY_ACTION_DRAIN_P2P"),
    ("drain_and_reset", "NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET"),
)
RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, for a pynvml too old to name it

# NVML return codes by value -> their names in nvml.h ("NVML_ERROR_TIMEOUT"): a fabric registration's
# error status is reported by name.
_RETURN_NAMES: dict[int, str] = {int(getattr(pynvml, n)): n for n in dir(pynvml) if n.startswith("NVML_ERROR_")}

_CONSTANTS = (
    "NVML_CLOCK_SM", "NVML_CLOCK_MEM", "NVML_TEMPERATURE_GPU", "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC", "NVML_AGGREGATE_ECC",
    "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
    "NVML_PCIE_UTIL_TX_BYTES", "NVML_PCIE_UTIL_RX_BYTES", "NVML_FI_DEV_MEMORY_TEMP", "NVML_SUCCESS",
    "NVML_ERROR_NOT_SUPPORTED", "NVML_FEATURE_ENABLED", "NVML_GPM_METRICS_GET_VERSION", "nvmlMemory_v2",
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
    "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED",
)


def error_reason(exc: BaseException) -> str:
    """NVMLError_GpuIsLost -> "gpu_is_lost": the `reason` label of error counters."""
    name = type(exc).__name__.removeprefix("NVMLError_")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower() or "unknown"


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """What does not change while the driver is loaded: read once per GPU."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str  # as NVML gives it, e.g. "00000000:3B:00.0"
    serial: str | None
    vbios_version: str | None
    driver_version: str | None
    cuda_driver_version: str | None  # "12.2"
    memory_total_bytes: int | None
    sm_clock_max_hertz: float | None
    memory_clock_max_hertz: float | None
    slowdown_temperature_celsius: float | None
    shutdown_temperature_celsius: float | None
    gpu_max_temperature_celsius: float | None
    memory_max_temperature_celsius: float | None
    nvlinks: tuple[int, ...]  # link numbers NVML answers for (XGMI links on AMD)
    vendor: str = "nvidia"  # "amd" from AmdSmiBackend (agent/gpu_backend.py Vendor)


@dataclass(frozen=True, slots=True)
class GpuConfigFacts:
    """How one GPU is configured: what every GPU of a job should have alike (the node_config
    collector turns them into NodeConfig). Read on demand, never cached: an administrator may change
    persistence, ECC (pending a reset), the power limit or application clocks at any time. A fact is
    None when NVML says NotSupported or the call failed (then ``errors`` names why); on a GPU that
    is lost or needs a reset every fact is None and ``health`` says so."""

    index: int
    health: str = "ok"  # ok | lost | reset_required | unavailable
    driver_version: str | None = None  # nvmlSystemGetDriverVersion: "535.161.08"
    cuda_driver_version: str | None = None  # nvmlSystemGetCudaDriverVersion: "12.2"
    vbios_version: str | None = None  # nvmlDeviceGetVbiosVersion: "96.00.74.00.0D"
    inforom_image_version: str | None = None  # nvmlDeviceGetInforomImageVersion: "G520.0200.00.05"
    ecc_mode_current: bool | None = None  # nvmlDeviceGetEccMode, current (a change waits for a reset)
    persistence_mode: bool | None = None  # nvmlDeviceGetPersistenceMode
    mig_mode_current: bool | None = None  # nvmlDeviceGetMigMode, current
    power_limit_watts: float | None = None  # nvmlDeviceGetEnforcedPowerLimit (mW)
    application_sm_clock_hertz: float | None = None  # nvmlDeviceGetApplicationsClock(NVML_CLOCK_SM), MHz
    application_memory_clock_hertz: float | None = None  # nvmlDeviceGetApplicationsClock(NVML_CLOCK_MEM)
    errors: tuple[tuple[str, str], ...] = ()  # (query, reason) of each call that failed


# A MIG device's name carries its GPU instance profile: "NVIDIA A100-SXM4-40GB MIG 1g.5gb" (nvidia-smi -L
# prints the same "MIG 1g.5gb Device 0"). Read from the name, one call per device, rather than through
# nvmlGpuInstanceGetInfo + nvmlDeviceGetGpuInstanceProfileInfo (a GPU instance handle and a versioned
# struct per device) for the same string.
_MIG_PROFILE = re.compile(r"\bMIG (\S+)\s*$")


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device of a physical GPU: its identity, which changes only when an administrator
    reconfigures the GPU's instances (read on the slow cadence)."""

    slot: int  # the index nvmlDeviceGetMigDeviceHandleByIndex answered for
    uuid: str  # "MIG-..."
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # GPU instance profile, e.g. "1g.10gb"; "" when the name carries none


@dataclass(frozen=True, slots=True)
class MigDeviceReading:
    device: MigDevice
    # The instance's own memory (nvmlDeviceGetMemoryInfo on the MIG handle, v1: `used` counts the
    # instance's reserve); None when the call failed.
    memory_used_bytes: int | None
    memory_total_bytes: int | None


@dataclass(frozen=True, slots=True)
class NvLinkReading:
    link: int
    active: bool | None
    crc_errors: int | None
    replay_errors: int | None
    recovery_errors: int | None


@dataclass(slots=True)
class GpuReading:
    """One GPU's dynamic state. None: NVML does not report it on this device (NotSupported) or
    the read failed (then ``errors`` names why); every field is None unless health is ok."""

    index: int
    health: str = "ok"  # ok | lost | reset_required | unavailable (agent.wire.GpuHealth)
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    # Video engines' busy share over NVML's own sampling period (nvmlDevice{En,De}coderUtilization).
    # Boards without the engine may still answer 0 (the recorded H100 has no NVENC: "Encoder: 0 %").
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    # Allocated plus reserved, as NVML's v1 memory info defines `used` (nvmlMemory_t: "Sum of
    # Reserved and Allocated device memory"), whichever version answered.
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    # Device memory the driver and firmware set aside (nvmlMemory_v2_t.reserved, driver R510+; absent
    # where only v1 answers). nvidia-smi and DCGM count it apart from "Used".
    memory_reserved_bytes: int | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    performance_state: int | None = None
    clock_event_reasons: int | None = None  # NVML bitmask; decode with PynvmlBackend.reason_names
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    pcie_replay_total: int | None = None
    # From GPM over the interval where the GPU has it (Hopper and later; absent in the first read
    # then), else nvmlDeviceGetPcieThroughput's 20 ms sample.
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    fan_speed_ratio: float | None = None
    # GPM (Hopper and later), averaged over the interval since the previous read(): None on older
    # GPUs and on the first read, which only takes the first sample of the pair.
    graphics_active_ratio: float | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    fp16_active_ratio: float | None = None
    fp32_active_ratio: float | None = None
    fp64_active_ratio: float | None = None
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None
    nvlinks: tuple[NvLinkReading, ...] = ()
    # NVLink payload bytes over all links since the driver loaded (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_*,
    # KiB converted to bytes): read with the links (slow=True) on GPUs that have NVLink, else None.
    nvlink_data_tx_bytes: int | None = None
    nvlink_data_rx_bytes: int | None = None
    # MIG mode (nvmlDeviceGetMigMode), current and pending (an admin's change waits for a GPU reset):
    # None where the GPU has no MIG (before Ampere: NotSupported). Re-read on the slow cadence.
    mig_mode_current: bool | None = None
    mig_mode_pending: bool | None = None
    # With MIG on: each MIG device, the layout as of the last slow read, its memory read now.
    mig_devices: tuple[MigDeviceReading, ...] = ()
    # NVLink fabric (nvmlDeviceGetGpuFabricInfoV, else nvmlDeviceGetGpuFabricInfo), read with the links
    # (slow=True): the registration state (None: no NVSwitch fabric), its error status by name when
    # it completed with one, the clique and cluster (set on multi-node NVLink systems only: None while
    # the cluster UUID is all zero) and the health mask's TRUE conditions (FABRIC_HEALTH_CONDITIONS).
    fabric_state: str | None = None
    fabric_status: str | None = None
    fabric_clique_id: int | None = None
    fabric_cluster_uuid: str | None = None
    fabric_health: tuple[str, ...] = ()
    # The PCIe link as trained now and the most GPU and slot allow (slow=True only).
    pcie_link_generation: int | None = None
    pcie_link_generation_max: int | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    # The driver's recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), read every cycle in the same
    # nvmlDeviceGetFieldValues call as the HBM temperature; None where the driver predates it.
    recovery_action: str | None = None
    # AMD only (AmdSmiBackend; None from NVML): deferred (poisoned, not yet consumed) ECC errors; the
    # XGMI links' RAS counts (block XGMI_WAFL), which amdsmi keeps per GPU, not per link (the link
    # totals of the report come from them); the junction's edge sensor; ECC counts per RAS block
    # ((block, corrected, uncorrected), slow cadence).
    ecc_deferred_volatile: int | None = None
    xgmi_corrected_errors: int | None = None
    xgmi_uncorrected_errors: int | None = None
    edge_temperature_celsius: float | None = None
    ecc_blocks: tuple[tuple[str, int, int], ...] = ()
    # NVML errors other than NotSupported met during this read: (query, reason).
    errors: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class XidEvent:
    index: int
    code: int


class _HealthError(Exception):
    def __init__(self, health: str, reason: str) -> None:
        super().__init__(health)
        self.health = health
        self.reason = reason


class _Functions(dict[str, Callable[..., Any]]):
    """The functions of an nvml module by name, each looked up once, when first asked for (a name
    the module lacks raises AttributeError then, as getattr would)."""

    def __init__(self, nvml: Any) -> None:
        super().__init__()
        self._nvml = nvml

    def __missing__(self, name: str) -> Callable[..., Any]:
        function: Callable[..., Any] = getattr(self._nvml, name)
        self[name] = function
        return function


class PynvmlBackend:
    """NVML for the agent. ``nvml`` is the pynvml module or a FakeNvml (same names, same units)."""

    vendor: Literal["nvidia"] = "nvidia"  # agent.gpu_backend.GpuBackend
    reason_words: tuple[str, ...] = tuple(name for name, _ in CLOCK_EVENT_REASONS)

    def __init__(self, nvml: ModuleType | FakeNvml, run: CommandRunner | None = None) -> None:
        self._nvml: Any = nvml
        # nvml's functions by name, each looked up on first use (about 30 _query calls a GPU read).
        self._functions = _Functions(nvml)
        # Runs nvidia-smi for reset_gpu: the real command, or over FakeNvml its imitation, so that a
        # fake GPU is never reset by a real nvidia-smi and a scenario sees the reset.
        self._run: CommandRunner = run or (nvml.nvidia_smi if isinstance(nvml, FakeNvml) else run_command)
        self._error = nvml.NVMLError
        self._not_supported = nvml.NVMLError_NotSupported
        self._timeout = nvml.NVMLError_Timeout
        self._health_of: tuple[tuple[type[BaseException], str], ...] = (
            (nvml.NVMLError_GpuIsLost, "lost"),
            (nvml.NVMLError_ResetRequired, "reset_required"),
            (nvml.NVMLError_Uninitialized, "unavailable"),
            (nvml.NVMLError_LibraryNotFound, "unavailable"),
            (nvml.NVMLError_DriverNotLoaded, "unavailable"),
        )
        self._health_errors = tuple(cls for cls, _ in self._health_of)
        self._reason_bits = tuple((name, int(getattr(nvml, const))) for name, const in CLOCK_EVENT_REASONS)
        self._nvlink_counters = tuple(int(getattr(nvml, const)) for _, const in NVLINK_ERROR_COUNTERS)
        # Per GPU: the values its links read last time and the NvLinkReadings made of them.
        self._nvlinks_last: dict[int, tuple[tuple[tuple[Any, ...], ...], tuple[NvLinkReading, ...]]] = {}
        # Constants looked up once: FakeNvml serves them through __getattr__, which is slow.
        self._c: dict[str, Any] = {name: getattr(nvml, name) for name in _CONSTANTS}
        self._value_members = _value_members(nvml)
        self._handles: dict[int, Any] = {}
        self._identities: dict[int, GpuIdentity] = {}
        # Queries a device answered NotSupported: a device capability, so never asked again.
        self._unsupported: dict[int, set[str]] = {}
        self._event_set: Any = None
        # GPM: per GPU whether the device supports it (asked once), and the sample taken by the
        # previous read(), the first of the next pair; freed when replaced or on shutdown.
        self._gpm_supported: dict[int, bool] = {}
        self._gpm_previous: dict[int, Any] = {}
        self._gpm_request: Any = None
        self._gpm_ids = tuple((attr, int(getattr(nvml, const)), 0.01)
                              for attr, const in GPM_PERCENT_METRICS) + tuple(
            (attr, int(getattr(nvml, const)), float(_MIB)) for attr, const in GPM_MIB_PER_SECOND_METRICS)
        self._gpm_function_missing: tuple[type[BaseException], ...] = tuple(
            cls for cls in (getattr(nvml, "NVMLError_FunctionNotFound", None),) if isinstance(cls, type))
        # GPUs whose driver refused nvmlDeviceGetMemoryInfo_v2 (before R510: no such function, or an
        # unknown struct version): asked with v1 from then on.
        self._memory_v1: set[int] = set()
        # MIG, per GPU as of its last slow read: (current, pending) mode, and each MIG device with
        # its handle. An empty slot answers NotFound; a GPU without MIG answers NotSupported.
        self._mig_mode: dict[int, tuple[bool, bool]] = {}
        self._mig_devices: dict[int, tuple[tuple[Any, MigDevice], ...]] = {}
        self._not_found = nvml.NVMLError_NotFound
        # Fabric, PCIe link and recovery action (issue 44): NVML's values -> our words, looked up once.
        self._fabric_states = {int(getattr(nvml, const)): word for word, const in FABRIC_STATES}
        self._fabric_health = tuple(
            (word, int(getattr(nvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{name}")),
             int(getattr(nvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{name}")),
             int(getattr(nvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{name}_TRUE")))
            for word, name in FABRIC_HEALTH_CONDITIONS)
        self._recovery_actions = {int(getattr(nvml, const)): word for word, const in RECOVERY_ACTIONS}
        self._recovery_field = int(getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", RECOVERY_ACTION_FIELD))
        # The two nvmlDeviceGetFieldValues asks of a read, with their keys in _unsupported made once.
        self._memory_temperature_and_recovery = self._field_ask(
            (self._c["NVML_FI_DEV_MEMORY_TEMP"], self._recovery_field))
        self._nvlink_data = self._field_ask(((self._c["NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"], NVLINK_ALL_LINKS),
                                             (self._c["NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"], NVLINK_ALL_LINKS)))
        # GPUs whose driver has no nvmlDeviceGetGpuFabricInfoV (FunctionNotFound: older drivers) or refuses
        # its v2 struct: asked with nvmlDeviceGetGpuFabricInfo (no health mask) from then on.
        self._fabric_v1: set[int] = set()
        self._fabric_v2_refused: tuple[type[BaseException], ...] = (
            *self._gpm_function_missing, nvml.NVMLError_ArgumentVersionMismatch)
        self._memory_v2_refused: tuple[type[BaseException], ...] = (
            *self._gpm_function_missing, nvml.NVMLError_ArgumentVersionMismatch, self._not_supported)

    # --- library -------------------------------------------------------------------------------


    @property
    def library(self) -> Any:
        """The module this backend calls: pynvml, or the FakeNvml a test or scenario gave it (the
        probes' fake engine couples its load to that fake)."""
        return self._nvml

    @property
    def library_errors(self) -> tuple[type[BaseException], ...]:
        return (self._error,)

    @staticmethod
    def error_reason(exc: BaseException) -> str:
        return error_reason(exc)

    def init(self) -> None:
        self._nvml.nvmlInit()

    def shutdown(self) -> None:
        self.close_events()
        for index in list(self._gpm_previous):
            self._gpm_free(self._gpm_previous.pop(index))
        try:
            self._nvml.nvmlShutdown()
        except self._error as exc:
            log.warning("nvmlShutdown failed: %s", exc)

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def reason_names(self, mask: int) -> list[str]:
        return [name for name, bit in self._reason_bits if mask & bit]

    def health_of(self, exc: BaseException) -> str | None:
        for cls, health in self._health_of:
            if isinstance(exc, cls):
                return health
        return None

    # --- one query -----------------------------------------------------------------------------

    def _query(self, index: int, errors: list[tuple[str, str]], name: str, *args: Any) -> Any:
        """One NVML call: NotSupported -> None (remembered), health errors raise, others -> None."""
        if name in self._unsupported[index]:
            return None
        try:
            return self._functions[name](*args)
        except self._error as exc:
            return self._failed(index, errors, name, exc)

    def _failed(self, index: int, errors: list[tuple[str, str]], name: str, exc: BaseException) -> None:
        """What a failed call means (_query's rules): NotSupported, or FunctionNotFound (a driver
        without the function: nvmlDeviceGetApplicationsClock is to go with CUDA 14, pynvml says), is
        remembered (never asked again), a health error raises _HealthError, any other is counted in
        ``errors``."""
        if isinstance(exc, (self._not_supported, *self._gpm_function_missing)):
            self._unsupported[index].add(name)
            return None
        if isinstance(exc, self._health_errors):
            raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
        errors.append((name, error_reason(exc)))
        return None

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            except self._health_errors as exc:
                raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
            self._handles[index] = handle
            self._unsupported.setdefault(index, set())
        return handle

    # --- identity ------------------------------------------------------------------------------

    def identity(self, index: int) -> GpuIdentity:
        """The GPU's identity and static limits, cached. Raises the NVMLError of a GPU that cannot
        be identified (lost, reset required, NVML gone); the caller reports it and retries."""
        cached = self._identities.get(index)
        if cached is not None:
            return cached
        try:
            ident = self._read_identity(index)
        except _HealthError as exc:
            raise exc.__cause__ or exc from None
        self._identities[index] = ident
        return ident

    def _read_identity(self, index: int) -> GpuIdentity:
        nvml = self._nvml
        h = self._handle(index)
        errors: list[tuple[str, str]] = []
        q = self._query
        uuid = q(index, errors, "nvmlDeviceGetUUID", h)
        if not uuid:
            raise nvml.NVMLError_Unknown()  # a GPU without a UUID cannot be named in any series
        pci = q(index, errors, "nvmlDeviceGetPciInfo", h)
        cuda = q(index, errors, "nvmlSystemGetCudaDriverVersion")
        memory = q(index, errors, "nvmlDeviceGetMemoryInfo", h)
        sm_max = q(index, errors, "nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_SM)
        mem_max = q(index, errors, "nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_MEM)

        def threshold(which: int) -> float | None:
            value = q(index, errors, "nvmlDeviceGetTemperatureThreshold", h, which)
            return None if value is None else float(value)

        links = []
        for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
            try:
                nvml.nvmlDeviceGetNvLinkState(h, link)
            except self._health_errors:
                raise
            except self._error:
                continue  # NotSupported / InvalidArgument: no such link on this board
            links.append(link)
        return GpuIdentity(
            index=index,
            uuid=str(uuid),
            name=str(q(index, errors, "nvmlDeviceGetName", h) or ""),
            pci_bus_id=str(pci.busId) if pci is not None else "",
            serial=q(index, errors, "nvmlDeviceGetSerial", h),
            vbios_version=q(index, errors, "nvmlDeviceGetVbiosVersion", h),
            driver_version=q(index, errors, "nvmlSystemGetDriverVersion"),
            cuda_driver_version=None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
            memory_total_bytes=None if memory is None else int(memory.total),
            sm_clock_max_hertz=None if sm_max is None else sm_max * _MHZ,
            memory_clock_max_hertz=None if mem_max is None else mem_max * _MHZ,
            slowdown_temperature_celsius=threshold(nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            shutdown_temperature_celsius=threshold(nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            gpu_max_temperature_celsius=threshold(nvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
            memory_max_temperature_celsius=threshold(nvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
            nvlinks=tuple(links),
        )

    # --- dynamic state -------------------------------------------------------------------------

    def running_processes(self, index: int) -> list[Any] | None:
        """The compute processes on the GPU as nvmlDeviceGetComputeRunningProcesses lists them
        (``pid``, ``usedGpuMemory`` and, on a GPU in MIG mode, the ``gpuInstanceId`` and
        ``computeInstanceId`` of the MIG device each runs in), or None when NVML cannot say (the GPU
        is unhealthy, the call failed or is not supported)."""
        try:
            h = self._handle(index)
            procs = self._query(index, [], "nvmlDeviceGetComputeRunningProcesses", h)
        except (_HealthError, self._error):
            return None
        return None if procs is None else list(procs)

    def running_pids(self, index: int) -> list[int] | None:
        """PIDs of the compute processes on the GPU, or None when NVML cannot say."""
        procs = self.running_processes(index)
        if procs is None:
            return None
        return [int(p.pid) for p in procs if getattr(p, "pid", None)]

    def read(self, index: int, *, slow: bool = True) -> GpuReading:
        """The GPU's dynamic state now. Never raises for an NVML error: a lost GPU, one that needs
        a reset or an NVML that went away is a reading with that health and no values. With
        ``slow=False`` the queries the collector paces slower are left out: NVLink (``nvlinks ==
        ()`` and no payload counters; 4 queries per link, 18 links on Hopper, most of a cycle's NVML
        calls) and the energy
        counter (``energy_joules`` None; 3-12 ms a call on a real H100, half of a read's NVML time:
        tests/fixtures/nvml-real/nvml-recording.json)."""
        reading = GpuReading(index=index)
        try:
            self._read_into(index, reading, slow)
            self._read_gpm(index, reading)
        except _HealthError as exc:
            previous = self._gpm_previous.pop(index, None)  # a pair must not span a lost GPU
            if previous is not None:
                self._gpm_free(previous)
            return GpuReading(index=index, health=exc.health, errors=[("device", exc.reason)])
        return reading

    # --- GPM -----------------------------------------------------------------------------------

    def _gpm_free(self, sample: Any) -> None:
        try:
            self._nvml.nvmlGpmSampleFree(sample)
        except self._error as exc:
            log.warning("nvmlGpmSampleFree failed: %s", exc)

    def _gpm_call(self, index: int, errors: list[tuple[str, str]], name: str, *args: Any) -> bool:
        """One GPM call: False when it failed (NotSupported: the device never asked again)."""
        try:
            self._functions[name](*args)
        except self._gpm_function_missing:
            self._gpm_supported[index] = False  # a driver older than GPM (R520)
            return False
        except self._not_supported:
            self._gpm_supported[index] = False
            return False
        except self._health_errors as exc:
            raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
        except self._error as exc:
            errors.append((name, error_reason(exc)))
            return False
        return True

    def _gpm_support(self, index: int, h: Any) -> bool:
        supported = self._gpm_supported.get(index)
        if supported is None:
            try:
                support = self._nvml.nvmlGpmQueryDeviceSupport(h)
                supported = bool(support.isSupportedDevice)
            except self._health_errors as exc:
                raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
            except self._error:  # NotSupported, FunctionNotFound (driver before R520), ...
                supported = False
            self._gpm_supported[index] = supported
        return supported

    def _read_gpm(self, index: int, r: GpuReading) -> None:
        """Take this cycle's GPM sample; with the previous cycle's, fill the GPM fields. The pair
        spans the time between two read() calls: the collector's interval."""
        h = self._handle(index)
        if not self._gpm_support(index, h):
            return
        nvml, e = self._nvml, r.errors
        try:
            sample = nvml.nvmlGpmSampleAlloc()
        except self._health_errors as exc:
            raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
        except self._error as exc:
            e.append(("nvmlGpmSampleAlloc", error_reason(exc)))
            return
        try:
            taken = self._gpm_call(index, e, "nvmlGpmSampleGet", h, sample)
        except _HealthError:
            self._gpm_free(sample)
            raise
        if not taken:
            self._gpm_free(sample)
            return
        previous = self._gpm_previous.pop(index, None)
        self._gpm_previous[index] = sample
        if previous is None:
            return  # the first sample of the first pair: no interval yet, so no values (absent)
        request = self._gpm_request
        if request is None:  # one request buffer (~19 KB: room for every metric id), reused
            request = self._gpm_request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = self._c["NVML_GPM_METRICS_GET_VERSION"]
            request.numMetrics = len(self._gpm_ids)
            # The ids are the call's input and nvmlGpmMetricsGet writes only each metric's value,
            # nvmlReturn and metricInfo: set once with the buffer (pynvml's __setattr__ is slow).
            ids = request.metrics
            for i, (_, metric_id, _) in enumerate(self._gpm_ids):
                ids[i].metricId = metric_id
        slots = request.metrics  # one attribute lookup: pynvml structs wrap __getattribute__
        try:
            # Pointers, set as ctypes sets them: pynvml's __setattr__ only encodes a str.
            _set_field(request, "sample1", previous)
            _set_field(request, "sample2", sample)
            if not self._gpm_call(index, e, "nvmlGpmMetricsGet", request):
                return
        finally:
            self._gpm_free(previous)
        success = self._c["NVML_SUCCESS"]
        for metric, (attr, _, scale) in zip(slots[:len(self._gpm_ids)], self._gpm_ids, strict=True):
            if _numeric_field(metric, "nvmlReturn") == success:
                value = max(float(_numeric_field(metric, "value")), 0.0) * scale
                # A percentage may overshoot 100 by rounding in the driver; a ratio stays in 0..1.
                setattr(r, attr, min(value, 1.0) if scale < 1.0 else value)

    def _read_into(self, index: int, r: GpuReading, slow: bool) -> None:
        c = self._c
        h = self._handle(index)
        e = r.errors
        q = self._query
        util = q(index, e, "nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            r.utilization_gpu_ratio = _numeric_field(util, "gpu") / 100.0
            r.utilization_memory_ratio = _numeric_field(util, "memory") / 100.0
        encoder = q(index, e, "nvmlDeviceGetEncoderUtilization", h)  # [percent, sampling period us]
        r.encoder_utilization_ratio = None if encoder is None else encoder[0] / 100.0
        decoder = q(index, e, "nvmlDeviceGetDecoderUtilization", h)
        r.decoder_utilization_ratio = None if decoder is None else decoder[0] / 100.0
        self._read_memory(index, e, h, r)
        sm = q(index, e, "nvmlDeviceGetClockInfo", h, c["NVML_CLOCK_SM"])
        r.sm_clock_hertz = None if sm is None else sm * _MHZ
        mem_clock = q(index, e, "nvmlDeviceGetClockInfo", h, c["NVML_CLOCK_MEM"])
        r.memory_clock_hertz = None if mem_clock is None else mem_clock * _MHZ
        temp = q(index, e, "nvmlDeviceGetTemperature", h, c["NVML_TEMPERATURE_GPU"])
        r.temperature_celsius = None if temp is None else float(temp)
        temp_memory, action = self._field_values(index, e, h, self._memory_temperature_and_recovery)
        r.memory_temperature_celsius = temp_memory
        r.recovery_action = None if action is None else self._recovery_action(e, int(action))
        power = q(index, e, "nvmlDeviceGetPowerUsage", h)
        r.power_watts = None if power is None else power / 1000.0
        limit = q(index, e, "nvmlDeviceGetEnforcedPowerLimit", h)
        r.power_limit_watts = None if limit is None else limit / 1000.0
        energy = q(index, e, "nvmlDeviceGetTotalEnergyConsumption", h) if slow else None
        r.energy_joules = None if energy is None else energy / 1000.0
        r.performance_state = q(index, e, "nvmlDeviceGetPerformanceState", h)
        r.clock_event_reasons = q(index, e, "nvmlDeviceGetCurrentClocksEventReasons", h)
        corrected, uncorrected = c["NVML_MEMORY_ERROR_TYPE_CORRECTED"], c["NVML_MEMORY_ERROR_TYPE_UNCORRECTED"]
        volatile, aggregate = c["NVML_VOLATILE_ECC"], c["NVML_AGGREGATE_ECC"]
        r.ecc_corrected_volatile = q(index, e, "nvmlDeviceGetTotalEccErrors", h, corrected, volatile)
        r.ecc_uncorrected_volatile = q(index, e, "nvmlDeviceGetTotalEccErrors", h, uncorrected, volatile)
        r.ecc_corrected_aggregate = q(index, e, "nvmlDeviceGetTotalEccErrors", h, corrected, aggregate)
        r.ecc_uncorrected_aggregate = q(index, e, "nvmlDeviceGetTotalEccErrors", h, uncorrected, aggregate)
        sbe = q(index, e, "nvmlDeviceGetRetiredPages", h,
                c["NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"])
        r.retired_pages_sbe = None if sbe is None else len(sbe)
        dbe = q(index, e, "nvmlDeviceGetRetiredPages", h, c["NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"])
        r.retired_pages_dbe = None if dbe is None else len(dbe)
        pending = q(index, e, "nvmlDeviceGetRetiredPagesPendingStatus", h)
        r.retired_pages_pending = None if pending is None else bool(pending)
        rows = q(index, e, "nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            r.remapped_rows_correctable, r.remapped_rows_uncorrectable = int(rows[0]), int(rows[1])
            r.remap_pending, r.remap_failure = bool(rows[2]), bool(rows[3])
        r.pcie_replay_total = q(index, e, "nvmlDeviceGetPcieReplayCounter", h)
        if not self._gpm_support(index, h):  # with GPM, _read_gpm fills these over the interval
            tx = q(index, e, "nvmlDeviceGetPcieThroughput", h, c["NVML_PCIE_UTIL_TX_BYTES"])
            r.pcie_tx_bytes_per_second = None if tx is None else tx * 1000.0  # NVML reports KB/s
            rx = q(index, e, "nvmlDeviceGetPcieThroughput", h, c["NVML_PCIE_UTIL_RX_BYTES"])
            r.pcie_rx_bytes_per_second = None if rx is None else rx * 1000.0
        fan = q(index, e, "nvmlDeviceGetFanSpeed", h)
        r.fan_speed_ratio = None if fan is None else fan / 100.0
        ident = self._identities.get(index)
        if slow and ident is not None and ident.nvlinks:
            r.nvlinks = self._read_nvlinks(index, e, h, ident.nvlinks)
            tx, rx = self._field_values(index, e, h, self._nvlink_data)
            r.nvlink_data_tx_bytes = None if tx is None else int(tx) * _KIB
            r.nvlink_data_rx_bytes = None if rx is None else int(rx) * _KIB
        if slow:
            self._read_mig_layout(index, e, h)
            self._read_fabric(index, e, h, r)
            self._read_pcie_link(index, e, h, r)
        self._read_mig(index, e, r)

    # --- MIG -----------------------------------------------------------------------------------

    def _read_mig_layout(self, index: int, errors: list[tuple[str, str]], h: Any) -> None:
        """MIG mode and, when it is on, the MIG devices: the slot, UUID, instance ids and profile of
        each. Empty slots (NotFound) are skipped; a device whose identity cannot be read is left out
        and its error counted."""
        mode = self._query(index, errors, "nvmlDeviceGetMigMode", h)  # [current, pending]
        if mode is None:
            if "nvmlDeviceGetMigMode" in self._unsupported[index]:  # no MIG on this GPU
                self._mig_mode.pop(index, None)
                self._mig_devices.pop(index, None)
            return  # the call failed (counted): the last layout stands until the next slow read
        current, pending = bool(mode[0]), bool(mode[1])
        previous = self._mig_mode.get(index)
        if previous is not None and previous[0] != current:
            # A reset applied a MIG mode change: what the GPU answers NotSupported depends on the
            # mode (its utilisation is N/A in MIG mode), so every query is asked again.
            log.info("GPU %d: MIG mode now %s; NVML capabilities asked again", index, "on" if current else "off")
            self._unsupported[index] = {"nvmlDeviceGetMigMode"} & self._unsupported[index]
            self._gpm_supported.pop(index, None)
        self._mig_mode[index] = (current, pending)
        devices: list[tuple[Any, MigDevice]] = []
        slots = self._query(index, errors, "nvmlDeviceGetMaxMigDeviceCount", h) if current else 0
        for slot in range(int(slots or 0)):
            try:
                mig = self._nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            except self._not_found:
                continue  # no MIG device in this slot
            except self._health_errors as exc:
                raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
            except self._error as exc:
                errors.append(("nvmlDeviceGetMigDeviceHandleByIndex", error_reason(exc)))
                continue
            uuid = self._mig_call(errors, "nvmlDeviceGetUUID", mig)
            gi = self._mig_call(errors, "nvmlDeviceGetGpuInstanceId", mig)
            ci = self._mig_call(errors, "nvmlDeviceGetComputeInstanceId", mig)
            name = self._mig_call(errors, "nvmlDeviceGetName", mig)
            if not uuid or gi is None or ci is None:
                continue  # a MIG device that cannot be named cannot be joined to anything
            match = _MIG_PROFILE.search(str(name or ""))
            devices.append((mig, MigDevice(slot=slot, uuid=str(uuid), gpu_instance_id=int(gi),
                                           compute_instance_id=int(ci), profile=match.group(1) if match else "")))
        self._mig_devices[index] = tuple(devices)

    def _read_mig(self, index: int, errors: list[tuple[str, str]], r: GpuReading) -> None:
        """The MIG mode and devices of the last slow read, each device's memory read now."""
        mode = self._mig_mode.get(index)
        if mode is None:
            return
        r.mig_mode_current, r.mig_mode_pending = mode
        out = []
        for mig, device in self._mig_devices.get(index, ()):
            memory = self._mig_call(errors, "nvmlDeviceGetMemoryInfo", mig)
            out.append(MigDeviceReading(
                device=device,
                memory_used_bytes=None if memory is None else int(memory.used),
                memory_total_bytes=None if memory is None else int(memory.total)))
        r.mig_devices = tuple(out)

    def _mig_call(self, errors: list[tuple[str, str]], name: str, *args: Any) -> Any:
        """One call on a MIG device handle: None when it fails (counted; not remembered as the
        parent's capability), health errors raise as for the parent."""
        try:
            return self._functions[name](*args)
        except self._health_errors as exc:
            raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
        except self._error as exc:
            errors.append((name, error_reason(exc)))
            return None

    def _read_memory(self, index: int, errors: list[tuple[str, str]], h: Any, r: GpuReading) -> None:
        """Memory info v2 (the reserve apart), or v1 where the driver refuses v2 (before R510)."""
        if index not in self._memory_v1:
            try:
                memory = self._nvml.nvmlDeviceGetMemoryInfo(h, self._c["nvmlMemory_v2"])
            except self._memory_v2_refused:
                self._memory_v1.add(index)
            except self._health_errors as exc:
                raise _HealthError(self.health_of(exc) or "unavailable", error_reason(exc)) from exc
            except self._error as exc:
                errors.append(("nvmlDeviceGetMemoryInfo", error_reason(exc)))
                return
            else:
                get = _numeric_field  # past pynvml's str wrapper: these are numbers
                r.memory_reserved_bytes = int(get(memory, "reserved"))
                r.memory_used_bytes = int(get(memory, "used")) + r.memory_reserved_bytes
                r.memory_total_bytes = int(get(memory, "total"))
                return
        memory = self._query(index, errors, "nvmlDeviceGetMemoryInfo", h)
        if memory is not None:
            r.memory_used_bytes = int(memory.used)
            r.memory_total_bytes = int(memory.total)

    # HBM temperature has no getter of its own: it is field NVML_FI_DEV_MEMORY_TEMP, whose own
    # nvmlReturn says NotSupported on boards without an HBM sensor; the recovery action rides in the
    # same call (no call of its own), NotSupported where the driver predates it.

    def _recovery_action(self, errors: list[tuple[str, str]], value: int) -> str | None:
        word = self._recovery_actions.get(value)
        if word is None:
            errors.append(("nvmlDeviceGetFieldValues", f"recovery_action_{value}"))
        return word

    # --- fabric and PCIe link (slow cadence) ---------------------------------------------------

    def _read_fabric(self, index: int, errors: list[tuple[str, str]], h: Any, r: GpuReading) -> None:
        """The GPU's NVLink fabric registration: nvmlDeviceGetGpuFabricInfoV with the v2 struct
        (health mask), or nvmlDeviceGetGpuFabricInfo where the driver has no V call. A GPU without a
        fabric answers NotSupported or state NOT_SUPPORTED: never asked again."""
        unsupported = self._unsupported[index]
        if "fabric" in unsupported:
            return
        nvml = self._nvml
        info: Any = None
        if index not in self._fabric_v1:
            info = nvml.c_nvmlGpuFabricInfo_v2_t()  # its constructor sets version = nvmlGpuFabricInfo_v2
            try:
                # By reference: pynvml hands the argument to C as given (callers pass ctypes.byref).
                nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
            except self._fabric_v2_refused:
                self._fabric_v1.add(index)
                info = None
            except self._error as exc:
                if isinstance(exc, self._not_supported):
                    unsupported.add("fabric")
                    return
                self._failed(index, errors, "nvmlDeviceGetGpuFabricInfoV", exc)
                return
        if info is None:
            info = nvml.c_nvmlGpuFabricInfo_t()
            try:
                nvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
            except self._error as exc:
                if isinstance(exc, (self._not_supported, *self._fabric_v2_refused)):
                    unsupported.add("fabric")  # a driver with neither call, or no fabric here
                    return
                self._failed(index, errors, "nvmlDeviceGetGpuFabricInfo", exc)
                return
        get = _numeric_field
        state = int(get(info, "state"))
        if state == self._c["NVML_GPU_FABRIC_STATE_NOT_SUPPORTED"]:
            unsupported.add("fabric")
            return
        word = self._fabric_states.get(state)
        if word is None:
            errors.append(("nvmlDeviceGetGpuFabricInfo", f"fabric_state_{state}"))
            return
        r.fabric_state = word
        status = int(get(info, "status"))
        if word == "completed" and status != self._c["NVML_SUCCESS"]:
            r.fabric_status = _RETURN_NAMES.get(status, f"NVML_ERROR_{status}")
        cluster = bytes(get(info, "clusterUuid"))
        if any(cluster):
            r.fabric_cluster_uuid = str(uuid.UUID(bytes=cluster))
            r.fabric_clique_id = int(get(info, "cliqueId"))
        if index not in self._fabric_v1:
            mask = int(get(info, "healthMask"))
            r.fabric_health = tuple(w for w, shift, width, true in self._fabric_health
                                    if (mask >> shift) & width == true)

    def _read_pcie_link(self, index: int, errors: list[tuple[str, str]], h: Any, r: GpuReading) -> None:
        q = self._query
        r.pcie_link_generation = q(index, errors, "nvmlDeviceGetCurrPcieLinkGeneration", h)
        r.pcie_link_generation_max = q(index, errors, "nvmlDeviceGetMaxPcieLinkGeneration", h)
        r.pcie_link_width = q(index, errors, "nvmlDeviceGetCurrPcieLinkWidth", h)
        r.pcie_link_width_max = q(index, errors, "nvmlDeviceGetMaxPcieLinkWidth", h)

    # --- configuration ---------------------------------------------------------------------------

    def config_facts(self, index: int) -> GpuConfigFacts:
        """How GPU ``index`` is configured now (GpuConfigFacts): 11 NVML calls, for a slow cadence.
        Never raises for an NVML error: a lost GPU is facts with that health and no values."""
        errors: list[tuple[str, str]] = []
        try:
            h = self._handle(index)
            q = self._query
            cuda = q(index, errors, "nvmlSystemGetCudaDriverVersion")
            ecc = q(index, errors, "nvmlDeviceGetEccMode", h)  # [current, pending]
            persistence = q(index, errors, "nvmlDeviceGetPersistenceMode", h)
            mig = q(index, errors, "nvmlDeviceGetMigMode", h)  # [current, pending]
            limit = q(index, errors, "nvmlDeviceGetEnforcedPowerLimit", h)
            sm = q(index, errors, "nvmlDeviceGetApplicationsClock", h, self._c["NVML_CLOCK_SM"])
            memory = q(index, errors, "nvmlDeviceGetApplicationsClock", h, self._c["NVML_CLOCK_MEM"])
            enabled = self._c["NVML_FEATURE_ENABLED"]
            return GpuConfigFacts(
                index=index,
                driver_version=q(index, errors, "nvmlSystemGetDriverVersion"),
                cuda_driver_version=None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
                vbios_version=q(index, errors, "nvmlDeviceGetVbiosVersion", h),
                inforom_image_version=q(index, errors, "nvmlDeviceGetInforomImageVersion", h),
                ecc_mode_current=None if ecc is None else int(ecc[0]) == enabled,
                persistence_mode=None if persistence is None else int(persistence) == enabled,
                mig_mode_current=None if mig is None else int(mig[0]) == enabled,
                power_limit_watts=None if limit is None else limit / 1000.0,
                application_sm_clock_hertz=None if sm is None else sm * _MHZ,
                application_memory_clock_hertz=None if memory is None else memory * _MHZ,
                errors=tuple(errors))
        except _HealthError as exc:
            return GpuConfigFacts(index=index, health=exc.health, errors=(*errors, ("device", exc.reason)))

    def _field_values(self, index: int, errors: list[tuple[str, str]], h: Any,
                      ask: tuple[tuple[int | tuple[int, int], ...], tuple[str, ...]]) -> list[float | None]:
        """One nvmlDeviceGetFieldValues call for the fields of ``ask`` (a field id, or (field id,
        scope id); with each its key in ``_unsupported``, made once by _field_ask): each value, or
        None where its own nvmlReturn failed. A field answered NotSupported is a device capability:
        it is never asked again, the other fields still are."""
        fields, keys = ask
        unsupported = self._unsupported[index]
        out: list[float | None] = [None] * len(fields)
        if unsupported.isdisjoint(keys):
            slots: Sequence[int] = range(len(fields))
            asked = list(fields)
        else:
            slots = [i for i, key in enumerate(keys) if key not in unsupported]
            asked = [fields[i] for i in slots]
        values = self._query(index, errors, "nvmlDeviceGetFieldValues", h, asked) if asked else None
        success, not_supported = self._c["NVML_SUCCESS"], self._c["NVML_ERROR_NOT_SUPPORTED"]
        members, get = self._value_members, _numeric_field  # numbers: past pynvml's str wrapper
        for i, v in zip(slots, values or (), strict=False):
            returned = get(v, "nvmlReturn")
            if returned == success:
                out[i] = float(getattr(get(v, "value"), members.get(get(v, "valueType"), "uiVal")))
            elif returned == not_supported:
                unsupported.add(keys[i])
            else:
                errors.append(("nvmlDeviceGetFieldValues", f"field_return_{int(returned)}"))
        return out

    @staticmethod
    def _field_ask(fields: tuple[int | tuple[int, int], ...]) -> tuple[tuple[int | tuple[int, int], ...],
                                                                         tuple[str, ...]]:
        """``fields`` with the key each is remembered by in ``_unsupported`` when NotSupported."""
        return fields, tuple(f"nvmlDeviceGetFieldValues{f}" for f in fields)

    def _read_nvlinks(self, index: int, e: list[tuple[str, str]], h: Any,
                      links: tuple[int, ...]) -> tuple[NvLinkReading, ...]:
        # _query's rules, inlined: 4 calls a link and 18 links on Hopper are most of a slow read's
        # calls, so each is one bound call in a try (free unless it raises); a failure goes
        # through _failed as in _query, and a query answered NotSupported is not asked again (the
        # flags below are re-read from ``unsupported`` after each failure, the only thing that adds
        # to it here, so every call _query would make is made and no other).
        unsupported = self._unsupported[index]
        nvml, error, failed = self._nvml, self._error, self._failed
        state_name, counter_name = "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter"
        get_state, get_counter = getattr(nvml, state_name), getattr(nvml, counter_name)
        enabled = self._c["NVML_FEATURE_ENABLED"]
        crc_counter, replay_counter, recovery_counter = self._nvlink_counters
        ask_state, ask_counter = state_name not in unsupported, counter_name not in unsupported
        read: list[tuple[int, bool | None, int | None, int | None, int | None]] = []
        for link in links:
            active = crc = replay = recovery = None
            if ask_state:
                try:
                    active = get_state(h, link) == enabled
                except error as exc:
                    active = failed(index, e, state_name, exc)
                    ask_state = state_name not in unsupported
            if ask_counter:
                try:
                    crc = get_counter(h, link, crc_counter)
                except error as exc:
                    crc = failed(index, e, counter_name, exc)
                    ask_counter = counter_name not in unsupported
            if ask_counter:
                try:
                    replay = get_counter(h, link, replay_counter)
                except error as exc:
                    replay = failed(index, e, counter_name, exc)
                    ask_counter = counter_name not in unsupported
            if ask_counter:
                try:
                    recovery = get_counter(h, link, recovery_counter)
                except error as exc:
                    recovery = failed(index, e, counter_name, exc)
                    ask_counter = counter_name not in unsupported
            read.append((link, active, crc, replay, recovery))
        # A healthy GPU's links read the same cycle after cycle: the readings of the last read are
        # handed back while every value is as it was (the same tuple lets the collector see that
        # by identity), rather than 18 frozen NvLinkReadings built again.
        values = tuple(read)
        last = self._nvlinks_last.get(index)
        if last is not None and last[0] == values:
            return last[1]
        readings = tuple(NvLinkReading(*v) for v in values)
        self._nvlinks_last[index] = (values, readings)
        return readings

    # --- reset --------------------------------------------------------------------------------

    def reset_gpu(self, index: int, timeout_seconds: float = RESET_TIMEOUT_SECONDS) -> str:
        """Reset one GPU with ``nvidia-smi --gpu-reset -i <pci bus id>`` and return its output.
        NVML has no public reset call (nvidia-smi uses a private one), so this runs the command
        through the ``run`` seam, bounded by ``timeout_seconds``. Raises OSError or
        subprocess.SubprocessError (the command's failure, its timeout) or the NVMLError of a GPU
        that cannot be identified. nvidia-smi itself refuses a GPU a process holds; the caller
        checks that first (agent/node_action_runner.py)."""
        bus_id = self.identity(index).pci_bus_id
        if not bus_id:
            raise self._nvml.NVMLError_Unknown()
        return self._run(["nvidia-smi", "--gpu-reset", "-i", bus_id], timeout_seconds)

    # --- Xid events ----------------------------------------------------------------------------

    def open_events(self, indices: list[int]) -> list[int]:
        """Register the GPUs for Xid critical-error events; returns the indices registered."""
        nvml = self._nvml
        self._event_set = nvml.nvmlEventSetCreate()
        registered = []
        for index in indices:
            try:
                nvml.nvmlDeviceRegisterEvents(self._handle(index), nvml.nvmlEventTypeXidCriticalError,
                                              self._event_set)
            except (self._error, _HealthError) as exc:
                log.warning("GPU %d: cannot register for NVML Xid events: %s", index, exc)
                continue
            registered.append(index)
        return registered

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        """The next Xid event, or None after ``timeout_ms``. NVML errors other than the timeout
        propagate (the caller counts them and backs off)."""
        if self._event_set is None:
            return None
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except self._timeout:
            return None
        if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
            return None
        return XidEvent(index=self._index_of(data.device), code=int(data.eventData))

    def _index_of(self, device: Any) -> int:
        # By handle first: asking NVML for the index of a GPU that just fell off the bus fails.
        address = _address(device)
        for index, handle in self._handles.items():
            if handle is device or (address is not None and _address(handle) == address):
                return index
        return int(self._nvml.nvmlDeviceGetIndex(device))

    def close_events(self) -> None:
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            try:
                self._nvml.nvmlEventSetFree(event_set)
            except self._error as exc:
                log.warning("nvmlEventSetFree failed: %s", exc)


def _address(handle: Any) -> int | None:
    """The address a pynvml device handle (a ctypes pointer) points at; None for other handles."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


# A numeric field of a pynvml struct read as ctypes reads it: pynvml's structs wrap every attribute
# read in a __getattribute__ that only turns bytes into str, a cost per read that numbers never need.
_numeric_field = object.__getattribute__
# And a field set as ctypes sets it, past pynvml's __setattr__ (which only encodes a str first).
_set_field = ctypes.Structure.__setattr__

# nvmlValueType_t -> the member of nvmlValue_t that holds it; any other type reads uiVal.
_VALUE_MEMBERS: tuple[tuple[str, str], ...] = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)


def _value_members(nvml: Any) -> dict[int, str]:
    """valueType -> member, looked up once per backend (the first listed wins a shared value)."""
    members: dict[int, str] = {}
    for const, member in _VALUE_MEMBERS:
        members.setdefault(int(getattr(nvml, const)), member)
    return members


def open_backend(config: NvmlConfig, clock: Callable[[], float]) -> PynvmlBackend | None:
    """The backend the configuration asks for, initialised; None (after one ERROR line) when NVML
    cannot be used. A node without NVML never falls back to the fake."""
    if config.backend == "fake":
        from vigil.agent.nvml.scenario import DEFAULT_SCENARIO, load_node_scenario

        scenario = DEFAULT_SCENARIO if config.scenario is None else load_node_scenario(config.scenario)
        nvml: ModuleType | FakeNvml = FakeNvml(scenario, clock, seed=config.seed)
        what = f"fake NVML ({config.scenario or 'default healthy 8x H100'})"
    else:
        try:
            import pynvml
        except ImportError as exc:
            log.error("NVML unavailable: cannot import pynvml (nvidia-ml-py): %s; no GPU metrics", exc)
            return None
        nvml = pynvml
        what = "NVML"
    backend = PynvmlBackend(nvml)
    try:
        backend.init()
    except NVMLError as exc:  # any failure to load the library means no GPU samples, loudly
        log.error("%s unavailable: nvmlInit failed: %s (%s); no GPU metrics from this agent",
                  what, exc, type(exc).__name__)
        return None
    return backend
