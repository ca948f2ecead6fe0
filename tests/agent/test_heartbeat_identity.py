"""Issue 37, against a real `vigil agent` process: a heartbeat's job is its sender's, as the kernel
and the scheduler say, never the name it claims.

Real processes send on the agent's Unix socket, so every datagram carries the sender's real pid and
uid (SCM_CREDENTIALS). The test cannot create Slurm jobs, so the agent reads cgroups from a process
table (collectors.training.proc_root) in which the test places each real pid in a Slurm job: the
victim's ranks in job 4242, the attacker in job 5151 or in none. As root, one attacker also runs as
another user (uid 65534, a forked child that calls setuid). Shown: a forged job claim is refused
and counted, and the victim's rank keeps its own steps; 16 invented job names (UDP, the site having
opted in, and the Unix socket) do not lock the real job out; an unpaired surrogate leaves the
collector cycle green; the real heartbeat path works end to end. Every process is stopped by pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.agent.proc_table import UNSCHEDULED, in_slurm_job, place
from tests.aggregator.aggregator_process import wait_for
from tests.loopback import free_port
from tests.pidfile import stop_children

REPO = Path(__file__).resolve().parents[2]
DEADLINE_SECONDS = 30.0
VICTIM_JOB, ATTACKER_JOB = 4242, 5151
NOBODY = 65534
# The victim: the real client, job and rank from Slurm's environment as srun sets them; it sends
# when told (after the test has placed its pid), then one step per line on stdin, until EOF.
VICTIM = """
import sys
from vigil_heartbeat import Heartbeat
hb = Heartbeat(env={"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                    "VIGIL_HEARTBEAT_ADDR": "unix:" + sys.argv[1]})
for line in sys.stdin:
    hb.step(int(line), 1.0, compute_seconds=0.7, comm_seconds=0.3)
    print(hb.sent, hb.dropped, flush=True)
"""


def beat(job: str, step: int, rank: int = 0) -> bytes:
    return json.dumps({"job": job, "rank": rank, "step": step, "step_seconds": 1.0}).encode()


class AgentProcess:
    def __init__(self, root: Path, socket_path: str) -> None:
        self.port = free_port()
        self.udp_port = free_port()
        config = root / "agent.yml"
        config.write_text(yaml.safe_dump({"collectors": {"training": {
            "udp_listen": f"127.0.0.1:{self.udp_port}", "http": False, "unix_socket": socket_path,
            "proc_root": str(root / "proc"), "interval_seconds": 0.25,
            # The site opted in to UDP (the squatting test): unverified, with their own cap.
            "accept_unverified": True, "max_unverified_jobs": 4}}}))
        self.log = (root / "agent.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vigil", "agent", "--config", str(config), "--backend", "fake",
             "--listen", f"127.0.0.1:{self.port}", "--node", "gpu-node-07", "--sysfs-root", str(root / "sys"),
             "--kmsg", str(root / "kmsg")], cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_for("the agent's /healthz", lambda: self.get("/healthz") is not None)

    def get(self, path: str) -> str | None:
        assert self.proc.poll() is None, f"agent exited {self.proc.returncode}"
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2).read().decode()
        except OSError:
            return None

    def metric(self, name: str, **labels: str) -> float | None:
        text = self.get("/metrics") or ""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            if match and match.group(1) == name and ",".join(sorted((match.group(2) or "").split(","))) == want:
                return float(match.group(3))
        return None

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        wait_for(what, ready, DEADLINE_SECONDS)

    def stop(self) -> None:
        stop_children([self.proc], 10.0)
        self.log.close()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[AgentProcess, Path, str]]:
    (tmp_path / "proc").mkdir()
    (tmp_path / "sys").mkdir()
    (tmp_path / "kmsg").write_text("")
    # The socket's directory must be reachable by another user (tmp_path is root's, mode 0700).
    sockets = Path(tempfile.mkdtemp(prefix="vigil-hb-"))
    sockets.chmod(0o755)
    path = str(sockets / "heartbeat.sock")
    agent = AgentProcess(tmp_path, path)
    try:
        yield agent, tmp_path / "proc", path
    finally:
        agent.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def send_from(proc_root: Path, cgroup: str, path: str, payloads: list[bytes],
              uid: int | None = None) -> tuple[int, int]:
    """Send ``payloads`` from a real child process placed in ``cgroup`` (as ``uid`` if given: a
    forked child that drops to that user first). Returns when it has sent and exited."""
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing here may return into pytest
        try:
            os.close(go_write)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            os.read(go_read, 1)  # placed in the process table
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                for payload in payloads:
                    s.sendto(payload, path)
            os.read(go_read, 1)  # stay alive until the parent has seen the datagrams counted
        finally:
            os._exit(0)
    os.close(go_read)
    place(proc_root, pid, cgroup)
    os.write(go_write, b"g")
    return pid, go_write


def finish(child: tuple[int, int]) -> None:
    pid, go_write = child
    os.write(go_write, b"x")
    os.close(go_write)
    os.waitpid(pid, 0)


def test_forged_claims_squatting_and_a_bad_label_leave_the_real_job_watched(
        world: tuple[AgentProcess, Path, str]) -> None:
    agent, proc_root, path = world
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'clients' / 'heartbeat'}"})
    try:
        in_slurm_job(proc_root, victim.pid, VICTIM_JOB)
        assert victim.stdin is not None and victim.stdout is not None

        def step(n: int) -> None:
            victim.stdin.write(f"{n}\n")  # type: ignore[union-attr]
            victim.stdin.flush()  # type: ignore[union-attr]
            assert victim.stdout.readline().split()[1] == "0"  # type: ignore[union-attr]  # nothing dropped

        # The real path, end to end: the client's claim "4242" is the sender's own job.
        step(10)
        agent.wait_for("the victim's step", lambda: agent.metric(
            "vigil_training_last_step", job=str(VICTIM_JOB), rank="0") == 10)

        # 1. Forged claims: a process of another job, and one of no job, name the victim's job and
        # rank with a later step. Refused and counted; the victim's rank keeps its own step.
        other_job = send_from(proc_root, f"0::/system.slice/slurmstepd.scope/job_{ATTACKER_JOB}/step_0\n", path,
                              [beat(str(VICTIM_JOB), 999)] * 3)
        unscheduled = send_from(proc_root, UNSCHEDULED, path, [beat(str(VICTIM_JOB), 999)] * 2)
        agent.wait_for("the forged claims counted", lambda: (
            agent.metric("vigil_training_heartbeats_rejected_total", reason="job_mismatch") == 3
            and agent.metric("vigil_agent_heartbeats_rejected_total", reason="unscheduled") == 2))
        finish(other_job)
        finish(unscheduled)
        if os.geteuid() == 0:  # another user, by setuid: the kernel says so, and it changes nothing
            nobody = send_from(proc_root, f"0::/slurm/uid_{NOBODY}/job_{ATTACKER_JOB}/step_0\n", path,
                               [beat(str(VICTIM_JOB), 999)] * 2, uid=NOBODY)
            agent.wait_for("the other user's claims counted", lambda: agent.metric(
                "vigil_training_heartbeats_rejected_total", reason="job_mismatch") == 5)
            finish(nobody)
        assert agent.metric("vigil_training_last_step", job=str(VICTIM_JOB), rank="0") == 10

        # 2. Squatting: 16 invented jobs over UDP, and the same names from a verified process of job
        # 5151 (all of them are its one job), then the victim's next steps are still taken.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            for i in range(16):
                udp.sendto(beat(f"invented-{i}", 1), ("127.0.0.1", agent.udp_port))
        squatter = send_from(proc_root, f"0::/system.slice/slurmstepd.scope/job_{ATTACKER_JOB}/step_0\n", path,
                             [beat(f"invented-{i}", 1, rank=i % 2) for i in range(16)])
        agent.wait_for("the squatting counted", lambda: agent.metric(
            "vigil_training_heartbeats_rejected_total", reason="too_many_unverified_jobs") == 12)
        step(11)
        agent.wait_for("the victim's next step", lambda: agent.metric(
            "vigil_training_last_step", job=str(VICTIM_JOB), rank="0") == 11)
        assert agent.metric("vigil_training_heartbeats_rejected_total", reason="too_many_jobs") == 0
        # 16 names from job 5151 are one job (5151), two ranks; never 16 slots.
        assert agent.metric("vigil_training_last_step", job=str(ATTACKER_JOB), rank="1") == 1
        assert agent.metric("vigil_training_last_step", job="invented-3", rank="0") is None
        finish(squatter)

        # 3. An unpaired surrogate and a newline in the job name, from a verified process: refused,
        # and the training collector's cycle stays green with the victim's series in it.
        bad = send_from(proc_root, f"0::/system.slice/slurmstepd.scope/job_{VICTIM_JOB}/step_1\n", path,
                        [b'{"job":"x\\ud800","rank":5,"step":1,"step_seconds":1.0}',
                         b'{"job":"a\\nXid 79","rank":6,"step":1,"step_seconds":1.0}'])
        agent.wait_for("the bad labels counted", lambda: agent.metric(
            "vigil_training_heartbeats_rejected_total", reason="bad_text") == 2)
        finish(bad)
        step(12)
        agent.wait_for("the victim's step after the bad label", lambda: agent.metric(
            "vigil_training_last_step", job=str(VICTIM_JOB), rank="0") == 12)
        # 4. Application signals (issue 40), which can hold a job: another job's process sends the
        # victim's job a NaN loss (refused: the job is the sender's); a verified process of the
        # victim's own job sends values the wire refuses (a bare NaN token, 1e999 read as infinity,
        # a misspelt "NaN", a negative gradient norm). None of it reaches the victim's rank.
        forged_nan = send_from(proc_root, f"0::/system.slice/slurmstepd.scope/job_{ATTACKER_JOB}/step_0\n", path,
                               [b'{"job":"%d","rank":0,"step":13,"step_seconds":1.0,"loss":"nan"}' % VICTIM_JOB])
        malformed = send_from(proc_root, f"0::/system.slice/slurmstepd.scope/job_{VICTIM_JOB}/step_1\n", path,
                              [b'{"job":"x","rank":7,"step":1,"step_seconds":1.0,"loss":NaN}',
                               b'{"job":"x","rank":7,"step":1,"step_seconds":1.0,"loss":1e999}',
                               b'{"job":"x","rank":7,"step":1,"step_seconds":1.0,"loss":"NaN"}',
                               b'{"job":"x","rank":7,"step":1,"step_seconds":1.0,"grad_norm":-2.0}'])
        agent.wait_for("the forged and malformed signals counted", lambda: (
            agent.metric("vigil_training_heartbeats_rejected_total", reason="job_mismatch") == (6 if os.geteuid() == 0
                                                                                                else 4)
            and agent.metric("vigil_training_heartbeats_rejected_total", reason="invalid_json") == 1
            and agent.metric("vigil_training_heartbeats_rejected_total", reason="schema") == 3))
        finish(forged_nan)
        finish(malformed)
        assert agent.metric("vigil_training_nonfinite_steps_total", job=str(VICTIM_JOB), rank="0") is None
        assert agent.metric("vigil_training_last_step", job=str(VICTIM_JOB), rank="7") is None
        health = json.loads(agent.get("/healthz") or "{}")
        assert health["failed_collectors"] == [] and "training" in health["collectors"]
        assert agent.metric("vigil_collector_success", collector="training") == 1
    finally:
        if victim.stdin is not None:
            victim.stdin.close()  # EOF: the victim's loop ends
        stop_children([victim], 10.0)  # type: ignore[list-item]
        if victim.stdout is not None:
            victim.stdout.close()
