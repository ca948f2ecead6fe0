"""An uninstrumented job's traces on its nodes: its processes on the GPUs, their utilization, the fabric.

It reads the job model's steps (sim/training.py StepBatch), its pauses and the scenario's
``uninstrumented_hang`` windows, and writes what a real job with no heartbeat leaves for the agent
to read: each rank's process in the node's simulated process table (``/proc/<pid>/cgroup`` in
Slurm job ``<name>``'s cgroup, so the real attribution keys the GPU to the job) and on its GPU
(FakeNvml ``running_pids``), each GPU's utilization (FakeNvml.set_utilization; busy-spin in a hang,
FakeNvml.set_busy_spin), and the node's RDMA data counters (port_xmit_data/port_rcv_data, in
4-octet units as the IBTA counters count). It sends no heartbeat and judges nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vigil.sim.fabric import NodeFabric
from vigil.sim.scenario import PAUSE_GPU_UTILIZATION
from vigil.sim.training import JobModel, StepBatch

# PortXmitData/PortRcvData count octets divided by 4 (IBTA vol. 1, PortCounters).
_OCTETS_PER_COUNT = 4


def slurm_cgroup(job: str, local_rank: int) -> str:
    """A Slurm task's /proc/<pid>/cgroup under cgroup v2 (https://slurm.schedmd.com/cgroup_v2.html)."""
    return f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/task_{local_rank}\n"


@dataclass
class _NodeState:
    gpus: list[int]
    pids: dict[int, list[int]]  # GPU index -> the job's pids on it
    utilization: float | None = None  # from the last window's steps (None: none yet)
    pending: deque[tuple[float, int]] = field(default_factory=deque)  # (step end, bytes each way)
    last_apply: float | None = None
    shown: Any = None  # the FakeNvml the job's processes were put on (a reboot brings a new one)


class UninstrumentedJob:
    """One uninstrumented job (``heartbeats: false``) on its nodes. ``observe`` takes each window's
    steps; ``apply`` puts the job's state on one node just before its agent collects."""

    def __init__(self, model: JobModel, *, pid_base: int, gpus_per_node: int, hcas: int,
                 proc_roots: dict[str, Path], hangs: Sequence[tuple[float, float]], start: float) -> None:
        """``hangs``: the job's uninstrumented_hang windows, simulated Unix times [from, until)."""
        self.model = model
        self.name = model.job.name
        self._hcas = hcas
        self._hangs = list(hangs)
        self._start = start + model.job.start_seconds
        self._end = start + model.job.end_seconds if model.job.end_seconds is not None else np.inf
        r = model.ranks_per_node
        self._nodes: dict[str, _NodeState] = {}
        for i, name in enumerate(model.nodes):
            pids: dict[int, list[int]] = {}
            for local in range(r):
                pid = pid_base + i * r + local
                pids.setdefault(local % gpus_per_node, []).append(pid)
                proc = proc_roots[name] / str(pid)
                proc.mkdir(parents=True, exist_ok=True)
                (proc / "cgroup").write_text(slurm_cgroup(self.name, local))
            self._nodes[name] = _NodeState(sorted(pids), pids)

    def hung(self, t: float) -> bool:
        return any(t0 <= t < t1 for t0, t1 in self._hangs)

    def observe(self, batch: StepBatch) -> None:
        """The window's steps: each node's GPU utilization (a rank's GPU is busy but for its data
        wait: computing, or waiting in the collective with NCCL's kernel resident) and the bytes its
        ports move at each step's end."""
        k = len(batch.step)
        if k == 0:
            return
        busy = 1.0 - batch.data_seconds / np.maximum(batch.step_seconds, 1e-9)
        r = self.model.ranks_per_node
        per_bytes = int(self.model.job.rdma_bytes_per_step)
        for i, name in enumerate(self.model.nodes):
            state = self._nodes[name]
            state.utilization = float(np.clip(busy[:, i * r:(i + 1) * r].mean(), 0.0, 1.0))
            if per_bytes:
                state.pending.extend((float(ts), per_bytes) for ts in batch.end_ts)

    def apply(self, node: str, nvml: Any, fabric: NodeFabric | None, now: float) -> None:
        """The job's state on ``node`` at ``now`` (simulated Unix time): processes, utilization or
        busy-spin, and the RDMA data counters grown by the steps that ended since the last call."""
        state = self._nodes.get(node)
        if state is None:
            return
        fake = nvml.library
        running = self._start <= now < self._end
        if running != (state.shown is fake):
            for gpu in state.gpus:
                if running:
                    fake.running_pids[gpu] = list(state.pids[gpu])
                else:
                    fake.running_pids.pop(gpu, None)
            state.shown = fake if running else None
        hung = running and self.hung(now)
        fake.set_busy_spin(state.gpus, hung)
        pause = self.model.pause_at(now) if running and not hung else None
        if not running:
            utilization = None  # the load the fleet's other GPUs show
        elif pause is not None:
            utilization = pause.gpu_utilization if pause.gpu_utilization is not None \
                else PAUSE_GPU_UTILIZATION[pause.kind]
        else:
            utilization = state.utilization
        fake.set_utilization(state.gpus, utilization)
        xmit = rcv = 0
        while state.pending and state.pending[0][0] <= now:
            _, nbytes = state.pending.popleft()
            xmit += nbytes
            rcv += nbytes
        if pause is not None and state.last_apply is not None:
            xmit += int(pause.rdma_bytes_per_second * (now - state.last_apply))  # storage writes
        state.last_apply = now
        if fabric is None or not self._hcas:
            return
        for hca in range(self._hcas):
            if xmit:
                fabric.add_counter(hca, "port_xmit_data", xmit // self._hcas // _OCTETS_PER_COUNT)
            if rcv:
                fabric.add_counter(hca, "port_rcv_data", rcv // self._hcas // _OCTETS_PER_COUNT)
