"""The training job model: per-rank step and phase times of a synchronous data-parallel job.

Each step every rank computes (its own time, jittered, slower on a slow node or on a node of a
slower hardware profile), loads data, then meets the others in a collective; so every rank's step
takes as long as the slowest rank's compute + data plus the collective itself, and the slow rank
is the one with the longest compute (or data wait) and the shortest collective wait. It emits the
heartbeats the ranks would send; it does not deliver them (the fleet feeds them to the real
training collector).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vigil.sim.scenario import DataStall, Hang, Job, Pause, SlowNode

# The heartbeat client's phase name for each kind of pause (vigil_heartbeat: JobPhase).
_PHASE_OF = {"checkpoint": "checkpointing", "evaluation": "evaluating"}


@dataclass(frozen=True)
class StepBatch:
    """The steps a job finished in one window: arrays of shape (steps, ranks) except ``step``
    and ``end_ts`` (shape (steps,))."""

    step: np.ndarray
    end_ts: np.ndarray
    step_seconds: np.ndarray
    compute_seconds: np.ndarray
    comm_seconds: np.ndarray
    data_seconds: np.ndarray
    # (steps, ranks): False where the rank had stopped (hung) and sent nothing for that step.
    alive: np.ndarray
    # Announced pauses that began in the window: (ts, last step, phase), as every rank says it.
    announcements: tuple[tuple[float, int, str], ...] = ()


JobFault = SlowNode | DataStall | Hang


class JobModel:
    """One job on ``nodes`` (names, in rank order), stepping on the simulated clock."""

    def __init__(self, job: Job, nodes: list[str], faults: list[JobFault],
                 fault_nodes: dict[int, list[str]], *, seed: int, start: float, gpus_per_node: int = 8,
                 profiles: Sequence[str] | None = None) -> None:
        """``profiles``: each node's device profile, in ``nodes`` order (the job's
        ``profile_compute_factor`` sets its ranks' speed); None: every node computes alike."""
        self.job = job
        self.nodes = nodes
        self.ranks_per_node = job.ranks_per_node
        self.n_ranks = len(nodes) * job.ranks_per_node
        self._gpus = gpus_per_node
        self._node_index = {n: i for i, n in enumerate(nodes)}
        self._rng = np.random.default_rng([seed, _stable_hash(job.name)])
        self._base_compute = job.step_seconds * job.phases.compute
        # Per rank: the compute time of its node's hardware relative to the job's step_seconds.
        self._hardware = np.repeat(
            [job.profile_compute_factor.get(p, 1.0) for p in profiles] if profiles is not None else np.ones(len(nodes)),
            job.ranks_per_node)
        self._base_comm = job.step_seconds * job.phases.comm
        self._base_data = job.step_seconds * job.phases.data
        self._start = start
        self._t = start + job.start_seconds  # when the step in progress began
        self._end = start + job.end_seconds if job.end_seconds is not None else np.inf
        self._step = 0
        self._pending: tuple[np.ndarray, np.ndarray, np.ndarray, float] | None = None
        # Fault schedule with rank masks, resolved once.
        self._slow: list[tuple[SlowNode, np.ndarray]] = []
        self._stall: list[tuple[float, float, np.ndarray, float]] = []
        self._hang: list[tuple[float, np.ndarray, float, float]] = []
        for i, fault in enumerate(faults):
            t0 = start + fault.at_seconds
            end = start + fault.until_seconds if fault.until_seconds is not None else np.inf
            if isinstance(fault, SlowNode):
                self._slow.append((fault, self._mask(fault_nodes[i], fault.ranks, fault.gpus)))
            elif isinstance(fault, DataStall):
                targeted = fault.node is not None or fault.nodes is not None or fault.component is not None
                mask = self._mask(fault_nodes[i]) if targeted else np.ones(self.n_ranks, dtype=bool)
                self._stall.append((t0, end, mask, fault.extra_seconds))
            else:
                self._hang.append((t0, self._mask(fault_nodes[i], fault.ranks, fault.gpus),
                                   fault.others_continue_seconds, end))

    def _mask(self, nodes: list[str], ranks: list[int] | None = None, gpus: list[int] | None = None) -> np.ndarray:
        mask = np.zeros(self.n_ranks, dtype=bool)
        r = self.ranks_per_node
        local = np.ones(r, dtype=bool)
        if ranks is not None:
            local = np.isin(np.arange(r), ranks)
        elif gpus is not None:
            local = np.isin(np.arange(r) % self._gpus, gpus)
        for n in nodes:
            i = self._node_index.get(n)
            if i is not None:
                mask[i * r:(i + 1) * r] = local
        return mask

    def _paused_until(self, t: float) -> tuple[float, Pause] | None:
        """If a step would start at ``t`` inside a checkpoint or evaluation pause, when it ends."""
        for p in self.job.pauses:
            first = self._start + self.job.start_seconds + p.first_at_seconds
            if t < first:
                continue
            into = (t - first) % p.every_seconds
            if into < p.seconds:
                return t - into + p.seconds, p
        return None

    def pause_at(self, t: float) -> Pause | None:
        """The checkpoint or evaluation pause the job is in at ``t`` (simulated Unix time), if any."""
        paused = self._paused_until(t) if self.job.pauses else None
        return paused[1] if paused is not None else None

    def rank_of(self, node: str, local: int) -> int:
        return self._node_index[node] * self.ranks_per_node + local

    @property
    def finished(self) -> bool:
        return self._t >= self._end

    def stopped_at(self, t: float) -> np.ndarray:
        """Ranks whose own process is stopped at ``t`` (a hang episode on their node)."""
        stopped = np.zeros(self.n_ranks, dtype=bool)
        for t0, mask, _, t1 in self._hang:
            if t0 <= t < t1:
                stopped |= mask
        return stopped

    def _blocked(self, start: float, end: float) -> float | None:
        """If a step running from ``start`` to ``end`` cannot finish because the job is blocked
        behind a stopped rank, when the job runs again (inf: never); else None."""
        for t0, _, others, t1 in self._hang:
            if t0 + others < end and start < t1:
                return t1
        return None

    def _noise(self, shape: tuple[int, ...]) -> np.ndarray:
        sigma = self.job.noise.sigma
        z = self._rng.standard_normal(shape)
        if self.job.noise.kind == "lognormal":
            return np.exp(sigma * z - sigma * sigma / 2.0)  # mean 1
        return np.maximum(0.05, 1.0 + sigma * z)

    def _draw(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        n = self.n_ranks
        factor = self._hardware.copy()
        elapsed = t - self._start
        for fault, mask in self._slow:
            if fault.active(elapsed):
                factor[mask] *= fault.factor
        compute = self._base_compute * factor * self._noise((n,))
        extra = np.zeros(n)
        for t0, t1, mask, x in self._stall:
            if t0 <= t < t1:
                extra[mask] += x
        data = (self._base_data + extra) * self._noise((n,))
        ready = compute + data
        if self._hang:
            ready = np.where(self.stopped_at(t), 0.0, ready)  # stopped ranks hold nobody up any more
        collective = self._base_comm * float(self._noise((1,))[0])
        step_seconds = float(ready.max()) + collective
        # Every rank waits in the collective for the slowest one, then for the collective itself.
        return compute, step_seconds - ready, data, step_seconds

    def advance(self, until: float) -> StepBatch:
        """Run every step that finishes by ``until`` (simulated Unix time)."""
        steps: list[int] = []
        ends: list[float] = []
        rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, float]] = []
        alive: list[np.ndarray] = []
        announced: list[tuple[float, int, str]] = []
        n = self.n_ranks
        while True:
            if self._t >= self._end:
                break  # the job has finished: its ranks exited and send nothing more
            if self._pending is None:
                if self.job.pauses:
                    paused = self._paused_until(self._t)
                    if paused is not None:
                        resume_at, pause = paused
                        if pause.announced:
                            announced.append((self._t, self._step, _PHASE_OF[pause.kind]))
                        self._t = resume_at
                        continue
                self._pending = self._draw(self._t)
            compute, comm, data, step_seconds = self._pending
            end = self._t + step_seconds
            if end > until:
                break  # finishes in a later window, with the draws it already has
            resume = self._blocked(self._t, end) if self._hang else None
            if resume is not None:
                # Blocked in a collective a stopped rank never reaches, until the job restarts
                # (from its last step: checkpoint reloads are not modelled).
                if resume > until:
                    break
                self._t = resume
                self._pending = None
                continue
            self._pending = None
            self._t = end
            self._step += 1
            steps.append(self._step)
            ends.append(end)
            rows.append((compute, comm, data, step_seconds))
            alive.append(~self.stopped_at(end) if self._hang else np.ones(n, dtype=bool))
        k = len(steps)
        if k == 0:
            empty = np.zeros((0, n))
            return StepBatch(np.zeros(0, dtype=np.int64), np.zeros(0), empty, empty, empty, empty,
                             np.zeros((0, n), dtype=bool), tuple(announced))
        compute = np.vstack([r[0] for r in rows])
        comm = np.vstack([r[1] for r in rows])
        data = np.vstack([r[2] for r in rows])
        step_s = np.repeat(np.array([r[3] for r in rows])[:, None], n, axis=1)
        return StepBatch(np.array(steps, dtype=np.int64), np.array(ends), step_s, compute, comm, data,
                         np.vstack(alive), tuple(announced))

    @property
    def last_step(self) -> int:
        return self._step


def _stable_hash(text: str) -> int:
    """A seed component from a name that does not change between runs (unlike hash())."""
    h = 2166136261
    for ch in text.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h
