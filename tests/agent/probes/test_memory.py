"""gpu_memory over the fake engine (torch on the CPU): a healthy GPU passes with its copy
bandwidth; words flipped only under load fail it with their count while the GPU reads healthy at
idle; a buffer that cannot be had fails with alloc_failed."""

from __future__ import annotations

import pytest

from tests.agent.probes.conftest import TickClock

pytest.importorskip("torch")

from vigil.agent.probes import memory
from vigil.agent.probes.engine import AllocationError
from vigil.agent.probes.engine_fake import FakeLoadEngine
from vigil.agent.probes.engine_torch import TorchEngine


def engine_over(fake):
    return FakeLoadEngine(TorchEngine(use_cuda=False, clock=TickClock(0.01), matmul_n=8), fake)


def test_pattern_errors_only_under_load_fail_the_gpu_and_the_others_pass(node, make_ctx):
    fake, backend = node("under-load-h100")
    idle = backend.read(2, slow=False)
    assert idle.health == "ok" and idle.ecc_uncorrected_volatile == 0
    results = {r.gpu: r for r in memory.run(make_ctx(engine_over(fake), backend, [0, 1, 2, 3]))}
    bad = results[2]
    assert bad.status == "fail" and bad.reason == "pattern_errors" and bad.metrics["pattern_errors"] == 12
    assert "12 words" in bad.detail
    assert bad.value == pytest.approx(results[0].value * 0.7)  # copies counted on the ticking clock
    assert [results[g].status for g in (0, 1, 3)] == ["pass", "pass", "pass"]
    assert all(results[g].value > 0 and results[g].unit == "gb_per_s" for g in (0, 1, 3))


class NoMemory:
    """A device with no memory to give (what CUDA's out-of-memory looks like to the probe)."""

    kind = "cuda"
    concurrent = True

    def copy_gb_per_s(self, device, nbytes):
        raise AllocationError("CUDA out of memory. Tried to allocate 1.00 GiB")

    def pattern_errors(self, device, nbytes):
        raise AllocationError("CUDA out of memory")


def test_an_allocation_failure_fails_with_alloc_failed(make_ctx):
    results = memory.run(make_ctx(NoMemory(), None, [0, 1]))
    assert [(r.gpu, r.status, r.reason) for r in results] == [(0, "fail", "alloc_failed"), (1, "fail", "alloc_failed")]


def test_a_passed_deadline_is_a_timeout(node, make_ctx):
    fake, backend = node({"gpus": 1})
    [r] = memory.run(make_ctx(engine_over(fake), backend, [0], deadline=-1.0))
    assert r.status == "error" and r.reason == "timeout"


def test_no_engine_is_skipped(make_ctx):
    assert memory.run(make_ctx(None, None, [0]))[0].status == "skipped"
