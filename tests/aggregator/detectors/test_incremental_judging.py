"""Incremental judging (issue 47) changes cost, never a decision: each heartbeat-side detector judging
the fleet's own view (change markers on: caches and shortcuts) finds exactly what a twin judging the
same fleet without markers (``FleetView.without_markers``: the long way) finds, every evaluation,
over a randomized evolving fleet. The fleet plays the faults and their lookalikes: a whole-job
slowdown, one slow node, a rank crashing first and the job restarting (new processes, or a tailed
log's step going back), a job stopping everywhere and one node stopping first, a node going silent,
ranks leaving a job, a job ending and another starting on its nodes, NaN losses and loss spikes, a
checkpoint phase. A run that found nothing would prove nothing: each seed must see findings."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import pytest

from vigil.aggregator.detectors.app_signals import AppSignalsConfig, AppSignalsDetector
from vigil.aggregator.detectors.crash_loop import CrashLoopConfig, CrashLoopDetector
from vigil.aggregator.detectors.hang import HangConfig, HangDetector
from vigil.aggregator.detectors.silence import SilenceConfig, SilenceDetector
from vigil.aggregator.detectors.straggler import StragglerConfig, StragglerDetector, last_complete_window
from vigil.aggregator.detectors.straggler import _median as straggler_median
from vigil.aggregator.fleet import Fleet, RankHistory
from vigil.aggregator.job_runs import JobRun
from vigil.contract.wire import GpuState, RankSummary, Report

INTERVAL = 2.5
NODES = 12
RANKS_PER_NODE = 2
PASSES = 400


@dataclass
class SimJob:
    name: str
    nodes: list[int]
    pids: bool = True  # False: a tailed log (no process identity)
    pid_base: int = 1000
    step: float = 0.0
    speed: float = 1.0  # the whole job's step-time factor
    slow_node: int | None = None
    frozen: set[int] = field(default_factory=set)  # nodes whose ranks stopped progressing
    frozen_all: bool = False
    exited: set[int] = field(default_factory=set)  # nodes whose ranks exited
    left: set[tuple[int, int]] = field(default_factory=set)  # (node, local rank) no longer reported
    progress_ts: dict[tuple[int, int], float] = field(default_factory=dict)
    nan: bool = False
    spike: bool = False
    phase: str | None = None


class World:
    """Twelve nodes, jobs of four to six of them, reports every 2.5 s; ``advance`` picks what happens."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.seq = dict.fromkeys(range(NODES), 0)
        self.silent: dict[int, int] = {}  # node -> passes left silent
        self.power_limit = dict.fromkeys(range(NODES), 700.0)  # a lowered one: another hardware class
        self.health: dict[tuple[int, int], str] = {}  # (node, GPU) -> health when not "ok"
        self.jobs: list[SimJob] = []
        self.count = 0
        for start in (0, 4, 8):
            self._new_job(list(range(start, start + 4 + rng.randrange(0, 3)))[:NODES - start])

    def _new_job(self, nodes: list[int]) -> None:
        self.count += 1
        self.jobs.append(SimJob(f"job-{self.count}", nodes, pids=self.rng.random() < 0.8,
                                pid_base=1000 * self.count))

    def advance(self, t: float) -> None:
        rng = self.rng
        for job in list(self.jobs):
            roll = rng.random()
            if roll < 0.01:
                job.speed = 1.5 if job.speed == 1.0 else 1.0  # whole-job slowdown (lookalike)
            elif roll < 0.025:
                job.slow_node = rng.choice(job.nodes) if job.slow_node is None else None
            elif roll < 0.035 and not job.exited:
                job.exited.add(rng.choice(job.nodes))  # one node's ranks crash first
            elif roll < 0.045 and job.exited:
                job.exited = set(job.nodes)  # ... then the rest
            elif roll < 0.06 and job.exited:
                self._restart(job)
            elif roll < 0.068:
                job.frozen = {rng.choice(job.nodes)}  # one node stops first
            elif roll < 0.074:
                job.frozen_all = True
            elif roll < 0.09 and (job.frozen or job.frozen_all):
                if rng.random() < 0.5:
                    self._restart(job)
                else:
                    job.frozen, job.frozen_all = set(), False
            elif roll < 0.096:
                job.left.add((rng.choice(job.nodes), rng.randrange(RANKS_PER_NODE)))  # a rank leaves
            elif roll < 0.11:
                job.nan = not job.nan
            elif roll < 0.125:
                job.spike = not job.spike
            elif roll < 0.135:
                job.phase = "checkpointing" if job.phase is None else None
            elif roll < 0.14 and len(self.jobs) < 5:
                self.jobs.remove(job)  # the job ends; another starts on its nodes
                self._new_job(job.nodes)
            if not job.frozen_all:
                job.step += 1.0 / job.speed
        if rng.random() < 0.02:
            self.silent[rng.randrange(NODES)] = rng.choice((2, 8, 60))
        if rng.random() < 0.02:
            n = rng.randrange(NODES)
            self.power_limit[n] = 400.0 if self.power_limit[n] == 700.0 else 700.0
        if rng.random() < 0.03:
            key = (rng.randrange(NODES), rng.randrange(RANKS_PER_NODE))
            self.health[key] = rng.choice(("ok", "lost", "reset_required", "unavailable"))

    def _restart(self, job: SimJob) -> None:
        job.pid_base += 100
        job.step = max(0.0, job.step - self.rng.choice((0, 5, 20)))
        job.exited, job.frozen, job.frozen_all, job.left = set(), set(), False, set()
        job.progress_ts.clear()

    def reports(self, t: float) -> list[Report]:
        out = []
        for n in range(NODES):
            if self.silent.get(n, 0) > 0:
                self.silent[n] -= 1
                continue
            self.seq[n] += 1
            ranks = [r for job in self.jobs if n in job.nodes for r in self._ranks(job, n, t)]
            gpus = [GpuState(index=k, uuid=f"GPU-{n}-{k}", name="NVIDIA H100 80GB HBM3", sm_clock_max_hertz=1.98e9,
                             power_limit_watts=self.power_limit[n], health=self.health.get((n, k), "ok"))  # type: ignore[arg-type]
                    for k in range(RANKS_PER_NODE)]
            out.append(Report(node=f"n{n:02d}", boot_id=f"boot-{n}", seq=self.seq[n], ts=t,
                              interval_seconds=INTERVAL, ranks=ranks, gpus=gpus))
        return out

    def _ranks(self, job: SimJob, n: int, t: float) -> list[RankSummary]:
        place = job.nodes.index(n)
        out = []
        for k in range(RANKS_PER_NODE):
            if (n, k) in job.left:
                continue
            stopped = job.frozen_all or n in job.frozen or n in job.exited
            key = (n, k)
            if not stopped or key not in job.progress_ts:
                job.progress_ts[key] = t
            own = 1.0 * job.speed * (1.3 if job.slow_node == n else 1.0) * (1 + 0.004 * self.rng.uniform(-1, 1))
            step = int(job.step)
            fields: dict[str, Any] = {}
            if job.nan and place == 0:
                fields = {"nonfinite_steps": 2, "nonfinite_loss_steps": 2, "nonfinite_first_step": step}
            else:
                fields = {"loss_p50": (9.0 if job.spike else 2.0) + 0.01 * self.rng.uniform(-1, 1)}
            out.append(RankSummary(
                job=job.name, rank=place * RANKS_PER_NODE + k, gpu=k,
                pid=job.pid_base + place * RANKS_PER_NODE + k if job.pids else None,
                state="exited" if n in job.exited else "running", window_seconds=5.0,
                window_end_ts=5.0 * (t // 5.0), steps=0 if stopped else 3, last_step=step,
                first_step=max(0, step - 3), last_progress_ts=job.progress_ts[key],
                step_seconds_p50=own + 0.2, compute_seconds_p50=own, comm_seconds_p50=0.2 * (2 - own),
                phase=job.phase, **fields))  # type: ignore[arg-type]
        return out


def twins() -> list[tuple[Any, Any]]:
    """Each detector twice: one judging the fleet's view, one judging it without markers."""
    def pair(cls: Any, config: Any) -> tuple[Any, Any]:
        return cls(config), cls(config)
    return [pair(HangDetector, HangConfig()),
            pair(CrashLoopDetector, CrashLoopConfig(window_seconds=600.0, lemon_window_seconds=900.0, lemon_jobs=2)),
            pair(AppSignalsDetector, AppSignalsConfig(spike_min_history_windows=4)),
            pair(StragglerDetector, StragglerConfig()),
            pair(SilenceDetector, SilenceConfig())]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_incremental_detectors_find_what_the_long_way_finds(seed: int) -> None:
    rng = random.Random(seed)
    world = World(rng)
    fleet = Fleet()
    detectors = twins()
    found: dict[str, int] = {}
    t = 1000.0
    for _ in range(PASSES):
        t += INTERVAL
        world.advance(t)
        for report in world.reports(t):
            fleet.ingest(report, t)
        fleet.forget_idle_jobs(t)
        view = fleet.view()
        bare = view.without_markers()
        for fast, slow in detectors:
            got = [f.model_dump() for f in fast.evaluate(view, t)]
            want = [f.model_dump() for f in slow.evaluate(bare, t)]
            assert got == want, (fast.name, t)
            if isinstance(fast, CrashLoopDetector):  # what only a later lemon finding would show
                assert fast._crashes == slow._crashes, t
            for f in got:
                found[f"{fast.name}:{f['key']}"] = found.get(f"{fast.name}:{f['key']}", 0) + 1
    # The run exercised the detectors, not only their quiet paths.
    assert {"hang", "crash_loop", "silence", "app_signals", "straggler"} <= {k.split(":")[0] for k in found}, found
    assert {"silence:gpu_lost", "silence:gpu_reset_required"} <= set(found), found
    straggler = next(fast for fast, _ in detectors if isinstance(fast, StragglerDetector))
    assert straggler.bulk_windows > 0  # its windows were read in bulk, the twin's rank by rank ...
    assert straggler.column_windows > 0  # ... or from its jobs' columns (JobState.columns)


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("rate", [1.0, 0.1])
def test_job_run_usual_rank_shortcut_is_the_long_way(rate: float, markers: bool) -> None:
    """JobRun.observe's inlined usual rank and its steady path (every rank the usual one: list
    reads) against ``_observe_rank`` for every rank: the same incarnations, steps, checkpoints and
    exited count over random restarts, exits and step counters going back (one process's counter
    kept per epoch). ``rate`` scales how often things happen: at 0.1 most observations are steady.
    ``markers``: the job's change marker (``JobState.runs_revision``) lets steady observations skip
    what did not change."""
    rng = random.Random(7)
    steady = 0
    fleet = Fleet()
    fast, slow = JobRun("j", 0.0), JobRun("j", 0.0)
    pids = [100 + r for r in range(6)]
    steps = [0] * 6
    states = ["running"] * 6
    for n in range(1, 600):
        t = n * INTERVAL
        for r in range(6):
            roll = rng.random() / rate
            if roll < 0.02:
                pids[r] += 1000
                states[r] = "running"
            elif roll < 0.04:
                states[r] = "exited" if states[r] == "running" else "running"
            elif roll < 0.05:
                steps[r] = max(0, steps[r] - 7)
            else:
                steps[r] += 1
        if rate < 1.0 and "exited" in states and rng.random() < 0.3:
            # The job restarted (at 0.1, exits are short and restarts are the whole job's).
            pids = [pid + 1000 for pid in pids]
            states = ["running"] * 6
        ranks = [RankSummary(job="j", rank=r, pid=pids[r], state=states[r], window_seconds=5.0,  # type: ignore[arg-type]
                             steps=1, last_step=steps[r], last_progress_ts=t,
                             checkpoint_step=steps[r] // 50 * 50 or None)
                 for r in range(6)]
        fleet.ingest(Report(node="a", boot_id="b", seq=n, ts=t, interval_seconds=INTERVAL, ranks=ranks), t)
        # Ranks leave the job's view now and then (and come back).
        view = fleet.view()
        present = [r for r in view.jobs["j"].ranks.values() if rng.random() > 0.05 * rate]
        steady += fast._steady is not None and present == fast._steady
        if markers:
            fast.observe(present, t, job=view.jobs["j"], revision=view.revision)
        else:
            fast.observe(present, t)
        slow.observe(present, t, shortcut=False)
        assert list(fast.incarnations) == list(slow.incarnations)
        assert {k: (v.pid, v.exited, fast.last_step_of(k), v.generation) for k, v in fast.ranks.items()} == \
            {k: (v.pid, v.exited, v.last_step, v.generation) for k, v in slow.ranks.items()}
        assert fast.exited == slow.exited == sum(v.exited for v in slow.ranks.values())
    assert fast.restarts > (3 if rate == 1.0 else 0)
    assert rate == 1.0 or steady > 100, steady


def _last_complete_window_rank_by_rank(ranks: list[RankHistory], interval: float, width: float, now: float) -> int:
    """straggler.last_complete_window as it was, rank by rank (the reference)."""
    deadline = math.floor((now - interval - width) / width + 1e-9)
    reached = math.floor(now / width + 1e-9)
    for rank in ranks:
        if rank.last_seen < now - 2 * width - interval:
            continue
        if not rank.windows:
            return deadline
        reached = min(reached, math.ceil(rank.windows[-1][0] / width - 1e-9))
        if reached <= deadline:
            return deadline
    return max(deadline, reached)


def test_last_complete_window_is_the_rank_by_rank_minimum() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        now = 1000.0 + rng.uniform(0, 50)
        width, interval = rng.choice((2.5, 5.0, 10.0)), rng.choice((0.0, 2.5, 10.0))
        ranks = []
        for r in range(rng.randrange(0, 6)):
            h = RankHistory(RankSummary(job="j", rank=r, window_seconds=width, steps=1, last_step=1,
                                        last_progress_ts=now), "n", now - rng.choice((0.0, 5.0, 40.0)), 8)
            for _ in range(rng.randrange(0, 3) if rng.random() < 0.3 else 1):
                h.windows.append((now - rng.uniform(0, 30), 1.0, None, 1, None))
            ranks.append(h)
        assert last_complete_window(ranks, interval, width, now) == \
            _last_complete_window_rank_by_rank(ranks, interval, width, now)


def test_the_straggler_small_median_is_statistics_median() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        values = [rng.choice((0.5, 1.0, rng.uniform(0, 2))) for _ in range(rng.randrange(1, 10))]
        assert straggler_median(values) == statistics.median(values)
