"""The heartbeat-side detectors' bulk paths (issue 47: a job whose ranks are in lockstep judged with
C-level list operations over its ranks) change cost, never a decision: app_signals, hang and
crash_loop judging the fleet's own view find exactly what twins judging it without markers
(``FleetView.without_markers``: the long way, rank by rank) find, every evaluation, over a randomized
fleet of jobs whose ranks mostly move together, while one rank at a time breaks step: a NaN loss on
one rank (and an older agent's, no loss and a non-finite step), a gradient-only overflow, a loss
missing, a loss spike, one rank hanging, exiting or restarted under a new pid, the whole job
restarting (a crash loop), a checkpoint, a window end unknown or going back, ranks joining and
leaving, windows ending at different passes on different nodes, and passes with no reports at all.
Most reports are compact (version 3, as the agent sends them: a field only when it changed, a field
back at its default cleared), the fleet's change markers' usual input. A run that found nothing, or
never took a bulk path, would prove nothing: each seed must see both."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.aggregator.detectors.test_straggler_columns import assert_columns_mirror_ranks
from vigil.agent.report_delta import delta, whole
from vigil.aggregator.detectors.app_signals import AppSignalsConfig, AppSignalsDetector
from vigil.aggregator.detectors.crash_loop import CrashLoopConfig, CrashLoopDetector
from vigil.aggregator.detectors.hang import HangConfig, HangDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import RankSummary, Report, decode_report

INTERVAL = 2.5
NODES = 12
RANKS_PER_NODE = 4
PASSES = 300


@dataclass
class Job:
    name: str
    nodes: list[int]
    loss: bool  # the job reports its loss (bench_evaluation's does not)
    pid_base: int
    step: int = 0
    ranks: set[tuple[int, int]] = field(default_factory=set)  # (node, local rank) reported
    # One rank's fault, (node, local rank) -> what and how many more passes.
    odd: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    pid_bump: dict[tuple[int, int], int] = field(default_factory=dict)
    progress_ts: dict[tuple[int, int], float] = field(default_factory=dict)
    spike: int = 0
    checkpoint: int | None = None


class World:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.seq = dict.fromkeys(range(NODES), 0)
        # Nodes whose agents end their windows half a window later (windows end at different passes).
        self.late_window = {n for n in range(NODES) if rng.random() < 0.3}
        self.jobs: list[Job] = []
        self.count = 0
        for start in (0, 4, 8):
            self._new_job(list(range(start, start + 4)))

    def _new_job(self, nodes: list[int]) -> None:
        self.count += 1
        job = Job(f"job-{self.count}", nodes, loss=self.rng.random() < 0.7, pid_base=10_000 * self.count)
        job.ranks = {(n, k) for n in nodes for k in range(RANKS_PER_NODE)}
        self.jobs.append(job)

    def advance(self) -> None:
        rng = self.rng
        for job in list(self.jobs):
            for key, (what, left) in list(job.odd.items()):
                if left <= 1:
                    del job.odd[key]
                else:
                    job.odd[key] = (what, left - 1)
            job.spike = max(0, job.spike - 1)
            roll = rng.random()
            one = rng.choice(sorted(job.ranks)) if job.ranks else None
            if roll < 0.12 and one is not None:
                what = rng.choice(("nan", "nan_old_agent", "grad_overflow", "no_loss", "hang", "exited",
                                   "window_none", "window_back", "no_steps", "checkpointing"))
                job.odd[one] = (what, rng.choice((1, 2, 6, 12)))
            elif roll < 0.15:
                job.spike = rng.choice((1, 3, 8))
            elif roll < 0.17 and one is not None:
                job.pid_bump[one] = job.pid_bump.get(one, 0) + 1  # one rank restarted under a new pid
            elif roll < 0.20:
                job.pid_base += 100  # the job restarted from its checkpoint (a crash loop when repeated)
                job.step = max(0, job.step - rng.choice((0, 3, 30)))
                job.odd.clear()
                job.progress_ts.clear()
            elif roll < 0.22:
                job.checkpoint = job.step
            elif roll < 0.24 and one is not None and len(job.ranks) > 4:
                job.ranks.discard(one)  # a rank leaves
            elif roll < 0.26:
                free = [(n, k) for n in job.nodes for k in range(RANKS_PER_NODE + 1) if (n, k) not in job.ranks]
                if free:
                    job.ranks.add(rng.choice(free))  # a rank joins (or comes back)
            elif roll < 0.265 and len(self.jobs) < 4:
                self.jobs.remove(job)  # the job ends; another starts on its nodes
                self._new_job(job.nodes)
            job.step += 1

    def reports(self, t: float) -> list[Report]:
        out = []
        for n in range(NODES):
            self.seq[n] += 1
            ranks = [s for job in self.jobs if n in job.nodes for s in self._ranks(job, n, t)]
            out.append(Report(node=f"n{n:02d}", boot_id=f"boot-{n}", seq=self.seq[n], ts=t,
                              interval_seconds=INTERVAL, ranks=ranks))
        return out

    def _ranks(self, job: Job, n: int, t: float) -> list[RankSummary]:
        place = job.nodes.index(n)
        shift = 2.5 if n in self.late_window else 0.0
        out = []
        for k in range(RANKS_PER_NODE + 1):
            key = (n, k)
            if key not in job.ranks:
                continue
            what = job.odd.get(key, ("", 0))[0]
            if what not in ("hang", "exited") or key not in job.progress_ts:
                job.progress_ts[key] = t
            fields: dict[str, Any] = {}
            if job.loss:
                fields["loss_p50"] = (8.0 if job.spike else 2.0) + 0.01 * self.rng.uniform(-1, 1)
            if what == "nan":
                fields.update(loss_p50=None, nonfinite_steps=2, nonfinite_loss_steps=2, nonfinite_first_step=job.step)
            elif what == "nan_old_agent":
                fields.update(loss_p50=None, nonfinite_steps=1)
            elif what == "grad_overflow":
                fields.update(nonfinite_steps=1)
            elif what == "no_loss":
                fields["loss_p50"] = None
            window_end: float | None = 5.0 * ((t - shift) // 5.0) + shift
            if what == "window_none":
                window_end = None
            elif what == "window_back":
                window_end = 5.0 * ((t - 40.0) // 5.0)
            stopped = what in ("hang", "exited", "no_steps")
            out.append(RankSummary(
                job=job.name, rank=place * (RANKS_PER_NODE + 1) + k, gpu=k % RANKS_PER_NODE,
                pid=job.pid_base + place * 10 + k + 1000 * job.pid_bump.get(key, 0),
                state="exited" if what == "exited" else "running", window_seconds=5.0, window_end_ts=window_end,
                steps=0 if stopped else 3, last_step=job.step, first_step=max(0, job.step - 3),
                last_progress_ts=job.progress_ts[key], step_seconds_p50=1.0, compute_seconds_p50=0.8,
                phase="checkpointing" if what == "checkpointing" else None, checkpoint_step=job.checkpoint,
                **fields))
        return out


def compact(fleet: Fleet, base: Report | None, report: Report, now: float) -> Report:
    """``report`` relative to ``base`` as the agent sends it, where the fleet holds that base; else whole."""
    if base is None:
        return report
    body = delta(whole(base), whole(report))
    if body is None:
        return report
    sent = decode_report(json.dumps({**body, "base_seq": base.seq}))
    return sent if fleet.refusal(sent, now) is None else report


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_bulk_paths_find_what_the_long_way_finds(seed: int) -> None:
    rng = random.Random(seed)
    world = World(rng)
    fleet = Fleet()
    pairs: list[tuple[Any, Any]] = [
        (HangDetector(HangConfig()), HangDetector(HangConfig())),
        (CrashLoopDetector(CrashLoopConfig(window_seconds=600.0, lemon_window_seconds=900.0, lemon_jobs=2)),
         CrashLoopDetector(CrashLoopConfig(window_seconds=600.0, lemon_window_seconds=900.0, lemon_jobs=2))),
        (AppSignalsDetector(AppSignalsConfig(spike_min_history_windows=4)),
         AppSignalsDetector(AppSignalsConfig(spike_min_history_windows=4))),
    ]
    found: dict[str, int] = {}
    held: dict[str, Report] = {}  # per node: its latest report ingested (the next compact one's base)
    compacts = 0
    t = 1000.0
    for _ in range(PASSES):
        t += INTERVAL
        world.advance()
        if rng.random() > 0.05:  # now and then a pass with no reports: only time passed
            for report in world.reports(t):
                sent = compact(fleet, held.get(report.node), report, t) if rng.random() < 0.8 else report
                compacts += sent.base_seq is not None
                fleet.ingest(sent, t)
                held[report.node] = report
        fleet.forget_idle_jobs(t)
        view = fleet.view()
        for job in view.jobs.values():
            assert_columns_mirror_ranks(job)  # the columns the bulk paths read
        bare = view.without_markers()
        for fast, slow in pairs:
            got = [f.model_dump() for f in fast.evaluate(view, t)]
            want = [f.model_dump() for f in slow.evaluate(bare, t)]
            assert got == want, (fast.name, t)
            for f in got:
                found[f"{fast.name}:{f['key']}"] = found.get(f"{fast.name}:{f['key']}", 0) + 1
            if isinstance(fast, AppSignalsDetector):
                # What only a later spike or hold would show: the loss history and the NaN records.
                assert {k: (list(s.losses), s.loss_seen, s.nan_by_incarnation, s.nan_since)
                        for k, s in fast._jobs.items()} == \
                    {k: (list(s.losses), s.loss_seen, s.nan_by_incarnation, s.nan_since)
                     for k, s in slow._jobs.items()}, t
            if isinstance(fast, CrashLoopDetector):
                assert fast._crashes == slow._crashes, t
                for run in fast.runs:
                    other = slow.runs.get(run.job)
                    assert other is not None and list(run.incarnations) == list(other.incarnations), t
    assert {"app_signals:nonfinite_loss", "app_signals:loss_spike", "hang:hang", "crash_loop:crash_loop"} \
        <= set(found), found
    assert compacts > PASSES * NODES // 2, compacts
    app = next(fast for fast, _ in pairs if isinstance(fast, AppSignalsDetector))
    assert app.bulk_judged > PASSES, app.bulk_judged  # most jobs' passes took the bulk path
    # ... and of those that judged new windows, many read them from the jobs' columns (RankColumns)
    assert app.columns_judged > PASSES // 2, (app.columns_judged, app.bulk_judged)
    hang = next(fast for fast, _ in pairs if isinstance(fast, HangDetector))
    assert hang.columns_noted > PASSES // 2, hang.columns_noted  # its running jobs' passes read their columns
    crash = next(fast for fast, _ in pairs if isinstance(fast, CrashLoopDetector))
    observed = sum(run.columns_observed for run in crash.runs)
    assert observed > PASSES // 10, observed  # the quiet steady jobs' steps read from their columns
