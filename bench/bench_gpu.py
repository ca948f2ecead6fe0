"""GPU collector CPU per cycle: 8 fake H100s through PynvmlBackend and FakeNvml.

Measures the process CPU time of ``GpuCollector.collect`` over many cycles of the embedded default
node (NVLink read every 10 s as configured by default), part of DESIGN.md section 9's 2 ms agent
budget. It measures only; it judges nothing.
"""

from __future__ import annotations

import time

from bench.measure import Measurement
from vigil.agent.collectors.gpu import GpuCollector, GpuConfig
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import DEFAULT_SCENARIO

CYCLES = 2000


def measure() -> list[Measurement]:
    now = [0.0]
    backend = PynvmlBackend(FakeNvml(DEFAULT_SCENARIO, lambda: now[0], start=0.0))
    backend.init()
    collector = GpuCollector(GpuConfig(xid_events=False), backend, lambda: now[0])
    collector.collect(0.0)  # identities are read once, outside the steady state
    start = time.process_time()
    for i in range(1, CYCLES + 1):
        now[0] = float(i)
        collector.collect(now[0])
    per_cycle_ms = (time.process_time() - start) / CYCLES * 1000.0
    collector.close()
    return [Measurement("GPU collector CPU per cycle (8 fake H100s)", per_cycle_ms, "ms", None,
                        note="part of the 2 ms agent budget")]


if __name__ == "__main__":
    for m in measure():
        print(f"{m.what}: {m.value:.3f} {m.unit} ({m.note})")
