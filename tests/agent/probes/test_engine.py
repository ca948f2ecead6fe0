"""The compute engines: torch on the CPU for real (tiny sizes, a ticking clock), the fake engine's
coupling of a probe's load to FakeNvml, and build_engine's choice."""

from __future__ import annotations

import pytest

from tests.agent.probes.conftest import TickClock

torch = pytest.importorskip("torch")

from vigil.agent.probes.engine import build_engine  # noqa: E402
from vigil.agent.probes.engine_fake import FakeLoadEngine  # noqa: E402
from vigil.agent.probes.engine_torch import TorchEngine  # noqa: E402


def cpu_engine(step: float = 0.1, n: int = 32) -> TorchEngine:
    return TorchEngine(use_cuda=False, clock=TickClock(step), matmul_n=n)


def test_cpu_burn_counts_flops_over_the_clock_and_calls_the_sampler():
    engine = cpu_engine()
    calls = []
    tflops = engine.matmul_tflops(0, 0.3, lambda: calls.append(1))
    # 3 matmuls of 2 * 32^3 flops in 0.3 s of the ticking clock, whatever the CPU's speed.
    assert tflops == pytest.approx(3 * 2 * 32**3 / 0.3 / 1e12, rel=1e-6)
    assert len(calls) == 3 and engine.kind == "cpu" and not engine.concurrent


def test_cpu_copies_and_p2p_are_measured_and_every_gpu_is_the_cpu():
    engine = cpu_engine(step=0.01)
    assert engine.copy_gb_per_s(0, 1 << 20) > 0
    assert engine.p2p_gb_per_s(0, 7, 1 << 20) > 0


def test_pattern_test_reads_back_every_pattern_intact():
    assert cpu_engine().pattern_errors(3, 1 << 16) == 0


def test_a_clock_that_never_moves_is_an_error_not_a_hang():
    engine = TorchEngine(use_cuda=False, clock=lambda: 0.0, matmul_n=2)
    with pytest.raises(RuntimeError, match="does not advance"):
        engine.copy_gb_per_s(0, 16)


def test_under_load_faults_show_only_while_the_fake_engine_loads_the_gpu(node):
    fake, backend = node({"gpus": 2, "faults": [
        {"at_seconds": 0, "gpu": 1, "kind": "under_load", "sm_clock_factor": 0.5, "throttle": "power_brake",
         "memory_factor": 0.5, "pattern_errors": 7}]})
    engine = FakeLoadEngine(cpu_engine(), fake)
    idle = backend.read(1, slow=False)
    assert backend.reason_names(idle.clock_event_reasons) == ["gpu_idle"]
    seen = []
    healthy = engine.matmul_tflops(0, 0.3)
    sagged = engine.matmul_tflops(1, 0.3, lambda: seen.append(backend.read(1, slow=False)))
    assert sagged == pytest.approx(healthy * 0.5)
    loaded = seen[0]
    assert set(backend.reason_names(loaded.clock_event_reasons)) == {"hw_slowdown", "hw_power_brake_slowdown"}
    assert loaded.utilization_gpu_ratio == 1.0 and loaded.sm_clock_hertz == pytest.approx(990e6)
    assert engine.pattern_errors(1, 1 << 16) == 7 and engine.pattern_errors(0, 1 << 16) == 0
    # The load ends with the call: idle again, healthy again.
    assert backend.reason_names(backend.read(1, slow=False).clock_event_reasons) == ["gpu_idle"]


def test_build_engine_picks_the_fake_engine_over_fake_nvml_and_torch_elsewhere(node):
    fake, backend = node({"gpus": 1})
    assert isinstance(build_engine(backend), FakeLoadEngine)
    assert isinstance(build_engine(fake), FakeLoadEngine)
    plain = build_engine(None)
    assert isinstance(plain, TorchEngine) and plain.kind == ("cuda" if torch.cuda.is_available() else "cpu")

