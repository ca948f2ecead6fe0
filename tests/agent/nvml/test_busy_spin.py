"""FakeNvml's busy-spin (a GPU hung in a collective): what the agent reads through the real backend
meets the telemetry hang detector's signature, while the same GPUs training do not; the run-time
switch (FakeNvml.set_busy_spin) does the same without a scripted time."""

from __future__ import annotations

from vigil.agent.nvml.backend import GpuReading, PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.profiles import PROFILES
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.aggregator.detectors.telemetry_hang import TelemetryHangConfig

# The SM clock's maximum (the agent reads it with the GPU's identity, not in every reading).
MAX_HZ = PROFILES["h100-sxm-80gb"].sm_clock_max_mhz * 1e6


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def spins(r: GpuReading, cfg: TelemetryHangConfig) -> bool:
    """The detector's per-GPU signature, over what the backend read."""
    u, clock, power, limit = r.utilization_gpu_ratio, r.sm_clock_hertz, r.power_watts, r.power_limit_watts
    dram, tx, rx = r.dram_active_ratio, r.pcie_tx_bytes_per_second, r.pcie_rx_bytes_per_second
    assert u is not None and clock is not None and power is not None and limit, r
    assert dram is not None and tx is not None and rx is not None, r
    nvlink = max(r.nvlink_tx_bytes_per_second or 0.0, r.nvlink_rx_bytes_per_second or 0.0)
    return (u >= cfg.min_utilization_ratio and clock / MAX_HZ >= cfg.min_sm_clock_ratio
            and power / limit <= cfg.max_power_limit_ratio and dram <= cfg.max_dram_active_ratio
            and max(tx, rx) <= cfg.max_pcie_bytes_per_second and nvlink <= cfg.max_nvlink_bytes_per_second)


def read_at(backend: PynvmlBackend, clock: Clock, t: float, index: int) -> GpuReading:
    clock.t = t - 5.0
    backend.read(index)  # the first GPM sample of the pair
    clock.t = t
    return backend.read(index)


def test_the_scripted_busy_spin_meets_the_signature_and_training_does_not() -> None:
    clock = Clock()
    backend = PynvmlBackend(FakeNvml(load_node_scenario("busy-spin-h100"), clock, start=0.0))
    backend.init()
    cfg = TelemetryHangConfig()
    for i in range(8):
        backend.identity(i)
    assert not any(spins(read_at(backend, clock, 40.0, i), cfg) for i in range(8))
    hung = [read_at(backend, clock, 90.0, i) for i in range(8)]
    assert all(spins(r, cfg) for r in hung)
    assert all(0.15 < (r.power_watts or 0.0) / (r.power_limit_watts or 1.0) < 0.25 for r in hung)


def test_the_run_time_switch() -> None:
    clock = Clock()
    fake = FakeNvml(load_node_scenario("training-h100"), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    backend.identity(2)
    cfg = TelemetryHangConfig()
    assert not spins(read_at(backend, clock, 20.0, 2), cfg)
    fake.set_busy_spin([2], True)
    assert spins(read_at(backend, clock, 40.0, 2), cfg)
    fake.set_busy_spin([2], False)
    assert not spins(read_at(backend, clock, 60.0, 2), cfg)
