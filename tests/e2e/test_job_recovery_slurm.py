"""Issue 40's real-Slurm test (Done when, second line), with nothing replaced: real slurmctld and
slurmd (tests/e2e/slurm_training.py: four nodes, vnode4 a spare by its ``vigil_spare`` feature),
a real ``vigil agent`` per node receiving the ranks' heartbeats on its Unix socket, a real
``vigil aggregator`` acting through its Slurm actuator, and batch jobs whose ``srun`` steps run the
ranks (tests/e2e/train_rank.py, the real heartbeat client).

1. A straggler's job is requeued at its next checkpoint, onto the spare. A three-node job (the
   straggler detector judges a node against at least two peers of its job: min_nodes >= 3) runs on
   vnode1-3; vnode2's compute is 15% slower; the ranks announce a checkpoint every ~15 s. The
   straggler detector drains vnode2 (the node's own finding, as before); the job-recovery planner
   then requeues the job excluding vnode2 when the job's next announced checkpoint has ended (not
   before: the work since the last checkpoint would be lost, while running on at 15% slower until
   the checkpoint costs less), and Slurm starts it again on vnode1, vnode3 and the spare vnode4,
   its node count kept.
2. A job that crash-loops without progress is held and paged. The batch script restarts its step
   in a loop (``for i in ...; do srun ...; done``, as sites do); each run resumes from its
   checkpoint (step 10) and crashes at step 18. After ``max_restarts_without_progress`` restarts
   the crash-loop detector holds the job (``scontrol requeuehold``: PENDING, held) and pages (the
   hold_job decision reaches a real Alertmanager with severity critical); no node is drained.

Windows and intervals are shortened so that each test is bounded (under a minute of job time):
the agents report every 0.5 s over 1 s training windows; the straggler detector judges 1 s windows
and drains after 3 in a row (5 s and 3 shipped).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Processes, http_json, which
from tests.e2e.slurm_training import (
    REQUEUE_DELAY_SECONDS,
    SPARE,
    SPARE_FEATURE,
    TrainingCluster,
    assert_held,
    events,
    job_nodes,
    rank_command,
    spare_cluster,
    start_training,
    states,
)
from tests.loopback import free_port
from tests.slurm_cluster import SlurmCluster
from vigil.aggregator.decision import REMOVING_ACTIONS

pytestmark = pytest.mark.external
__all__ = ["spare_cluster"]  # the fixture, imported: this module's own four-node cluster

SLOW_NODE = "vnode2"
SLOW_FACTOR = 1.15  # vnode2's compute per step, against its peers'
STEP_SECONDS = 0.2
COMPUTE_SECONDS = 0.12
CHECKPOINT_EVERY_STEPS = 75  # ~15 s at 0.2 s a step, plus the save
CHECKPOINT_SECONDS = 0.5
WINDOW_SECONDS = 1.0  # the agents' training window and the straggler detector's judged window
REPORT_SECONDS = 0.5
JOB_SECONDS = 90.0  # each rank's own bound: a job the test fails to see through still ends
AGENT_TRAINING = {"window_seconds": WINDOW_SECONDS}
STRAGGLER = {"window_seconds": WINDOW_SECONDS, "persistence_windows": 3, "min_nodes": 3}
# The planner's assumed cadence before it has seen two checkpoints: this job's (1800 s shipped,
# at which "now" would be cheaper than waiting half an hour for the first checkpoint).
CADENCE_SECONDS = CHECKPOINT_EVERY_STEPS * STEP_SECONDS + CHECKPOINT_SECONDS
JOB_RECOVERY = {"enabled": True, "default_checkpoint_interval_seconds": CADENCE_SECONDS}
SPARES = {"enabled": True, "refresh_seconds": 1.0}

MAX_RESTARTS = 2  # detectors.crash_loop.max_restarts_without_progress here (3 shipped)
CRASH_AT_STEP = 18
CRASH_CHECKPOINT_EVERY_STEPS = 10
CRASH_LOOP_RUNS = 12  # the script's own bound: far more runs than the hold needs
ALERTMANAGER = which("prometheus-alertmanager") or which("alertmanager")


@pytest.fixture
def straggler_run(spare_cluster: SlurmCluster, tmp_path: Path) -> Iterator[TrainingCluster]:
    cluster = start_training(spare_cluster, tmp_path, {
        "detectors": {"straggler": STRAGGLER},
        "job_recovery": JOB_RECOVERY,
        "spares": SPARES,
        "gate": {"min_removed_seconds": 0},
    }, AGENT_TRAINING, report_seconds=REPORT_SECONDS)
    try:
        yield cluster
    finally:
        cluster.stop()


def _checkpoint_ends(cluster: TrainingCluster, job_nodes_before: list[str]) -> list[tuple[float, int]]:
    """(when the last rank's save ended, its step) of each checkpoint every rank announced."""
    by_step: dict[int, list[float]] = {}
    for e in events(cluster.work, "checkpoint"):
        if e["node"] in job_nodes_before:
            by_step.setdefault(e["step"], []).append(e["end"])
    return sorted((max(ends), step) for step, ends in by_step.items() if len(ends) == len(job_nodes_before))


def test_a_stragglers_job_is_requeued_at_its_next_checkpoint_onto_the_spare(straggler_run: TrainingCluster) -> None:
    cluster, slurm = straggler_run, straggler_run.slurm
    script = "#!/bin/bash\nexec srun -N3 -n3 " + rank_command(
        cluster.work, cluster.agents_dir, "--step-seconds", str(STEP_SECONDS), "--compute-seconds",
        str(COMPUTE_SECONDS), "--slow-node", SLOW_NODE, "--slow-factor", str(SLOW_FACTOR),
        "--checkpoint-every-steps", str(CHECKPOINT_EVERY_STEPS), "--checkpoint-seconds", str(CHECKPOINT_SECONDS),
        "--max-seconds", str(JOB_SECONDS)) + "\n"
    job = cluster.submit(script, 3, "straggled")
    slurm.wait_for(f"job {job} running", lambda: slurm.job(job).get("JobState") == "RUNNING", 30)
    first_nodes = job_nodes(slurm, job)
    assert first_nodes == ["vnode1", "vnode2", "vnode3"], slurm.job(job)  # the spare is taken last

    drains = cluster.wait_decided(f"the straggler drain of {SLOW_NODE}", lambda ds: [
        d for d in ds if d["action"] == "drain" and d["detector"] == "straggler"], 60)
    assert [(d["node"], d.get("job")) for d in drains] == [(SLOW_NODE, job)], cluster.explain()
    drained_at = drains[0]["ts"]

    restarts = cluster.wait_decided("the job-recovery restart", lambda ds: [
        d for d in ds if d["action"] == "restart_job" and d["detector"] == "job_recovery"], 60)
    assert len(restarts) == 1, cluster.explain()
    restart = restarts[0]
    assert (restart["node"], restart["job"]) == (SLOW_NODE, job), restart
    evidence = restart["evidence"]
    assert evidence["signal"] == "job_recovery" and evidence["when"] == "checkpoint", evidence
    assert evidence["exclude"] == [SLOW_NODE] and evidence["chosen"] in evidence["estimate"], evidence
    assert evidence["trigger"] == {"detector": "straggler", "action": "drain"}, evidence
    assert evidence["spares_available"] == 1, evidence  # vnode4, idle with the feature

    # Slurm: held, vnode2 excluded, released; started again on vnode1, vnode3 and the spare.
    after = cluster.wait_job(job, "running again", lambda j: (j["Restarts"], j["JobState"]) == ("1", "RUNNING"),
                             REQUEUE_DELAY_SECONDS + 30)
    assert after["NumNodes"] == "3" and SLOW_NODE in after["ExcNodeList"], after
    assert job_nodes(slurm, job) == ["vnode1", "vnode3", SPARE], after
    restarted = [e for e in events(cluster.work, "start") if e["slurm_restarts"] == 1]
    cluster_states = states(slurm)
    assert cluster_states[SLOW_NODE] in ("drained", "draining"), cluster_states

    # When: after the straggler decision and after the end of the first checkpoint that followed it
    # (the ranks' own record, wall clock), and at that checkpoint, not a later one.
    checkpoints = _checkpoint_ends(cluster, first_nodes)
    after_drain = [(end, step) for end, step in checkpoints if end > drained_at]
    assert after_drain, f"no checkpoint after the drain: {checkpoints}\n{cluster.explain()}"
    next_end, next_step = after_drain[0]
    assert evidence["checkpoint_step"] == next_step, (evidence, checkpoints)
    assert restart["ts"] >= next_end > drained_at, (restart["ts"], checkpoints, drained_at)
    # Slurm ended the first run (SIGTERM to its ranks) only after that, and before any later save.
    requeued_at = min(e["ts"] for e in events(cluster.work, "terminated"))
    assert requeued_at > next_end, (requeued_at, next_end)
    assert [step for end, step in checkpoints if end > next_end] == [], checkpoints
    # The ranks of the new run resumed from that checkpoint.
    slurm.wait_for("the new run's ranks", lambda: len(
        [e for e in events(cluster.work, "start") if e["slurm_restarts"] == 1]) == 3, 30)
    restarted = [e for e in events(cluster.work, "start") if e["slurm_restarts"] == 1]
    assert sorted(e["node"] for e in restarted) == ["vnode1", "vnode3", SPARE], restarted
    assert {e["step"] for e in restarted} == {next_step}, restarted
    print(f"\nstraggler drain {drained_at - min(e['ts'] for e in events(cluster.work, 'start')):.1f} s after the "
          f"job's start; next checkpoint ended {next_end - drained_at:.1f} s later; requeued "
          f"{requeued_at - next_end:.1f} s after it; spare feature {SPARE_FEATURE}")


def _alertmanager(processes: Processes, tmp_path: Path) -> str:
    """A real Alertmanager that keeps what it is sent (a null receiver), on loopback."""
    assert ALERTMANAGER is not None
    addr = f"127.0.0.1:{free_port()}"
    config = tmp_path / "alertmanager.yml"
    config.write_text("route:\n  receiver: pager\n  group_wait: 1s\nreceivers:\n  - name: pager\n")
    processes.start("alertmanager", [ALERTMANAGER, f"--config.file={config}",
                                     f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address={addr}",
                                     "--cluster.listen-address=", "--log.level=warn"])
    deadline = time.monotonic() + 30
    while True:
        try:
            http_json(f"http://{addr}/api/v2/status")
            return addr
        except OSError:
            processes.check_alive()
            assert time.monotonic() < deadline, processes.logs()
            time.sleep(0.2)


def _pages(alertmanager: str, job: str) -> list[dict[str, Any]]:
    return [a for a in http_json(f"http://{alertmanager}/api/v2/alerts")
            if a["labels"].get("alertname") == "VigilDecision" and a["labels"].get("job") == job]


@pytest.mark.skipif(ALERTMANAGER is None, reason="needs prometheus-alertmanager (apt-get install it)")
def test_a_job_crash_looping_without_progress_is_held_and_paged(
        spare_cluster: SlurmCluster, tmp_path: Path, processes: Processes) -> None:
    alertmanager = _alertmanager(processes, tmp_path)
    cluster = start_training(spare_cluster, tmp_path, {
        "detectors": {"crash_loop": {"max_restarts_without_progress": MAX_RESTARTS}},
        "actuators": {"alertmanager": {"enabled": True, "url": f"http://{alertmanager}"}},
    }, AGENT_TRAINING, report_seconds=REPORT_SECONDS)
    slurm = cluster.slurm
    try:
        rank = rank_command(cluster.work, cluster.agents_dir, "--step-seconds", str(STEP_SECONDS),
                            "--checkpoint-every-steps", str(CRASH_CHECKPOINT_EVERY_STEPS),
                            "--checkpoint-seconds", "0.2", "--crash-at-step", str(CRASH_AT_STEP),
                            "--max-seconds", str(JOB_SECONDS))
        script = (f"#!/bin/bash\nfor i in $(seq 1 {CRASH_LOOP_RUNS}); do\n"
                  f"  RESTART=$i srun -N1 -n1 {rank} && exit 0\n  sleep 1\ndone\nexit 1\n")
        job = cluster.submit(script, 1, "crashloop")
        holds = cluster.wait_decided("the crash-loop hold", lambda ds: [
            d for d in ds if d["action"] == "hold_job"], 90)
        assert [(d["detector"], d["node"], d["job"]) for d in holds] == [("crash_loop", None, job)], cluster.explain()
        evidence = holds[0]["evidence"]
        assert evidence["restarts"] >= MAX_RESTARTS and evidence["best_step"] == CRASH_AT_STEP, evidence

        # Slurm: requeued and held (a person releases it), never running again by itself.
        assert_held(cluster.wait_job(job, "held", lambda j: j["JobState"] == "PENDING", 30))
        runs = {e["restart"] for e in events(cluster.work, "start")}
        # The page: the hold_job alert at the real Alertmanager, severity critical, naming the job.
        pages: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while not pages:
            pages = [a for a in _pages(alertmanager, job) if a["labels"]["action"] == "hold_job"]
            assert pages or time.monotonic() < deadline, cluster.explain()
            time.sleep(0.25)
        assert pages[0]["labels"]["severity"] == "critical" and pages[0]["labels"]["detector"] == "crash_loop"
        assert "node" not in pages[0]["labels"], pages
        # It stopped the loop: as many runs as the detector needed (the first and MAX_RESTARTS more,
        # plus at most the one under way when the hold landed), far fewer than the script's.
        assert MAX_RESTARTS + 1 <= len(runs) <= MAX_RESTARTS + 2, sorted(runs)
        assert all(e["step"] == CRASH_AT_STEP for e in events(cluster.work, "crash")), events(cluster.work, "crash")
        # No node is to blame: nothing removed, every node in service.
        acting_on_nodes = {a.value for a in REMOVING_ACTIONS} | {"restart_job"}
        assert [d for _, d in cluster.seen.values() if d["action"] in acting_on_nodes] == [], cluster.explain()
        assert set(states(slurm).values()) == {"idle"}, states(slurm)
        first_crash = min(e["ts"] for e in events(cluster.work, "crash"))
        print(f"\ncrash loop: held after {len(runs)} runs, {holds[0]['ts'] - first_crash:.1f} s after the first "
              f"crash; evidence {evidence}")
    finally:
        cluster.stop()
