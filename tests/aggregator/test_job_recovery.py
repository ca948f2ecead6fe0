"""The job-recovery planner: restart a running job without a slow or failing node at the moment
that loses the least GPU time, emitted only then, and its outcome recorded against the estimate.
The lookalikes that must not act: a job-level finding, an alert, a node whose job left it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import FleetView, JobState, RankHistory
from vigil.aggregator.job_recovery import JobRecoveryConfig, JobRecoveryPlanner
from vigil.aggregator.ledger import Ledger
from vigil.contract.wire import RankSummary

T0 = 1_000.0
JOB = "4242"
CONFIG = JobRecoveryConfig(enabled=True)


class Job:
    """One job: 2 ranks on each of its nodes, announcing checkpoints on the agents' clock."""

    def __init__(self, nodes: tuple[str, ...] = ("n1", "n2", "n3", "n4"), step_seconds: float = 1.15) -> None:
        self.state = JobState(JOB)
        self.place(nodes, step_seconds, T0)

    def place(self, nodes: tuple[str, ...], step_seconds: float, now: float,
              checkpoint: tuple[int, float] | None = None) -> None:
        for i, node in enumerate(n for n in nodes for _ in range(2)):
            s = RankSummary(job=JOB, rank=i, window_seconds=5, steps=4, last_step=100, last_progress_ts=now,
                            step_seconds_p50=step_seconds,
                            checkpoint_step=checkpoint[0] if checkpoint else None,
                            checkpoint_ts=checkpoint[1] if checkpoint else None)
            rank = self.state.ranks.get(i)
            if rank is None:
                self.state.ranks[i] = RankHistory(s, node, now, 8)
            else:
                rank.observe(s, node, now, now)
        self.state.last_seen = now

    def view(self) -> FleetView:
        return FleetView({}, {JOB: self.state})


def straggler(node: str = "n2", excess: float = 0.15, action: Action = Action.DRAIN) -> Finding:
    return Finding(detector="straggler", node=node, job=JOB, action=action, reason="slow", since=T0 - 30,
                   key=JOB, evidence={"signal": "compute_seconds_p50", "excess_ratio": excess})


def run(planner: JobRecoveryPlanner, job: Job, now: float, found: list[Finding], spares: int | None = 1,
        checkpoint: tuple[int, float] | None = None, nodes: tuple[str, ...] = ("n1", "n2", "n3", "n4"),
        step_seconds: float = 1.15) -> list[Finding]:
    job.place(nodes, step_seconds, now, checkpoint)
    return planner.evaluate(job.view(), now, found, spares)


def test_a_straggler_restarts_its_job_after_the_next_checkpoint_not_before() -> None:
    planner, job = JobRecoveryPlanner(CONFIG), Job()
    # Two checkpoints seen before the finding: a 25 s cadence.
    assert run(planner, job, T0, [], checkpoint=(100, T0 - 20)) == []
    assert run(planner, job, T0 + 5, [], checkpoint=(200, T0 + 5)) == []
    # The straggler found 5 s after a checkpoint: waiting for the next one loses least.
    assert run(planner, job, T0 + 10, [straggler()], checkpoint=(200, T0 + 5)) == []
    assert run(planner, job, T0 + 25, [straggler()], checkpoint=(200, T0 + 5)) == []
    # The next checkpoint is reported: the restart goes out now.
    out = run(planner, job, T0 + 32, [straggler()], checkpoint=(300, T0 + 30))
    assert len(out) == 1
    f = out[0]
    assert (f.detector, f.action, f.node, f.job) == ("job_recovery", Action.RESTART_JOB, "n2", JOB)
    ev = f.evidence
    assert ev["signal"] == "job_recovery" and ev["when"] == ev["chosen"] == "checkpoint"
    assert ev["exclude"] == ["n2"] and ev["checkpoint_step"] == 300 and ev["spares_available"] == 1
    assert ev["trigger"] == {"detector": "straggler", "action": "drain"}
    assert set(ev["estimate"]) == {"now", "checkpoint", "job_end"}
    assert ev["estimate"]["checkpoint"] < ev["estimate"]["now"] < ev["estimate"]["job_end"]
    # Proposed again (same episode, same id) until the job left the node.
    again = run(planner, job, T0 + 35, [straggler()], checkpoint=(300, T0 + 30))
    assert again == out


def test_the_checkpoint_time_is_put_on_the_aggregators_clock_with_the_nodes_offset() -> None:
    planner, job = JobRecoveryPlanner(CONFIG), Job()
    offsets = {"n1": 100.0}

    class Node:
        def __init__(self, offset: float) -> None:
            self.clock_offset_seconds = offset

    def view() -> FleetView:
        return FleetView({n: Node(o) for n, o in offsets.items()}, {JOB: job.state})  # type: ignore[misc]

    # Rank clocks 100 s ahead: a checkpoint stamped T0 + 110 ended at T0 + 10, before the finding.
    for now, ck in ((T0, (100, T0 + 80)), (T0 + 5, (200, T0 + 105))):
        job.place(("n1",), 1.0, now, ck)
        planner.evaluate(view(), now, [], 1)
    job.place(("n1", "n2"), 1.0, T0 + 20, (300, T0 + 110))
    assert planner.evaluate(view(), T0 + 20, [straggler()], 1) == []


def test_lookalikes_do_not_restart_anything() -> None:
    planner, job = JobRecoveryPlanner(CONFIG), Job()
    whole = Finding(detector="hang", node=WHOLE_JOB, job=JOB, action=Action.RESTART_JOB, reason="hung", since=T0)
    alert = straggler(action=Action.ALERT)
    elsewhere = straggler(node="n9")  # the job does not run on n9 (it left, or never did)
    for now in (T0, T0 + 100, T0 + 200):
        assert run(planner, job, now, [whole, alert, elsewhere], checkpoint=(int(now), now)) == []
    assert planner.pending == 0


def test_without_a_spare_a_slow_node_waits_and_a_dead_one_is_restarted_anyway() -> None:
    slow = JobRecoveryPlanner(CONFIG.model_copy(update={"default_checkpoint_interval_seconds": 30}))
    job = Job()
    assert run(slow, job, T0, [straggler()], spares=0, checkpoint=(1, T0 - 1)) == []
    assert slow.pending == 1
    dead = Finding(detector="silence", node="n2", action=Action.DRAIN, reason="silent", since=T0 - 60, key="silent")
    out = run(JobRecoveryPlanner(CONFIG), Job(), T0, [dead], spares=0, checkpoint=(1, T0 - 1))
    assert [f.evidence["chosen"] for f in out] == ["now"]
    assert out[0].evidence["estimate"]["checkpoint"] is None and "no spare" in out[0].reason


def test_a_small_slowdown_is_left_to_the_jobs_end() -> None:
    planner, job = JobRecoveryPlanner(CONFIG), Job()
    for now in (T0, T0 + 30, T0 + 60, T0 + 90):
        assert run(planner, job, now, [straggler(excess=0.01)], checkpoint=(int(now), now)) == []
    assert planner.pending == 1


def test_the_outcome_is_measured_against_the_estimate_and_exported() -> None:
    planner, job = JobRecoveryPlanner(CONFIG), Job()
    run(planner, job, T0, [], checkpoint=(100, T0 - 20))
    run(planner, job, T0 + 5, [straggler()], checkpoint=(200, T0 + 5))
    assert run(planner, job, T0 + 32, [straggler()], checkpoint=(300, T0 + 30))
    # Restarted on a spare (n5 for n2), 15% faster.
    assert run(planner, job, T0 + 400, [], nodes=("n1", "n5", "n3", "n4"), step_seconds=1.0) == []
    assert run(planner, job, T0 + 410, [], nodes=("n1", "n5", "n3", "n4"), step_seconds=1.0) == []
    assert planner.outcomes[("checkpoint", "improved")] == 1
    registry = CollectorRegistry()
    registry.register(planner.collector())
    text = generate_latest(registry).decode()
    assert 'vigil_aggregator_job_recovery_outcomes_total{chosen="checkpoint",outcome="improved"} 1.0' in text
    assert 'vigil_aggregator_job_recovery_restarts_total{chosen="checkpoint"} 1.0' in text
    assert planner.estimated_saved_gpu_seconds > 0 and planner.realised_saved_gpu_seconds > 0


def test_the_engine_runs_the_planner_over_the_detectors_findings() -> None:
    class Straggler:
        def evaluate(self, view: FleetView, now: float) -> list[Finding]:
            return [straggler()] if JOB in view.jobs else []

    config = parse_config({"job_recovery": {"enabled": True, "default_checkpoint_interval_seconds": 30},
                           "detectors": {"topology": {"enabled": False}}})
    engine = Engine(config, Ledger.in_memory(), detectors=[Straggler()])
    engine.spares_available = lambda: 1
    job = Job()
    job.place(("n1", "n2", "n3", "n4"), 1.15, T0, (100, T0 - 5))
    found = engine.judge(job.view(), T0)
    assert [f.detector for f in found] == ["straggler"]  # waiting for the next checkpoint
    job.place(("n1", "n2", "n3", "n4"), 1.15, T0 + 30, (200, T0 + 25))
    found = engine.judge(job.view(), T0 + 30)
    assert [f.detector for f in found] == ["straggler", "job_recovery"]
