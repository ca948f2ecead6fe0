"""The compute seam the GPU probes measure through: a burn, copies, a pattern test and P2P copies
on one device. The real engine (torch on CUDA, or on the CPU where there is no GPU:
engine_torch.py) and the fake one that couples a probe's load to FakeNvml's under-load faults
(engine_fake.py) live beside this protocol; the probes never import torch themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, TypeVar

from vigil.contract.wire import ProbeName, ProbeResult

if TYPE_CHECKING:
    from vigil.agent.probes.context import ProbeContext

log = logging.getLogger(__name__)
T = TypeVar("T")

# Called by the engine from inside a burn, while the device works (after a batch of matmuls was
# issued, before waiting for it): the compute probe reads NVML there, so its clocks, power and
# throttle reasons are the loaded GPU's.
LoadSampler = Callable[[], None]


class AllocationError(Exception):
    """The device could not give the memory a probe asked for (CUDA out of memory): a fail of the
    GPU under test, not an error of the probe."""


class ComputeEngine(Protocol):
    """One node's devices as the probes use them. ``device`` is the NVML index."""

    @property
    def kind(self) -> str:  # "cuda" or "cpu": recorded with every result
        ...

    @property
    def concurrent(self) -> bool:
        """Whether every GPU may be driven at once (one thread per GPU); on the CPU every GPU is the
        same cores, so the probes take them in turn."""
        ...

    def matmul_tflops(self, device: int, seconds: float, sample: LoadSampler | None = None) -> float:
        """Run square matmuls on ``device`` for about ``seconds``; the TFLOP/s achieved. ``sample``
        is called now and then while the device works."""
        ...

    def copy_gb_per_s(self, device: int, nbytes: int) -> float:
        """Device-to-device copy bandwidth on ``device`` (read + write bytes per second / 1e9).
        Raises AllocationError when the buffers cannot be had."""
        ...

    def pattern_errors(self, device: int, nbytes: int) -> int:
        """Allocate ``nbytes`` on ``device``, write patterns, read them back: the words that differ.
        Raises AllocationError when the buffer cannot be had."""
        ...

    def p2p_gb_per_s(self, src: int, dst: int, nbytes: int) -> float:
        """Copy bandwidth from ``src`` to ``dst`` (peer to peer where the hardware allows).
        Raises AllocationError when the buffers cannot be had."""
        ...


def build_engine(nvml: object | None) -> ComputeEngine | None:
    """The engine for this node: over a FakeNvml backend (or a FakeNvml itself), the fake engine
    that couples a probe's load to the fake's under-load faults, over torch on the CPU; else torch
    (CUDA where present, the CPU elsewhere); None without torch (the GPU probes then report
    ``skipped``/``no_engine``)."""
    from vigil.agent.nvml.fake import FakeNvml
    from vigil.agent.probes.engine_torch import TorchEngine

    # PynvmlBackend.library: the module it calls (pynvml or a FakeNvml).
    module = nvml if isinstance(nvml, FakeNvml) else getattr(nvml, "library", None)
    try:
        if isinstance(module, FakeNvml):
            from vigil.agent.probes.engine_fake import FakeLoadEngine

            return FakeLoadEngine(TorchEngine(use_cuda=False), module)
        identity = getattr(nvml, "identity", None)
        return TorchEngine(nvml_uuid=(lambda index: str(identity(index).uuid)) if identity else None)
    except ImportError as exc:
        log.warning("no compute engine for the GPU probes: torch cannot be imported (%s)", exc)
        return None


def per_gpu(engine: ComputeEngine, gpus: list[int], work: Callable[[int], T]) -> list[T]:
    """``work(gpu)`` for every GPU, all at once (one thread each) where the engine drives devices
    concurrently, else in turn; the answers in ``gpus``' order."""
    if not engine.concurrent or len(gpus) < 2:
        return [work(gpu) for gpu in gpus]
    with ThreadPoolExecutor(max_workers=len(gpus), thread_name_prefix="probe-gpu") as pool:
        return list(pool.map(work, gpus))


def usable_engine(ctx: ProbeContext, probe: ProbeName, min_gpus: int = 1) -> ComputeEngine | list[ProbeResult]:
    """The engine a GPU probe measures through, or its ``skipped`` result where it cannot run here
    (no engine: torch is not importable; fewer GPUs than it needs)."""
    if ctx.engine is None:
        return [ProbeResult(probe=probe, status="skipped", reason="no_engine",
                            detail="torch is not importable on this node")]
    if len(ctx.gpus) < min_gpus:
        reason = "no_gpus" if min_gpus == 1 else "single_gpu"
        return [ProbeResult(probe=probe, status="skipped", reason=reason,
                            detail=f"{len(ctx.gpus)} GPU(s): {probe} needs {min_gpus}")]
    return ctx.engine
