"""Issue 37's headline attacks against real processes: a real slurmctld/slurmd cluster, real
`vigil agent`s and a real `vigil aggregator` (Slurm actuator, not dry run).

1. A forged job identity. Slurm job J really runs on vnode1 and vnode2; its ranks (the real
   heartbeat client) beat on each node's agent through the Unix socket, placed in job J by a fake
   process table (collectors.training.proc_root: real pids, cgroups the test writes). An attacker
   running as another user (uid 65534) in another job, and one in no job, claim J's id and ranks
   on vnode1, then pause: the pattern that used to drain vnode1 as a hang and requeue J. Now the
   agent refuses and counts every claim, and for longer than the hang detector's limit nothing is
   decided, vnode1 stays allocated and J keeps running, never requeued. A comma list as a job name
   on the opted-in unverified UDP path is refused at the agent (it never reaches squeue).
2. A trickling webhook receiver next to the Slurm actuator: the aggregator answers /healthz while
   the webhook's start-up reach check is held open, a fatal Xid drains the node in Slurm while the
   webhook's delivery of the same decision is still held open, and /healthz says `degraded`.

Every wait has a deadline; every process the test starts is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.agent.proc_table import UNSCHEDULED, in_slurm_job, place
from tests.aggregator.aggregator_process import (
    REPO,
    ROLE_TOKENS,
    SECRET,
    SITE_SECRET,
    AggregatorProcess,
    slurm_aggregator_config,
    wait_for,
)
from tests.aggregator.stuck_receivers import TricklingReceiver
from tests.loopback import free_port
from tests.pidfile import stop_children
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.auth import node_token
from vigil.aggregator.detectors.hang import HangConfig

XID_79 = ("[ 2071.315227] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
          "GPU has fallen off the bus.\n")
NOBODY = 65534
ATTACKER_JOB = 5151
START_SECONDS = 30.0  # bound on any process coming up or a first report arriving
REPORT_SECONDS = 0.5  # the agents' report interval here (aggregator.interval_seconds)
EVALUATE_SECONDS = 0.5  # slurm_aggregator_config's evaluate_interval_seconds
# How long after the forged ranks' last step a hang verdict would have come: the shipped hang
# limit (detectors.hang.min_stall_seconds, 20 s) plus a few report and evaluation intervals and a
# delivery (without the agent's refusal, vnode1 was decided on ~21 s after the pause).
WINDOW_SECONDS = HangConfig().min_stall_seconds + 4 * REPORT_SECONDS + 4 * EVALUATE_SECONDS + 1.0
ATTACKER_STEPS = 12  # forged steps, 0.25 s apart: seen advancing over several reports
FORGED_RANKS = (2, 3)
# A rank of job J: the real client, identity from Slurm's environment as srun sets it. It starts
# stepping on its first stdin line (sent once its pid is placed in the job) and steps every
# 0.25 s, as training does, until stdin closes.
RANK = """
import select, sys
from vigil_heartbeat import Heartbeat
hb = Heartbeat(env={"SLURM_JOB_ID": sys.argv[2], "SLURM_PROCID": sys.argv[3], "SLURM_LOCALID": "0",
                    "VIGIL_HEARTBEAT_ADDR": "unix:" + sys.argv[1]})
sys.stdin.readline()
step = 0
while not select.select([sys.stdin], [], [], 0.25)[0]:
    step += 1
    hb.step(step, 0.25, compute_seconds=0.2, comm_seconds=0.05)
"""


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if got == labels:
            return float(match.group(3))
    return None


class Agent:
    """A real `vigil agent` for one Slurm node, reporting to the aggregator; ``training``: its
    training collector on, with a Unix heartbeat socket, a fake process table and UDP opted in."""

    def __init__(self, root: Path, node: str, aggregator_url: str, *, training: bool) -> None:
        self.node = node
        self.port = free_port()
        self.udp_port = free_port()
        self.kmsg = root / f"{node}.kmsg"
        self.kmsg.write_text("[    5.000000] nvidia: module loaded\n")
        self.proc_root = root / f"{node}.proc"
        self.proc_root.mkdir()
        # The socket's directory must be reachable by another user (pytest's tmp_path is 0700).
        self.socket_dir = Path(tempfile.mkdtemp(prefix=f"vigil-{node}-"))
        self.socket_dir.chmod(0o755)
        self.socket = str(self.socket_dir / "heartbeat.sock")
        token = root / f"{node}.token"
        token.write_text(node_token(SITE_SECRET.encode(), node) + "\n")
        token.chmod(0o600)
        collectors: dict[str, Any] = {"training": {"enabled": False}}
        if training:
            collectors["training"] = {
                "unix_socket": self.socket, "proc_root": str(self.proc_root), "interval_seconds": 0.25,
                "udp_listen": f"127.0.0.1:{self.udp_port}", "http": False,
                # The site opted in to unverified UDP: keyed apart, plain names only.
                "accept_unverified": True}
        config = root / f"{node}.yaml"
        config.write_text(yaml.safe_dump({
            "node": node, "listen": f"127.0.0.1:{self.port}", "nvml": {"backend": "fake"},
            "aggregator": {"url": aggregator_url, "interval_seconds": REPORT_SECONDS, "token_file": str(token)},
            "collectors": collectors,
        }))
        self.log = root / f"{node}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vigil", "agent", "--config", str(config), "--kmsg", str(self.kmsg)],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})

    def metric(self, name: str, **labels: str) -> float | None:
        assert self.proc.poll() is None, f"agent {self.node} exited:\n{self.log.read_text()[-3000:]}"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            return _metric(resp.read().decode(), name, **labels)

    def stop(self) -> None:
        stop_children([self.proc], 10.0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


@dataclass
class Attacker:
    """A forked process that sends forged heartbeats, then pauses (alive and silent) until told."""

    pid: int
    go: int  # write end: b"g" starts it, b"x" (or closing) ends its pause
    sent: int  # read end: b"d" once its last heartbeat was sent


def start_attacker(proc_root: Path, cgroup: str, path: str, job: int, uid: int | None) -> Attacker:
    go_read, go_write = os.pipe()
    sent_read, sent_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing here may return into pytest
        try:
            os.close(go_write)
            os.close(sent_read)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            if os.read(go_read, 1) == b"g":  # placed in the process table
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    for step in range(1, ATTACKER_STEPS + 1):
                        for rank in FORGED_RANKS:
                            s.sendto(json.dumps({"job": str(job), "rank": rank, "step": step,
                                                 "step_seconds": 0.25}).encode(), path)
                        select.select([go_read], [], [], 0.25)  # a training loop's pace
                os.write(sent_write, b"d")
                os.read(go_read, 1)  # the pause: alive, sending nothing, until the parent ends it
        finally:
            os._exit(0)
    os.close(go_read)
    os.close(sent_write)
    place(proc_root, pid, cgroup)
    os.write(go_write, b"g")
    return Attacker(pid, go_write, sent_read)


def wait_sent(attacker: Attacker) -> None:
    readable, _, _ = select.select([attacker.sent], [], [], START_SECONDS)
    assert readable and os.read(attacker.sent, 1) == b"d", "the attacker did not send its heartbeats"


def end_attacker(attacker: Attacker) -> None:
    with contextlib.suppress(OSError):  # it may be gone already
        os.write(attacker.go, b"x")
    os.close(attacker.go)
    os.close(attacker.sent)
    os.waitpid(attacker.pid, 0)


def submit_on(cluster: SlurmCluster, nodes: str) -> str:
    job = cluster.run([cluster.sbatch, "--parsable", "--requeue", "-N2", "-w", nodes, "-o", "/dev/null",
                       "--wrap", "sleep 300"]).strip()
    cluster.wait_for(f"job {job} running", lambda: cluster.job(job).get("JobState") == "RUNNING", START_SECONDS)
    return job


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:  # noqa: F811
    slurm_cluster.reset()
    try:
        yield slurm_cluster
    finally:
        slurm_cluster.reset()


@pytest.mark.external
def test_forged_job_claims_and_their_pause_drain_nothing_and_requeue_nothing(
        tmp_path: Path, cluster: SlurmCluster) -> None:
    job = submit_on(cluster, "vnode1,vnode2")
    assert [cluster.sinfo_state(n) for n in ("vnode1", "vnode2")] == ["allocated", "allocated"]
    aggregator = AggregatorProcess(tmp_path, slurm_aggregator_config(cluster.scontrol,
                                                                     str(cluster.root / "slurm.conf")))
    agents: list[Agent] = []
    ranks: list[subprocess.Popen[bytes]] = []
    attackers: list[Attacker] = []
    try:
        aggregator.start()
        agents = [Agent(tmp_path, node, aggregator.url, training=True) for node in ("vnode1", "vnode2")]
        vnode1, vnode2 = agents
        for agent in agents:
            wait_for(f"{agent.node}'s heartbeat socket", partial(os.path.exists, agent.socket), START_SECONDS)
        # Job J's ranks 0 (vnode1) and 1 (vnode2), placed in job J on their own node.
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'clients' / 'heartbeat'}"}
        for rank, agent in enumerate(agents):
            proc = subprocess.Popen([sys.executable, "-c", RANK, agent.socket, job, str(rank)],
                                    stdin=subprocess.PIPE, cwd=REPO, env=env)
            ranks.append(proc)
            in_slurm_job(agent.proc_root, proc.pid, int(job))
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()

        def ranks_at(node: str) -> list[tuple[str, int]]:
            status, body = aggregator.status(f"/v1/nodes/{node}")  # 404 until its first report
            return [(r["job"], r["rank"]) for r in body["ranks"]] if status == 200 else []

        wait_for("job J's ranks at the aggregator", lambda: ranks_at("vnode1") == [(job, 0)]
                 and ranks_at("vnode2") == [(job, 1)], START_SECONDS)

        # The attack: a process of another user in another job, and one in no job, claim J's id
        # and ranks 2 and 3 on vnode1, step a few times, then pause.
        other_user = NOBODY if os.geteuid() == 0 else None  # setuid needs root; the claim is the same
        attackers.append(start_attacker(
            vnode1.proc_root, f"0::/slurm/uid_{NOBODY}/job_{ATTACKER_JOB}/step_0\n", vnode1.socket, int(job),
            other_user))
        attackers.append(start_attacker(vnode1.proc_root, UNSCHEDULED, vnode1.socket, int(job), None))
        for attacker in attackers:
            wait_sent(attacker)
        paused_at = time.monotonic()
        # The opted-in UDP path: a comma list (squeue -n reads it as two jobs) and J's own id.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            for name in ("teamA-pretrain,teamB-finetune", job):
                udp.sendto(json.dumps({"job": name, "rank": 0, "step": 1, "step_seconds": 0.25}).encode(),
                           ("127.0.0.1", vnode1.udp_port))

        # Longer than a hang verdict on the forged ranks would take: nothing is decided at all.
        while time.monotonic() - paused_at < WINDOW_SECONDS:
            decisions, _ = aggregator.decisions()
            assert decisions == [], (f"decided {time.monotonic() - paused_at:.1f} s after the forged ranks "
                                     f"paused: {decisions}")
            assert all(p.poll() is None for p in ranks), "a rank of job J exited"
            time.sleep(0.5)  # the poll's pace; the window's end is the bound, not this

        # Every claim refused and counted by the agent, by who sent it.
        forged = ATTACKER_STEPS * len(FORGED_RANKS)
        assert vnode1.metric("vigil_training_heartbeats_rejected_total", reason="job_mismatch") == forged + 1
        assert vnode1.metric("vigil_agent_heartbeats_rejected_total", reason="unscheduled") == forged
        assert vnode1.metric("vigil_training_heartbeats_rejected_total", reason="bad_job_name") == 1
        assert vnode2.metric("vigil_training_heartbeats_rejected_total", reason="job_mismatch") == 0
        # J's real ranks are still watched and moving; the forged ones never existed anywhere.
        assert ranks_at("vnode1") == [(job, 0)] and ranks_at("vnode2") == [(job, 1)]
        assert (vnode1.metric("vigil_training_rank_state", job=job, rank="0", state="running") == 1
                and vnode1.metric("vigil_training_last_step", job=job, rank="2") is None)
        # Slurm: vnode1 allocated, not drained; J running where it ran, never requeued.
        assert [cluster.sinfo_state(n) for n in ("vnode1", "vnode2")] == ["allocated", "allocated"]
        state = cluster.job(job)
        assert (state["JobState"], state["Restarts"], state["ExcNodeList"]) == ("RUNNING", "0", "(null)")
        assert aggregator.decisions() == ([], {})
    finally:
        for attacker in attackers:
            end_attacker(attacker)
        for proc in ranks:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the rank's loop ends
        stop_children(ranks, 10.0)
        for agent in agents:
            agent.stop()
        aggregator.stop()


WEBHOOK_TIMEOUT_SECONDS = 5.0  # the webhook's total deadline; the trickled answer takes ~12 s


@pytest.mark.external
def test_a_trickling_webhook_delays_neither_start_up_nor_the_slurm_drain(
        tmp_path: Path, cluster: SlurmCluster) -> None:
    receiver = TricklingReceiver(interval_seconds=0.2)
    secret = tmp_path / "webhook.secret"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    config = slurm_aggregator_config(cluster.scontrol, str(cluster.root / "slurm.conf"))
    config["actuators"]["webhook"] = {"enabled": True, "url": receiver.url, "secret_file": str(secret),
                                      "timeout_seconds": WEBHOOK_TIMEOUT_SECONDS}
    config["actuators"]["delivery"]["max_attempts"] = 1000
    aggregator = AggregatorProcess(tmp_path, config)
    agent: Agent | None = None

    def health() -> dict[str, Any]:
        status, body = aggregator.status("/healthz")
        assert status == 200, body
        return dict(body)

    def deadline_cuts(phase: str) -> float:
        req = urllib.request.Request(aggregator.url + "/metrics",
                                     headers={"Authorization": f"Bearer {ROLE_TOKENS['read']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        return _metric(text, "vigil_aggregator_actuator_deadline_exceeded_total", actuator="webhook",
                       phase=phase) or 0.0

    try:
        aggregator.start()  # returns once it listens
        wait_for("the webhook's reach check at the receiver", lambda: receiver.accepted >= 1, START_SECONDS)
        assert health()["role"] == "leader"
        assert receiver.cut == 0 and receiver.holding == 1  # answered while the check is held open
        agent = Agent(tmp_path, "vnode2", aggregator.url, training=False)
        wait_for("vnode2 to report", lambda: any(
            n["node"] == "vnode2" for n in aggregator.request("GET", "/v1/nodes")["nodes"]), START_SECONDS)
        wait_for("the reach check cut at its deadline", lambda: deadline_cuts("check") == 1, START_SECONDS)
        assert health()["acting"]["stalled_actuators"] == ["webhook"]

        with agent.kmsg.open("a") as f:
            f.write(XID_79)
        wait_for("vnode2 drained in Slurm", lambda: "drain" in cluster.sinfo_state("vnode2"), 20)
        # Drained while the webhook's first exchange for the same decision is still held open.
        assert deadline_cuts("delivery") == 0 and receiver.holding == 1 and receiver.completed == 0
        [decision], deliveries = aggregator.decisions()
        # Xid 79 is reboot_node; with actuators.slurm.reboot off, Slurm drains the node.
        assert (decision["node"], decision["action"]) == ("vnode2", "reboot_node")
        states = {d["actuator"]: d["state"] for d in deliveries[decision["id"]]}
        assert states["slurm"] == "delivered" and states["webhook"] != "delivered"
        assert decision["id"] in cluster.reason("vnode2")

        wait_for("the webhook's delivery cut at its deadline", lambda: deadline_cuts("delivery") >= 1, START_SECONDS)
        body = health()
        assert body["status"] == "degraded" and body["acting"]["stalled_actuators"] == ["webhook"], body
        assert receiver.completed == 0
        assert [cluster.sinfo_state(n) for n in ("vnode1", "vnode3")] == ["idle", "idle"]
    finally:
        if agent is not None:
            agent.stop()
        aggregator.stop()
        receiver.close()
