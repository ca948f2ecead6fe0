"""Issue 40's real-DDP test (Done when, third line): a NaN loss reported through the heartbeat
stops the job's restart loop and names the job; no node is removed.

A two-node Slurm batch job (real slurmctld/slurmd, tests/e2e/slurm_training.py) whose script
restarts its step in a loop (``for i in ...; do srun ...; done``) runs a real torch DDP job (gloo,
two processes, tests/e2e/ddp_nan.py) that reports its loss with every step to its node's real
``vigil agent``. A bad batch at a fixed step turns the loss NaN on every rank; the job crashes
and its loop starts it again from its checkpoint, before the bad step; the loss goes NaN again at
the same step. The app_signals detector of the real ``vigil aggregator`` holds the job (hold_job,
naming the job: Slurm's job id; no node), and the Slurm actuator requeues it held, which stops
the loop. No node is drained: the loss is the job's, not a node's.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.slurm_training import TrainingCluster, assert_held, events, spare_cluster, start_training, states
from tests.loopback import free_port
from tests.slurm_cluster import SlurmCluster
from vigil.aggregator.decision import REMOVING_ACTIONS
from vigil_heartbeat import Heartbeat

pytestmark = [pytest.mark.external, pytest.mark.skipif(
    "loss" not in inspect.signature(Heartbeat.step).parameters,
    reason="needs the heartbeat client's hb.step(..., loss=) (issue 40, clients/heartbeat)")]
torch = pytest.importorskip("torch")
__all__ = ["spare_cluster"]  # the fixture, imported: this module's own Slurm cluster

BAD_BATCH_STEP = 12  # after the checkpoint at step 10 (ddp_nan saves every 5 steps)
LOOP_RUNS = 6  # the script's own bound: more runs than the hold needs
AGENT_TRAINING = {"window_seconds": 1.0}


@pytest.fixture
def ddp_run(spare_cluster: SlurmCluster, tmp_path: Path) -> Iterator[TrainingCluster]:
    cluster = start_training(spare_cluster, tmp_path, {}, AGENT_TRAINING, report_seconds=0.5)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_nan_loss_across_a_restart_holds_the_job_and_removes_no_node(ddp_run: TrainingCluster) -> None:
    cluster, slurm = ddp_run, ddp_run.slurm
    # Each run its own rendezvous port: the last run's may still be in TIME_WAIT.
    ports = " ".join(str(free_port()) for _ in range(LOOP_RUNS))
    script = (f"#!/bin/bash\nexport MASTER_ADDR=127.0.0.1\nfor port in {ports}; do\n"
              f"  MASTER_PORT=$port srun -N2 -n2 --kill-on-bad-exit=1 {sys.executable} -m tests.e2e.ddp_nan "
              f"{cluster.work} {cluster.agents_dir} {BAD_BATCH_STEP} && exit 0\n  sleep 1\ndone\nexit 1\n")
    job = cluster.submit(script, 2, "nanloss")
    holds = cluster.wait_decided("the hold of the NaN job", lambda ds: [d for d in ds if d["action"] == "hold_job"],
                                 150)
    assert [(d["detector"], d["node"], d["job"]) for d in holds] == [("app_signals", None, job)], cluster.explain()
    evidence = holds[0]["evidence"]
    assert evidence["signal"] == "nonfinite_loss" and evidence["restarts"] >= 1, evidence
    assert sorted(evidence["job_nodes"]) == ["vnode1", "vnode2"], evidence
    # The first NaN was an alert naming the job (no node), before the hold.
    alerts = [d for _, d in cluster.seen.values() if d["action"] == "alert" and d["detector"] == "app_signals"]
    assert [(d["node"], d["job"]) for d in alerts] == [(None, job)] and alerts[0]["ts"] < holds[0]["ts"], alerts
    assert_held(cluster.wait_job(job, "held", lambda j: j["JobState"] == "PENDING", 30))

    # The loop stopped after the NaN came back in the restarted run: two runs (a third at most,
    # if it was starting as the hold landed), each NaN first at the bad batch's step.
    starts = [e for e in events(cluster.work, "start") if e["rank"] == 0]
    assert 2 <= len(starts) <= 3, starts
    first_nan: dict[tuple[int, int], int] = {}
    for e in events(cluster.work, "nan"):
        first_nan.setdefault((e["rank"], len([s for s in starts if s["ts"] < e["ts"]])), e["step"])
    assert set(first_nan.values()) == {BAD_BATCH_STEP, BAD_BATCH_STEP + 1}, first_nan  # rank 0's batch, then all
    assert {s["step"] for s in starts[1:]} == {BAD_BATCH_STEP - 2}, starts  # resumed from the checkpoint before it

    # The job is named; no node is removed, none drained in Slurm.
    decided = [d for _, d in cluster.seen.values()]
    acting_on_nodes = {a.value for a in REMOVING_ACTIONS} | {"restart_job"}
    assert [d for d in decided if d["action"] in acting_on_nodes] == [], cluster.explain()
    node_states = states(slurm)
    assert set(node_states.values()) <= {"idle", "allocated", "mixed"}, node_states
    second_nan = min(e["ts"] for e in events(cluster.work, "nan") if e["ts"] > starts[1]["ts"])
    print(f"\nNaN loss: held after {len(starts)} runs, {holds[0]['ts'] - second_nan:.1f} s after the restarted "
          f"run's first NaN step; evidence {evidence}")
