"""AmdSmiBackend: the only code that calls AMD's amdsmi library, over the real ``amdsmi`` module or
FakeAmdSmi, behind the same seam as PynvmlBackend (agent/gpu_backend.py GpuBackend).

It reads each AMD GPU's identity once and its dynamic state on demand into the NVML package's
GpuIdentity/GpuReading, converting amdsmi's units (MHz, W, uW, bytes, percent, energy ticks of
``counter_resolution`` uJ, PCIe MT/s) to base units; NOT_SUPPORTED becomes an absent field,
GPU-level errors a health state (lost, reset_required, unavailable). XGMI link status and the RAS
block counts are read on the slow cadence. It waits on amdsmi's event notifications (no Xid on AMD).
It emits no metrics and decides nothing. It never imports ``amdsmi`` at module import.

API source: ROCm/amdsmi py-interface/amdsmi_interface.py (function names, argument enums, return
dicts), amdsmi_exception.py (AmdSmiLibraryException.get_error_code), amdsmi_wrapper.py (status
codes), py-interface/README.md (units); https://rocm.docs.amd.com/projects/amdsmi ("amdsmi Python
API"). amdsmi_get_gpu_xgmi_link_status and amdsmi_get_violation_status need ROCm 6.4+ / 6.3+: an
older library lacks them and the fields they fill stay absent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from vigil.agent.gpu_backend import GpuNotification
from vigil.agent.nvml.backend import (
    RESET_TIMEOUT_SECONDS,
    GpuConfigFacts,
    GpuIdentity,
    GpuReading,
    NvLinkReading,
    XidEvent,
)
from vigil.contract.seams import CommandRunner, run_command

if TYPE_CHECKING:
    from vigil.agent.config import NvmlConfig

log = logging.getLogger(__name__)

_MHZ = 1_000_000.0

# amdsmi_status_t codes (amdsmi_wrapper.py) by the health they mean. NOT_FOUND ("Device Not found")
# is what a handle of a GPU gone from the bus or hung past recovery answers; AMDGPU_RESTART_ERR is
# amdgpu failing to restart (reset) it: the GPU needs a reset from outside. The library or driver
# gone: NOT_INIT, DRIVER_NOT_LOADED, FAIL_LOAD_MODULE, INIT_ERROR.
STATUS_NOT_SUPPORTED = (2, 3)  # NOT_SUPPORTED, NOT_YET_IMPLEMENTED: a capability, never asked again
STATUS_HEALTH: dict[int, str] = {31: "lost", 54: "reset_required", 32: "unavailable", 34: "unavailable",
                                 4: "unavailable", 18: "unavailable"}
STATUS_NAMES: dict[int, str] = {
    1: "inval", 2: "not_supported", 3: "not_yet_implemented", 4: "fail_load_module", 5: "fail_load_symbol",
    6: "drm_error", 7: "api_failed", 8: "timeout", 9: "retry", 10: "no_perm", 11: "interrupt", 12: "io",
    13: "address_fault", 14: "file_error", 15: "out_of_resources", 16: "internal_exception",
    17: "input_out_of_bounds", 18: "init_error", 19: "refcount_overflow", 30: "busy", 31: "not_found",
    32: "not_init", 33: "no_slot", 34: "driver_not_loaded", 40: "no_data", 41: "insufficient_size",
    42: "unexpected_size", 43: "unexpected_data", 52: "file_not_found", 53: "arg_ptr_null",
    54: "amdgpu_restart_err", 55: "setting_unavailable"}

# Violation (throttle) status of MI300 and later (amdsmi_get_violation_status): the active_* flag ->
# our clock-event word. Where the meaning is NVIDIA's, NVIDIA's word (agent/nvml/backend.py
# CLOCK_EVENT_REASONS), so the thermal detector and the probes judge AMD unchanged: PROCHOT (the
# hardware slowdown line) -> hw_slowdown, PPT (package power tracking: the power cap, "PVIOL") ->
# sw_power_cap, socket thermal ("TVIOL") -> hw_thermal_slowdown; voltage-regulator and HBM thermal
# limits have no NVIDIA word and keep their own.
VIOLATION_REASONS: tuple[tuple[str, str], ...] = (
    ("active_prochot_thrm", "hw_slowdown"),
    ("active_ppt_pwr", "sw_power_cap"),
    ("active_socket_thrm", "hw_thermal_slowdown"),
    ("active_vr_thrm", "vr_thermal_slowdown"),
    ("active_hbm_thrm", "hbm_thermal_slowdown"),
)
# RAS blocks read one by one on the slow cadence (AmdSmiGpuBlock names), where ECC is enabled.
ECC_BLOCKS: tuple[str, ...] = ("UMC", "SDMA", "GFX", "MMHUB", "ATHUB", "PCIE_BIF", "HDP", "XGMI_WAFL", "DF",
                               "SMN", "SEM", "MP0", "MP1", "FUSE", "MCA", "VCN", "JPEG", "IH", "MPIO")
# Event notifications listened to: every type amdsmi has (AmdSmiEvtNotificationType).
EVENT_TYPES: tuple[str, ...] = ("VMFAULT", "THERMAL_THROTTLE", "GPU_PRE_RESET", "GPU_POST_RESET", "RING_HANG")
# PCIe transfer rate (MT/s, as pcie_metric.pcie_speed holds it) -> generation.
PCIE_GENERATIONS: dict[int, int] = {2500: 1, 5000: 2, 8000: 3, 16000: 4, 32000: 5, 64000: 6}
# Functions only newer libraries have: absent from the module, their fields stay None.
OPTIONAL_FUNCTIONS = ("amdsmi_get_gpu_xgmi_link_status", "amdsmi_get_violation_status")


def _number(value: Any) -> float | None:
    """amdsmi's dict values: a number, or the string "N/A" (a max-uint sentinel) -> None."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _pcie_generation(speed: Any) -> int | None:
    mts = _number(speed)
    if mts is None:
        return None
    if mts < 100:  # GT/s, as some library versions and the CLI print it
        mts *= 1000
    return PCIE_GENERATIONS.get(int(mts))


@dataclass(frozen=True, slots=True)
class AmdProcess:
    """A process as running_processes lists it, in pynvml's names (attribution reads ``pid``)."""

    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: None = None
    computeInstanceId: None = None


class _HealthError(Exception):
    def __init__(self, health: str, reason: str) -> None:
        super().__init__(health)
        self.health = health
        self.reason = reason


class AmdSmiBackend:
    """amdsmi for the agent. ``amdsmi`` is the amdsmi module or a FakeAmdSmi (same names, same units)."""

    vendor: Literal["amd"] = "amd"
    reason_words: tuple[str, ...] = tuple(word for _, word in VIOLATION_REASONS)

    def __init__(self, amdsmi: Any, run: CommandRunner | None = None) -> None:
        self._m = amdsmi
        # amd-smi for reset_gpu: the real command, or over FakeAmdSmi its imitation.
        fake_run = getattr(type(amdsmi), "amd_smi", None)
        self._run: CommandRunner = run or (amdsmi.amd_smi if fake_run is not None else run_command)
        self._library_error: type[BaseException] = amdsmi.AmdSmiLibraryException
        self._errors: tuple[type[BaseException], ...] = (amdsmi.AmdSmiException,)
        self._optional = {name: hasattr(amdsmi, name) for name in OPTIONAL_FUNCTIONS}
        self._handles: list[Any] | None = None
        self._identities: dict[int, GpuIdentity] = {}
        self._unsupported: dict[int, set[str]] = {}
        self._ecc_blocks: dict[int, tuple[Any, ...]] = {}
        self._readers: list[Any] = []
        self._pending: list[dict[str, Any]] = []  # notifications read and not yet handed out
        m = amdsmi
        self._hotspot, self._vram, self._edge = (m.AmdSmiTemperatureType.HOTSPOT, m.AmdSmiTemperatureType.VRAM,
                                                 m.AmdSmiTemperatureType.EDGE)
        self._current = m.AmdSmiTemperatureMetric.CURRENT
        self._page_status = m.AmdSmiMemoryPageStatus

    # --- library -----------------------------------------------------------------------------

    @property
    def library(self) -> Any:
        return self._m

    @property
    def library_errors(self) -> tuple[type[BaseException], ...]:
        return self._errors

    def init(self) -> None:
        self._m.amdsmi_init(self._m.AmdSmiInitFlags.INIT_AMD_GPUS)

    def shutdown(self) -> None:
        self.close_events()
        try:
            self._m.amdsmi_shut_down()
        except self._errors as exc:
            log.warning("amdsmi_shut_down failed: %s", exc)

    def device_count(self) -> int:
        return len(self._processor_handles())

    def _processor_handles(self) -> list[Any]:
        if self._handles is None:
            self._handles = list(self._m.amdsmi_get_processor_handles())
        return self._handles

    def reason_names(self, mask: int) -> list[str]:
        return [word for bit, (_, word) in enumerate(VIOLATION_REASONS) if mask >> bit & 1]

    def health_of(self, exc: BaseException) -> str | None:
        if isinstance(exc, self._library_error):
            return STATUS_HEALTH.get(int(getattr(exc, "err_code", 0) or 0))
        return None

    def error_reason(self, exc: BaseException) -> str:
        """AmdSmiLibraryException(AMDSMI_STATUS_BUSY) -> "busy"; a parameter error -> "parameter"."""
        code = getattr(exc, "err_code", None)
        if code is None:
            return "parameter" if type(exc).__name__ == "AmdSmiParameterException" else "unknown"
        return STATUS_NAMES.get(int(code), f"status_{int(code)}")

    # --- one query -----------------------------------------------------------------------------

    def _call(self, index: int, errors: list[tuple[str, str]], name: str, *args: Any) -> Any:
        """One amdsmi call: NOT_SUPPORTED -> None (remembered), health errors raise, others -> None."""
        unsupported = self._unsupported.setdefault(index, set())
        if name in unsupported:
            return None
        if name in self._optional and not self._optional[name]:
            return None
        try:
            return getattr(self._m, name)(*args)
        except self._errors as exc:
            code = getattr(exc, "err_code", None)
            if code in STATUS_NOT_SUPPORTED:
                unsupported.add(name)
                return None
            health = self.health_of(exc)
            if health is not None:
                raise _HealthError(health, self.error_reason(exc)) from exc
            errors.append((name, self.error_reason(exc)))
            return None

    def _handle(self, index: int) -> Any:
        try:
            handles = self._processor_handles()
        except self._errors as exc:
            raise _HealthError(self.health_of(exc) or "unavailable", self.error_reason(exc)) from exc
        if not 0 <= index < len(handles):
            raise _HealthError("lost", "not_found")
        return handles[index]

    # --- identity ------------------------------------------------------------------------------

    def identity(self, index: int) -> GpuIdentity:
        """The GPU's identity and static limits, cached. Raises the AmdSmiLibraryException of a GPU
        that cannot be identified (lost, library gone); the caller reports it and retries."""
        cached = self._identities.get(index)
        if cached is not None:
            return cached
        try:
            ident = self._read_identity(index)
        except _HealthError as exc:
            raise exc.__cause__ or self._library_error(31) from None
        self._identities[index] = ident
        return ident

    def _read_identity(self, index: int) -> GpuIdentity:
        m = self._m
        h = self._handle(index)
        e: list[tuple[str, str]] = []
        q = self._call
        uuid = q(index, e, "amdsmi_get_gpu_device_uuid", h)
        if not uuid:
            raise self._library_error(43)  # UNEXPECTED_DATA: a GPU without a UUID cannot be named
        asic = q(index, e, "amdsmi_get_gpu_asic_info", h) or {}
        vbios = q(index, e, "amdsmi_get_gpu_vbios_info", h) or {}
        driver = q(index, e, "amdsmi_get_gpu_driver_info", h) or {}
        total = q(index, e, "amdsmi_get_gpu_memory_total", h, m.AmdSmiMemoryType.VRAM)
        gfx = q(index, e, "amdsmi_get_clock_info", h, m.AmdSmiClkType.GFX) or {}
        mem = q(index, e, "amdsmi_get_clock_info", h, m.AmdSmiClkType.MEM) or {}

        def threshold(sensor: Any, metric: Any) -> float | None:
            return _number(q(index, e, "amdsmi_get_temp_metric", h, sensor, metric))

        critical, emergency = m.AmdSmiTemperatureMetric.CRITICAL, m.AmdSmiTemperatureMetric.EMERGENCY
        links = q(index, e, "amdsmi_get_gpu_xgmi_link_status", h)
        serial = asic.get("asic_serial")
        gfx_max, mem_max = _number(gfx.get("max_clk")), _number(mem.get("max_clk"))
        return GpuIdentity(
            index=index, uuid=str(uuid), name=str(asic.get("market_name") or ""),
            pci_bus_id=str(q(index, e, "amdsmi_get_gpu_device_bdf", h) or ""),
            serial=None if serial in (None, "N/A") else str(serial),
            vbios_version=vbios.get("part_number") or vbios.get("version") or None,
            driver_version=driver.get("driver_version") or None,
            cuda_driver_version=None,
            memory_total_bytes=None if total is None else int(total),
            sm_clock_max_hertz=None if gfx_max is None else gfx_max * _MHZ,
            memory_clock_max_hertz=None if mem_max is None else mem_max * _MHZ,
            slowdown_temperature_celsius=threshold(self._hotspot, critical),
            shutdown_temperature_celsius=threshold(self._hotspot, emergency),
            gpu_max_temperature_celsius=None,
            memory_max_temperature_celsius=threshold(self._vram, critical),
            nvlinks=() if not links else tuple(i for i, s in enumerate(links.get("status", ())) if s != "X"),
            vendor="amd",
        )

    # --- dynamic state -------------------------------------------------------------------------

    def running_processes(self, index: int) -> list[Any] | None:
        """The GPU's processes (amdsmi_get_gpu_process_list) as AmdProcess, or None when amdsmi
        cannot say. amdsmi lists only processes the caller may see (all of them as root)."""
        try:
            h = self._handle(index)
            procs = self._call(index, [], "amdsmi_get_gpu_process_list", h)
        except _HealthError:
            return None
        if procs is None:
            return None
        return [AmdProcess(pid=int(p["pid"]), usedGpuMemory=int(_number(p.get("mem")) or 0)) for p in procs
                if p.get("pid")]

    def running_pids(self, index: int) -> list[int] | None:
        procs = self.running_processes(index)
        return None if procs is None else [p.pid for p in procs]

    def read(self, index: int, *, slow: bool = True) -> GpuReading:
        """The GPU's dynamic state now. Never raises for an amdsmi error: a lost GPU, one that needs
        a reset or a library that went away is a reading with that health and no values. With
        ``slow=False`` the energy counter, the XGMI links and the per-block RAS counts are left out."""
        reading = GpuReading(index=index)
        try:
            self._read_into(index, reading, slow)
        except _HealthError as exc:
            return GpuReading(index=index, health=exc.health, errors=[("device", exc.reason)])
        return reading

    def _read_into(self, index: int, r: GpuReading, slow: bool) -> None:
        m = self._m
        h = self._handle(index)
        e = r.errors
        q = self._call
        activity = q(index, e, "amdsmi_get_gpu_activity", h)
        if activity is not None:
            gfx, umc = _number(activity.get("gfx_activity")), _number(activity.get("umc_activity"))
            r.utilization_gpu_ratio = None if gfx is None else min(gfx / 100.0, 1.0)
            r.utilization_memory_ratio = None if umc is None else min(umc / 100.0, 1.0)
        used = q(index, e, "amdsmi_get_gpu_memory_usage", h, m.AmdSmiMemoryType.VRAM)
        r.memory_used_bytes = None if used is None else int(used)
        ident = self._identities.get(index)
        r.memory_total_bytes = ident.memory_total_bytes if ident is not None else None
        gfx_clock = q(index, e, "amdsmi_get_clock_info", h, m.AmdSmiClkType.GFX)
        clk = None if gfx_clock is None else _number(gfx_clock.get("clk"))
        r.sm_clock_hertz = None if clk is None else clk * _MHZ
        mem_clock = q(index, e, "amdsmi_get_clock_info", h, m.AmdSmiClkType.MEM)
        clk = None if mem_clock is None else _number(mem_clock.get("clk"))
        r.memory_clock_hertz = None if clk is None else clk * _MHZ
        r.temperature_celsius = _number(q(index, e, "amdsmi_get_temp_metric", h, self._hotspot, self._current))
        r.memory_temperature_celsius = _number(q(index, e, "amdsmi_get_temp_metric", h, self._vram, self._current))
        r.edge_temperature_celsius = _number(q(index, e, "amdsmi_get_temp_metric", h, self._edge, self._current))
        power = q(index, e, "amdsmi_get_power_info", h)
        if power is not None:  # W; MI300 reports the current socket power, older boards the average
            watts = _number(power.get("current_socket_power"))
            r.power_watts = watts if watts is not None else _number(power.get("average_socket_power"))
        cap = q(index, e, "amdsmi_get_power_cap_info", h)
        cap_uw = None if cap is None else _number(cap.get("power_cap"))
        r.power_limit_watts = None if cap_uw is None else cap_uw / 1e6
        if slow:
            energy = q(index, e, "amdsmi_get_energy_count", h)
            if energy is not None:
                ticks, resolution = _number(energy.get("energy_accumulator")), _number(energy.get("counter_resolution"))
                if ticks is not None and resolution is not None:
                    r.energy_joules = ticks * resolution / 1e6  # ticks x uJ per tick
        violation = q(index, e, "amdsmi_get_violation_status", h)
        if violation is not None:
            r.clock_event_reasons = sum(1 << bit for bit, (key, _) in enumerate(VIOLATION_REASONS)
                                        if violation.get(key) is True)
        total = q(index, e, "amdsmi_get_gpu_total_ecc_count", h)
        if total is not None:  # RAS counts since the driver loaded: NVML's "volatile" counters
            r.ecc_corrected_volatile = int(total["correctable_count"])
            r.ecc_uncorrected_volatile = int(total["uncorrectable_count"])
            r.ecc_deferred_volatile = int(total.get("deferred_count") or 0)
        self._read_bad_pages(index, e, h, r)
        pcie = q(index, e, "amdsmi_get_pcie_info", h)
        if pcie is not None:
            metric, static = pcie.get("pcie_metric", {}), pcie.get("pcie_static", {})
            replays = _number(metric.get("pcie_replay_count"))
            r.pcie_replay_total = None if replays is None else int(replays)
            if slow:
                width, width_max = _number(metric.get("pcie_width")), _number(static.get("max_pcie_width"))
                generation_max = _number(static.get("pcie_interface_version"))
                r.pcie_link_generation = _pcie_generation(metric.get("pcie_speed"))
                r.pcie_link_generation_max = None if generation_max is None else int(generation_max)
                r.pcie_link_width = None if width is None else int(width)
                r.pcie_link_width_max = None if width_max is None else int(width_max)
        if slow:
            self._read_xgmi(index, e, h, r, ident)
            self._read_ecc_blocks(index, e, h, r)

    def _read_bad_pages(self, index: int, e: list[tuple[str, str]], h: Any, r: GpuReading) -> None:
        """Retired ("bad") pages by status. amdgpu retires a page for an uncorrectable error, so they
        count as NVML's double-bit retirements (retired_pages_dbe; sbe 0); a pending page waits for
        the next driver reload or GPU reset (retired_pages_pending); an unreservable page is one the
        driver could not retire, the memory's last defence gone, as NVML's failed row remap
        (remap_failure)."""
        pages = self._call(index, e, "amdsmi_get_gpu_bad_page_info", h)
        if pages is None:
            return
        status = self._page_status
        counts = {int(status.RESERVED): 0, int(status.PENDING): 0, int(status.UNRESERVABLE): 0}
        for page in pages:
            value = int(page.get("status", -1))
            if value in counts:
                counts[value] += 1
        r.retired_pages_sbe = 0
        r.retired_pages_dbe = counts[int(status.RESERVED)]
        r.retired_pages_pending = counts[int(status.PENDING)] > 0
        r.remap_failure = counts[int(status.UNRESERVABLE)] > 0

    def _read_xgmi(self, index: int, e: list[tuple[str, str]], h: Any, r: GpuReading,
                   ident: GpuIdentity | None) -> None:
        links = self._call(index, e, "amdsmi_get_gpu_xgmi_link_status", h)
        if links is not None and ident is not None:
            status = list(links.get("status", ()))
            r.nvlinks = tuple(
                NvLinkReading(link, None if status[link] not in ("U", "D") else status[link] == "U", None, None, None)
                for link in range(len(status)) if link in ident.nvlinks)

    def _read_ecc_blocks(self, index: int, e: list[tuple[str, str]], h: Any, r: GpuReading) -> None:
        """ECC counts of every RAS block with ECC enabled (amdsmi_get_gpu_ecc_enabled's mask, asked
        once); XGMI_WAFL's are the XGMI links' errors (correctable: retried on the link; uncorrectable:
        lost), which the report sums as NVLink replay and recovery errors."""
        m = self._m
        blocks = self._ecc_blocks.get(index)
        if blocks is None:
            mask = self._call(index, e, "amdsmi_get_gpu_ecc_enabled", h)
            if mask is None:
                return  # the call failed (counted) or ECC is not supported: asked again next time
            blocks = self._ecc_blocks[index] = tuple(
                m.AmdSmiGpuBlock[name] for name in ECC_BLOCKS if int(mask) & int(m.AmdSmiGpuBlock[name]))
        out = []
        for block in blocks:
            counts = self._call(index, e, "amdsmi_get_gpu_ecc_count", h, block)
            if counts is None:
                continue
            corrected, uncorrected = int(counts["correctable_count"]), int(counts["uncorrectable_count"])
            out.append((block.name.lower(), corrected, uncorrected))
            if block.name == "XGMI_WAFL":
                r.xgmi_corrected_errors, r.xgmi_uncorrected_errors = corrected, uncorrected
        r.ecc_blocks = tuple(out)

    # --- configuration ---------------------------------------------------------------------------

    def config_facts(self, index: int) -> GpuConfigFacts:
        """How GPU ``index`` is configured now: driver, VBIOS, ECC (any block enabled) and the power
        cap; AMD has no persistence mode, MIG, CUDA, InfoROM or application clocks (None)."""
        errors: list[tuple[str, str]] = []
        try:
            h = self._handle(index)
            q = self._call
            driver = q(index, errors, "amdsmi_get_gpu_driver_info", h) or {}
            vbios = q(index, errors, "amdsmi_get_gpu_vbios_info", h) or {}
            ecc = q(index, errors, "amdsmi_get_gpu_ecc_enabled", h)
            cap = q(index, errors, "amdsmi_get_power_cap_info", h)
            cap_uw = None if cap is None else _number(cap.get("power_cap"))
            return GpuConfigFacts(
                index=index, driver_version=driver.get("driver_version") or None,
                vbios_version=vbios.get("part_number") or vbios.get("version") or None,
                ecc_mode_current=None if ecc is None else int(ecc) != 0,
                power_limit_watts=None if cap_uw is None else cap_uw / 1e6, errors=tuple(errors))
        except _HealthError as exc:
            return GpuConfigFacts(index=index, health=exc.health, errors=(*errors, ("device", exc.reason)))

    # --- reset ---------------------------------------------------------------------------------

    def reset_gpu(self, index: int, timeout_seconds: float = RESET_TIMEOUT_SECONDS) -> str:
        """Reset one GPU with ``amd-smi reset --gpureset --gpu <bdf>`` through the ``run`` seam,
        bounded by ``timeout_seconds`` (amdsmi_reset_gpu is a blocking call with no deadline of its
        own). Raises OSError or subprocess.SubprocessError, or the exception of a GPU that cannot be
        identified."""
        bdf = self.identity(index).pci_bus_id
        if not bdf:
            raise self._library_error(31)
        return self._run(["amd-smi", "reset", "--gpureset", "--gpu", bdf], timeout_seconds)

    # --- event notifications -------------------------------------------------------------------

    def open_events(self, indices: list[int]) -> list[int]:
        """Register the GPUs for every amdsmi event notification type; returns those registered."""
        m = self._m
        types = [m.AmdSmiEvtNotificationType[name] for name in EVENT_TYPES]
        registered = []
        refused: tuple[type[BaseException], ...] = (*self._errors, _HealthError)
        for index in indices:
            try:
                self._readers.append(m.AmdSmiEventReader(self._handle(index), types))
            except refused as exc:
                log.warning("GPU %d: cannot register for amdsmi event notifications: %s", index, exc)
                continue
            registered.append(index)
        return registered

    def wait_xid(self, timeout_ms: int) -> XidEvent | GpuNotification | None:
        """The next event notification (AMD has no Xid), or None after ``timeout_ms``. amdsmi reads
        the notifications of every registered GPU through any one reader; several at once are
        delivered one per call."""
        if not self._readers:
            return None
        pending = self._pending
        if not pending:
            try:
                pending.extend(self._readers[0].read(timeout_ms, 10))
            except self._m.AmdSmiTimeoutException:
                return None
        if not pending:
            return None
        event = pending.pop(0)
        return GpuNotification(index=self._index_of(event.get("processor_handle")),
                               kind=str(event.get("event", "none")).lower(), message=str(event.get("message", "")))

    def _index_of(self, handle: Any) -> int:
        handles = self._handles or []
        for index, known in enumerate(handles):
            if known is handle or _handle_value(known) == _handle_value(handle):
                return index
        return -1

    def close_events(self) -> None:
        readers, self._readers = self._readers, []
        for reader in readers:
            try:
                reader.stop()
            except self._errors as exc:
                log.warning("amdsmi event reader stop failed: %s", exc)


def _handle_value(handle: Any) -> Any:
    """The address a real amdsmi_processor_handle (a ctypes void pointer) holds; the object otherwise."""
    return getattr(handle, "value", handle)


def open_amdsmi_backend(config: NvmlConfig, clock: Callable[[], float], *, quiet: bool = False) -> AmdSmiBackend | None:
    """The AMD backend the configuration asks for, initialised; None (after one ERROR line unless
    ``quiet``: auto-detection probing) when amdsmi cannot be used. Never falls back to the fake."""
    if config.backend == "fake":
        from vigil.agent.amdsmi.fake import DEFAULT_AMD_SCENARIO, FakeAmdSmi
        from vigil.agent.nvml.scenario import load_node_scenario

        scenario = DEFAULT_AMD_SCENARIO if config.scenario is None else load_node_scenario(config.scenario)
        library: Any = FakeAmdSmi(scenario, clock, seed=config.seed)
        what = f"fake amdsmi ({config.scenario or 'default healthy 8x MI300X'})"
    else:
        try:
            import amdsmi  # type: ignore[import-not-found, unused-ignore]
        except ImportError as exc:
            if not quiet:
                log.error("amdsmi unavailable: cannot import amdsmi (ROCm's Python package): %s; no GPU metrics", exc)
            return None
        library = amdsmi
        what = "amdsmi"
    backend = AmdSmiBackend(library)
    try:
        backend.init()
    except backend.library_errors as exc:
        if not quiet:
            log.error("%s unavailable: amdsmi_init failed: %s (%s); no GPU metrics from this agent",
                      what, exc, type(exc).__name__)
        return None
    return backend
