"""Wire types: the agent's Report to the aggregator, and the heartbeat it accepts from training code.

These pydantic models are the one definition of the JSON contract (docs/openapi.yaml documents
the same shapes, and a test checks that they agree). The agent builds them; the aggregator
validates incoming JSON with them. Unknown fields are rejected so a typo cannot pass silently;
a value the hardware does not report is ``None`` (absent), never 0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WIRE_VERSION = 1

GpuHealth = Literal["ok", "lost", "reset_required", "unavailable"]
RankState = Literal["running", "hung", "exited"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Event(_Wire):
    """Something that happened, as opposed to a state: an Xid, a link going down, a hang.

    ``kind`` is one of: xid, sxid, gpu_lost, mlx5_error, link_down, link_up, link_flap,
    counter_reset, hang, rank_exit, nvml_unavailable. Subject fields that do not apply are None.
    ``count`` > 1 means identical events were collapsed (a flood is counted, not forwarded line
    by line); ``ts`` is then the first occurrence and ``last_ts`` the latest.
    """

    kind: str
    ts: float
    urgent: bool = False
    message: str = ""
    code: int | None = None
    gpu: int | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    device: str | None = None
    port: int | None = None
    job: str | None = None
    rank: int | None = None
    count: int = 1
    last_ts: float | None = None
    # Which reader saw it ("kmsg", "nvml", "sysfs", "heartbeat"): an Xid seen by both the kernel
    # log and NVML's event API is one fault, and the aggregator dedups by (gpu, code, time).
    source: str = ""


class GpuState(_Wire):
    """One GPU's state and counters at report time (NVLink counters summed over its links)."""

    index: int
    uuid: str
    health: GpuHealth = "ok"
    name: str | None = None
    pci_bus_id: str | None = None
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    memory_clock_hertz: float | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    slowdown_temperature_celsius: float | None = None
    shutdown_temperature_celsius: float | None = None
    memory_max_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    performance_state: int | None = None
    # Active clock-event (throttle) reasons by our short name, e.g. ["hw_thermal_slowdown"].
    clock_event_reasons: list[str] = Field(default_factory=list)
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
    nvlink_crc_errors_total: int | None = None
    nvlink_replay_errors_total: int | None = None
    nvlink_recovery_errors_total: int | None = None
    nvlink_links_active: int | None = None
    nvlink_links_down: list[int] = Field(default_factory=list)


class PortState(_Wire):
    """One RDMA port. ``counters`` are raw (data counters already in bytes). ``deltas`` and
    ``rates_per_second`` are since the agent's previous cycle and list only counters that moved
    (absent: unchanged); a counter that went backwards or sits at its saturation value has none
    and is named in ``flags`` ("reset" or "saturated") instead. The aggregator judges over its
    own window from the raw counters; these are for a reader of a single report."""

    device: str
    port: int
    state: str | None = None
    phys_state: str | None = None
    rate_bits_per_second: float | None = None
    link_layer: str | None = None
    netdev: str | None = None
    counters: dict[str, int] = Field(default_factory=dict)
    deltas: dict[str, int] = Field(default_factory=dict)
    rates_per_second: dict[str, float] = Field(default_factory=dict)
    flags: dict[str, str] = Field(default_factory=dict)


class RankSummary(_Wire):
    """One training rank over the report window: not every step, a summary of them."""

    job: str
    rank: int
    gpu: int | None = None
    pid: int | None = None
    state: RankState = "running"
    window_seconds: float
    steps: int
    last_step: int
    last_progress_ts: float
    step_seconds_p50: float | None = None
    step_seconds_p90: float | None = None
    compute_seconds_p50: float | None = None
    compute_seconds_p90: float | None = None
    comm_seconds_p50: float | None = None
    comm_seconds_p90: float | None = None
    data_seconds_p50: float | None = None
    data_seconds_p90: float | None = None


class HostFacts(_Wire):
    cpu_utilization_ratio: float | None = None
    load1: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    uptime_seconds: float | None = None
    kernel: str | None = None
    driver_version: str | None = None


class Report(_Wire):
    """The agent's periodic push (``POST /v1/reports``). ``seq`` increases by one per report
    within a ``boot_id``; a new boot id means counters restarted from zero."""

    version: int = WIRE_VERSION
    node: str = Field(min_length=1, max_length=253)
    boot_id: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)
    ts: float
    interval_seconds: float = Field(gt=0)
    urgent: bool = False
    topology: dict[str, str] = Field(default_factory=dict)
    nvml_available: bool = True
    gpus: list[GpuState] = Field(default_factory=list)
    ports: list[PortState] = Field(default_factory=list)
    ranks: list[RankSummary] = Field(default_factory=list)
    host: HostFacts | None = None
    events: list[Event] = Field(default_factory=list)
    # Collectors whose last cycle failed, so the aggregator can tell "no data" from "healthy".
    failed_collectors: list[str] = Field(default_factory=list)


class Heartbeat(_Wire):
    """One training step from one rank (UDP datagram or ``POST /v1/heartbeat``)."""

    job: str = Field(min_length=1, max_length=128)
    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    step_seconds: float = Field(ge=0)
    compute_seconds: float | None = Field(default=None, ge=0)
    comm_seconds: float | None = Field(default=None, ge=0)
    data_seconds: float | None = Field(default=None, ge=0)
    gpu: int | None = Field(default=None, ge=0)
    pid: int | None = Field(default=None, ge=1)
    ts: float | None = None
