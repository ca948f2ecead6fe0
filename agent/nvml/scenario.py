"""Node scenarios: the YAML that drives FakeNvml (device profile, GPU count, load, scripted faults).

``load_node_scenario`` accepts a path or the name of a scenario shipped under ``scenarios/node/``
and returns a validated ``NodeScenario``; a typo or a wrong type raises ``ScenarioError`` naming
the key path (``faults.2.xid.code: ...``). It describes what happens; FakeNvml makes it happen.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from vigil.agent.amdsmi.profiles import AMD_DEVICE_PROFILES
from vigil.agent.nvml.profiles import PROFILES, DeviceProfile
from vigil.contract.validation import StrictModel, format_validation_error, read_yaml_file

# Shipped scenarios live in the repository's scenarios/node/, installed as package data of `vigil`
# (vigil/scenarios links to scenarios/), so the lookup works from a checkout and from a wheel.
SCENARIO_DIR = Path(str(resources.files("vigil") / "scenarios" / "node"))


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names every offending key path."""


class Load(StrictModel):
    utilization: float = Field(default=0.0, ge=0, le=1)  # mean GPU utilization, 0..1
    noise: float = Field(default=0.0, ge=0, le=1)  # +- amplitude around the mean, 0..1
    memory_used_ratio: float = Field(default=0.0, ge=0, le=1)  # of total memory, when busy
    # What the busy GPUs spend their cycles on, as NVML's GPM metrics see it (Hopper and later):
    # `training` keeps the tensor cores busy and DRAM moderate; `memory_bound` saturates DRAM
    # bandwidth with the tensor cores mostly idle (an attention/optimizer-heavy or badly fused job).
    workload: Literal["training", "memory_bound"] = "training"
    # The PCIe generation the GPUs' links retrain to while idle (utilization 0), back to their
    # maximum as soon as work arrives: what a board does that drops to a low performance state at idle
    # (nvidia-smi's documentation of "PCIe Generation Current": "These may be reduced when the GPU is
    # not in use"). None: the link holds its maximum at idle, as every recorded HGX board here does
    # in persistence mode at P0 (idle, 0 % utilization, 86 MHz SM clock, yet "PCIe Generation Current:
    # 5" = Max: tests/fixtures/nvidia-smi/nvidia-smi-q-8xH100-535.161.08.txt:63-71 for each of its 8
    # GPUs, tests/fixtures/nvml-real/nvidia-smi-q.txt:76-84, nvml-real-h200/nvidia-smi-q.txt:76-84).
    # The lookalike a PCIe link detector must not act on.
    pcie_idle_link_generation: int | None = Field(default=None, ge=1, le=6)


class _Fault(StrictModel):
    at_seconds: float = Field(ge=0)  # scenario time at which the fault starts
    gpu: int = Field(ge=0)


class EccCorrectedGrowth(_Fault):
    kind: Literal["ecc_corrected_growth"]
    rate_per_second: float = Field(gt=0)
    duration_seconds: float | None = Field(default=None, gt=0)  # None: grows for ever


class EccUncorrectable(_Fault):
    kind: Literal["ecc_uncorrectable"]
    count: int = Field(default=1, ge=1)


class RowRemapPending(_Fault):
    kind: Literal["row_remap_pending"]
    rows: int = Field(default=1, ge=1)


class RowRemapFailure(_Fault):
    kind: Literal["row_remap_failure"]


class ThermalThrottle(_Fault):
    kind: Literal["thermal_throttle"]
    duration_seconds: float = Field(gt=0)
    clock_ratio: float = Field(default=0.5, gt=0, le=1)  # SM clock as a share of its maximum


class PowerBrake(_Fault):
    kind: Literal["power_brake"]
    duration_seconds: float = Field(gt=0)
    clock_ratio: float = Field(default=0.3, gt=0, le=1)


class PowerCap(_Fault):
    """The GPU is held at a software power cap (nvidia-smi -pl, a site power budget, or a tensor
    load that would draw more than the board's limit): busy, its SM clock at ``clock_ratio`` of its
    maximum, clock event reason sw_power_cap, drawing at its enforced limit as a real capped board
    does."""

    kind: Literal["power_cap"]
    duration_seconds: float | None = Field(default=None, gt=0)  # None: capped for ever
    clock_ratio: float = Field(default=0.6, gt=0, le=1)


class MemoryBound(_Fault):
    """From ``at_seconds`` the job on this GPU is memory-bound: DRAM bandwidth utilisation near
    ``dram_active_ratio``, tensor cores mostly idle (the node-wide form is load.workload)."""

    kind: Literal["memory_bound"]
    duration_seconds: float | None = Field(default=None, gt=0)
    dram_active_ratio: float = Field(default=0.93, gt=0, le=1)


class BusySpin(_Fault):
    """From ``at_seconds`` the GPU busy-spins: a kernel resident every sample period (NCCL's,
    polling for a peer that never sends) on a few SMs at its top clock, drawing a fifth of its
    power limit, with no DRAM, PCIe or NVLink traffic: the hang signature scitix/sichek's GPU hang
    check reads (components/hang/config/default_spec.yaml). At run time: FakeNvml.set_busy_spin."""

    kind: Literal["busy_spin"]
    duration_seconds: float | None = Field(default=None, gt=0)  # None: for ever


class Xid(_Fault):
    kind: Literal["xid"]
    code: int = Field(ge=1, le=65535)


class GpuLost(_Fault):
    kind: Literal["gpu_lost"]


class ResetRequired(_Fault):
    kind: Literal["reset_required"]


class NvlinkErrors(_Fault):
    kind: Literal["nvlink_errors"]
    link: int = Field(ge=0)
    rate_per_second: float = Field(gt=0)
    error_type: Literal["crc", "replay", "recovery"] = "crc"


class NvlinkDown(_Fault):
    kind: Literal["nvlink_down"]
    link: int = Field(ge=0)


class TemperatureDrift(_Fault):
    """The GPU runs hotter and hotter (a failing fan, dried thermal paste): its temperature
    climbs ``celsius_per_hour`` above its usual reading, for ``duration_seconds`` or for ever."""

    kind: Literal["temperature_drift"]
    celsius_per_hour: float = Field(gt=0, le=600)
    duration_seconds: float | None = Field(default=None, gt=0)


class HotHbm(_Fault):
    """The GPU's HBM runs ``extra_celsius`` above its usual temperature (a blocked cold plate)."""

    kind: Literal["hot_hbm"]
    extra_celsius: float = Field(gt=0, le=60)
    duration_seconds: float | None = Field(default=None, gt=0)


class PcieReplay(_Fault):
    """PCIe link-level replays grow at ``rate_per_second`` (a marginal riser or retimer)."""

    kind: Literal["pcie_replay"]
    rate_per_second: float = Field(gt=0)
    duration_seconds: float | None = Field(default=None, gt=0)


class UnderLoad(_Fault):
    """A fault that shows only while the GPU works flat out (a probe's burn or copies, which the
    fake engine announces to FakeNvml): a marginal HBM stack, a failing cold plate or VRM. Idle, and
    under the scenario's own job load, the GPU reads healthy; loaded, its SM clock sags to
    ``sm_clock_factor`` of its maximum with ``throttle`` set (HW slowdown and its thermal or
    power-brake cause, as nvidia-smi nests them; ``none``: a sag no reason explains), a burn reaches
    ``compute_factor`` x ``sm_clock_factor`` of what it would (every other pass also loses
    ``compute_jitter`` of it: passes that disagree), copies ``memory_factor``, and the pattern test
    finds ``pattern_errors`` words wrong."""

    kind: Literal["under_load"]
    duration_seconds: float | None = Field(default=None, gt=0)  # None: for ever
    sm_clock_factor: float = Field(default=1.0, gt=0, le=1)
    throttle: Literal["thermal", "power_brake", "none"] = "thermal"
    compute_factor: float = Field(default=1.0, gt=0, le=1)
    compute_jitter: float = Field(default=0.0, ge=0, le=1)  # 1: every other pass stalls
    memory_factor: float = Field(default=1.0, gt=0, le=1)
    pattern_errors: int = Field(default=0, ge=0, le=1 << 40)

    @model_validator(mode="after")
    def _has_an_effect(self) -> UnderLoad:
        if (self.sm_clock_factor == 1.0 and self.compute_factor == 1.0 and self.compute_jitter == 0.0
                and self.memory_factor == 1.0 and self.pattern_errors == 0):
            raise ValueError("under_load changes nothing: set sm_clock_factor, compute_factor, compute_jitter, "
                             "memory_factor or pattern_errors")
        return self


OnOff = Literal["enabled", "disabled"]


class ConfigDrift(StrictModel):
    """From ``at_seconds`` the node (or only GPU ``gpu``) is configured otherwise than its board's
    profile: another driver and CUDA version (node-wide only), VBIOS or GPU firmware image, ECC or
    persistence mode, enforced power limit, application clocks. Each field left out keeps its value;
    later drifts override earlier ones. A node installed with another driver is ``at_seconds: 0``; a
    staged roll-out is one drift per node at its turn. What NVML answers for these facts and the
    enforced power limit (the draw of a capped GPU follows it); it does not change what the driver
    supports (a profile's NotSupported answers stay)."""

    kind: Literal["config_drift"]
    at_seconds: float = Field(default=0.0, ge=0)
    gpu: int | None = Field(default=None, ge=0)  # None: every GPU of the node
    driver_version: str | None = Field(default=None, pattern=r"^\d{2,4}(\.\d{1,4}){1,3}$")  # "550.90.07"
    cuda_driver_version: str | None = Field(default=None, pattern=r"^\d{1,3}\.\d$")  # "12.4"
    vbios_version: str | None = Field(default=None, min_length=1, max_length=32)
    inforom_image_version: str | None = Field(default=None, min_length=1, max_length=32)
    ecc_mode: OnOff | None = None
    persistence_mode: OnOff | None = None
    power_limit_watts: float | None = Field(default=None, gt=0, le=2000)
    application_sm_clock_mhz: int | None = Field(default=None, gt=0, le=5000)
    application_memory_clock_mhz: int | None = Field(default=None, gt=0, le=10000)

    @model_validator(mode="after")
    def _changes_something(self) -> ConfigDrift:
        facts = CONFIG_DRIFT_FACTS
        if all(getattr(self, name) is None for name in facts):
            raise ValueError(f"config_drift changes nothing: set one of {', '.join(facts)}")
        if self.gpu is not None and (self.driver_version or self.cuda_driver_version):
            raise ValueError("driver_version and cuda_driver_version are the node's: leave gpu out")
        return self


CONFIG_DRIFT_FACTS = ("driver_version", "cuda_driver_version", "vbios_version", "inforom_image_version", "ecc_mode",
                      "persistence_mode", "power_limit_watts", "application_sm_clock_mhz",
                      "application_memory_clock_mhz")


class FabricManagerDown(StrictModel):
    """From ``at_seconds`` (for ``duration_seconds``, or for ever) the node's Fabric Manager does not
    run: every GPU of an NVSwitch board reads fabric state ``state`` (not_started: FM never
    registered it, as after a boot with FM failed; in_progress: registration stuck). NVML itself
    still answers. The board's profile needs an NVSwitch fabric."""

    kind: Literal["fabric_manager_down"]
    at_seconds: float = Field(default=0.0, ge=0)
    state: Literal["not_started", "in_progress"] = "not_started"
    duration_seconds: float | None = Field(default=None, gt=0)


FabricCondition = Literal["degraded_bandwidth", "route_recovery", "route_unhealthy", "access_timeout_recovery"]


class FabricDegraded(_Fault):
    """From ``at_seconds`` GPU ``gpu``'s fabric health mask reads these conditions TRUE (its state
    stays completed). The health mask needs nvmlDeviceGetGpuFabricInfoV: scripting this fault says the
    node's driver has it, so the fake answers the V call on this node even where the profile's
    driver (535) lacks it."""

    kind: Literal["fabric_degraded"]
    conditions: tuple[FabricCondition, ...] = Field(default=("degraded_bandwidth",), min_length=1)
    duration_seconds: float | None = Field(default=None, gt=0)


class PcieLinkDegraded(_Fault):
    """From ``at_seconds`` GPU ``gpu``'s PCIe link is trained at ``width`` lanes and/or generation
    ``generation``, below the board's maximum, whatever the load (a bad riser, retimer or slot, as
    after a link retrain): the maximum NVML reports stays the board's."""

    kind: Literal["pcie_link_degraded"]
    width: int | None = Field(default=None, ge=1, le=32)
    generation: int | None = Field(default=None, ge=1, le=6)
    duration_seconds: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _degrades(self) -> PcieLinkDegraded:
        if self.width is None and self.generation is None:
            raise ValueError("pcie_link_degraded changes nothing: set width and/or generation")
        return self


class RecoveryActionFault(_Fault):
    """From ``at_seconds`` the driver names ``action`` as what recovers GPU ``gpu``
    (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), for ``duration_seconds`` or until a GPU reset clears a
    gpu_reset or drain_and_reset verdict; "none" otherwise. Scripting it says the node's driver has
    the field: the fake answers it on every GPU of this node from the start, even where the profile's
    driver (535) predates it."""

    kind: Literal["recovery_action"]
    action: Literal["none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"] = "gpu_reset"
    duration_seconds: float | None = Field(default=None, gt=0)


class BadPages(_Fault):
    """AMD RAS (amdsmi_get_gpu_bad_page_info): from ``at_seconds`` ``count`` more device-memory pages
    of GPU ``gpu`` are retired with ``status``: reserved (retired now), pending (retired at the
    next driver reload or GPU reset) or unreservable (the driver could not retire it). An
    ecc_uncorrectable fault on an AMD board also retires one page per error (amdgpu retires the page
    of every uncorrectable UMC error); this is the page retirement alone. AMD boards only."""

    kind: Literal["bad_pages"]
    count: int = Field(default=1, ge=1, le=4096)
    status: Literal["reserved", "pending", "unreservable"] = "reserved"


class NvmlUnavailable(StrictModel):
    """The driver goes away for the whole node: nvmlInit and every call fail from then on."""

    kind: Literal["nvml_unavailable"]
    at_seconds: float = Field(ge=0)


Fault = Annotated[
    EccCorrectedGrowth | EccUncorrectable | RowRemapPending | RowRemapFailure | ThermalThrottle | PowerBrake
    | Xid | GpuLost | ResetRequired | NvlinkErrors | NvlinkDown | NvmlUnavailable | TemperatureDrift | HotHbm
    | PcieReplay | PowerCap | MemoryBound | UnderLoad | BusySpin | ConfigDrift | FabricManagerDown | FabricDegraded
    | PcieLinkDegraded | RecoveryActionFault | BadPages,
    Field(discriminator="kind"),
]

FAULT_KINDS: tuple[str, ...] = (
    "ecc_corrected_growth", "ecc_uncorrectable", "row_remap_pending", "row_remap_failure", "thermal_throttle",
    "power_brake", "xid", "gpu_lost", "reset_required", "nvlink_errors", "nvlink_down", "nvml_unavailable",
    "temperature_drift", "hot_hbm", "pcie_replay", "power_cap", "memory_bound", "under_load", "busy_spin",
    "config_drift", "fabric_manager_down", "fabric_degraded", "pcie_link_degraded", "recovery_action",
    "bad_pages",
)

# Every board a scenario may name: NVIDIA's (FakeNvml) and AMD's (FakeAmdSmi, vendor "amd").
ALL_PROFILES: dict[str, DeviceProfile] = {**PROFILES, **AMD_DEVICE_PROFILES}
# Fault kinds only one vendor's boards can show. On an AMD board the NVLink kinds stand for its XGMI
# links (nvlink_errors: crc and replay grow the XGMI_WAFL block's correctable count, recovery its
# uncorrectable one; nvlink_down: the link reads down), nvml_unavailable for amdsmi's driver going
# away, and thermal_throttle, power_brake and power_cap for its violation status (socket thermal,
# PROCHOT, PPT).
NVIDIA_ONLY_FAULT_KINDS: tuple[str, ...] = (
    "xid", "row_remap_pending", "row_remap_failure", "fabric_manager_down", "fabric_degraded", "recovery_action",
    "config_drift", "memory_bound", "under_load", "busy_spin")
AMD_ONLY_FAULT_KINDS: tuple[str, ...] = ("bad_pages",)


# Kinds that act on the whole node: they take no ``gpu`` (nvml_unavailable, fabric_manager_down) or
# an optional one, absent meaning every GPU (config_drift).
NODE_WIDE_FAULT_KINDS: tuple[str, ...] = ("nvml_unavailable", "fabric_manager_down", "config_drift")


class Process(StrictModel):
    """A compute process holding one GPU from ``from_seconds`` until ``until_seconds`` (None: for
    ever): what NVML lists for the GPU, and what makes nvidia-smi refuse to reset it."""

    gpu: int = Field(ge=0)
    pid: int = Field(ge=1, le=4_194_304)  # Linux pid_max ceiling (PID_MAX_LIMIT, 2^22)
    from_seconds: float = Field(default=0.0, ge=0)
    until_seconds: float | None = Field(default=None, gt=0)


# A GPU has 7 compute slices to share among its MIG GPU instances ("7g" is the whole GPU): NVIDIA MIG
# User Guide, "Partitioning". Placement rules beyond that sum are not modelled.
MIG_COMPUTE_SLICES = 7


class MigLayout(StrictModel):
    """GPU ``gpu`` in MIG mode with these GPU instances (one compute instance filling each), as an
    administrator's ``nvidia-smi mig -cgi ... -C`` leaves it; ``pending`` differs from ``enabled``
    when a mode change waits for the GPU's reset."""

    gpu: int = Field(ge=0)
    enabled: bool = True
    pending: bool | None = None  # None: as enabled (no change waiting)
    instances: tuple[str, ...] = ()  # GPU instance profiles, e.g. ["3g.40gb", "2g.20gb", "2g.20gb"]

    @model_validator(mode="after")
    def _check_slices(self) -> MigLayout:
        if self.instances and not self.enabled:
            raise ValueError("instances need enabled: true (MIG devices exist only in MIG mode)")
        slices = sum(mig_compute_slices(name) for name in self.instances)
        if slices > MIG_COMPUTE_SLICES:
            raise ValueError(f"instances use {slices} compute slices, a GPU has {MIG_COMPUTE_SLICES}")
        return self


def mig_compute_slices(profile: str) -> int:
    """"3g.40gb" -> 3; 0 for a name that does not start so (rejected against the board's table)."""
    head = profile.split("g.", 1)[0]
    return int(head) if head.isdigit() else 0


class NodeScenario(StrictModel):
    description: str = ""
    profile: str = "h100-sxm-80gb"
    gpus: int = Field(default=8, ge=1, le=8)
    load: Load = Load()
    faults: tuple[Fault, ...] = ()
    processes: tuple[Process, ...] = ()
    mig: tuple[MigLayout, ...] = ()  # GPUs in MIG mode; the others have it off

    @model_validator(mode="after")
    def _check_references(self) -> NodeScenario:
        if self.profile not in ALL_PROFILES:
            raise ValueError(f"profile {self.profile!r} is not one of {sorted(ALL_PROFILES)}")
        board = ALL_PROFILES[self.profile]
        seen: set[int] = set()
        for i, layout in enumerate(self.mig):
            if layout.gpu >= self.gpus:
                raise ValueError(f"mig.{i}.gpu: {layout.gpu} but the node has {self.gpus} GPUs")
            if layout.gpu in seen:
                raise ValueError(f"mig.{i}.gpu: GPU {layout.gpu} has two MIG layouts")
            seen.add(layout.gpu)
            if not board.mig_profiles:
                raise ValueError(f"mig.{i}: {self.profile} has no MIG profiles")
            for name in layout.instances:
                if board.mig_memory_bytes(name) is None:
                    raise ValueError(f"mig.{i}.instances: {name!r} is not one of "
                                     f"{[n for n, _ in board.mig_profiles]} on {self.profile}")
        links = board.nvlink_count
        for i, fault in enumerate(self.faults):
            gpu = getattr(fault, "gpu", None)
            if gpu is not None and gpu >= self.gpus:
                raise ValueError(f"faults.{i}.gpu: {gpu} but the node has {self.gpus} GPUs")
            link = getattr(fault, "link", None)
            if link is not None and link >= links:
                raise ValueError(f"faults.{i}.link: {link} but {self.profile} has {links} NVLinks")
            self._check_board(i, fault, board)
        for i, process in enumerate(self.processes):
            if process.gpu >= self.gpus:
                raise ValueError(f"processes.{i}.gpu: {process.gpu} but the node has {self.gpus} GPUs")
        return self


    def _check_board(self, i: int, fault: Any, board: DeviceProfile) -> None:
        """A fault the board (its driver) could not show is a scenario error, not a silent no-op."""
        kind = fault.kind
        if board.vendor == "amd" and kind in NVIDIA_ONLY_FAULT_KINDS:
            raise ValueError(f"faults.{i}: {kind} is an NVIDIA fault; {self.profile} is an AMD board")
        if board.vendor != "amd" and kind in AMD_ONLY_FAULT_KINDS:
            raise ValueError(f"faults.{i}: {kind} is an AMD fault; {self.profile} is an NVIDIA board")
        if kind in ("fabric_manager_down", "fabric_degraded") and not board.nvswitch_fabric:
            raise ValueError(f"faults.{i}: {kind} needs an NVSwitch fabric, which {self.profile} has not")
        if kind == "pcie_link_degraded":
            if fault.generation is not None and fault.generation > board.pcie_link_generation_max:
                raise ValueError(f"faults.{i}.generation: {fault.generation} but {self.profile}'s link is at "
                                 f"most generation {board.pcie_link_generation_max}")
            if fault.width is not None and fault.width > board.pcie_link_width_max:
                raise ValueError(f"faults.{i}.width: {fault.width} but {self.profile}'s link is at most "
                                 f"x{board.pcie_link_width_max}")


def parse_node_scenario(data: Any, source: str = "<data>") -> NodeScenario:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(f"invalid node scenario {source}: the top level must be a mapping")
    try:
        return NodeScenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(format_validation_error(exc, f"invalid node scenario {source}", NodeScenario)) from None


def resolve_scenario_path(path_or_name: str | Path) -> Path:
    """A path as given if it exists, else a shipped scenario by name (with or without `.yaml`)."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    name = str(path_or_name).removesuffix(".yaml")
    shipped = SCENARIO_DIR / f"{name}.yaml"
    if "/" not in name and shipped.is_file():
        return shipped
    known = sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
    raise ScenarioError(f"node scenario {str(path_or_name)!r} is neither a file nor a shipped scenario {known}")


def load_node_scenario(path_or_name: str | Path) -> NodeScenario:
    path = resolve_scenario_path(path_or_name)
    return parse_node_scenario(read_yaml_file(path, "node scenario", ScenarioError), str(path))


def shipped_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


# The embedded default (`nvml: {backend: fake}` with no scenario): a healthy 8x H100 SXM node busy
# training; scenarios/node/healthy-h100.yaml says the same in YAML.
DEFAULT_SCENARIO = NodeScenario(
    description="healthy HGX H100 node running a training job",
    profile="h100-sxm-80gb",
    gpus=8,
    load=Load(utilization=0.92, noise=0.05, memory_used_ratio=0.85),
)
