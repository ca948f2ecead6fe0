"""The compute seam the GPU probes measure through: a burn, copies, a pattern test and P2P copies
on one device. The real engine (torch on CUDA, or on the CPU where there is no GPU) and the fake
one over FakeNvml live beside this protocol; the probes never import torch themselves.
"""

from __future__ import annotations

from typing import Protocol


class ComputeEngine(Protocol):
    """One node's devices as the probes use them. ``device`` is the NVML index."""

    @property
    def kind(self) -> str:  # "cuda" or "cpu": recorded with every result
        ...

    def matmul_tflops(self, device: int, seconds: float) -> float:
        """Run square matmuls on ``device`` for about ``seconds``; the TFLOP/s achieved."""
        ...

    def copy_gb_per_s(self, device: int, nbytes: int) -> float:
        """Device-to-device copy bandwidth on ``device`` (read + write bytes per second / 1e9)."""
        ...

    def pattern_errors(self, device: int, nbytes: int) -> int:
        """Allocate ``nbytes`` on ``device``, write patterns, read them back: the words that differ."""
        ...

    def p2p_gb_per_s(self, src: int, dst: int, nbytes: int) -> float:
        """Copy bandwidth from ``src`` to ``dst`` (peer to peer where the hardware allows)."""
        ...


def build_engine(nvml: object | None) -> ComputeEngine | None:
    """The engine for this node: over a FakeNvml backend, the fake engine that couples load to the
    fake's faults; else torch (CUDA where present, the CPU elsewhere); None without torch.
    (Foundation placeholder: the torch and fake engines are being written.)"""
    return None
