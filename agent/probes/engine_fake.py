"""FakeLoadEngine: the compute seam of a node whose GPUs are a FakeNvml. It runs every burn, copy and
pattern test for real on an inner engine (torch on the CPU in tests) and, while one runs, tells the
fake that the GPU is under a probe's load, so NVML reads taken during the probe show a busy GPU
and the scenario's ``under_load`` faults (a sagging clock with its throttle reasons). The figure it
returns is the modelled GPU's (an H100 SXM's nominal figures below, scaled by those faults), not
the inner engine's: a fake GPU's throughput must not vary with how busy the test machine's CPU is.
The pattern test's errors are the inner engine's plus the fault's.

It is how a test or the simulator makes a fault that only a probe finds: at idle the same GPU
reads healthy to the passive collectors. It decides nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.probes.engine import ComputeEngine, LoadSampler

# The modelled GPU's figures (an H100 SXM 80GB, NVIDIA's datasheet: 989 dense BF16 TFLOP/s, 3.35 TB/s
# HBM3, 450 GB/s NVLink per direction), at the fraction a real burn or copy achieves (about 70%,
# 85% and 82%): what the fake reports for a healthy GPU under a probe.
NOMINAL_TFLOPS = 692.0
NOMINAL_COPY_GB_PER_S = 2850.0
NOMINAL_P2P_GB_PER_S = 370.0


class FakeLoadEngine:
    """``inner`` measures; ``nvml`` is the FakeNvml whose GPU ``i`` the probe's device ``i`` is."""

    def __init__(self, inner: ComputeEngine, nvml: FakeNvml) -> None:
        self._inner = inner
        self._nvml = nvml
        self._burns: dict[int, int] = {}  # device -> burns run: every other one loses the jitter

    @property
    def kind(self) -> str:
        return "fake"

    @property
    def concurrent(self) -> bool:
        return self._inner.concurrent

    @contextmanager
    def _loaded(self, *devices: int) -> Iterator[None]:
        started: list[int] = []
        try:
            for device in devices:
                self._nvml.begin_load(device)
                started.append(device)
            yield
        finally:
            for device in started:
                self._nvml.end_load(device)

    def matmul_tflops(self, device: int, seconds: float, sample: LoadSampler | None = None) -> float:
        with self._loaded(device):
            self._inner.matmul_tflops(device, seconds, sample)  # the work and its time, for real
            effects = self._nvml.load_effects(device)
        burn = self._burns.get(device, 0)
        self._burns[device] = burn + 1
        jitter = effects.compute_jitter if burn % 2 else 0.0
        return NOMINAL_TFLOPS * effects.compute_factor * (1.0 - jitter)

    def copy_gb_per_s(self, device: int, nbytes: int) -> float:
        with self._loaded(device):
            self._inner.copy_gb_per_s(device, nbytes)
            effects = self._nvml.load_effects(device)
        return NOMINAL_COPY_GB_PER_S * effects.memory_factor

    def pattern_errors(self, device: int, nbytes: int) -> int:
        with self._loaded(device):
            wrong = self._inner.pattern_errors(device, nbytes)
            effects = self._nvml.load_effects(device)
        return wrong + effects.pattern_errors

    def p2p_gb_per_s(self, src: int, dst: int, nbytes: int) -> float:
        with self._loaded(src, dst):
            self._inner.p2p_gb_per_s(src, dst, nbytes)
            factor = min(self._nvml.load_effects(src).memory_factor, self._nvml.load_effects(dst).memory_factor)
        return NOMINAL_P2P_GB_PER_S * factor
