"""The crash-loop detector: a job that restarts without progress is held (job-level, no node named),
one that restarts and progresses is not; a node first to exit in three different jobs is a lemon,
one job crashing there three times or a job crashing everywhere together is not."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import WHOLE_JOB, Action
from vigil.aggregator.detectors.crash_loop import CrashLoopConfig, CrashLoopDetector
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.wire import RankSummary

INTERVAL = 2.5


def summary(job: str, rank: int, *, pid: int | None, step: int, ts: float, state: str = "running",
            checkpoint: int | None = None) -> RankSummary:
    steps = 2 if state == "running" else 0
    return RankSummary(job=job, rank=rank, pid=pid, state=state, window_seconds=5.0, steps=steps,  # type: ignore[arg-type]
                       last_step=step, last_progress_ts=ts, step_seconds_p50=1.0, first_step=max(0, step - 2),
                       checkpoint_step=checkpoint)


@dataclass
class Run:
    """One incarnation: from ``start`` step, one step a second, to ``crash`` (None: never crashes),
    over ``seconds``; ``checkpoint``: the checkpoint step its ranks report."""

    start: int
    crash: int | None
    seconds: float = 15.0
    checkpoint: int | None = None


class Job:
    """A job of ``nodes`` x ``ranks`` ranks whose incarnations follow ``runs``, each new process a new
    pid, a crash leaving every rank exited for ``gap`` seconds before the next run (a job script's
    ``for i in ...; do srun python train.py; done``)."""

    def __init__(self, name: str, nodes: list[FakeNode], ranks: int = 2, pid_base: int = 1000) -> None:
        self.name, self.nodes, self.ranks, self.pid = name, nodes, ranks, pid_base

    def timeline(self, runs: list[Run], t0: float,
                 gap: float = 5.0) -> Iterator[tuple[float, dict[str, list[RankSummary]]]]:
        t = t0
        for run in runs:
            self.pid += 100
            begin = t
            last = run.start
            while t < begin + run.seconds:
                last = run.start + int(t - begin)
                if run.crash is not None:
                    last = min(last, run.crash)
                yield t, self._ranks(last, t, "running", run.checkpoint)
                t += INTERVAL
            if run.crash is None:
                continue
            end = t
            while t < end + gap:
                yield t, self._ranks(last, end, "exited", run.checkpoint)
                t += INTERVAL

    def _ranks(self, step: int, ts: float, state: str, checkpoint: int | None) -> dict[str, list[RankSummary]]:
        out: dict[str, list[RankSummary]] = {}
        for i, node in enumerate(self.nodes):
            out[node.name] = [summary(self.name, i * self.ranks + k, pid=self.pid + i * self.ranks + k, step=step,
                                      ts=ts, state=state, checkpoint=checkpoint) for k in range(self.ranks)]
        return out


def play(job: Job, runs: list[Run], detector: CrashLoopDetector | None = None, fleet: Fleet | None = None,
         t0: float = 0.0):
    """Every report of the job's timeline into a fleet, the detector after each round. Returns the
    detector, the fleet, every (time, finding) and the time after the last round."""
    detector = detector or CrashLoopDetector(CrashLoopConfig())
    fleet = fleet or Fleet()
    found = []
    t = t0
    for t, ranks in job.timeline(runs, t0):
        for node in job.nodes:
            node.ranks = ranks[node.name]
            fleet.ingest(node.report(t), t)
        found.extend((t, f) for f in detector.evaluate(fleet.view(), t))
    return detector, fleet, found, t


def nodes_(n: int = 2, prefix: str = "n") -> list[FakeNode]:
    return [FakeNode(f"{prefix}{i}", gpus=0, ports=0) for i in range(n)]


def holds(found):
    return [(t, f) for t, f in found if f.action is Action.HOLD_JOB]


def test_a_job_crashing_at_the_same_step_is_held_after_three_restarts_naming_the_job_and_no_node():
    # Each run resumes from the checkpoint at step 40 and crashes at step 50: 10-20 s runs.
    runs = [Run(0, 50, seconds=60.0)] + [Run(40, 50) for _ in range(4)]
    _, _, found, _ = play(Job("4242", nodes_()), runs)
    held = holds(found)
    assert held, "never held"
    first_t, first = held[0]
    assert (first.node, first.job, first.detector) == (WHOLE_JOB, "4242", "crash_loop")
    ev = first.evidence
    assert ev["signal"] == "crash_loop" and ev["restarts"] == 3 and ev["best_step"] == 50
    assert ev["job_nodes"] == ["n0", "n1"]
    assert ev["steps_per_incarnation"][:4] == [[0, 50], [40, 50], [40, 50], [40, 50]]
    # Held when the fourth run (the third restart) was seen exited (t = 120 s): before the fifth started.
    assert first_t == 60 + 3 * 20
    # One episode: the same since (so the same decision) in every later evaluation.
    assert {f.since for _, f in held} == {first.since}
    assert not [f for _, f in found if f.node != WHOLE_JOB]  # no node named, none removed


def test_a_job_that_restarts_and_then_progresses_is_not_held():
    # A requeue after a node failure (or vigil's own restart_job): each run gets past the last one.
    runs = [Run(0, 50, seconds=60.0), Run(40, 70, seconds=40.0), Run(60, 95, seconds=40.0), Run(90, 130, seconds=45.0),
            Run(120, None, seconds=40.0)]
    _, _, found, _ = play(Job("7", nodes_()), runs)
    assert holds(found) == []


def test_progress_by_checkpoint_counts_and_a_progressing_current_run_ends_the_streak():
    # Every run crashes at step 50, but each completes a checkpoint past where it resumed: the
    # next one resumes further on (the resiliency extension's progress notion).
    runs = [Run(0, 50, seconds=60.0, checkpoint=20)] + [Run(20 + 5 * k, 50, checkpoint=25 + 5 * k) for k in range(4)]
    _, _, found, _ = play(Job("8", nodes_()), runs)
    assert holds(found) == []
    # Three failed restarts, then a run that gets well past them: held while it failed, not after.
    runs = [Run(0, 50, seconds=60.0)] + [Run(40, 50) for _ in range(3)] + [Run(40, None, seconds=40.0)]
    _, _, found, end = play(Job("9", nodes_()), runs)
    assert holds(found) and not [f for t, f in found if t >= end - 5]


def test_a_streak_outside_the_window_is_not_held():
    runs = [Run(0, 50, seconds=60.0)] + [Run(40, 50, seconds=400.0) for _ in range(3)]
    _, _, found, _ = play(Job("10", nodes_()), runs, CrashLoopDetector(CrashLoopConfig(window_seconds=600.0)))
    assert holds(found) == []


def test_a_pid_less_rank_restarting_shows_by_its_step_going_back():
    class LogJob(Job):
        def _ranks(self, step, ts, state, checkpoint):
            out = super()._ranks(step, ts, "running", checkpoint)
            return {n: [RankSummary(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "pid": None}) for s in rs]
                    for n, rs in out.items()}

    runs = [Run(0, 50, seconds=60.0)] + [Run(40, 50) for _ in range(4)]
    detector, _, found, _ = play(LogJob("11", nodes_()), runs)
    assert detector.runs.get("11").restarts == 4
    assert holds(found)


def test_one_process_whose_step_counter_goes_back_did_not_restart():
    # A step counter kept per epoch: the same pids, running throughout.
    nodes = nodes_()
    detector, fleet = CrashLoopDetector(CrashLoopConfig()), Fleet()
    for i in range(200):
        t = i * INTERVAL
        for n_i, node in enumerate(nodes):
            node.ranks = [summary("12", n_i * 2 + k, pid=500 + n_i * 2 + k, step=i % 20, ts=t) for k in range(2)]
            fleet.ingest(node.report(t), t)
        assert detector.evaluate(fleet.view(), t) == []
    assert detector.runs.get("12").restarts == 0


def crash_on(job: Job, first: str | None, t0: float, *, together: bool = False) -> Iterator[tuple[float, dict]]:
    """A job runs 20 s, then ``first``'s ranks exit; the rest exit 30 s later (the NCCL timeout
    tearing them down), or with ``together`` all at once (an exception at the same step)."""
    t = t0
    while t < t0 + 20:
        yield t, job._ranks(int(t - t0), t, "running", None)
        t += INTERVAL
    while t < t0 + 60:
        ranks = job._ranks(20, t0 + 20, "exited", None)
        if not together and t < t0 + 50:
            for name in list(ranks):
                if name != first:
                    ranks[name] = job._ranks(20, t0 + 20, "running", None)[name]
        yield t, ranks
        t += INTERVAL


def drive_crashes(jobs: list[tuple[Job, str | None, bool]], detector: CrashLoopDetector, gap: float = 100.0):
    fleet = Fleet()
    found = []
    t0 = 0.0
    for job, first, together in jobs:
        for t, ranks in crash_on(job, first, t0, together=together):
            for node in job.nodes:
                node.ranks = ranks[node.name]
                fleet.ingest(node.report(t), t)
            found.extend(detector.evaluate(fleet.view(), t))
        t0 += gap
    return found


def test_a_node_first_to_crash_in_three_different_jobs_is_sent_to_inspection():
    lemon = FakeNode("lemon", gpus=0, ports=0)
    jobs = []
    for j in range(3):
        # The lemon is never rank 0's node (rank 0 is first-crash suspect for the job's own reasons).
        others = [FakeNode(f"j{j}n{i}", gpus=0, ports=0) for i in range(2)]
        jobs.append((Job(f"{100 + j}", [*others, lemon], pid_base=10_000 * (j + 1)), "lemon", False))
    found = drive_crashes(jobs, CrashLoopDetector(CrashLoopConfig()))
    lemons = [f for f in found if f.action is Action.INSPECT_HARDWARE]
    assert lemons and {f.node for f in lemons} == {"lemon"}
    assert lemons[-1].evidence["jobs"] == ["100", "101", "102"] and lemons[-1].evidence["signal"] == "lemon_node"
    assert len({f.since for f in lemons}) == 1


def test_one_job_crashing_three_times_on_a_node_or_jobs_crashing_everywhere_together_is_no_lemon():
    lemon = FakeNode("lemon", gpus=0, ports=0)
    other = FakeNode("other", gpus=0, ports=0)
    same = Job("200", [other, lemon])
    found = drive_crashes([(same, "lemon", False)] * 3, CrashLoopDetector(CrashLoopConfig()))
    assert not [f for f in found if f.action is Action.INSPECT_HARDWARE]
    together = [(Job(f"{300 + j}", [FakeNode(f"k{j}", gpus=0, ports=0), lemon], pid_base=5000 * (j + 1)), None, True)
                for j in range(3)]
    found = drive_crashes(together, CrashLoopDetector(CrashLoopConfig()))
    assert not [f for f in found if f.action is Action.INSPECT_HARDWARE]
    # The lemon holding rank 0 of each job: rank 0's own duties, not evidence against the node.
    first = [(Job(f"{400 + j}", [lemon, FakeNode(f"m{j}", gpus=0, ports=0)], pid_base=7000 * (j + 1)), "lemon", False)
             for j in range(3)]
    found = drive_crashes(first, CrashLoopDetector(CrashLoopConfig()))
    assert not [f for f in found if f.action is Action.INSPECT_HARDWARE]


def test_a_hold_goes_through_the_real_engine_and_gate_with_no_node_and_counts_in_the_restart_budget():
    config = parse_config({"dry_run": False, "gate": {"restart_job_budget": 1}})
    ledger = Ledger(Gate(GateConfig(dry_run=False, restart_job_budget=1)), Store(":memory:"), {})
    engine = Engine(config, ledger, detectors=[CrashLoopDetector(config.detectors.crash_loop)])
    job = Job("4242", nodes_())
    admitted = []
    for t, ranks in job.timeline([Run(0, 50, seconds=60.0)] + [Run(40, 50) for _ in range(4)], 0.0):
        for node in job.nodes:
            node.ranks = ranks[node.name]
            engine.ingest(node.report(t), t)
        admitted.extend(engine.evaluate(t))
    assert [(d.action, d.node, d.job, d.detector) for d in admitted] == [(Action.HOLD_JOB, None, "4242", "crash_loop")]
    state = ledger.store.state
    assert [job for _, job in state.restarts] == ["4242"]  # the restart budget counted it
    assert state.nodes == {}  # no node touched
