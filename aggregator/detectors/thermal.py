"""Thermal detector: GPUs held slow by heat or a power brake while they have work, and hot HBM.

It reads each GPU's recent states: utilization, SM clock against its maximum, the active
clock-event reasons and the HBM temperature against its limit. A busy GPU clocked down for a
thermal or power-brake reason over the whole persistence window is drained (one such GPU slows
every rank of its job); HBM near its limit is an alert. Power capping alone is normal under load
and is ignored.
"""

from __future__ import annotations

from pydantic import Field

from agent.collectors.collector import StrictModel
from aggregator.decision import Action, Finding
from aggregator.fleet import FleetView, GpuHistory, GpuSample, NodeState

NAME = "thermal"


class ThermalConfig(StrictModel):
    enabled: bool = True
    # NVML clock-event reasons that mean the hardware is protecting itself (nvmlClocksEventReasons:
    # HwSlowdown, HwThermalSlowdown, SwThermalSlowdown, HwPowerBrakeSlowdown). SwPowerCap is
    # the normal state of a GPU at full load and is deliberately absent.
    reasons: list[str] = Field(default_factory=lambda: [
        "hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"])
    min_utilization_ratio: float = Field(default=0.5, ge=0, le=1)
    # H100 SXM boosts to 1980 MHz; a thermal slowdown drops it by a third or more.
    max_clock_ratio: float = Field(default=0.75, gt=0, le=1)
    # One minute: transient brakes (a PSU hiccup) clear within seconds.
    persistence_seconds: float = Field(default=60.0, gt=0)
    min_reports: int = Field(default=3, ge=1)
    action: Action = Action.DRAIN
    # nvidia-smi -q "Memory Max Operating Temp" is 95 C on H100 SXM; used when NVML omits it.
    memory_max_celsius_default: float = 95.0
    memory_margin_celsius: float = Field(default=3.0, ge=0)
    memory_action: Action = Action.ALERT


class ThermalDetector:
    name = NAME

    def __init__(self, config: ThermalConfig) -> None:
        self.config = config
        self._reasons = frozenset(config.reasons)

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        for node in view.nodes.values():
            for gpu in node.gpus.values():
                if gpu.last_seen < node.last_seen:
                    continue
                out.extend(self._judge(node, gpu, now))
        return out

    def _throttled(self, s: GpuSample) -> bool:
        cfg = self.config
        if s.utilization_gpu_ratio is None or s.sm_clock_hertz is None or not s.sm_clock_max_hertz:
            return False
        return (s.utilization_gpu_ratio >= cfg.min_utilization_ratio
                and s.sm_clock_hertz / s.sm_clock_max_hertz <= cfg.max_clock_ratio
                and not self._reasons.isdisjoint(s.clock_event_reasons))

    def _hbm_hot(self, s: GpuSample) -> bool:
        if s.memory_temperature_celsius is None:
            return False
        limit = s.memory_max_temperature_celsius or self.config.memory_max_celsius_default
        return s.memory_temperature_celsius >= limit - self.config.memory_margin_celsius

    def _run(self, gpu: GpuHistory, test: str) -> tuple[float, int] | None:
        """Start and length of the current run of samples passing ``test``."""
        check = self._throttled if test == "throttle" else self._hbm_hot
        start: float | None = None
        n = 0
        for s in reversed(gpu.samples):
            if not check(s):
                break
            start, n = s.ts, n + 1
        if start is None:
            return None
        return start, n

    def _judge(self, node: NodeState, gpu: GpuHistory, now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        last = gpu.last
        for test in ("throttle", "hbm"):
            run = self._run(gpu, test)
            if run is None:
                continue
            start, n = run
            if n < cfg.min_reports or now - start < cfg.persistence_seconds:
                continue
            if test == "throttle":
                ratio = (last.sm_clock_hertz or 0.0) / (last.sm_clock_max_hertz or 1.0)
                active = sorted(self._reasons.intersection(last.clock_event_reasons))
                out.append(Finding(
                    detector=NAME, node=node.name, gpu=gpu.index, action=cfg.action, since=start,
                    key="clock_throttle",
                    reason=(f"GPU {gpu.index}: SM clock at {ratio:.0%} of max for {now - start:.0f} s while "
                            f"{last.utilization_gpu_ratio:.0%} busy ({', '.join(active)})"),
                    evidence={"signal": "clock_event_reasons", "uuid": gpu.uuid, "reasons": active,
                              "sm_clock_ratio": round(ratio, 3), "utilization_gpu_ratio": last.utilization_gpu_ratio,
                              "temperature_celsius": last.temperature_celsius, "power_watts": last.power_watts}))
            else:
                limit = last.memory_max_temperature_celsius or cfg.memory_max_celsius_default
                out.append(Finding(
                    detector=NAME, node=node.name, gpu=gpu.index, action=cfg.memory_action, since=start,
                    key="hbm_temperature",
                    reason=f"GPU {gpu.index}: HBM at {last.memory_temperature_celsius:.0f} C, limit {limit:.0f} C",
                    evidence={"signal": "memory_temperature_celsius", "uuid": gpu.uuid,
                              "memory_temperature_celsius": last.memory_temperature_celsius,
                              "memory_max_temperature_celsius": limit}))
        return out
