"""A real DDP job (torch.distributed, gloo, 4 CPU processes) reporting through four real agents to a
real aggregator: with the StepTimer one slowed rank gets its node drained and no other; with only
``hb.step(n)`` the aggregator says it has no per-rank timing and drains nobody.

Each of four nodes hosts one rank (each agent on the fake NVML backend, with its own heartbeat
socket; each rank admitted to its job's Slurm id in its node's process table): the straggler
detector compares nodes with their job's other nodes and needs at least four
(``detectors.straggler.min_nodes``). Rank 3, on node-d, computes 0.25 s longer per step. Every
process is bounded in time and stopped by pid. Skipped without torch (``pip install -e '.[torch]'``,
which `make test` does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.aggregator.aggregator_process import AggregatorProcess, wait_for
from tests.loopback import free_port
from tests.training.agents import Agent, cluster

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ddp_worker.py")
WORLD = 4
SLOW_RANK = 3
SLOW_SECONDS = 0.25
NODES = {"node-a": (0,), "node-b": (1,), "node-c": (2,), "node-d": (3,)}
SLOW_NODE = "node-d"
# The two jobs' Slurm ids: their keys, whatever run id torchrun gives them (a display name only).
TIMED, STEPS = "7101", "7102"


@pytest.fixture(scope="module")
def ddp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AggregatorProcess, dict[str, Agent]]]:
    with cluster(tmp_path_factory.mktemp("ddp"), list(NODES), {
        "dry_run": True,
        "evaluate_interval_seconds": 1.0,
        "detectors": {
            # A 4-node job judged in the agents' 6 s summary windows (tests/training/agents.py), not the
            # shipped 5 s: the test's job lives for tens of seconds on a loaded machine.
            "straggler": {"min_nodes": 4, "persistence_windows": 3},
        },
    }) as running:
        yield running


def train(agents: dict[str, Agent], job: str, mode: str, seconds: float, root: Path,
          slurm_job: str) -> list[subprocess.Popen[bytes]]:
    master = free_port()
    procs = []
    for node, ranks in NODES.items():
        for local, rank in enumerate(ranks):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "RANK": str(rank),
                   "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(local), "TORCHELASTIC_RUN_ID": job,
                   "VIGIL_HEARTBEAT_ADDR": f"unix:{agents[node].socket_path}", "OMP_NUM_THREADS": "1"}
            log = (root / f"{job}-rank{rank}.log").open("wb")
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), mode, str(seconds), str(SLOW_RANK), str(SLOW_SECONDS)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
            # Before torch's process group is up (seconds), so no step is sent unplaced.
            agents[node].admit(procs[-1].pid, int(slurm_job))
    return procs


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def decisions(aggregator: AggregatorProcess, job: str) -> list[dict[str, Any]]:
    found, _ = aggregator.decisions()
    return [d for d in found if d.get("job") == job]


# Four torch processes start and train for tens of seconds (80-100 s on a loaded 2-core machine):
# `make test-all` runs it; the fast paths it crosses have their own tests.
@pytest.mark.slow
def test_slowed_rank_drains_its_node_and_no_other_and_step_counts_alone_cannot_rank(
        ddp_cluster: Any, tmp_path: Path) -> None:
    """Two jobs on the same four nodes at once: "ddp-timed" (StepTimer) and "ddp-steps" (hb.step(n)
    only), each with rank 3 slowed. Running them together halves the test's time (torch's start-up
    dominates) and shows the judgements stay per job."""
    aggregator, agents = ddp_cluster
    procs = (train(agents, "ddp-timed", "timed", 240.0, tmp_path, TIMED)
             + train(agents, "ddp-steps", "steps", 240.0, tmp_path, STEPS))
    try:
        try:
            wait_for("a straggler drain", lambda: any(
                d["action"] == "drain" and d["detector"] == "straggler" for d in decisions(aggregator, TIMED)),
                200.0)  # generous: 8 torch processes start on a shared 2-core machine
        except AssertionError:
            seen = [aggregator.request("GET", f"/v1/nodes/{n}")["ranks"] for n in NODES]
            raise AssertionError(f"no drain; decisions {decisions(aggregator, TIMED)}; ranks {seen}") from None
        timed = decisions(aggregator, TIMED)
        drains = [d for d in timed if d["action"] == "drain"]
        assert {d["node"] for d in drains} == {SLOW_NODE}, drains
        assert drains[0]["evidence"]["excess_ratio"] > 0 and drains[0]["evidence"]["job_nodes"] == len(NODES)
        # Timed ranks are never reported as untimed.
        assert not [d for d in timed if d["detector"] == "gpu_peer" and d["action"] == "observe"]
        ranks = {(r["job"], r["rank"]): r for n in NODES for r in aggregator.request("GET", f"/v1/nodes/{n}")["ranks"]}
        slow = ranks[(TIMED, SLOW_RANK)]
        for rank in range(WORLD - 1):
            assert slow["compute_seconds_p50"] > ranks[(TIMED, rank)]["compute_seconds_p50"]
            assert slow["comm_seconds_p50"] < ranks[(TIMED, rank)]["comm_seconds_p50"]
        # The step-only job, judged over the same windows: said to be unrankable, nobody drained.
        steps = decisions(aggregator, STEPS)
        observe = [d for d in steps if d["detector"] == "gpu_peer" and d["action"] == "observe"]
        assert len(observe) == 1 and "no per-rank timing" in observe[0]["reason"]
        assert [d for d in steps if d["action"] == "drain"] == []
        assert all(ranks[(STEPS, r)]["compute_seconds_p50"] is None for r in range(WORLD))
    finally:
        stop_all(procs)
