"""Fixtures for the node-local probes: clocks that tick per call (so a burn's loop ends after a
known number of matmuls, never on the wall clock), a FakeNvml node with its backend, and a
ProbeContext over them with the fake engine over torch on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import NodeScenario, load_node_scenario, parse_node_scenario
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.agent.probes.engine import ComputeEngine


class TickClock:
    """Each call returns the time and then moves it on by ``step`` seconds."""

    def __init__(self, step: float, t: float = 0.0) -> None:
        self.step = step
        self.t = t

    def __call__(self) -> float:
        now = self.t
        self.t += self.step
        return now


class FrozenClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def no_command(argv: Sequence[str], timeout_seconds: float) -> str:
    raise FileNotFoundError(argv[0])


# Tiny work: 2 passes of 0.3 s on a clock that ticks 0.1 s per read (3 matmuls a pass), 1 MiB buffers.
TINY = ProbesConfig(burn_passes=2, burn_pass_seconds=0.3, memory_bytes=1 << 20)


@pytest.fixture
def node() -> Callable[..., tuple[FakeNvml, PynvmlBackend]]:
    def make(scenario: str | NodeScenario | dict[str, Any] = "healthy-h100",
             clock: Callable[[], float] | None = None) -> tuple[FakeNvml, PynvmlBackend]:
        if isinstance(scenario, dict):
            scenario = parse_node_scenario(scenario)
        sc = load_node_scenario(scenario) if isinstance(scenario, str) else scenario
        fake = FakeNvml(sc, clock or FrozenClock(), start=0.0)
        backend = PynvmlBackend(fake)
        backend.init()
        return fake, backend

    return make


@pytest.fixture
def make_ctx() -> Callable[..., ProbeContext]:
    def make(engine: ComputeEngine | None, nvml: Any, gpus: list[int], *, config: ProbesConfig = TINY,
             run: Callable[[Sequence[str], float], str] = no_command, deadline: float = 1e9,
             quick: bool = False) -> ProbeContext:
        return ProbeContext(config=config, gpus=gpus, nvml=nvml, engine=engine, run=run,
                            clock=TickClock(0.01), deadline=deadline, quick=quick)

    return make
