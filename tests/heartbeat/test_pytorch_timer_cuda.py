"""StepTimer on a real GPU: CUDA events on the current stream, read a step later, give the GPU's
compute time (checked against the same kernels timed with a synchronize around them) and rank a
step with more work above a step with less. Runs under the `gpu` marker; skips without CUDA."""

from __future__ import annotations

import time

import pytest

from tests.heartbeat.fakes import RecordingHeartbeat
from vigil_heartbeat.pytorch import StepTimer

pytestmark = pytest.mark.gpu

# The host enqueues a step far faster than the GPU runs it; a CUDA event's timing and a host
# clock around a synchronized run of the same kernels agree within launch overheads: 25% leaves
# room for clock boost changes between the two runs (bf16 products of 4096^3 take ~0.2-0.5 ms).
AGREEMENT = 0.25


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def _work(torch, a, b, products: int) -> None:
    for _ in range(products):
        a @ b  # the kernel is the point


def test_cuda_event_compute_matches_the_gpu_and_ranks_more_work_higher(torch):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    _work(torch, a, b, 20)  # warm-up: kernel selection, clocks up
    torch.cuda.synchronize()
    beats = RecordingHeartbeat()
    timer = StepTimer(beats, torch_module=torch)
    assert timer.timing == "cuda_events"
    plan = [20, 80] * 6  # products per step: step n runs plan[n - 1]
    computes: dict[int, list[float]] = {20: [], 80: []}
    seen: set[int] = set()
    for step, products in enumerate(plan, start=1):
        with timer.compute():
            _work(torch, a, b, products)
        timer.step(step)
        resolved = timer.last_resolved
        if resolved is not None and resolved[0] not in seen and resolved[0] > 2:  # past the first steps' warm-up
            seen.add(resolved[0])
            computes[plan[resolved[0] - 1]].append(resolved[1])
        torch.cuda.synchronize()  # so that the next step() finds this one done (the test's pace, not the timer's)
    torch.cuda.synchronize()
    assert beats.beats[0]["compute"] is None  # step 1's events are read at step 2 at the soonest
    assert all(beat["timing"] == "cuda_events" for beat in beats.beats)
    assert computes[20] and computes[80], computes
    light, heavy = sorted(computes[20])[len(computes[20]) // 2], sorted(computes[80])[len(computes[80]) // 2]
    assert heavy > 2.5 * light, (light, heavy)  # four times the products: clearly more
    # The same 80 products timed from the host around a synchronize.
    torch.cuda.synchronize()
    started = time.perf_counter()
    _work(torch, a, b, 80)
    torch.cuda.synchronize()
    host = time.perf_counter() - started
    assert abs(heavy - host) <= AGREEMENT * host, (heavy, host)
