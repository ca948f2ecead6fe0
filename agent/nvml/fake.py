"""FakeNvml: a stand-in for the ``pynvml`` module, driven by a node scenario and a clock.

It answers the pynvml functions PynvmlBackend calls, with NVML's names, signatures and units
(mW, mJ, bytes, MHz, percent, KB/s, KiB) and the real ``pynvml.NVMLError_*`` exceptions, so the real
backend runs in every test. Constants and exception classes are pynvml's own; any other
attribute fails loudly, so a backend call the fake was not taught cannot pass unnoticed. It does
not load libnvidia-ml and does no I/O; answers are computed from precomputed tables, cheaply,
because the fleet simulator runs a thousand of these.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import random
import subprocess
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from vigil.agent.nvml.profiles import PROFILES, DeviceProfile
from vigil.agent.nvml.scenario import ConfigDrift, NodeScenario

Clock = Callable[[], float]

_NOISE_TABLE_SIZE = 1024
# Event waits sleep at most this long in real time per call: the scenario clock may be fake, so
# the fake cannot know when an event "arrives" and re-checks instead (NVML itself blocks).
_EVENT_POLL_SECONDS = 0.05
_NO_INSTANCE = 0xFFFFFFFF  # NVML's gpuInstanceId/computeInstanceId outside MIG
_MIB = 1024 * 1024
# A memory-bound job's DRAM-active ratio (load.workload: memory_bound): bandwidth-bound kernels
# reach ~90-95% of HBM peak (STREAM-like copies on H100 reach ~3 of 3.35 TB/s).
_MEMORY_BOUND_DRAM_RATIO = 0.93
# NVLink 3 and 4 carry 25 GB/s per link per direction (H100 datasheet: 18 links, 900 GB/s total).
_NVLINK_BYTES_PER_SECOND_PER_LINK = 25_000_000_000
# Shares of that NVLink bandwidth a busy GPU uses (also GPM's NVLink rate in gpm()): a training step's
# collectives (all-reduce, all-gather) keep the links ~30% busy; a memory-bound job moves little.
_NVLINK_TRAINING_SHARE = 0.30
_NVLINK_MEMORY_BOUND_SHARE = 0.08
# A busy-spinning GPU (busy_spin): NCCL's kernels poll on one block per channel, 16-32 channels on
# an H100's 132 SMs (NCCL_MIN/MAX_NCHANNELS defaults), so a few SMs are active and the draw stays
# near idle: sichek's hang check expects under 160 W of an H100's 700 W limit. The share of the
# idle-to-busy power span it draws, and the share of SMs active.
_SPIN_POWER_SHARE = 0.12
_SPIN_SM_ACTIVE_RATIO = 0.12
# What nvmlDevice{En,De}coderUtilization return beside the percentage: the sampling period in us.
# The real H100 (driver 580) answered 100,000 us to both, idle and loaded
# (tests/fixtures/nvml-real/nvml-recording.json, 2026-11-26); the backend does not read it.
_CODEC_SAMPLING_PERIOD_US = 100_000
_NVLINK_FIELDS = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
_ALL_LINKS = 0xFFFFFFFF  # scopeId: every link summed (nvml.h, NVLink throughput counters)
_MEMORY_TEMP_FIELD = pynvml.NVML_FI_DEV_MEMORY_TEMP
# pynvml's return codes and value types the fake writes into its structs, looked up once.
_SUCCESS, _NOT_SUPPORTED = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED
_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
_UNSIGNED_INT, _UNSIGNED_LONG_LONG = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG

# MIG: at most 7 MIG devices per GPU (7 compute slices, NVIDIA MIG User Guide, "Partitioning"); the
# GPU instance ids each size of instance takes, lowest free first (7g: 0; 4g: 1; 3g: 1-2; 2g: 3-5;
# 1g: 7-13), as `nvidia-smi mig -lgi` listings of A100s commonly show them: recalled, not recorded
# here, and a real driver's ids depend on the placement. One compute instance fills each GPU
# instance: compute instance id 0.
MIG_DEVICES_MAX = 7
_MIG_GPU_INSTANCE_IDS = {7: (0,), 4: (1,), 3: (1, 2), 2: (3, 4, 5), 1: (7, 8, 9, 10, 11, 12, 13)}

_HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
_HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
_HW_POWER_BRAKE = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
_SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
_IDLE = pynvml.nvmlClocksEventReasonGpuIdle
# A GPU held by the software power cap draws at its enforced limit, its clock lowered to stay
# there: the real H100 and H200 under bf16 matmul drew 0.979-0.991 of their 700 W limit at 0.70-0.80
# of their top clock (tests/fixtures/nvml-real*/backend-ops.json). The draw moves with the load's
# noise by this much per unit of utilization (real: +-4 W between reads).
_CAPPED_DRAW_RATIO = 0.985
_CAPPED_DRAW_PER_UTILIZATION = 0.2
# Fabric (nvmlGpuFabricInfo_v2_t): a healthy registered GPU's health mask reads FALSE (2) in each of
# the four 2-bit condition fields (pynvml/nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*; the other fields left
# NOT_SUPPORTED, 0); a fabric_degraded fault sets its conditions TRUE (1). Not recorded on a real
# NVSwitch board here. Our condition word -> the field's shift.
_FABRIC_HEALTH_SHIFTS = {
    "degraded_bandwidth": pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW,
    "route_recovery": pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY,
    "route_unhealthy": pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY,
    "access_timeout_recovery": pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY,
}
_FABRIC_HEALTHY_MASK = sum(2 << shift for shift in _FABRIC_HEALTH_SHIFTS.values())
_FABRIC_STATES = {"not_started": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
                  "in_progress": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS}
_RECOVERY_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvml.h; pynvml 13.615 names it)
_RECOVERY_ACTIONS = {"none": 0, "gpu_reset": 1, "node_reboot": 2, "drain_p2p": 3, "drain_and_reset": 4}
# Verdicts a GPU reset answers (the driver names the reset as the cure): cleared by the fake's reset.
_CLEARED_BY_RESET = frozenset({"gpu_reset", "drain_and_reset"})
# GPM metric ids (pynvml's), looked up once rather than on every gpm() answer.
_GPM_GRAPHICS_UTIL = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
_GPM_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
_GPM_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
_GPM_ANY_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
_GPM_HMMA_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL
_GPM_IMMA_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL
_GPM_DFMA_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL
_GPM_DRAM_BW_UTIL = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
_GPM_FP16_UTIL = pynvml.NVML_GPM_METRIC_FP16_UTIL
_GPM_FP32_UTIL = pynvml.NVML_GPM_METRIC_FP32_UTIL
_GPM_FP64_UTIL = pynvml.NVML_GPM_METRIC_FP64_UTIL
_GPM_PCIE_TX_PER_SEC = pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC
_GPM_PCIE_RX_PER_SEC = pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC
_GPM_NVLINK_TX_PER_SEC = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
_GPM_NVLINK_RX_PER_SEC = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
# A busy-spinning GPU's GPM answer (FakeGpuHandle.gpm), the same whatever the load.
_GPM_SPINNING: dict[int, float] = {
    _GPM_GRAPHICS_UTIL: 100.0, _GPM_SM_UTIL: 100.0 * _SPIN_SM_ACTIVE_RATIO,
    _GPM_SM_OCCUPANCY: 100.0 * _SPIN_SM_ACTIVE_RATIO / 8,
    **dict.fromkeys((_GPM_ANY_TENSOR_UTIL, _GPM_HMMA_TENSOR_UTIL, _GPM_IMMA_TENSOR_UTIL, _GPM_DFMA_TENSOR_UTIL,
                     _GPM_DRAM_BW_UTIL, _GPM_FP16_UTIL, _GPM_FP64_UTIL, _GPM_NVLINK_TX_PER_SEC,
                     _GPM_NVLINK_RX_PER_SEC), 0.0),
    _GPM_FP32_UTIL: 1.0, _GPM_PCIE_TX_PER_SEC: 0.01, _GPM_PCIE_RX_PER_SEC: 0.01}
_NVLINK_COUNTER_KIND = {
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc",
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
}


_GPM_SAMPLE_POINTER = pynvml.c_nvmlGpmSample_t


def _pointer_address(pointer: Any) -> int:
    if type(pointer) is _GPM_SAMPLE_POINTER:
        # The pointer's own bytes read as a void pointer: the address ctypes.cast gives, in 0.4 us
        # against 1.0 us (timeit; the fake resolves six GPM sample pointers a GPU read).
        return ctypes.c_void_p.from_buffer(pointer).value or 0
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


def _is_passthrough(value: Any) -> bool:
    """pynvml attributes the fake re-exports: constants, exception classes and ctypes structs."""
    if isinstance(value, int | str | float | bytes):
        return True
    if isinstance(value, type):
        return issubclass(value, BaseException | ctypes.Structure | ctypes.Union)
    return False


@dataclass(frozen=True, slots=True)
class _Window:
    start: float
    end: float
    reasons: int
    clock_ratio: float
    hot: bool  # temperature climbs to the slowdown threshold


@dataclass(frozen=True, slots=True)
class _Growth:
    start: float
    end: float
    rate_per_second: float


@dataclass(frozen=True, slots=True)
class UnderLoadEffects:
    """What the ``under_load`` faults active on one GPU do to a probe's figures (the fake engine
    applies them): factors of 1 and no errors on a sound GPU."""

    sm_clock_factor: float = 1.0
    compute_factor: float = 1.0  # of the burn's throughput, the clock's sag included
    compute_jitter: float = 0.0  # every other pass loses this share more
    memory_factor: float = 1.0
    pattern_errors: int = 0


_NO_EFFECTS = UnderLoadEffects()


@dataclass(frozen=True, slots=True)
class _UnderLoadFault:
    start: float
    end: float
    window: _Window | None  # the clock sag while loaded (None: the clock holds)
    effects: UnderLoadEffects


@dataclass(frozen=True, slots=True)
class _Step:
    at: float
    count: int


@dataclass(frozen=True, slots=True)
class FakeEventData:
    """The fields of pynvml's c_nvmlEventData_t that a reader uses."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = _NO_INSTANCE
    computeInstanceId: int = _NO_INSTANCE


class FakeMigHandle:
    """One MIG device (a GPU instance with one compute instance filling it) of a FakeGpuHandle."""

    def __init__(self, parent: FakeGpuHandle, slot: int, profile: str, gpu_instance_id: int,
                 memory_total_bytes: int) -> None:
        self.parent = parent
        self.slot = slot
        self.profile = profile
        self.gpu_instance_id = gpu_instance_id
        self.compute_instance_id = 0
        self.memory_total_bytes = memory_total_bytes
        digest = hashlib.sha256(f"{parent.uuid}:{gpu_instance_id}".encode()).hexdigest()
        self.uuid = f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


class FakeGpuHandle:
    """One GPU: the scenario's faults for it, precomputed into time windows and steps."""

    def __init__(self, index: int, profile: DeviceProfile, scenario: NodeScenario, seed: int) -> None:
        self.index = index
        self.profile = profile
        digest = hashlib.sha256(f"{seed}:{profile.key}:{index}".encode()).hexdigest()
        self.uuid = f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
        self.serial = str(1650000000000 + int(digest[32:40], 16) % 1_000_000_000)
        self.pci_bus_id = profile.pcie_bus_ids[index]
        self.nvlink_count = profile.nvlink_count
        rng = random.Random(f"{seed}:{index}")
        # uniform(-1, 1) is -1 + 2 * random(): the same values, without its per-call overhead
        # (the simulator builds 8,000 of these tables). Contiguous doubles: as a tuple, each of the
        # 1,024 was an object of its own, 40% of a simulated node's ~20,000 heap blocks (tracemalloc).
        draw = rng.random
        self.noise = array("d", [-1.0 + 2.0 * draw() for _ in range(_NOISE_TABLE_SIZE)])
        self.energy_base_mj = rng.randrange(10**9, 10**11)  # energy since the driver loaded
        self.pcie_replay_base = rng.randrange(0, 80)  # the recording shows 52..67 on healthy GPUs
        self.nvlink_data_base_kib = rng.randrange(10**9, 10**12) if profile.nvlink_count else 0
        self.load = scenario.load
        self.lost_at = math.inf
        self.reset_required_at = math.inf
        # Scenario time of the last GPU reset (FakeNvml.nvidia_smi): faults scripted before it are
        # cleared, as a reset clears them; later ones still happen.
        self.reset_at = -math.inf
        self.windows: list[_Window] = []
        self.ecc_growth: list[_Growth] = []
        self.ecc_uncorrected: list[_Step] = []
        self.remap_pending: list[_Step] = []
        self.remap_failure_at = math.inf
        self.nvlink_growth: dict[tuple[int, str], list[_Growth]] = {}
        self.nvlink_down_at: dict[int, float] = {}
        self.xids: list[tuple[float, int]] = []
        self.temperature_drift: list[_Growth] = []  # degrees Celsius per second
        self.hbm_extra: list[tuple[float, float, float]] = []  # (start, end, degrees Celsius)
        self.pcie_replay_growth: list[_Growth] = []
        self.memory_bound: list[tuple[float, float, float]] = []  # (start, end, DRAM active ratio)
        # Busy-spin windows (start, end), and the run-time switch FakeNvml.set_busy_spin sets.
        self.busy_spin: list[tuple[float, float]] = []
        self.spin_now = False
        # The run-time mean utilization FakeNvml.set_utilization sets over the load's (None: the load's).
        self.utilization_now: float | None = None
        # MIG mode now and after the next reset, and the MIG devices by slot (None: empty slot).
        self.mig_enabled = False
        self.mig_pending = False
        self.mig_slots: list[FakeMigHandle | None] = []
        # A probe's load (FakeNvml.begin_load/end_load: how many probe loads run on the GPU now),
        # and the faults that show only under it.
        self.probe_loads = 0
        self.under_load: list[_UnderLoadFault] = []
        # Issue 44: configuration drifts on this GPU (node-wide ones included), in time order; the
        # fabric registration stalls (start, end, NVML state) and health conditions (start, end,
        # conditions); the degraded PCIe link (start, end, generation, width); the recovery verdicts
        # (start, end, action).
        self.config_drifts: list[ConfigDrift] = []
        self.fabric_down: list[tuple[float, float, int]] = []
        self.fabric_degraded: list[tuple[float, float, frozenset[str]]] = []
        self.pcie_degraded: list[tuple[float, float, int | None, int | None]] = []
        self.recovery: list[tuple[float, float, str]] = []
        # What the node's driver answers: the profile's, or newer where a fault needs it (a
        # scenario scripting a recovery action or fabric health says the driver has them).
        self.recovery_action_supported = profile.recovery_action_supported or any(
            f.kind == "recovery_action" for f in scenario.faults)
        self.functions_missing = profile.functions_missing - (
            {"nvmlDeviceGetGpuFabricInfoV"} if any(f.kind == "fabric_degraded" for f in scenario.faults) else set())
        for fault in scenario.faults:
            if fault.kind == "config_drift":
                if fault.gpu is None or fault.gpu == index:
                    self.config_drifts.append(fault)
                continue
            if fault.kind == "fabric_manager_down":
                end = fault.at_seconds + fault.duration_seconds if fault.duration_seconds else math.inf
                self.fabric_down.append((fault.at_seconds, end, _FABRIC_STATES[fault.state]))
                continue
            if getattr(fault, "gpu", None) != index:
                continue
            at = fault.at_seconds
            match fault.kind:
                case "ecc_corrected_growth":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.ecc_growth.append(_Growth(at, end, fault.rate_per_second))
                case "ecc_uncorrectable":
                    self.ecc_uncorrected.append(_Step(at, fault.count))
                case "row_remap_pending":
                    self.remap_pending.append(_Step(at, fault.rows))
                case "row_remap_failure":
                    self.remap_failure_at = min(self.remap_failure_at, at)
                case "thermal_throttle":
                    self.windows.append(_Window(at, at + fault.duration_seconds, _HW_SLOWDOWN | _HW_THERMAL,
                                                fault.clock_ratio, hot=True))
                case "power_brake":
                    self.windows.append(_Window(at, at + fault.duration_seconds,
                                                _HW_SLOWDOWN | _HW_POWER_BRAKE, fault.clock_ratio, hot=False))
                case "xid":
                    self.xids.append((at, fault.code))
                case "gpu_lost":
                    self.lost_at = min(self.lost_at, at)
                case "reset_required":
                    self.reset_required_at = min(self.reset_required_at, at)
                case "nvlink_errors":
                    self.nvlink_growth.setdefault((fault.link, fault.error_type), []).append(
                        _Growth(at, math.inf, fault.rate_per_second))
                case "nvlink_down":
                    self.nvlink_down_at[fault.link] = min(self.nvlink_down_at.get(fault.link, math.inf), at)
                case "temperature_drift":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.temperature_drift.append(_Growth(at, end, fault.celsius_per_hour / 3600.0))
                case "hot_hbm":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.hbm_extra.append((at, end, fault.extra_celsius))
                case "pcie_replay":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.pcie_replay_growth.append(_Growth(at, end, fault.rate_per_second))
                case "power_cap":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.windows.append(_Window(at, end, _SW_POWER_CAP, fault.clock_ratio, hot=False))
                case "memory_bound":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.memory_bound.append((at, end, fault.dram_active_ratio))
                case "busy_spin":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.busy_spin.append((at, end))
                case "fabric_degraded":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.fabric_degraded.append((at, end, frozenset(fault.conditions)))
                case "pcie_link_degraded":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.pcie_degraded.append((at, end, fault.generation, fault.width))
                case "recovery_action":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    self.recovery.append((at, end, fault.action))
                case "under_load":
                    end = at + fault.duration_seconds if fault.duration_seconds else math.inf
                    window = None
                    if fault.sm_clock_factor < 1.0:
                        cause = {"thermal": _HW_THERMAL, "power_brake": _HW_POWER_BRAKE}.get(fault.throttle)
                        reasons = _HW_SLOWDOWN | cause if cause is not None else 0
                        window = _Window(at, end, reasons, fault.sm_clock_factor, hot=fault.throttle == "thermal")
                    self.under_load.append(_UnderLoadFault(at, end, window, UnderLoadEffects(
                        sm_clock_factor=fault.sm_clock_factor,
                        compute_factor=fault.compute_factor * fault.sm_clock_factor,
                        compute_jitter=fault.compute_jitter, memory_factor=fault.memory_factor,
                        pattern_errors=fault.pattern_errors)))
        self.xids.sort()
        self.config_drifts.sort(key=lambda d: d.at_seconds)

    # --- configuration, fabric, PCIe link and recovery verdict at scenario time t ----------------

    def configured(self, fact: str, default: Any, t: float) -> Any:
        """A configuration fact at ``t``: the latest drift that set it, else the profile's."""
        return _configured(self.config_drifts, fact, default, t)

    def power_limit_mw(self, t: float) -> int:
        if not self.config_drifts:
            return self.profile.power_limit_mw
        watts = self.configured("power_limit_watts", None, t)
        return self.profile.power_limit_mw if watts is None else int(watts * 1000)

    def fabric(self, t: float) -> tuple[int, int]:
        """(NVML fabric state, health mask): registered and healthy unless a fault says otherwise."""
        for start, end, state in self.fabric_down:
            if start <= t < end:
                return state, 0
        mask = _FABRIC_HEALTHY_MASK
        for start, end, conditions in self.fabric_degraded:
            if start <= t < end:
                for condition in conditions:  # the condition's field FALSE (2) -> TRUE (1)
                    shift = _FABRIC_HEALTH_SHIFTS[condition]
                    mask = mask & ~(3 << shift) | 1 << shift
        return pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, mask

    def pcie_link(self, t: float) -> tuple[int, int]:
        """(generation, width) the link is trained at now."""
        p = self.profile
        generation, width = p.pcie_link_generation_max, p.pcie_link_width_max
        idle = self.load.pcie_idle_link_generation
        if idle is not None and self.utilization(t) == 0.0:
            generation = min(generation, idle)  # retrained down at idle; back to max under load
        for start, end, degraded_generation, degraded_width in self.pcie_degraded:
            if start <= t < end:
                if degraded_generation is not None:
                    generation = min(generation, degraded_generation)
                if degraded_width is not None:
                    width = min(width, degraded_width)
        return generation, width

    def recovery_action(self, t: float) -> int:
        """The driver's verdict now: the latest active fault's, else none."""
        action = "none"
        for start, end, verdict in self.recovery:
            if start <= t < end and not (verdict in _CLEARED_BY_RESET and self.reset_at >= start):
                action = verdict
        return _RECOVERY_ACTIONS[action]

    # --- the state at scenario time t -------------------------------------------------------

    def spinning(self, t: float) -> bool:
        """Whether the GPU busy-spins at ``t`` (and no probe loads it)."""
        if self.probe_loads:
            return False
        if self.spin_now:
            return True
        # Asked several times a read: no generator for the (usual) GPU without busy_spin windows.
        return bool(self.busy_spin) and any(start <= t < end for start, end in self.busy_spin)

    def utilization(self, t: float) -> float:
        if self.probe_loads or self.spinning(t):
            return 1.0  # a burn, a copy loop or a polling kernel keeps the GPU busy every sample period
        load = self.load
        mean = load.utilization if self.utilization_now is None else self.utilization_now
        if mean == 0.0:
            return 0.0
        u = mean + load.noise * self.noise[int(t) % _NOISE_TABLE_SIZE]
        return 0.0 if u < 0.0 else 1.0 if u > 1.0 else u

    def window(self, t: float) -> _Window | None:
        if self.probe_loads:
            for f in self.under_load:
                if f.window is not None and f.start <= t < f.end:
                    return f.window
        if not self.windows:  # the usual GPU, asked five times a read: no spin check needed
            return None
        spinning = self.spinning(t)
        for w in self.windows:
            # A software power cap holds only a GPU drawing at its limit: a polling kernel does not.
            if w.start <= t < w.end and not (spinning and w.reasons & _SW_POWER_CAP):
                return w
        return None

    def load_effects(self, t: float) -> UnderLoadEffects:
        """The under-load faults active at ``t``, combined (factors multiply, errors add)."""
        active = [f.effects for f in self.under_load if f.start <= t < f.end]
        if not active:
            return _NO_EFFECTS
        if len(active) == 1:
            return active[0]
        return UnderLoadEffects(
            sm_clock_factor=math.prod(e.sm_clock_factor for e in active),
            compute_factor=math.prod(e.compute_factor for e in active),
            compute_jitter=max(e.compute_jitter for e in active),
            memory_factor=math.prod(e.memory_factor for e in active),
            pattern_errors=sum(e.pattern_errors for e in active))

    def dram_cap(self, t: float) -> float | None:
        """The DRAM-active ratio a memory-bound job holds this GPU at, or None when it is not one."""
        for start, end, ratio in self.memory_bound:
            if start <= t < end:
                return ratio
        return _MEMORY_BOUND_DRAM_RATIO if self.load.workload == "memory_bound" else None

    def gpm(self, t: float) -> dict[int, float]:
        """The GPM metrics over a sample interval ending at ``t``, NVML's units (percent, MiB/s).

        Shares of a busy GPU: a dense-transformer training step keeps the tensor pipes busy about
        half the time (HMMA), the SMs busy nearly always, DRAM bandwidth moderately; a memory-bound
        job saturates DRAM with the tensor pipes nearly idle. A capped clock (power cap, brake,
        thermal) leaves the activity ratios, which are shares of cycles, as they are but moves less
        data per second, so DRAM and the interconnects scale with it."""
        if self.spinning(t):  # a polling kernel on a few SMs: no tensor work, no traffic
            return dict(_GPM_SPINNING)
        u = self.utilization(t)
        w = self.window(t)
        clock = w.clock_ratio if w is not None else 1.0
        cap = self.dram_cap(t)
        if cap is None:  # training
            sm, occupancy, tensor, fp16, fp32, fp64 = 0.93 * u, 0.42 * u, 0.55 * u, 0.06 * u, 0.12 * u, 0.0
            dram = 0.38 * u * clock
            nvlink = _NVLINK_TRAINING_SHARE * u * clock
        else:  # memory-bound: DRAM at its cap while busy, tensor pipes mostly idle
            sm, occupancy, tensor, fp16, fp32, fp64 = 0.88 * u, 0.61 * u, 0.04 * u, 0.10 * u, 0.22 * u, 0.0
            dram = cap if u > 0 else 0.0
            nvlink = _NVLINK_MEMORY_BOUND_SHARE * u * clock
        p = self.profile
        pcie_mib = p.pcie_max_bytes_per_second / _MIB * 0.02 * (0.05 + u) * clock
        nvlink_mib = p.nvlink_count * _NVLINK_BYTES_PER_SECOND_PER_LINK / _MIB * nvlink
        return {
            _GPM_GRAPHICS_UTIL: 100.0 * u,
            _GPM_SM_UTIL: 100.0 * sm,
            _GPM_SM_OCCUPANCY: 100.0 * occupancy,
            _GPM_ANY_TENSOR_UTIL: 100.0 * tensor,
            _GPM_HMMA_TENSOR_UTIL: 100.0 * tensor,
            _GPM_IMMA_TENSOR_UTIL: 0.0,
            _GPM_DFMA_TENSOR_UTIL: 0.0,
            _GPM_DRAM_BW_UTIL: 100.0 * dram,
            _GPM_FP16_UTIL: 100.0 * fp16,
            _GPM_FP32_UTIL: 100.0 * fp32,
            _GPM_FP64_UTIL: 100.0 * fp64,
            _GPM_PCIE_TX_PER_SEC: pcie_mib,
            _GPM_PCIE_RX_PER_SEC: pcie_mib * 0.6,
            _GPM_NVLINK_TX_PER_SEC: nvlink_mib,
            _GPM_NVLINK_RX_PER_SEC: nvlink_mib,
        }

    def nvlink_data_kib(self, t: float) -> int:
        """NVLink payload KiB per direction, all links, since the driver loaded: the integral of the
        load's mean NVLink share (noise and clock caps left out, as for the energy counter, so the
        counter never goes backwards)."""
        share = _NVLINK_TRAINING_SHARE if self.load.workload != "memory_bound" else _NVLINK_MEMORY_BOUND_SHARE
        kib_per_second = self.nvlink_count * _NVLINK_BYTES_PER_SECOND_PER_LINK * share * self.load.utilization / 1024
        return self.nvlink_data_base_kib + int(kib_per_second * max(t, 0.0))

    @staticmethod
    def grown(growths: Sequence[_Growth], t: float) -> int:
        total = 0
        for g in growths:
            if t >= g.start:
                total += int(g.rate_per_second * (min(t, g.end) - g.start))
        return total

    @staticmethod
    def stepped(steps: Sequence[_Step], t: float) -> int:
        return sum(s.count for s in steps if t >= s.at)


def _by_reference(ref: Any) -> Any:
    """The struct a ``ctypes.byref`` points to. pynvml's struct-filling calls hand their argument to
    C as given, so a bare struct would be passed by value to the real library: refused here, loudly."""
    if isinstance(ref, ctypes.Structure):
        raise TypeError("pass ctypes.byref(struct): pynvml hands this argument to libnvidia-ml as given")
    return ref._obj


def _configured(drifts: Sequence[ConfigDrift], fact: str, default: Any, t: float) -> Any:
    """A configuration fact at ``t`` under ``drifts`` (in time order): the latest that set it."""
    value = default
    for drift in drifts:
        if drift.at_seconds > t:
            break
        set_to = getattr(drift, fact)
        if set_to is not None:
            value = set_to
    return value


class _FakeGpmSample:
    """What one GPM sample buffer holds: which GPU it was taken on and when (None: not yet)."""

    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(16)  # the address pynvml's opaque pointer holds
        self.handle: FakeGpuHandle | None = None
        self.t: float | None = None


class _FakeEventSet:
    def __init__(self) -> None:
        self.devices: dict[int, FakeGpuHandle] = {}
        self.delivered: dict[int, int] = {}  # gpu index -> how many of its xids were delivered
        self.freed = threading.Event()


class FakeNvml:
    """Imitates the pynvml module for one node. Scenario time is ``clock() - start``."""

    def __init__(self, scenario: NodeScenario, clock: Clock, start: float | None = None, seed: int = 0) -> None:
        self.scenario = scenario
        self._clock = clock
        self._start = clock() if start is None else start
        self.profile = PROFILES[scenario.profile]
        self.handles = [FakeGpuHandle(i, self.profile, scenario, seed) for i in range(scenario.gpus)]
        self._unavailable_at = min((f.at_seconds for f in scenario.faults if f.kind == "nvml_unavailable"),
                                   default=math.inf)
        self._initialized = 0  # NVML counts nvmlInit calls; each needs an nvmlShutdown
        # GPU index -> PIDs of compute processes on it, set by a test or the simulator, on top of
        # the scenario's ``processes`` (none by default: an idle node).
        self.running_pids: dict[int, list[int]] = {}
        self.resets: list[tuple[int, float]] = []  # (GPU index, scenario time) of each reset
        # GPM sample buffers allocated and not yet freed, by the address of their opaque pointer:
        # a test checks the backend frees every sample it allocates.
        self.gpm_samples: dict[int, _FakeGpmSample] = {}
        self._load_lock = threading.Lock()
        # The node's own facts (driver, CUDA): the node-wide drifts, in time order.
        self._node_drifts = sorted((f for f in scenario.faults if f.kind == "config_drift" and f.gpu is None),
                                   key=lambda d: d.at_seconds)
        for layout in scenario.mig:
            self.configure_mig(layout.gpu, layout.instances, enabled=layout.enabled,
                               pending=layout.enabled if layout.pending is None else layout.pending)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the class does not define: constants pass through, functions fail.
        value = getattr(pynvml, name, None)
        if value is not None and _is_passthrough(value):
            return value
        raise AttributeError(
            f"FakeNvml does not implement pynvml.{name}: teach agent/nvml/fake.py before the backend calls it")

    def now(self) -> float:
        return self._clock() - self._start

    # --- a probe's load (the fake engine, agent/probes/engine_fake.py) -------------------------

    def begin_load(self, index: int) -> None:
        """A probe starts loading GPU ``index`` flat out: until end_load it reads busy (utilisation
        100%, busy power, top clock) and its under_load faults show (a sagging clock and its
        throttle reasons); loads nest (a P2P copy loads two GPUs, probes may overlap)."""
        with self._load_lock:
            self.handles[index].probe_loads += 1

    def end_load(self, index: int) -> None:
        with self._load_lock:
            handle = self.handles[index]
            handle.probe_loads = max(handle.probe_loads - 1, 0)

    def set_busy_spin(self, indexes: Sequence[int], on: bool) -> None:
        """The seam for a run driven by a real job's state (a test, the simulator): GPUs
        ``indexes`` busy-spin from now until switched off (as a busy_spin fault, without a time)."""
        for index in indexes:
            self.handles[index].spin_now = on

    def set_utilization(self, indexes: Sequence[int], utilization: float | None) -> None:
        """The seam for a run driven by a job's state (the simulator): GPUs ``indexes`` read this
        mean utilization (0..1, the load's noise around it) from now on, and what follows from it
        (clock, power, temperature, GPM activity); None: the load's again. The energy and NVLink
        counters keep integrating the load's mean, so they never run backwards."""
        if utilization is not None and not 0.0 <= utilization <= 1.0:
            raise ValueError(f"utilization {utilization} is not in [0, 1]")
        for index in indexes:
            self.handles[index].utilization_now = utilization

    def load_effects(self, index: int) -> UnderLoadEffects:
        """What GPU ``index``'s under_load faults do to a probe's figures now."""
        return self.handles[index].load_effects(self.now())

    def configure_mig(self, index: int, instances: Sequence[str | None], *, enabled: bool = True,
                      pending: bool | None = None) -> None:
        """What an administrator's ``nvidia-smi -mig`` and ``nvidia-smi mig -dci -dgi / -cgi ... -C``
        leave on GPU ``index``: the mode (``pending`` differs until a reset applies it) and these GPU
        instances, in slots 0.. in order; ``None`` in ``instances`` leaves that slot empty (an
        instance destroyed). Raises ValueError for a profile the board does not offer."""
        handle = self.handles[index]
        handle.mig_enabled = enabled
        handle.mig_pending = enabled if pending is None else pending
        used: set[int] = set()
        slots: list[FakeMigHandle | None] = []
        for slot, name in enumerate(instances):
            if name is None:
                slots.append(None)
                continue
            memory = handle.profile.mig_memory_bytes(name)
            if memory is None or not enabled:
                raise ValueError(f"GPU {index}: no MIG profile {name!r} (MIG {'on' if enabled else 'off'})")
            pool = _MIG_GPU_INSTANCE_IDS.get(int(name.split("g.", 1)[0]), ())
            gi = next((i for i in pool if i not in used), None)
            if gi is None or slot >= MIG_DEVICES_MAX:
                raise ValueError(f"GPU {index}: no room for another {name} instance")
            used.add(gi)
            slots.append(FakeMigHandle(handle, slot, name, gi, memory))
        handle.mig_slots = slots

    # --- library -------------------------------------------------------------------------------

    def _live(self) -> float:
        t = self._clock() - self._start
        if t >= self._unavailable_at:
            raise pynvml.NVMLError_DriverNotLoaded()
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        return t

    def _device(self, handle: FakeGpuHandle, function: str) -> float:
        t = self._clock() - self._start  # _live's checks, inlined: every device query passes here
        if t >= self._unavailable_at:
            raise pynvml.NVMLError_DriverNotLoaded()
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        if t >= handle.lost_at:
            raise pynvml.NVMLError_GpuIsLost()
        if t >= handle.reset_required_at:
            raise pynvml.NVMLError_ResetRequired()
        if function in handle.profile.not_supported:
            raise pynvml.NVMLError_NotSupported()
        return t

    def nvmlInit(self) -> None:
        if self.now() >= self._unavailable_at:
            raise pynvml.NVMLError_DriverNotLoaded()
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        t = self._live()
        return str(_configured(self._node_drifts, "driver_version", self.profile.driver_version, t))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        """1000 * major + 10 * minor, as NVML: a drift's "12.4" answers 12040."""
        t = self._live()
        drifted = _configured(self._node_drifts, "cuda_driver_version", None, t)
        if drifted is None:
            return self.profile.cuda_driver_version
        major, minor = str(drifted).split(".")
        return int(major) * 1000 + int(minor) * 10

    def nvmlDeviceGetCount(self) -> int:
        self._live()
        return len(self.handles)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpuHandle:
        self._live()
        if not 0 <= index < len(self.handles):
            raise pynvml.NVMLError_InvalidArgument()
        handle = self.handles[index]
        self._device(handle, "nvmlDeviceGetHandleByIndex")
        return handle

    # --- identity ------------------------------------------------------------------------------

    def nvmlDeviceGetIndex(self, handle: FakeGpuHandle) -> int:
        self._device(handle, "nvmlDeviceGetIndex")
        return handle.index

    def nvmlDeviceGetUUID(self, handle: FakeGpuHandle | FakeMigHandle) -> str:
        if isinstance(handle, FakeMigHandle):
            self._mig(handle)
            return handle.uuid
        self._device(handle, "nvmlDeviceGetUUID")
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpuHandle | FakeMigHandle) -> str:
        """A MIG device's name is its parent's with the profile: "NVIDIA A100-SXM4-80GB MIG 1g.10gb"."""
        if isinstance(handle, FakeMigHandle):
            self._mig(handle)
            return f"{handle.parent.profile.name} MIG {handle.profile}"
        self._device(handle, "nvmlDeviceGetName")
        return handle.profile.name

    def nvmlDeviceGetSerial(self, handle: FakeGpuHandle) -> str:
        self._device(handle, "nvmlDeviceGetSerial")
        return handle.serial

    def nvmlDeviceGetVbiosVersion(self, handle: FakeGpuHandle) -> str:
        t = self._device(handle, "nvmlDeviceGetVbiosVersion")
        return str(handle.configured("vbios_version", handle.profile.vbios_version, t))

    # --- configuration (issue 44) ----------------------------------------------------------------

    def nvmlDeviceGetInforomImageVersion(self, handle: FakeGpuHandle) -> str:
        t = self._device(handle, "nvmlDeviceGetInforomImageVersion")
        return str(handle.configured("inforom_image_version", handle.profile.inforom_image_version, t))

    def _enabled(self, handle: FakeGpuHandle, fact: str, t: float) -> int:
        """An on/off fact (on by default) as NVML's nvmlEnableState_t."""
        on = handle.configured(fact, "enabled", t) == "enabled"
        return pynvml.NVML_FEATURE_ENABLED if on else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetEccMode(self, handle: FakeGpuHandle) -> list[int]:
        """[current, pending]: "ECC Mode Current: Enabled, Pending: Enabled" in every recording here
        (nvidia-smi-q-8xH100-535.161.08.txt:123-125); a drift sets both (no change waiting)."""
        t = self._device(handle, "nvmlDeviceGetEccMode")
        mode = self._enabled(handle, "ecc_mode", t)
        return [mode, mode]

    def nvmlDeviceGetPersistenceMode(self, handle: FakeGpuHandle) -> int:
        """"Persistence Mode: Enabled" in every recording here (nvidia-smi-q-8xH100-535.161.08.txt:15)."""
        t = self._device(handle, "nvmlDeviceGetPersistenceMode")
        return self._enabled(handle, "persistence_mode", t)

    def nvmlDeviceGetApplicationsClock(self, handle: FakeGpuHandle, clock_type: int) -> int:
        """MHz; the board's default, its maximum clocks ("Applications Clocks: Graphics 1980 MHz, Memory
        2619 MHz" = "Max Clocks", nvidia-smi-q-8xH100-535.161.08.txt:189-191 and 200-203)."""
        t = self._device(handle, "nvmlDeviceGetApplicationsClock")
        p = handle.profile
        if clock_type == pynvml.NVML_CLOCK_SM or clock_type == pynvml.NVML_CLOCK_GRAPHICS:
            return int(handle.configured("application_sm_clock_mhz", p.sm_clock_max_mhz, t))
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return int(handle.configured("application_memory_clock_mhz", p.memory_clock_max_mhz, t))
        raise pynvml.NVMLError_InvalidArgument()

    # --- NVLink fabric and PCIe link (issue 44) ---------------------------------------------------

    def _fabric(self, handle: FakeGpuHandle, function: str, info: Any) -> None:
        t = self._device(handle, function)
        if function in handle.functions_missing:
            raise pynvml.NVMLError_FunctionNotFound()
        p = handle.profile
        put = ctypes.Structure.__setattr__  # past pynvml's str/bytes wrappers, as ctypes sets them
        if not p.nvswitch_fabric:
            put(info, "state", pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED)
            put(info, "status", pynvml.NVML_ERROR_NOT_SUPPORTED)
            return
        state, mask = handle.fabric(t)
        put(info, "state", state)
        put(info, "status", pynvml.NVML_SUCCESS)
        put(info, "cliqueId", 0)  # single-node NVSwitch: no clique, an all-zero cluster UUID
        if function == "nvmlDeviceGetGpuFabricInfoV":
            put(info, "healthMask", mask)

    def nvmlDeviceGetGpuFabricInfoV(self, handle: FakeGpuHandle, info_ref: Any) -> int:
        """Fills the c_nvmlGpuFabricInfo_v2_t ``info_ref`` points to (version checked, as the real call does)."""
        info = _by_reference(info_ref)
        if getattr(info, "version", None) != pynvml.nvmlGpuFabricInfo_v2:
            self._device(handle, "nvmlDeviceGetGpuFabricInfoV")
            if "nvmlDeviceGetGpuFabricInfoV" in handle.functions_missing:
                raise pynvml.NVMLError_FunctionNotFound()
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        self._fabric(handle, "nvmlDeviceGetGpuFabricInfoV", info)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfo(self, handle: FakeGpuHandle, info_ref: Any) -> int:
        """Fills the c_nvmlGpuFabricInfo_t ``info_ref`` points to (no version, no health mask)."""
        self._fabric(handle, "nvmlDeviceGetGpuFabricInfo", _by_reference(info_ref))
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeGpuHandle) -> int:
        t = self._device(handle, "nvmlDeviceGetCurrPcieLinkGeneration")
        return handle.pcie_link(t)[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeGpuHandle) -> int:
        t = self._device(handle, "nvmlDeviceGetCurrPcieLinkWidth")
        return handle.pcie_link(t)[1]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeGpuHandle) -> int:
        self._device(handle, "nvmlDeviceGetMaxPcieLinkGeneration")
        return handle.profile.pcie_link_generation_max

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeGpuHandle) -> int:
        self._device(handle, "nvmlDeviceGetMaxPcieLinkWidth")
        return handle.profile.pcie_link_width_max

    def nvmlDeviceGetPciInfo(self, handle: FakeGpuHandle) -> pynvml.nvmlPciInfo_t:
        self._device(handle, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = handle.pci_bus_id
        info.busIdLegacy = handle.pci_bus_id
        domain, bus, rest = handle.pci_bus_id.split(":")
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(rest.split(".")[0], 16)
        return info

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeGpuHandle, clock_type: int) -> int:
        self._device(handle, "nvmlDeviceGetMaxClockInfo")
        if clock_type == pynvml.NVML_CLOCK_SM or clock_type == pynvml.NVML_CLOCK_GRAPHICS:
            return handle.profile.sm_clock_max_mhz
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return handle.profile.memory_clock_max_mhz
        raise pynvml.NVMLError_InvalidArgument()

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeGpuHandle, threshold: int) -> int:
        self._device(handle, "nvmlDeviceGetTemperatureThreshold")
        p = handle.profile
        values = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: p.shutdown_temperature_celsius,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: p.slowdown_temperature_celsius,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: p.gpu_max_temperature_celsius,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: p.memory_max_temperature_celsius,
        }
        if threshold not in values:
            raise pynvml.NVMLError_NotSupported()
        return values[threshold]

    # --- dynamic readings ----------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpuHandle) -> pynvml.c_nvmlUtilization_t:
        """NotSupported while the GPU is in MIG mode, where nvidia-smi prints "GPU-Util: N/A": the
        engines are shared out among the instances, whose activity DCGM measures per instance."""
        t = self._device(handle, "nvmlDeviceGetUtilizationRates")
        if handle.mig_enabled:
            raise pynvml.NVMLError_NotSupported()
        u = handle.utilization(t)
        rates = pynvml.c_nvmlUtilization_t()
        put = ctypes.Structure.__setattr__  # numbers, past pynvml's str-encoding wrapper
        put(rates, "gpu", round(u * 100))
        put(rates, "memory", round(u * 45))  # memory-controller busy share: ~half of SM busy in LLM training
        return rates

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpuHandle | FakeMigHandle, version: int | None = None) -> Any:
        """pynvml's signature: no version gives v1 (c_nvmlMemory_t, `used` counts the reserve),
        nvmlMemory_v2 gives c_nvmlMemory_v2_t (`used` allocated only, `reserved` apart). On a MIG
        device: the instance's own memory (v1 only here; the backend asks v1)."""
        if isinstance(handle, FakeMigHandle):
            t = self._mig(handle)
            if version:
                raise pynvml.NVMLError_NotSupported()
            mig_total = handle.memory_total_bytes
            mig_busy = handle.parent.load.memory_used_ratio if handle.parent.utilization(t) > 0 else 0.0
            mig_used = int(mig_total * mig_busy) // _MIB * _MIB
            return pynvml.c_nvmlMemory_t(total=mig_total, free=mig_total - mig_used, used=mig_used)
        t = self._device(handle, "nvmlDeviceGetMemoryInfo")
        p = handle.profile
        total, reserved = p.memory_total_bytes, p.memory_reserved_bytes
        busy = handle.load.memory_used_ratio if handle.utilization(t) > 0 else 0.0
        allocated = min(int(total * busy) // _MIB * _MIB, total - reserved)
        free = total - reserved - allocated
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=reserved + allocated)
        if version != pynvml.nvmlMemory_v2:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, free=free, used=allocated)

    def nvmlDeviceGetEncoderUtilization(self, handle: FakeGpuHandle) -> list[int]:
        """[percent, sampling period us]. Training never encodes video; boards without NVENC (H100,
        A100) answer 0 all the same, as the recorded H100 does ("Encoder: 0 %")."""
        self._device(handle, "nvmlDeviceGetEncoderUtilization")
        return [0, _CODEC_SAMPLING_PERIOD_US]

    def nvmlDeviceGetDecoderUtilization(self, handle: FakeGpuHandle) -> list[int]:
        """[percent, sampling period us]: 0, as on the recorded H100 ("Decoder: 0 %"); a training job
        feeding images or video through NVDEC would move it, and no scenario does."""
        self._device(handle, "nvmlDeviceGetDecoderUtilization")
        return [0, _CODEC_SAMPLING_PERIOD_US]

    def nvmlDeviceGetClockInfo(self, handle: FakeGpuHandle, clock_type: int) -> int:
        t = self._device(handle, "nvmlDeviceGetClockInfo")
        p = handle.profile
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return p.memory_clock_max_mhz
        if clock_type != pynvml.NVML_CLOCK_SM and clock_type != pynvml.NVML_CLOCK_GRAPHICS:
            raise pynvml.NVMLError_InvalidArgument()
        w = handle.window(t)
        if w is not None:
            return int(p.sm_clock_max_mhz * w.clock_ratio)
        return p.sm_clock_max_mhz if handle.utilization(t) > 0 else p.sm_clock_idle_mhz

    def nvmlDeviceGetTemperature(self, handle: FakeGpuHandle, sensor: int) -> int:
        t = self._device(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_InvalidArgument()
        p = handle.profile
        w = handle.window(t)
        if w is not None and w.hot:
            return p.slowdown_temperature_celsius + 1
        u = handle.utilization(t)
        drift = handle.grown(handle.temperature_drift, t) if handle.temperature_drift else 0
        return round(p.temperature_idle_celsius + (p.temperature_busy_celsius - p.temperature_idle_celsius) * u) + drift

    def nvmlDeviceGetFieldValues(self, handle: FakeGpuHandle, field_ids: Sequence[int | tuple[int, int]]) -> Any:
        """As pynvml: each entry a field id or (field id, scope id)."""
        t = self._device(handle, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        # The numeric fields set as ctypes sets them, past pynvml's str-encoding __setattr__ (these
        # are all numbers: the same bytes, without a wrapper call per field).
        put, get = ctypes.Structure.__setattr__, object.__getattribute__
        for i, entry in enumerate(field_ids):
            field_id, scope = entry if isinstance(entry, tuple) else (entry, 0)
            v = values[i]
            put(v, "fieldId", field_id)
            put(v, "scopeId", scope)
            if field_id in _NVLINK_FIELDS:
                links = handle.nvlink_count
                if not links:
                    put(v, "nvmlReturn", _NOT_SUPPORTED)
                elif scope != _ALL_LINKS and not 0 <= scope < links:
                    put(v, "nvmlReturn", _INVALID_ARGUMENT)
                else:
                    kib = handle.nvlink_data_kib(t)
                    put(v, "valueType", _UNSIGNED_LONG_LONG)
                    get(v, "value").ullVal = kib if scope == _ALL_LINKS else kib // links
                    put(v, "nvmlReturn", _SUCCESS)
            elif field_id == _RECOVERY_FIELD:
                if not handle.recovery_action_supported:  # a driver that predates the field
                    put(v, "nvmlReturn", _NOT_SUPPORTED)
                else:
                    put(v, "valueType", _UNSIGNED_INT)
                    get(v, "value").uiVal = handle.recovery_action(t)
                    put(v, "nvmlReturn", _SUCCESS)
            elif field_id == _MEMORY_TEMP_FIELD:
                p = handle.profile
                u = handle.utilization(t)
                span = p.memory_temperature_busy_celsius - p.memory_temperature_idle_celsius
                put(v, "valueType", _UNSIGNED_INT)
                extra = sum(x for start, end, x in handle.hbm_extra if start <= t < end) if handle.hbm_extra else 0
                get(v, "value").uiVal = round(p.memory_temperature_idle_celsius + span * u + extra)
                put(v, "nvmlReturn", _SUCCESS)
            else:
                put(v, "nvmlReturn", _NOT_SUPPORTED)
        return values

    def _power_mw(self, handle: FakeGpuHandle, t: float) -> int:
        p = handle.profile
        w = handle.window(t)
        u = handle.utilization(t)
        if w is not None and w.reasons & _SW_POWER_CAP and u > 0.0:
            # Capped: at the limit whatever the clock (a slowdown below cuts the draw with it).
            ratio = _CAPPED_DRAW_RATIO + _CAPPED_DRAW_PER_UTILIZATION * (u - handle.load.utilization)
            return int(handle.power_limit_mw(t) * min(ratio, 1.0))
        if w is not None:
            u *= w.clock_ratio
        if handle.spinning(t):
            u = _SPIN_POWER_SHARE
        draw = int(p.power_idle_mw + (p.power_busy_mw - p.power_idle_mw) * u)
        # A drifted (lowered) limit holds the draw under it, as the board's power controller does.
        return min(draw, handle.power_limit_mw(t)) if handle.config_drifts else draw

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpuHandle) -> int:
        t = self._device(handle, "nvmlDeviceGetPowerUsage")
        return self._power_mw(handle, t)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeGpuHandle) -> int:
        t = self._device(handle, "nvmlDeviceGetEnforcedPowerLimit")
        return handle.power_limit_mw(t)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeGpuHandle) -> int:
        t = self._device(handle, "nvmlDeviceGetTotalEnergyConsumption")
        # Integrates the noise-free draw (mW * s = mJ) so the counter never goes backwards.
        p = handle.profile
        mean_mw = p.power_idle_mw + (p.power_busy_mw - p.power_idle_mw) * handle.load.utilization
        return handle.energy_base_mj + int(mean_mw * max(t, 0.0))

    def nvmlDeviceGetPerformanceState(self, handle: FakeGpuHandle) -> int:
        self._device(handle, "nvmlDeviceGetPerformanceState")
        return 0  # HGX boards in persistence mode sit in P0 even when idle (see the recording)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeGpuHandle) -> int:
        t = self._device(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        w = handle.window(t)
        reasons = w.reasons if w is not None else 0
        if handle.utilization(t) == 0.0:
            reasons |= _IDLE
        return reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGpuHandle, error_type: int, counter_type: int) -> int:
        t = self._device(handle, "nvmlDeviceGetTotalEccErrors")
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return handle.grown(handle.ecc_growth, t)
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return handle.stepped(handle.ecc_uncorrected, t)
        raise pynvml.NVMLError_InvalidArgument()

    def nvmlDeviceGetRetiredPages(self, handle: FakeGpuHandle, cause: int) -> list[int]:
        self._device(handle, "nvmlDeviceGetRetiredPages")
        return []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeGpuHandle) -> int:
        self._device(handle, "nvmlDeviceGetRetiredPagesPendingStatus")
        return pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, handle: FakeGpuHandle) -> tuple[int, int, int, int]:
        t = self._device(handle, "nvmlDeviceGetRemappedRows")
        remapped_rows = handle.stepped(handle.remap_pending, t)
        # A remap waits for the next GPU reset (rows scripted before the last reset are done);
        # the failure means no spare row was left.
        pending_rows = remapped_rows - handle.stepped(handle.remap_pending, handle.reset_at)
        failed = t >= handle.remap_failure_at
        uncorrectable = remapped_rows + handle.stepped(handle.ecc_uncorrected, t) + (1 if failed else 0)
        return (0, uncorrectable, 1 if pending_rows else 0, 1 if failed else 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpuHandle) -> list[Any]:
        """The PIDs in ``running_pids[index]`` (set by a test or the simulator), as pynvml returns
        them: friendly objects with pid, usedGpuMemory (bytes), gpuInstanceId, computeInstanceId."""
        t = self._device(handle, "nvmlDeviceGetComputeRunningProcesses")
        migs = [m for m in handle.mig_slots if m is not None] if handle.mig_enabled else []
        out = []
        for i, pid in enumerate(self._pids(handle, t)):
            mig = migs[i % len(migs)] if migs else None  # on a MIG GPU: the processes spread over its devices
            out.append(pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_v3_t(
                pid=pid, usedGpuMemory=60 << 30 if mig is None else mig.memory_total_bytes * 3 // 4,
                gpuInstanceId=_NO_INSTANCE if mig is None else mig.gpu_instance_id,
                computeInstanceId=_NO_INSTANCE if mig is None else mig.compute_instance_id)))
        return out

    def _pids(self, handle: FakeGpuHandle, t: float) -> list[int]:
        """The compute processes on ``handle`` at scenario time ``t``: the test's, then the
        scenario's that have started and not yet ended."""
        scripted = [p.pid for p in self.scenario.processes
                    if p.gpu == handle.index and p.from_seconds <= t
                    and (p.until_seconds is None or t < p.until_seconds)]
        return [*self.running_pids.get(handle.index, ()), *scripted]

    # --- MIG ----------------------------------------------------------------------------------

    def _mig(self, handle: FakeMigHandle) -> float:
        """The checks of a call on a MIG device: its parent's, and the instance still existing."""
        parent = handle.parent
        t = self._device(parent, "nvmlDeviceGetMigDeviceHandleByIndex")
        slots = parent.mig_slots
        if not parent.mig_enabled or handle.slot >= len(slots) or slots[handle.slot] is not handle:
            raise pynvml.NVMLError_InvalidArgument()  # destroyed by a reconfiguration: a stale handle
        return t

    def nvmlDeviceGetMigMode(self, handle: FakeGpuHandle) -> list[int]:
        """[current, pending], NVML_DEVICE_MIG_ENABLE (1) or _DISABLE (0); NotSupported before Ampere."""
        self._device(handle, "nvmlDeviceGetMigMode")
        return [int(handle.mig_enabled), int(handle.mig_pending)]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpuHandle) -> int:
        """NVML: "zero if MIG is not supported or enabled"."""
        self._device(handle, "nvmlDeviceGetMaxMigDeviceCount")
        if not handle.mig_enabled or "nvmlDeviceGetMigMode" in handle.profile.not_supported:
            return 0
        return MIG_DEVICES_MAX

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpuHandle, index: int) -> FakeMigHandle:
        """InvalidArgument past the maximum count (0 with MIG off), NotFound for an empty slot."""
        self._device(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not handle.mig_enabled or not 0 <= index < MIG_DEVICES_MAX:
            raise pynvml.NVMLError_InvalidArgument()
        mig = handle.mig_slots[index] if index < len(handle.mig_slots) else None
        if mig is None:
            raise pynvml.NVMLError_NotFound()
        return mig

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeGpuHandle | FakeMigHandle) -> int:
        if not isinstance(handle, FakeMigHandle):  # NVML: NotSupported "if device is not a MIG device"
            self._device(handle, "nvmlDeviceGetGpuInstanceId")
            raise pynvml.NVMLError_NotSupported()
        self._mig(handle)
        return handle.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeGpuHandle | FakeMigHandle) -> int:
        if not isinstance(handle, FakeMigHandle):
            self._device(handle, "nvmlDeviceGetComputeInstanceId")
            raise pynvml.NVMLError_NotSupported()
        self._mig(handle)
        return handle.compute_instance_id

    # --- nvidia-smi --gpu-reset --------------------------------------------------------------

    def nvidia_smi(self, argv: Sequence[str], timeout_seconds: float) -> str:
        """A command runner (agent.seams.CommandRunner) imitating ``nvidia-smi --gpu-reset -i
        <pci bus id>``, the one command the backend runs: like the real one it refuses (exit 1) a
        GPU that compute processes hold or a bus id it does not know; otherwise the GPU's lost,
        reset-required and remap-pending faults scripted so far are cleared, its processes are
        gone, and the reset is recorded in ``resets`` as (index, scenario time)."""
        args = list(argv)
        if args[:2] != ["nvidia-smi", "--gpu-reset"] or len(args) != 4 or args[2] != "-i":
            raise subprocess.CalledProcessError(2, args, output="", stderr="fake nvidia-smi: unsupported arguments")
        t = self.now()
        handle = next((h for h in self.handles if h.pci_bus_id.lower() == args[3].lower()), None)
        if handle is None or t >= self._unavailable_at:
            raise subprocess.CalledProcessError(
                1, args, output="", stderr=f"No devices were found matching the given PCI bus id {args[3]}")
        if self._pids(handle, t):
            raise subprocess.CalledProcessError(
                1, args, output=f"GPU {handle.pci_bus_id} is currently in use by another process.\n", stderr="")
        handle.reset_at = t
        if handle.mig_pending != handle.mig_enabled:  # a reset applies a pending MIG mode change
            handle.mig_enabled = handle.mig_pending
            handle.mig_slots = []
        if handle.lost_at <= t:
            handle.lost_at = math.inf
        if handle.reset_required_at <= t:
            handle.reset_required_at = math.inf
        self.running_pids.pop(handle.index, None)
        self.resets.append((handle.index, t))
        return f"GPU {handle.pci_bus_id} was successfully reset.\n"

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeGpuHandle) -> int:
        t = self._device(handle, "nvmlDeviceGetPcieReplayCounter")
        return handle.pcie_replay_base + handle.grown(handle.pcie_replay_growth, t)

    def nvmlDeviceGetPcieThroughput(self, handle: FakeGpuHandle, counter: int) -> int:
        t = self._device(handle, "nvmlDeviceGetPcieThroughput")
        if handle.spinning(t):
            return 10  # KB/s: doorbells and the proxy's polls, no payload
        u = handle.utilization(t)
        kb_per_second = handle.profile.pcie_max_bytes_per_second // 1000 // 50  # ~2% of the link
        share = 1.0 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 0.6
        return int(kb_per_second * share * (0.05 + u))

    def nvmlDeviceGetFanSpeed(self, handle: FakeGpuHandle) -> int:
        self._device(handle, "nvmlDeviceGetFanSpeed")
        return 40

    # --- GPM (Hopper and later) ---------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, handle: FakeGpuHandle) -> pynvml.c_nvmlGpmSupport_t:
        self._device(handle, "nvmlGpmQueryDeviceSupport")
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1 if handle.profile.gpm_supported else 0
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        """A c_nvmlGpmSample_t (pynvml's opaque pointer type) to a buffer of the fake's own."""
        self._live()
        sample = _FakeGpmSample()
        pointer = ctypes.cast(sample.buffer, pynvml.c_nvmlGpmSample_t)
        self.gpm_samples[_pointer_address(pointer)] = sample
        return pointer

    def _gpm_sample(self, pointer: Any) -> _FakeGpmSample:
        sample = self.gpm_samples.get(_pointer_address(pointer))
        if sample is None:  # freed, or never allocated here
            raise pynvml.NVMLError_InvalidArgument()
        return sample

    def nvmlGpmSampleFree(self, pointer: Any) -> None:
        self._gpm_sample(pointer)
        del self.gpm_samples[_pointer_address(pointer)]

    def nvmlGpmSampleGet(self, handle: FakeGpuHandle, pointer: Any) -> Any:
        t = self._device(handle, "nvmlGpmSampleGet")
        if not handle.profile.gpm_supported:
            raise pynvml.NVMLError_NotSupported()
        sample = self._gpm_sample(pointer)
        sample.handle, sample.t = handle, t
        return pointer

    def nvmlGpmMetricsGet(self, metrics_get: Any) -> Any:
        """Fills ``metrics[i].value`` (and nvmlReturn) for each requested metricId, from the two
        samples' GPU over the interval between them, as the real call does."""
        self._live()
        # The numeric fields set and read as ctypes does, past pynvml's str/bytes wrappers.
        get, put = object.__getattribute__, ctypes.Structure.__setattr__
        if get(metrics_get, "version") != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        first = self._gpm_sample(get(metrics_get, "sample1"))
        second = self._gpm_sample(get(metrics_get, "sample2"))
        handle = second.handle
        if handle is None or first.handle is not handle or first.t is None or second.t is None:
            raise pynvml.NVMLError_InvalidArgument()
        t = self._device(handle, "nvmlGpmMetricsGet")
        if not handle.profile.gpm_supported:
            raise pynvml.NVMLError_NotSupported()
        values = handle.gpm(min(second.t, t))
        slots = get(metrics_get, "metrics")
        not_supported, success = _NOT_SUPPORTED, _SUCCESS
        for i in range(get(metrics_get, "numMetrics")):
            metric = slots[i]
            value = values.get(get(metric, "metricId"))
            if value is None:
                put(metric, "nvmlReturn", not_supported)
            else:
                put(metric, "value", value)
                put(metric, "nvmlReturn", success)
        return metrics_get

    # --- NVLink --------------------------------------------------------------------------------

    def _link(self, handle: FakeGpuHandle, link: int) -> float:
        # The device checks of _device, inlined: NVLink queries are most of a cycle's calls.
        t = self._clock() - self._start
        if t >= self._unavailable_at:
            raise pynvml.NVMLError_DriverNotLoaded()
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        if t >= handle.lost_at:
            raise pynvml.NVMLError_GpuIsLost()
        if t >= handle.reset_required_at:
            raise pynvml.NVMLError_ResetRequired()
        if not 0 <= link < handle.nvlink_count:
            raise pynvml.NVMLError_InvalidArgument()
        return t

    def nvmlDeviceGetNvLinkState(self, handle: FakeGpuHandle, link: int) -> int:
        # _link's checks in one expression; when one fails, _link raises what NVML would.
        t = self._clock() - self._start
        if not (t < self._unavailable_at and self._initialized and t < handle.lost_at
                and t < handle.reset_required_at and 0 <= link < handle.nvlink_count):
            t = self._link(handle, link)
        down = t >= handle.nvlink_down_at.get(link, math.inf)
        return pynvml.NVML_FEATURE_DISABLED if down else pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: FakeGpuHandle, link: int, counter: int) -> int:
        t = self._clock() - self._start
        if not (t < self._unavailable_at and self._initialized and t < handle.lost_at
                and t < handle.reset_required_at and 0 <= link < handle.nvlink_count):
            t = self._link(handle, link)
        kind = _NVLINK_COUNTER_KIND.get(counter)
        if kind is None:
            raise pynvml.NVMLError_NotSupported()
        if not handle.nvlink_growth:
            return 0
        growths = handle.nvlink_growth.get((link, kind))
        return handle.grown(growths, t) if growths else 0

    # --- events --------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> _FakeEventSet:
        self._live()
        return _FakeEventSet()

    def nvmlDeviceRegisterEvents(self, handle: FakeGpuHandle, event_types: int, event_set: _FakeEventSet) -> None:
        self._device(handle, "nvmlDeviceRegisterEvents")
        if event_types & ~pynvml.nvmlEventTypeXidCriticalError:
            raise pynvml.NVMLError_NotSupported()  # the fake only produces Xid events
        event_set.devices[handle.index] = handle
        event_set.delivered.setdefault(handle.index, 0)

    def nvmlEventSetWait_v2(self, event_set: _FakeEventSet, timeout_ms: int) -> FakeEventData:
        # Bounded in real time whatever the scenario clock does: a frozen test clock must not hang.
        polls = math.ceil(timeout_ms / 1000.0 / _EVENT_POLL_SECONDS) if timeout_ms > 0 else 0
        for attempt in range(polls + 1):
            t = self._live()
            pending = False
            for index, handle in event_set.devices.items():
                sent = event_set.delivered[index]
                if sent < len(handle.xids):
                    if handle.xids[sent][0] <= t:
                        event_set.delivered[index] = sent + 1
                        return FakeEventData(handle, pynvml.nvmlEventTypeXidCriticalError, handle.xids[sent][1])
                    pending = True
            if attempt == polls or event_set.freed.is_set():
                break
            if not pending and self._unavailable_at == math.inf:
                # Nothing scripted is left to deliver and NVML never goes away: no re-check can
                # change the answer, so sleep out the whole wait as NVML's own blocking call does
                # (a 50 ms re-check was 20 wake-ups a second of an idle agent's Xid thread).
                event_set.freed.wait((polls - attempt) * _EVENT_POLL_SECONDS)
                break
            event_set.freed.wait(_EVENT_POLL_SECONDS)
        raise pynvml.NVMLError_Timeout()

    def nvmlEventSetFree(self, event_set: _FakeEventSet) -> None:
        event_set.freed.set()
