"""Real training jobs under a real Slurm for the job-level tests (issue 40): a four-node slurmctld/
slurmd cluster whose vnode4 is a spare (node feature ``vigil_spare``, and a higher scheduling
weight, so Slurm gives it to a job only when the other nodes cannot take it: how a site keeps a
spare idle), one real ``vigil agent`` per node with its heartbeat Unix socket and its process
table (tests/training/agents.py), a real ``vigil aggregator`` acting through the Slurm actuator,
and batch scripts whose ``srun`` steps run the ranks (tests/e2e/train_rank.py, ddp_nan.py).

The ranks find their node's agent from Slurm's SLURMD_NODENAME (``<agents>/<node>.sock``) and
log what they do to ``<work>/events.jsonl``, which ``events`` reads. Every process is bounded in
time and stopped by its pid: the daemons by the cluster fixture, the agents and the aggregator by
``TrainingCluster.stop``; Slurm's jobs are cancelled before the daemons stop.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.aggregator.aggregator_process import REPO, AggregatorProcess, slurm_aggregator_config, wait_for
from tests.slurm_cluster import SlurmCluster, start_cluster
from tests.training.agents import Agent

NODES = ("vnode1", "vnode2", "vnode3", "vnode4")
SPARE = "vnode4"
SPARE_FEATURE = "vigil_spare"  # aggregator/spares.py's default Slurm feature
# Slurm allocates the lowest-weight nodes first (slurm.conf(5) Weight): the spare is taken last.
NODE_CONF = {SPARE: f"Features={SPARE_FEATURE} Weight=100"}
# A requeued job may start again this long after its requeue (AuthInfo cred_expire, 120 s by
# default): short, so a test sees the restart.
REQUEUE_DELAY_SECONDS = 10
START_SECONDS = 30.0  # any process coming up, a job starting, a first report arriving
PYTHONPATH = f"{REPO}:{REPO / 'clients' / 'heartbeat'}"


@pytest.fixture(scope="module")
def spare_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """vnode1-3 and the spare vnode4, all idle."""
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"), NODES, node_conf=NODE_CONF,
                            cred_expire_seconds=REQUEUE_DELAY_SECONDS)
    try:
        yield cluster
    finally:
        cluster.stop()


def events(work: Path, event: str | None = None) -> list[dict[str, Any]]:
    """What the ranks logged (train_rank.log_event), oldest first; only ``event`` ones if given."""
    path = work / "events.jsonl"
    if not path.exists():
        return []
    found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in found if event is None or e["event"] == event]


@dataclass
class TrainingCluster:
    """The Slurm cluster, the aggregator and one agent per node; ``work`` holds the ranks' files."""

    slurm: SlurmCluster
    aggregator: AggregatorProcess
    agents: dict[str, Agent]
    agents_dir: Path  # short: each agent's Unix socket path must fit in sun_path (108 bytes)
    work: Path
    seen: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    def submit(self, script: str, nodes: int, name: str) -> str:
        """Submit a batch script of ``nodes`` nodes, its environment ours plus the repo's path."""
        path = self.work / f"{name}.sh"
        path.write_text(script)
        env = {**self.slurm.env, "PYTHONPATH": PYTHONPATH}
        done = subprocess.run(
            [self.slurm.sbatch, "--parsable", "--requeue", f"-N{nodes}", f"--job-name={name}",
             f"--chdir={REPO}", "-o", str(self.work / f"{name}-%j.out"), str(path)],
            capture_output=True, text=True, timeout=10, check=True, env=env)
        return done.stdout.strip()

    def poll(self) -> list[dict[str, Any]]:
        """The aggregator's decisions, each noted with the wall time it was first seen."""
        decisions, _ = self.aggregator.decisions()
        now = time.time()
        for d in decisions:
            self.seen.setdefault(d["id"], (now, d))
        return decisions

    def decided(self, action: str, detector: str | None = None) -> list[dict[str, Any]]:
        return sorted((d for d in self.poll() if d["action"] == action
                       and (detector is None or d["detector"] == detector)), key=lambda d: d["ts"])

    def wait_decided(self, what: str, check: Callable[[list[dict[str, Any]]], Any], timeout_seconds: float) -> Any:
        """Poll the decisions until ``check`` returns something truthy; the logs on a timeout."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            found = check(self.poll())
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what}\n{self.explain()}")
            time.sleep(0.25)

    def wait_job(self, job: str, what: str, check: Callable[[dict[str, str]], bool], timeout_seconds: float
                 ) -> dict[str, str]:
        """Poll ``scontrol show job`` until ``check`` holds for its fields; them, or the logs on a timeout."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            fields = self.slurm.job(job)
            if check(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_seconds}s waiting for job {job} {what}: "
                                     f"{fields}\n{self.explain()}")
            time.sleep(0.25)

    def explain(self) -> str:
        decisions = [(round(ts, 1), d["action"], d["detector"], d["node"], d.get("job"), d["reason"][:120])
                     for ts, d in sorted(self.seen.values(), key=lambda t: t[0])]
        outs = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-800:]}"
                         for p in sorted(self.work.glob("*.out")))
        jobs = self.slurm.run([self.slurm.squeue, "-h", "-o", "%i %T %r %N"], 5)
        return (f"decisions: {decisions}\nsqueue: {jobs}\nevents: {events(self.work)[-12:]}\n{outs}\n"
                f"--- aggregator ---\n{self.aggregator.log()[-3000:]}")

    def stop(self) -> None:
        self.slurm.reset()  # jobs first: their ranks are Slurm's processes
        for agent in self.agents.values():
            agent.stop()
        self.aggregator.stop()
        shutil.rmtree(self.agents_dir, ignore_errors=True)


def start_training(slurm: SlurmCluster, work: Path, aggregator_config: dict[str, Any],
                   agent_training: dict[str, Any], *, report_seconds: float = 0.5) -> TrainingCluster:
    """The aggregator (the Slurm actuator's config plus ``aggregator_config``) and an agent on
    every node (its training collector: ``agent_training`` over tests/training/agents.py's),
    every agent healthy and reporting before it returns."""
    slurm.reset()
    slurm.wait_for("every node idle", lambda: set(states(slurm).values()) == {"idle"}, START_SECONDS)
    config = slurm_aggregator_config(slurm.scontrol, str(slurm.root / "slurm.conf"))
    for key, value in aggregator_config.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    aggregator = AggregatorProcess(work, config)
    aggregator.start()
    agents_dir = Path(tempfile.mkdtemp(prefix="vigil-e2e-"))
    cluster = TrainingCluster(slurm, aggregator, {}, agents_dir, work)
    try:
        for node in slurm.nodes:
            cluster.agents[node] = Agent(agents_dir, node, aggregator.url, training=agent_training,
                                         interval_seconds=report_seconds)
        for agent in cluster.agents.values():
            wait_for(f"agent {agent.node}", agent.healthy, START_SECONDS)
        wait_for("every agent's first report",
                 lambda: len(aggregator.request("GET", "/v1/nodes")["nodes"]) == len(slurm.nodes), START_SECONDS)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def rank_command(work: Path, agents: Path, *args: str) -> str:
    """The shell words that start one rank of train_rank.py (from the repo, as ``--chdir`` sets)."""
    return " ".join([sys.executable, "-m", "tests.e2e.train_rank", "--work", str(work), "--agents", str(agents),
                     *args])


def job_nodes(slurm: SlurmCluster, job: str) -> list[str]:
    """The job's nodes as Slurm lists them, expanded by Slurm."""
    hostlist = slurm.job(job).get("NodeList", "")
    if not hostlist or hostlist == "(null)":
        return []
    return slurm.run([slurm.scontrol, "show", "hostnames", hostlist]).split()


def states(slurm: SlurmCluster) -> dict[str, str]:
    return {node: slurm.sinfo_state(node) for node in slurm.nodes}


def assert_held(job: dict[str, str]) -> None:
    """``scontrol show job``'s fields of a job requeued held: pending at priority 0, for the reason
    Slurm gives a held job (``job_requeued_in_held_state`` right after ``scontrol requeuehold``,
    JobHeldAdmin / JobHeldUser)."""
    assert (job["JobState"], job["Priority"]) == ("PENDING", "0"), job
    assert job["Reason"] in ("job_requeued_in_held_state", "JobHeldAdmin", "JobHeldUser"), job
