"""FakeAmdSmi: a stand-in for AMD's ``amdsmi`` Python module, driven by a node scenario and a clock.

It answers the amdsmi functions AmdSmiBackend calls with amdsmi's names, argument enums (checked as
amdsmi checks them: a wrong type raises AmdSmiParameterException), return dicts and units (MHz, W,
uW, bytes, percent, C, energy ticks), and its exceptions (AmdSmiLibraryException carrying an
AMDSMI_STATUS_* code). Every name the fake was not taught fails loudly (AttributeError naming it).
A GPU's timeline (load, faults, resets) is FakeNvml's FakeGpuHandle over the scenario, so one
scenario language drives both vendors. It loads no library and does no I/O.

API source: ROCm/amdsmi, py-interface/amdsmi_interface.py, amdsmi_exception.py and amdsmi_wrapper.py
(commit 0ceca28f, ROCm 6.3; amdsmi_get_gpu_xgmi_link_status from ROCm 6.4+'s amdsmi_interface.py);
units from py-interface/README.md ("amdsmi Python API").
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import Any

from vigil.agent.amdsmi.profiles import AMD_PROFILES, AmdProfile
from vigil.agent.nvml.fake import _HW_POWER_BRAKE, _SW_POWER_CAP, FakeGpuHandle
from vigil.agent.nvml.scenario import Load, NodeScenario

Clock = Callable[[], float]

# amdsmi_wrapper.py's status codes (amdsmi_status_t), those the fake raises or the backend reads.
AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NOT_YET_IMPLEMENTED = 3
AMDSMI_STATUS_FAIL_LOAD_MODULE = 4
AMDSMI_STATUS_DRM_ERROR = 6
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_IO = 12
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_BUSY = 30
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
AMDSMI_STATUS_NO_DATA = 40
AMDSMI_STATUS_AMDGPU_RESTART_ERR = 54


# --- amdsmi's enums (amdsmi_interface.py, values from amdsmi_wrapper.py) ---------------------------

class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2
    HBM_0 = 3
    HBM_1 = 4
    HBM_2 = 5
    HBM_3 = 6
    PLX = 7


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2
    MAX_HYST = 3
    MIN_HYST = 4
    CRITICAL = 5
    CRITICAL_HYST = 6
    EMERGENCY = 7
    EMERGENCY_HYST = 8


class AmdSmiGpuBlock(IntEnum):
    INVALID = 0
    UMC = 1
    SDMA = 2
    GFX = 4
    MMHUB = 8
    ATHUB = 16
    PCIE_BIF = 32
    HDP = 64
    XGMI_WAFL = 128
    DF = 256
    SMN = 512
    SEM = 1024
    MP0 = 2048
    MP1 = 4096
    FUSE = 8192
    MCA = 16384
    VCN = 32768
    JPEG = 65536
    IH = 131072
    MPIO = 262144


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiMemoryPageStatus(IntEnum):
    RESERVED = 0
    PENDING = 1
    UNRESERVABLE = 2


class AmdSmiEvtNotificationType(IntEnum):
    NONE = 0
    VMFAULT = 1
    THERMAL_THROTTLE = 2
    GPU_PRE_RESET = 3
    GPU_POST_RESET = 4
    RING_HANG = 5


# --- amdsmi's exceptions (amdsmi_exception.py) ----------------------------------------------------

class AmdSmiException(Exception):
    """Base smi exception class"""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, received: Any, expected: Any, msg: str | None = None) -> None:
        super().__init__(msg)
        self.err_code = None
        self.err_msg = msg or f"Invalid parameter:\nActual type: {type(received)}\nExpected type: {expected}"

    def __str__(self) -> str:
        return self.err_msg


# The busy GPU's memory-controller (UMC) activity as a share of its graphics activity: a training
# step's HBM traffic (modelled; FakeNvml's DRAM share of a training load is 0.38).
_UMC_SHARE = 0.38
_BUSY_MEMORY_BYTES = 150 << 30  # a process's VRAM on a busy GPU (modelled)
_PAGE_SIZE = 4096
_EVENT_POLL_SECONDS = 0.05  # a read waits at most this long in real time (the scenario clock may be fake)


class FakeAmdHandle:
    """One GPU (amdsmi_processor_handle): its timeline is FakeNvml's handle over the scenario, plus
    the faults only amdsmi reports (bad pages, XGMI link errors as RAS counts)."""

    def __init__(self, index: int, profile: AmdProfile, scenario: NodeScenario, seed: int) -> None:
        self.index = index
        self.profile = profile
        self.timeline = FakeGpuHandle(index, profile.device, scenario, seed)
        digest = hashlib.sha256(f"amd:{seed}:{profile.device.key}:{index}".encode()).hexdigest()
        # amdsmi's UUID form: 8-4-4-4-12 hex, the device id in the first group ("xxxx74a1-...").
        self.uuid = f"{digest[:4]}{profile.device_id:04x}-{digest[4:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:28]}"
        self.serial = f"0x{digest[28:44].upper()}"
        self.bdf = profile.device.pcie_bus_ids[index]
        # Bad pages: (at, count, status); an uncorrectable UMC error retires one page (reserved).
        self.bad_pages: list[tuple[float, int, int]] = []
        for fault in scenario.faults:
            if getattr(fault, "gpu", None) != index:
                continue
            if fault.kind == "bad_pages":
                status = AmdSmiMemoryPageStatus[fault.status.upper()]
                self.bad_pages.append((fault.at_seconds, fault.count, int(status)))
            elif fault.kind == "ecc_uncorrectable":
                self.bad_pages.append((fault.at_seconds, fault.count, int(AmdSmiMemoryPageStatus.RESERVED)))
        # Events delivered so far (the event reader's cursor): (kind, scenario time) pairs.
        self.events_delivered: set[tuple[int, float]] = set()


class FakeAmdEventReader:
    """amdsmi.AmdSmiEventReader: registers one GPU for the notification types, reads the node's."""

    def __init__(self, fake: FakeAmdSmi, handle: Any, event_types: Iterable[AmdSmiEvtNotificationType]) -> None:
        if not isinstance(handle, FakeAmdHandle):
            raise AmdSmiParameterException(handle, FakeAmdHandle)
        types = list(event_types)
        for event_type in types:
            if not isinstance(event_type, AmdSmiEvtNotificationType):
                raise AmdSmiParameterException(event_type, AmdSmiEvtNotificationType)
        fake._device(handle)
        self._fake = fake
        self.handle = handle
        self.types = frozenset(int(t) for t in types)
        self.stopped = False
        fake.event_readers.append(self)

    def read(self, timeout_ms: int, num_elem: int = 10) -> list[dict[str, Any]]:
        """The pending notifications of the node's registered GPUs, at most ``num_elem``, waiting up
        to ``timeout_ms`` (capped in real time) when there are none. A notification is delivered once."""
        out = self._fake._pending_events(num_elem)
        if not out:
            self._fake._event_wait.wait(min(timeout_ms / 1000.0, _EVENT_POLL_SECONDS))
        return out

    def stop(self) -> None:
        self.stopped = True


class FakeAmdSmi:
    """Imitates the amdsmi module for one node. Scenario time is ``clock() - start``."""

    def __init__(self, scenario: NodeScenario, clock: Clock, start: float | None = None, seed: int = 0) -> None:
        profile = AMD_PROFILES.get(scenario.profile)
        if profile is None:
            raise ValueError(f"FakeAmdSmi needs an AMD profile ({sorted(AMD_PROFILES)}), not {scenario.profile!r}")
        self.scenario = scenario
        self.profile = profile
        self._clock = clock
        self._start = clock() if start is None else start
        self.handles = [FakeAmdHandle(i, profile, scenario, seed) for i in range(scenario.gpus)]
        self._unavailable_at = min((f.at_seconds for f in scenario.faults if f.kind == "nvml_unavailable"),
                                   default=math.inf)
        self._initialized = 0
        self.running_pids: dict[int, list[int]] = {}  # GPU index -> PIDs a test or the simulator sets
        self.resets: list[tuple[int, float]] = []  # (GPU index, scenario time) of each reset
        self.calls: set[str] = set()  # every amdsmi name the backend called (the coverage test reads it)
        self.event_readers: list[FakeAmdEventReader] = []
        self._event_wait = threading.Event()  # never set: a bounded real-time wait for read()
        self._reset_events: list[tuple[float, int, int]] = []  # (t, gpu, event type) from resets

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the class does not define: nothing passes through.
        raise AttributeError(
            f"FakeAmdSmi does not implement amdsmi.{name}: teach agent/amdsmi/fake.py before the backend calls it")

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("amdsmi_") or name == "AmdSmiEventReader":
            object.__getattribute__(self, "calls").add(name)
        return object.__getattribute__(self, name)

    def now(self) -> float:
        return self._clock() - self._start

    # --- checks as the library makes them ---------------------------------------------------

    def _live(self) -> float:
        t = self.now()
        if t >= self._unavailable_at:
            raise AmdSmiLibraryException(AMDSMI_STATUS_DRIVER_NOT_LOADED)
        if not self._initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        return t

    def _device(self, handle: Any) -> float:
        if not isinstance(handle, FakeAmdHandle):
            raise AmdSmiParameterException(handle, FakeAmdHandle)
        t = self._live()
        timeline = handle.timeline
        if t >= timeline.lost_at:  # a GPU gone from under its handle (hung, off the bus)
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_FOUND)
        if t >= timeline.reset_required_at:  # amdgpu's recovery (its GPU reset) failed
            raise AmdSmiLibraryException(AMDSMI_STATUS_AMDGPU_RESTART_ERR)
        return t

    @staticmethod
    def _enum(value: Any, enum: type[IntEnum]) -> None:
        if not isinstance(value, enum):
            raise AmdSmiParameterException(value, enum)

    # --- library ----------------------------------------------------------------------------

    def amdsmi_init(self, flag: AmdSmiInitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        self._enum(flag, AmdSmiInitFlags)
        if self.now() >= self._unavailable_at:
            raise AmdSmiLibraryException(AMDSMI_STATUS_DRIVER_NOT_LOADED)
        self._initialized += 1

    def amdsmi_shut_down(self) -> None:
        if not self._initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        self._initialized -= 1

    def amdsmi_get_processor_handles(self) -> list[FakeAmdHandle]:
        self._live()
        return list(self.handles)

    # --- identity -----------------------------------------------------------------------------

    def amdsmi_get_gpu_device_uuid(self, handle: Any) -> str:
        self._device(handle)
        return str(handle.uuid)

    def amdsmi_get_gpu_device_bdf(self, handle: Any) -> str:
        self._device(handle)
        return str(handle.bdf)

    def amdsmi_get_gpu_asic_info(self, handle: Any) -> dict[str, Any]:
        self._device(handle)
        p = handle.profile
        return {"market_name": p.device.name, "vendor_id": "0x1002",
                "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
                "subvendor_id": "0x1002", "device_id": hex(p.device_id), "rev_id": "0x00",
                "asic_serial": handle.serial, "oam_id": handle.index, "num_compute_units": p.compute_units,
                "target_graphics_version": "gfx942"}

    def amdsmi_get_gpu_vbios_info(self, handle: Any) -> dict[str, str]:
        self._device(handle)
        version = handle.profile.device.vbios_version
        return {"name": "AMD MI300X_HW_SRIOV_CVS_1VF", "build_date": "2024/05/08 10:26",
                "part_number": version, "version": "022.040.003.043.000001"}

    def amdsmi_get_gpu_driver_info(self, handle: Any) -> dict[str, str]:
        self._device(handle)
        return {"driver_name": "amdgpu", "driver_version": handle.profile.device.driver_version,
                "driver_date": "2015/01/01 00:00"}

    def amdsmi_get_gpu_memory_total(self, handle: Any, mem_type: AmdSmiMemoryType) -> int:
        self._device(handle)
        self._enum(mem_type, AmdSmiMemoryType)
        if mem_type != AmdSmiMemoryType.VRAM:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return int(handle.profile.device.memory_total_bytes)

    def amdsmi_get_gpu_memory_usage(self, handle: Any, mem_type: AmdSmiMemoryType) -> int:
        t = self._device(handle)
        self._enum(mem_type, AmdSmiMemoryType)
        if mem_type != AmdSmiMemoryType.VRAM:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        timeline = handle.timeline
        busy = timeline.utilization(t) > 0 or bool(self._pids(handle, t))
        ratio = timeline.load.memory_used_ratio if busy else 0.0
        return int(handle.profile.device.memory_total_bytes * ratio) + (300 << 20)  # driver's own ~300 MiB

    # --- load, clocks, temperatures, power ----------------------------------------------------

    def amdsmi_get_gpu_activity(self, handle: Any) -> dict[str, Any]:
        t = self._device(handle)
        u = handle.timeline.utilization(t)
        return {"gfx_activity": round(100 * u), "umc_activity": round(100 * u * _UMC_SHARE), "mm_activity": "N/A"}

    def amdsmi_get_clock_info(self, handle: Any, clock_type: AmdSmiClkType) -> dict[str, Any]:
        t = self._device(handle)
        self._enum(clock_type, AmdSmiClkType)
        p = handle.profile.device
        timeline = handle.timeline
        if clock_type == AmdSmiClkType.MEM:
            busy = timeline.utilization(t) > 0
            return {"clk": p.memory_clock_max_mhz if busy else 900, "min_clk": 900, "max_clk": p.memory_clock_max_mhz,
                    "clk_locked": "N/A", "clk_deep_sleep": "DISABLED"}
        if clock_type != AmdSmiClkType.GFX:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        w = timeline.window(t)
        if w is not None:
            clk = int(p.sm_clock_max_mhz * w.clock_ratio)
        else:
            clk = p.sm_clock_max_mhz if timeline.utilization(t) > 0 else p.sm_clock_idle_mhz
        return {"clk": clk, "min_clk": 500, "max_clk": p.sm_clock_max_mhz, "clk_locked": "DISABLED",
                "clk_deep_sleep": "ENABLED" if clk == p.sm_clock_idle_mhz else "DISABLED"}

    def amdsmi_get_temp_metric(self, handle: Any, sensor: AmdSmiTemperatureType,
                               metric: AmdSmiTemperatureMetric) -> int:
        t = self._device(handle)
        self._enum(sensor, AmdSmiTemperatureType)
        self._enum(metric, AmdSmiTemperatureMetric)
        p = handle.profile
        d = p.device
        if sensor.name in p.temperature_not_supported or sensor not in (
                AmdSmiTemperatureType.HOTSPOT, AmdSmiTemperatureType.VRAM):
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        hotspot = sensor == AmdSmiTemperatureType.HOTSPOT
        if metric == AmdSmiTemperatureMetric.CRITICAL:
            return d.slowdown_temperature_celsius if hotspot else d.memory_max_temperature_celsius
        if metric == AmdSmiTemperatureMetric.EMERGENCY:
            return p.hotspot_emergency_celsius if hotspot else d.memory_max_temperature_celsius + 5
        if metric != AmdSmiTemperatureMetric.CURRENT:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        timeline = handle.timeline
        u = timeline.utilization(t)
        if hotspot:
            w = timeline.window(t)
            if w is not None and w.hot:
                return d.slowdown_temperature_celsius + 1
            drift = timeline.grown(timeline.temperature_drift, t) if timeline.temperature_drift else 0
            busy_span = d.temperature_busy_celsius - d.temperature_idle_celsius
            return round(d.temperature_idle_celsius + busy_span * u) + drift
        extra = sum(x for start, end, x in timeline.hbm_extra if start <= t < end)
        span = d.memory_temperature_busy_celsius - d.memory_temperature_idle_celsius
        return round(d.memory_temperature_idle_celsius + span * u + extra)

    def _power_w(self, handle: FakeAmdHandle, t: float) -> float:
        d = handle.profile.device
        timeline = handle.timeline
        u = timeline.utilization(t)
        w = timeline.window(t)
        if w is not None and w.reasons & _SW_POWER_CAP and u > 0:
            return d.power_limit_mw / 1000.0 * 0.985  # held at the cap (PPT), as FakeNvml's capped draw
        if w is not None:
            u *= w.clock_ratio
        return (d.power_idle_mw + (d.power_busy_mw - d.power_idle_mw) * u) / 1000.0

    def amdsmi_get_power_info(self, handle: Any) -> dict[str, Any]:
        """Socket power in W (README: current_socket_power "W"); MI300X reports the current socket
        power, not the average (N/A), and power_limit in W."""
        t = self._device(handle)
        return {"current_socket_power": round(self._power_w(handle, t)), "average_socket_power": "N/A",
                "gfx_voltage": "N/A", "soc_voltage": "N/A", "mem_voltage": "N/A",
                "power_limit": handle.profile.device.power_limit_mw // 1000}

    def amdsmi_get_power_cap_info(self, handle: Any) -> dict[str, int]:
        """In uW (README, amdsmi_get_power_cap_info: "uW")."""
        self._device(handle)
        cap = handle.profile.device.power_limit_mw * 1000
        return {"power_cap": cap, "default_power_cap": cap, "dpm_cap": 0, "min_power_cap": 0, "max_power_cap": cap}

    def amdsmi_get_energy_count(self, handle: Any) -> dict[str, Any]:
        """energy_accumulator ticks of counter_resolution uJ since the driver loaded (README:
        "energy_accumulator * counter_resolution = total_energy_consumption in micro-Joules")."""
        t = self._device(handle)
        d = handle.profile.device
        timeline = handle.timeline
        mean_w = (d.power_idle_mw + (d.power_busy_mw - d.power_idle_mw) * timeline.load.utilization) / 1000.0
        uj = timeline.energy_base_mj * 1000 + mean_w * max(t, 0.0) * 1e6
        resolution = handle.profile.energy_counter_resolution_uj
        ticks = int(uj / resolution)
        return {"power": ticks, "energy_accumulator": ticks, "counter_resolution": resolution,
                "timestamp": int(max(t, 0.0) * 1e9)}

    def amdsmi_get_violation_status(self, handle: Any) -> dict[str, Any]:
        """MI300 violation status (amdsmi 6.3+): active_* booleans; the fake leaves the
        accumulators N/A. thermal_throttle -> socket thermal, power_brake -> PROCHOT, power_cap -> PPT."""
        t = self._device(handle)
        w = handle.timeline.window(t)
        reasons = w.reasons if w is not None else 0
        thermal = bool(w is not None and w.hot)
        out: dict[str, Any] = {key: "N/A" for key in (
            "reference_timestamp", "violation_timestamp", "acc_counter", "acc_prochot_thrm", "acc_ppt_pwr",
            "acc_socket_thrm", "acc_vr_thrm", "acc_hbm_thrm", "per_prochot_thrm", "per_ppt_pwr",
            "per_socket_thrm", "per_vr_thrm", "per_hbm_thrm")}
        out.update(active_prochot_thrm=bool(reasons & _HW_POWER_BRAKE), active_ppt_pwr=bool(reasons & _SW_POWER_CAP),
                   active_socket_thrm=thermal, active_vr_thrm=False, active_hbm_thrm=False)
        return out

    # --- memory errors ------------------------------------------------------------------------

    def amdsmi_get_gpu_ecc_enabled(self, handle: Any) -> int:
        self._device(handle)
        return sum(int(AmdSmiGpuBlock[name]) for name in handle.profile.ecc_blocks)

    def _block_counts(self, handle: FakeAmdHandle, block: AmdSmiGpuBlock, t: float) -> tuple[int, int]:
        timeline = handle.timeline
        if block == AmdSmiGpuBlock.UMC:
            return timeline.grown(timeline.ecc_growth, t), timeline.stepped(timeline.ecc_uncorrected, t)
        if block == AmdSmiGpuBlock.XGMI_WAFL:
            corrected = uncorrected = 0
            for (_, kind), growths in timeline.nvlink_growth.items():
                if kind == "recovery":
                    uncorrected += timeline.grown(growths, t)
                else:
                    corrected += timeline.grown(growths, t)
            return corrected, uncorrected
        return 0, 0

    def amdsmi_get_gpu_ecc_count(self, handle: Any, block: AmdSmiGpuBlock) -> dict[str, int]:
        t = self._device(handle)
        self._enum(block, AmdSmiGpuBlock)
        if block.name not in handle.profile.ecc_blocks:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        corrected, uncorrected = self._block_counts(handle, block, t)
        return {"correctable_count": corrected, "uncorrectable_count": uncorrected, "deferred_count": 0}

    def amdsmi_get_gpu_total_ecc_count(self, handle: Any) -> dict[str, int]:
        t = self._device(handle)
        corrected = uncorrected = 0
        for name in handle.profile.ecc_blocks:
            c, u = self._block_counts(handle, AmdSmiGpuBlock[name], t)
            corrected += c
            uncorrected += u
        return {"correctable_count": corrected, "uncorrectable_count": uncorrected, "deferred_count": 0}

    def amdsmi_get_gpu_bad_page_info(self, handle: Any) -> list[dict[str, Any]]:
        t = self._device(handle)
        reset_at = handle.timeline.reset_at
        out: list[dict[str, Any]] = []
        for at, count, status in handle.bad_pages:
            if at > t:
                continue
            # A pending page is retired (reserved) by the next GPU reset.
            now = AmdSmiMemoryPageStatus.RESERVED if status == AmdSmiMemoryPageStatus.PENDING and reset_at >= at \
                else AmdSmiMemoryPageStatus(status)
            for _ in range(count):
                out.append({"value": len(out), "page_address": 0x1_0000_0000 + len(out) * _PAGE_SIZE,
                            "page_size": _PAGE_SIZE, "status": int(now)})
        return out

    # --- links --------------------------------------------------------------------------------

    def amdsmi_get_pcie_info(self, handle: Any) -> dict[str, Any]:
        """Speeds in MT/s as the library fills them (amd-smi prints them / 1000 as GT/s)."""
        t = self._device(handle)
        timeline = handle.timeline
        generation, width = timeline.pcie_link(t)
        d = handle.profile.device
        speeds = {1: 2500, 2: 5000, 3: 8000, 4: 16000, 5: 32000, 6: 64000}
        replays = timeline.pcie_replay_base + timeline.grown(timeline.pcie_replay_growth, t)
        return {
            "pcie_static": {"max_pcie_width": d.pcie_link_width_max,
                            "max_pcie_speed": speeds[d.pcie_link_generation_max],
                            "pcie_interface_version": d.pcie_link_generation_max, "slot_type": "OAM"},
            "pcie_metric": {"pcie_width": width, "pcie_speed": speeds[generation], "pcie_bandwidth": 18,
                            "pcie_replay_count": replays,
                            "pcie_l0_to_recovery_count": 0, "pcie_replay_roll_over_count": 0,
                            "pcie_nak_sent_count": 0, "pcie_nak_received_count": 0,
                            "pcie_lc_perf_other_end_recovery_count": 0},
        }

    def amdsmi_get_gpu_xgmi_link_status(self, handle: Any) -> dict[str, Any]:
        """ROCm 6.4+: "U" up, "D" down, "X" disabled, per link."""
        t = self._device(handle)
        timeline = handle.timeline
        status = ["D" if t >= timeline.nvlink_down_at.get(link, math.inf) else "U"
                  for link in range(timeline.nvlink_count)]
        return {"status": status, "total_links": len(status)}

    # --- processes and reset ------------------------------------------------------------------

    def _pids(self, handle: FakeAmdHandle, t: float) -> list[int]:
        scripted = [p.pid for p in self.scenario.processes if p.gpu == handle.index and p.from_seconds <= t
                    and (p.until_seconds is None or t < p.until_seconds)]
        return [*self.running_pids.get(handle.index, ()), *scripted]

    def amdsmi_get_gpu_process_list(self, handle: Any) -> list[dict[str, Any]]:
        t = self._device(handle)
        return [{"name": "python3", "pid": pid, "mem": _BUSY_MEMORY_BYTES,
                 "engine_usage": {"gfx": 0, "enc": 0},
                 "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": _BUSY_MEMORY_BYTES}}
                for pid in self._pids(handle, t)]

    def amd_smi(self, argv: Sequence[str], timeout_seconds: float) -> str:
        """A command runner imitating ``amd-smi reset --gpureset --gpu <bdf>``, the one command the
        backend runs: it refuses (exit 1) a GPU that processes hold or a BDF it does not know;
        otherwise the GPU's lost and reset-required faults scripted so far are cleared, pending bad
        pages become reserved, its processes are gone, GPU_PRE_RESET and GPU_POST_RESET are
        notified, and the reset is recorded in ``resets``."""
        args = list(argv)
        if args[:3] != ["amd-smi", "reset", "--gpureset"] or len(args) != 5 or args[3] != "--gpu":
            raise subprocess.CalledProcessError(2, args, output="", stderr="fake amd-smi: unsupported arguments")
        t = self.now()
        handle = next((h for h in self.handles if h.bdf.lower() == args[4].lower()), None)
        if handle is None or t >= self._unavailable_at:
            raise subprocess.CalledProcessError(1, args, output="", stderr=f"No GPU matches {args[4]}")
        if self._pids(handle, t):
            raise subprocess.CalledProcessError(
                1, args, output="", stderr=f"GPU {handle.bdf}: AMDSMI_STATUS_BUSY - Device busy\n")
        timeline = handle.timeline
        timeline.reset_at = t
        if timeline.lost_at <= t:
            timeline.lost_at = math.inf
        if timeline.reset_required_at <= t:
            timeline.reset_required_at = math.inf
        self.running_pids.pop(handle.index, None)
        self.resets.append((handle.index, t))
        self._reset_events += [(t, handle.index, int(AmdSmiEvtNotificationType.GPU_PRE_RESET)),
                               (t, handle.index, int(AmdSmiEvtNotificationType.GPU_POST_RESET))]
        return f"GPU: {handle.index}\n    RESET: Successfully reset GPU {handle.index}\n"

    # --- events -------------------------------------------------------------------------------

    def AmdSmiEventReader(self, handle: Any,  # amdsmi's class name, called as a function
                          event_types: Iterable[AmdSmiEvtNotificationType]) -> FakeAmdEventReader:
        return FakeAmdEventReader(self, handle, event_types)

    def _pending_events(self, limit: int) -> list[dict[str, Any]]:
        """Notifications now due: RING_HANG when a GPU hangs (its gpu_lost fault: the ring times out
        before the driver gives the GPU up), THERMAL_THROTTLE when a thermal window opens, and the
        resets' pair; each once, for GPUs some open reader registered for that type."""
        t = self.now()
        wanted: dict[int, frozenset[int]] = {}
        for reader in self.event_readers:
            if not reader.stopped:
                wanted[reader.handle.index] = wanted.get(reader.handle.index, frozenset()) | reader.types
        due: list[tuple[float, int, int]] = list(self._reset_events)
        for h in self.handles:
            timeline = h.timeline
            if timeline.lost_at <= t:
                due.append((timeline.lost_at, h.index, int(AmdSmiEvtNotificationType.RING_HANG)))
            for w in timeline.windows:
                if w.hot and w.start <= t:
                    due.append((w.start, h.index, int(AmdSmiEvtNotificationType.THERMAL_THROTTLE)))
        out: list[dict[str, Any]] = []
        for at, index, kind in sorted(due):
            h = self.handles[index]
            if kind not in wanted.get(index, ()) or (kind, at) in h.events_delivered or len(out) >= limit:
                continue
            h.events_delivered.add((kind, at))
            out.append({"processor_handle": h, "event": AmdSmiEvtNotificationType(kind).name,
                        "message": f"fake amdgpu: {AmdSmiEvtNotificationType(kind).name.lower()} on {h.bdf}"})
        return out


# amdsmi's enums and exceptions as attributes of the module the fake stands for (amdsmi.AmdSmiClkType...).
for _name in ("AmdSmiInitFlags", "AmdSmiClkType", "AmdSmiTemperatureType", "AmdSmiTemperatureMetric", "AmdSmiGpuBlock",
              "AmdSmiMemoryType", "AmdSmiMemoryPageStatus", "AmdSmiEvtNotificationType", "AmdSmiException",
              "AmdSmiLibraryException", "AmdSmiRetryException", "AmdSmiTimeoutException", "AmdSmiParameterException"):
    setattr(FakeAmdSmi, _name, globals()[_name])

# The embedded default (`vigil agent --backend fake --vendor amd` with no scenario): a healthy node of
# 8 MI300X busy training.
DEFAULT_AMD_SCENARIO = NodeScenario(
    description="healthy 8x MI300X node running a training job",
    profile="mi300x-oam-192gb",
    gpus=8,
    load=Load(utilization=0.92, noise=0.05, memory_used_ratio=0.85),
)
