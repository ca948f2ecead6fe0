"""Fixtures for the NVML boundary tests: a settable clock, a backend over FakeNvml, and the real GPUs
recorded (tests/fixtures/nvml-real*/) with the fake that stands for each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.profiles import H100_SXM_80GB, H200_SXM_141GB, DeviceProfile
from vigil.agent.nvml.scenario import NodeScenario, load_node_scenario


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_backend(clock: FakeClock) -> Callable[..., tuple[FakeNvml, PynvmlBackend]]:
    def make(scenario: str | NodeScenario = "healthy-h100", seed: int = 0) -> tuple[FakeNvml, PynvmlBackend]:
        sc = load_node_scenario(scenario) if isinstance(scenario, str) else scenario
        fake = FakeNvml(sc, clock, start=0.0, seed=seed)
        backend = PynvmlBackend(fake)
        backend.init()
        return fake, backend

    return make


@dataclass(frozen=True)
class RealGpu:
    """One real GPU recorded by scripts/record-real-gpu.py, and the fake that stands for it."""

    folder: Path  # tests/fixtures/nvml-real*/ (PROVENANCE.md there says where and when)
    scenario: str  # the FakeNvml node scenario of the same board
    training_scenario: str  # the same board training at its power cap, as the recording shows
    profile: DeviceProfile


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
# Every real recording the replay and fake-vs-real tests run over; a new board recorded is one row.
REAL_GPUS = {
    "h100": RealGpu(FIXTURES / "nvml-real", "healthy-h100", "training-h100", H100_SXM_80GB),
    "h200": RealGpu(FIXTURES / "nvml-real-h200", "healthy-h200", "training-h200", H200_SXM_141GB),
}


@pytest.fixture(scope="module", params=list(REAL_GPUS))
def real_gpu(request: pytest.FixtureRequest) -> RealGpu:
    return REAL_GPUS[request.param]
