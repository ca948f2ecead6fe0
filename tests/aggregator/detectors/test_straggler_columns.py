"""The straggler detectors judging from their jobs' rank columns (JobState.columns, kept by the fleet on
ingest: issue 47) finds exactly what the long way finds (rank by rank, on a view without markers),
every pass, with the same memory (each window's verdict, each class's spreads), over a randomized
fleet that moves the columns under it: ranks joining late, leaving (a node forgotten, ranks evicted
by another job's), moving to another node, summary windows widening and narrowing, late and lost
windows, a second hardware class, a real straggler (a node, one GPU) and its lookalike (the whole job
slowing down). The GPU straggler detector is held to its long way (``LongWayGpuStraggler``) alike.
The fleet's columns mirror each job's ranks (their newest windows and latest summaries) after every
round."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from tests.aggregator.detectors.test_gpu_straggler_short_way import CountingGpuStraggler
from tests.aggregator.detectors.test_incremental_gpu_side import LongWayGpuStraggler
from vigil.aggregator.detectors.gpu_straggler import GpuStragglerConfig
from vigil.aggregator.detectors.straggler import StragglerConfig, StragglerDetector, _Verdict
from vigil.aggregator.fleet import Fleet, FleetConfig, JobState
from vigil.aggregator.fleet.history import summary_flags
from vigil.contract.wire import GpuState, RankSummary, Report

INTERVAL = 2.5
NODES = 16


def assert_columns_mirror_ranks(job: JobState) -> None:
    """Each slot of the job's columns holds one of its ranks and that rank's newest window."""
    columns = job.columns
    assert sorted(id(r) for r in columns.ranks) == sorted(id(r) for r in job.ranks.values())
    for slot, rank in enumerate(columns.ranks):
        assert rank.columns is columns and rank.slot == slot
        assert columns.seen[slot] == rank.last_seen
        # The latest summary's figures (app_signals, hang, job_runs read them), every summary.
        s = rank.last
        assert columns.flags[slot] == summary_flags(s)
        assert columns.marks[slot] == (s.window_end_ts if s.window_end_ts is not None else -math.inf)
        assert (s.loss_p50 is None and math.isnan(columns.losses[slot])) or columns.losses[slot] == s.loss_p50
        assert (columns.progress[slot], columns.report_ts[slot], columns.last_steps[slot]) == (
            s.last_progress_ts, rank.report_ts, s.last_step)
        if not rank.windows:
            assert columns.ends[slot] == -math.inf
            continue
        end, compute, comm, steps, data = rank.windows[-1]
        assert (columns.ends[slot], columns.owns[slot], columns.computes[slot], columns.steps[slot]) == (
            end, compute + (data or 0.0), compute, steps)
        assert columns.no_comm[slot] == (comm is None)
        assert (comm is None and math.isnan(columns.comms[slot])) or columns.comms[slot] == comm


class World:
    """Job "a" on nodes 0-9 (4 ranks a node), job "b" on nodes 10-15 (2 a node, two of its nodes of
    another power limit); job "c" now and then takes nodes 0-1 from "a" (evicting its ranks)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.seq = dict.fromkeys(range(NODES), 0)
        self.silent: dict[int, int] = {}
        self.speed = {"a": 1.0, "b": 1.0, "c": 1.0}
        self.slow: dict[str, int | None] = {"a": None, "b": None, "c": None}
        self.factor = 1.25  # how much slower the slow node is: now and then near the floor (4%)
        self.slow_rank: int | None = None  # one slow GPU of job "a" (waiting least in the collective)
        self.wide = {"a": False, "b": False, "c": False}
        self.late: set[int] = set()
        self.c_on = False
        self.moved: tuple[int, float] | None = None  # (rank of "a" moved from node 2 to node 3, since)
        self.joined_at = rng.uniform(1020, 1200)  # rank 40 of "a" (node 9's fifth) joins late

    def advance(self, t: float) -> None:
        rng = self.rng
        for job in ("a", "b", "c"):
            roll = rng.random()
            if roll < 0.02:
                self.speed[job] = 1.4 if self.speed[job] == 1.0 else 1.0  # whole-job slowdown (lookalike)
            elif roll < 0.05:
                nodes = {"a": range(10), "b": range(10, 16), "c": range(2)}[job]
                self.slow[job] = rng.choice(list(nodes)) if self.slow[job] is None else None
                self.factor = rng.choice((1.25, rng.uniform(1.03, 1.06)))
            elif roll < 0.06:
                self.wide[job] = not self.wide[job]
        if rng.random() < 0.02:
            self.c_on = not self.c_on
        if rng.random() < 0.02:
            self.slow_rank = rng.randrange(40) if self.slow_rank is None else None
        if rng.random() < 0.01:
            self.silent[rng.randrange(NODES)] = rng.choice((2, 16))  # 16 passes: forgotten
        if rng.random() < 0.05:
            self.late = {rng.randrange(NODES)} if not self.late else set()
        if self.moved is None and rng.random() < 0.01:
            self.moved = (2 * 4 + 1, t)

    def reports(self, t: float) -> list[Report]:
        out = []
        for n in range(NODES):
            if self.silent.get(n, 0) > 0:
                self.silent[n] -= 1
                continue
            if self.rng.random() < 0.04:
                continue  # a lost report: its ranks' windows come a report late or not at all
            self.seq[n] += 1
            ranks = []
            if n < 10 and not (self.c_on and n < 2):
                locals_ = list(range(4)) + ([4] if n == 9 and t >= self.joined_at else [])
                for k in locals_:
                    rank = n * 4 + k if k < 4 else 40
                    if self.moved is not None and rank == self.moved[0]:
                        continue  # moved away from node 2 ...
                    ranks.append(self._rank("a", rank, n, t))
                if n == 3 and self.moved is not None and t - self.moved[1] > 35:
                    ranks.append(self._rank("a", self.moved[0], n, t))  # ... and back on node 3 after 35 s
            if self.c_on and n < 2:
                ranks += [self._rank("c", n * 6 + k, n, t) for k in range(6)]
            if n >= 10:
                ranks += [self._rank("b", (n - 10) * 2 + k, n, t) for k in range(2)]
            limit = 500.0 if n in (14, 15) else 700.0
            gpus = [GpuState(index=k, uuid=f"GPU-{n}-{k}", name="NVIDIA H100 80GB HBM3", sm_clock_max_hertz=1.98e9,
                             power_limit_watts=limit) for k in range(4)]
            out.append(Report(node=f"n{n:02d}", boot_id=f"boot-{n}", seq=self.seq[n], ts=t, interval_seconds=INTERVAL,
                              ranks=ranks, gpus=gpus))
        return out

    def _rank(self, job: str, rank: int, n: int, t: float) -> RankSummary:
        rng = self.rng
        width = 10.0 if self.wide[job] else 5.0
        end = width * math.floor(t / width) - (width if n in self.late else 0.0)
        own = self.speed[job] * (self.factor if self.slow[job] == n else 1.0) * (1 + 0.01 * rng.uniform(-1, 1))
        gpu_slow = job == "a" and rank == self.slow_rank
        own *= 1.3 if gpu_slow else 1.0
        return RankSummary(
            job=job, rank=rank, gpu=rank % 4, state="running", window_seconds=width, window_end_ts=end,
            steps=rng.choice((1, 3, 3)), last_step=int(t), last_progress_ts=t, step_seconds_p50=own + 0.3,
            compute_seconds_p50=own,
            comm_seconds_p50=0.05 if gpu_slow else 0.3 * (2 - own) if rng.random() > 0.01 else None,
            data_seconds_p50=0.02 * rng.random() if job != "b" else None)


def _memory(detector: StragglerDetector) -> dict[str, Any]:
    def verdict(v: _Verdict) -> tuple[Any, ...]:
        return (v.flagged, v.judged, {c: (m, sorted(names)) for c, (m, names) in v.classes.items()}, v.reference,
                v.notes, v.pruned)
    return {name: (m.last_judged, {i: verdict(v) for i, v in m.windows.items()}, m.spreads, m.removed,
                   m.episode_since, m.class_runs, m.class_said) for name, m in detector._memo.items()}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_column_judging_finds_what_the_long_way_finds(seed: int) -> None:
    rng = random.Random(seed)
    world = World(rng)
    fleet = Fleet(FleetConfig(max_ranks_per_node=6, forget_after_seconds=60.0))
    fast, slow = StragglerDetector(StragglerConfig()), StragglerDetector(StragglerConfig())
    found: dict[str, int] = {}
    t = 1000.0
    for _ in range(500):
        t += INTERVAL
        world.advance(t)
        for report in world.reports(t):
            fleet.ingest(report, t)
        fleet.forget_departed(t, lambda _: 30.0)
        view = fleet.view()
        for job in view.jobs.values():
            assert_columns_mirror_ranks(job)
        got = [f.model_dump() for f in fast.evaluate(view, t)]
        assert got == [f.model_dump() for f in slow.evaluate(view.without_markers(), t)], t
        assert _memory(fast) == _memory(slow), t
        for f in got:
            found[f"{f['action']}:{f['key']}"] = found.get(f"{f['action']}:{f['key']}", 0) + 1
    assert fast.column_windows > 100 and slow.column_windows == 0  # the columns were read, the twin's ranks
    assert fast.bulk_windows > 0  # ... and the windows that are not the usual one took the long way
    assert any(k.startswith("drain:") for k in found), found
    assert fleet.evicted["ranks"] > 0  # job "c" evicted ranks of "a": slots given back


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_gpu_straggler_columns_find_what_the_long_way_finds(seed: int) -> None:
    rng = random.Random(seed)
    world = World(rng)
    fleet = Fleet(FleetConfig(max_ranks_per_node=6, forget_after_seconds=60.0))
    short, long = CountingGpuStraggler(GpuStragglerConfig()), LongWayGpuStraggler(GpuStragglerConfig())
    found = 0
    in_columns = 0
    t = 1000.0
    for _ in range(500):
        t += INTERVAL
        world.advance(t)
        for report in world.reports(t):
            fleet.ingest(report, t)
        fleet.forget_departed(t, lambda _: 30.0)
        view = fleet.view()
        got = short.evaluate(view, t)
        assert got == long.evaluate(view, t), t
        assert {n: (m.last_judged, m.spreads, m.runs, m.removed) for n, m in short._memo.items()} == {
            n: (m.last_judged, m.spreads, m.runs, m.removed) for n, m in long._memo.items()}, t
        found += len(got)
        in_columns += sum(roster.columns for roster in short._job_nodes.values())
    assert found and in_columns and short.cut  # the slow GPU was found, and windows were cut from the columns
