"""gpu_compute over the fake engine (torch on the CPU, a ticking clock): a healthy node passes; a
GPU that throttles only under load fails the probe while the passive GPU collector, reading the
same GPU idle, sees nothing; the software power cap a healthy H100 sits at under a burn passes."""

from __future__ import annotations

import pytest

from tests.agent.probes.conftest import FrozenClock, TickClock

pytest.importorskip("torch")

from vigil.agent.collectors.gpu import GpuCollector, GpuConfig
from vigil.agent.probes import compute
from vigil.agent.probes.context import ProbesConfig
from vigil.agent.probes.engine_fake import FakeLoadEngine
from vigil.agent.probes.engine_torch import TorchEngine


def engine_over(fake):
    return FakeLoadEngine(TorchEngine(use_cuda=False, clock=TickClock(0.1), matmul_n=32), fake)


def by_gpu(results):
    return {r.gpu: r for r in results}


def test_a_healthy_node_passes_with_clocks_power_and_no_throttle(node, make_ctx):
    fake, backend = node({"gpus": 2})
    results = compute.run(make_ctx(engine_over(fake), backend, [0, 1]))
    assert [r.status for r in results] == ["pass", "pass"]
    r = results[0]
    assert r.unit == "tflops" and r.value and r.value > 0
    assert r.metrics["cv"] == pytest.approx(0.0, abs=1e-9) and r.metrics["passes"] == 2
    assert r.metrics["sm_clock_mhz_min"] == 1980 and r.metrics["power_w_max"] == 650.0
    assert r.metrics["throttle_hw_slowdown"] == 0.0 and r.metrics["nvml_samples"] >= 2


def test_a_fault_only_under_load_fails_the_burn_and_is_invisible_at_idle(node, make_ctx):
    fake, backend = node("under-load-h100")
    # Passive first: the GPU collector at idle sees every GPU sound (no throttle reason but idle).
    collection = GpuCollector(GpuConfig(xid_events=False), backend, lambda: 0.0).collect(0.0)
    active = {dict(s.labels)["gpu"] + ":" + dict(s.labels)["reason"] for s in collection.samples
              if s.name == "vigil_gpu_clock_event_active" and s.value == 1.0}
    assert active == {f"{g}:gpu_idle" for g in range(4)}
    results = by_gpu(compute.run(make_ctx(engine_over(fake), backend, [0, 1, 2, 3])))
    bad = results[1]
    assert bad.status == "fail" and bad.reason == "throttled"
    assert "hw_slowdown" in bad.detail and "hw_thermal_slowdown" in bad.detail
    assert bad.metrics["sm_clock_mhz_min"] == int(1980 * 0.55)
    assert bad.value == pytest.approx(results[0].value * 0.55)
    # GPU 2's fault is its memory's: the burn passes there (the memory probe finds it).
    assert [results[g].status for g in (0, 2, 3)] == ["pass", "pass", "pass"]


def test_a_silent_sag_that_varies_between_passes_fails_on_cv(node, make_ctx):
    fake, backend = node({"gpus": 1, "faults": [
        {"at_seconds": 0, "gpu": 0, "kind": "under_load", "compute_jitter": 0.4}]})
    [r] = compute.run(make_ctx(engine_over(fake), backend, [0]))
    assert r.status == "fail" and r.reason == "cv_high" and r.metrics["cv"] > 0.15


def test_jitter_within_the_bound_passes(node, make_ctx):
    fake, backend = node({"gpus": 1, "faults": [
        {"at_seconds": 0, "gpu": 0, "kind": "under_load", "compute_jitter": 0.05}]})
    [r] = compute.run(make_ctx(engine_over(fake), backend, [0]))
    assert r.status == "pass" and 0 < r.metrics["cv"] < 0.15


def test_the_software_power_cap_is_recorded_and_never_fails(node, make_ctx):
    fake, backend = node({"gpus": 1, "faults": [{"at_seconds": 0, "gpu": 0, "kind": "power_cap", "clock_ratio": 0.75}]})
    [r] = compute.run(make_ctx(engine_over(fake), backend, [0]))
    assert r.status == "pass" and r.metrics["throttle_sw_power_cap"] == 1.0


class PassClock:
    """An engine that moves the FakeNvml's scenario clock on by ``step`` after every pass."""

    def __init__(self, inner, clock, step: float) -> None:
        self.inner, self.clock, self.step = inner, clock, step
        self.kind, self.concurrent = inner.kind, inner.concurrent

    def matmul_tflops(self, device, seconds, sample=None):
        try:
            return self.inner.matmul_tflops(device, seconds, sample)
        finally:
            self.clock.t += self.step


def test_one_throttled_sample_is_a_clock_transition_not_a_fail(node, make_ctx):
    scenario_clock = FrozenClock()
    fake, backend = node({"gpus": 1, "faults": [
        {"at_seconds": 0, "gpu": 0, "kind": "under_load", "sm_clock_factor": 0.95, "duration_seconds": 1}]},
        clock=scenario_clock)
    engine = PassClock(engine_over(fake), scenario_clock, step=10.0)  # the fault is over after pass 1
    [r] = compute.run(make_ctx(engine, backend, [0]))
    assert r.metrics["throttle_hw_slowdown"] == 0.5 and r.metrics["nvml_samples"] == 2
    assert r.status == "pass"


def test_the_deadline_stops_the_burn_with_a_timeout(node, make_ctx):
    fake, backend = node({"gpus": 1})
    [r] = compute.run(make_ctx(engine_over(fake), backend, [0], deadline=0.2))
    assert r.status == "error" and r.reason == "timeout" and r.metrics["passes"] == 0


def test_quick_runs_two_passes(node, make_ctx):
    fake, backend = node({"gpus": 1})
    config = ProbesConfig(burn_passes=5, burn_pass_seconds=0.3)
    [r] = compute.run(make_ctx(engine_over(fake), backend, [0], config=config, quick=True))
    assert r.metrics["passes"] == 2


def test_no_engine_or_no_gpus_is_skipped(make_ctx):
    assert compute.run(make_ctx(None, None, [0]))[0].reason == "no_engine"
    engine = TorchEngine(use_cuda=False, clock=TickClock(0.1), matmul_n=8)
    assert compute.run(make_ctx(engine, None, []))[0].reason == "no_gpus"


def test_without_nvml_the_burn_still_measures(make_ctx):
    engine = TorchEngine(use_cuda=False, clock=TickClock(0.1), matmul_n=8)
    [r] = compute.run(make_ctx(engine, None, [0]))
    assert r.status == "pass" and r.metrics["nvml_samples"] == 0 and "sm_clock_mhz_min" not in r.metrics
