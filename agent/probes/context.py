"""What every probe gets from the world (the seams, its deadline, its group) and the agent's
``probes`` configuration: how long and how hard each probe works. No probe logic lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from vigil.contract.seams import Clock, CommandRunner
from vigil.contract.validation import StrictModel
from vigil.contract.wire import ProbeGroup, ProbeName, ProbeResult

if TYPE_CHECKING:
    from vigil.agent.probes.engine import ComputeEngine


class ProbesConfig(StrictModel):
    """``probes``: how long and how hard each probe works on this node (docs/probes.md)."""

    # The timed matmul burn per GPU: passes of this many seconds each; the coefficient of variation
    # across passes shows a GPU whose clocks sag under sustained load. 5 passes of 4 s: 20 s per
    # GPU, all GPUs at once, long enough to heat an HBM stack and reach a power-brake.
    burn_pass_seconds: float = Field(default=4.0, gt=0, le=600)
    burn_passes: int = Field(default=5, ge=2, le=100)
    # The burn fails on its own when its passes' coefficient of variation (stdev / mean) exceeds
    # this: a sanity bound, far above the few percent healthy GPUs of one class vary by (a tighter
    # bound per hardware class is probes.baselines' max_metrics {"cv": ...}); 0.15 catches clocks
    # that oscillate or collapse mid-burn without a throttle reason to show for it.
    burn_cv_max: float = Field(default=0.15, gt=0, le=10)
    # The memory probes' buffer per GPU (bandwidth copies and the pattern test).
    memory_bytes: int = Field(default=1 << 30, ge=1 << 20, le=1 << 40)
    # dcgmi diag's run level (1 quick, 2 medium, 3 long, 4 extended: minutes to an hour).
    dcgm_level: int = Field(default=2, ge=1, le=4)
    # ib_write_bw's message size and the seconds it runs per HCA.
    rdma_seconds: float = Field(default=5.0, gt=0, le=600)
    # ib_write_bw's average below this fraction of the port's line rate (sysfs ports/<p>/rate) fails.
    # Healthy links reach 95-98%: 392.34 of 400 Gb/s on NDR (tests/fixtures/perftest/), "190+ Gb/s"
    # on HDR in perftest guides; 90% leaves room for RoCE's headers, and a link trained down to a
    # lower speed or width (the fault this finds) falls to 50% or less.
    rdma_min_line_rate_ratio: float = Field(default=0.9, gt=0, le=1)
    # The collective's buffer and iterations (an all-reduce as nccl-tests' all_reduce_perf runs it).
    collective_bytes: int = Field(default=1 << 26, ge=1 << 10, le=1 << 34)
    collective_iterations: int = Field(default=20, ge=1, le=10_000)
    # Every probe run (all the probes of one request) is stopped after this long and reported
    # ``error``/``timeout``: a stuck GPU must not hold the agent's node-action queue for ever.
    run_timeout_seconds: float = Field(default=900.0, gt=0, le=7200)
    # The non-intrusive probes this agent may run while a job holds a GPU (intrusive ones never do).
    allow_with_job: list[ProbeName] = Field(default_factory=list)


@dataclass
class ProbeContext:
    """What a probe gets from the world: every OS and hardware boundary is here, nothing else."""

    config: ProbesConfig
    gpus: list[int]  # the node's GPU indices to probe (NVML's order)
    nvml: Any  # agent.nvml.backend.PynvmlBackend (or None: no NVML): clocks, power, throttle during a burn
    engine: ComputeEngine | None  # the compute seam (torch on CUDA, or on CPU where there is none); None: no torch
    run: CommandRunner  # dcgmi, ib_write_bw
    clock: Clock  # monotonic seconds: durations and the deadline
    deadline: float  # clock() by which the probe must have returned
    group: ProbeGroup | None = None
    quick: bool = False
    sysfs_root: Path = Path("/sys")  # rdma_bw: the HCAs and their ports' rates (class/infiniband)


ProbeFunction = Callable[[ProbeContext], list[ProbeResult]]
