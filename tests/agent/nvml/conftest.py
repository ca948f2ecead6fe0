"""Fixtures for the NVML boundary tests: a settable clock and a backend over FakeNvml."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
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
