"""A real, throw-away Slurm cluster on loopback for tests: munged, slurmctld and one slurmd per
fake node, from Debian's packages (munge, slurmctld, slurmd, slurm-client), all in a temp dir.

Use it from a test module with ``from tests.slurm_cluster import slurm_cluster  # noqa: F401``;
the fixture yields a ``SlurmCluster`` (``.nodes``, ``.sinfo_state(node)``, ``.reason(node)``,
``.scontrol``, ``.env``, ``.run``). Each daemon runs in the foreground as our child, is stopped by
its pid and reaped; the whole start is bounded in time, and the fixture skips with the reason
when a binary is missing or the cluster does not come up.

``start_cluster`` also takes slurm.conf lines of its own (``extra_conf``: a RebootProgram,
ResumeTimeout) and ``ReturnToService``. Daemons that a RebootProgram starts again (not our
children) leave a pidfile (tests/pidfile.py) in ``restarted_dir``; ``stop()`` stops those too.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.loopback import free_port
from tests.pidfile import stop_pidfile

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "sbatch", "squeue")
# Debian puts the daemons in /usr/sbin, which a non-login PATH may lack.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
START_TIMEOUT_SECONDS = 30.0
NODE_NAMES = ("vnode1", "vnode2", "vnode3")


_free_port = free_port


def _which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[str]
    env: dict[str, str]
    scontrol: str
    sinfo: str
    sbatch: str
    squeue: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def restarted_dir(self) -> Path:
        """Where a RebootProgram leaves "<pid> <start ticks>" pidfiles of the daemons it started."""
        return self.root / "restarted"

    def run(self, argv: Sequence[str], timeout_seconds: float = 10.0) -> str:
        """A ``CommandRunner`` (contract/seams.py) pointed at this cluster."""
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_seconds, check=True, env=self.env
        )
        return done.stdout

    def sinfo_state(self, node: str) -> str:
        """The node's state as ``sinfo`` prints it: idle, drained, draining, allocated, ..."""
        return self.run([self.sinfo, "-h", "-N", "-n", node, "-o", "%T"]).strip()

    def reason(self, node: str) -> str:
        return self.run([self.sinfo, "-h", "-N", "-n", node, "-o", "%E"]).strip()

    def submit(self, command: str = "sleep 300") -> str:
        return self.run([self.sbatch, "--parsable", "--requeue", "-N1", "-o", "/dev/null", "--wrap", command]).strip()

    def job(self, job_id: str) -> dict[str, str]:
        line = self.run([self.scontrol, "show", "job", "-o", job_id])
        return {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", line)}

    def wait_for(self, what: str, check: Callable[[], bool], timeout_seconds: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"slurm: timed out after {timeout_seconds}s waiting for {what}")
            time.sleep(0.2)

    def reset(self) -> None:
        """Cancel every job and return every node to service, so tests do not see each other."""
        for node in self.nodes:
            if "drain" in self.sinfo_state(node):
                self.run([self.scontrol, "update", f"NodeName={node}", "State=RESUME"])
        jobs = self.run([self.squeue, "-h", "-o", "%i"]).split()
        if jobs:
            self.run(["scancel", *jobs])

    def stop(self) -> None:
        # Jobs first: a job's slurmstepd outlives its slurmd and would be left behind.
        try:
            jobs = self.run([self.squeue, "-h", "-o", "%i"], 5).split()
            if jobs:
                self.run(["scancel", *jobs], 5)
                self.wait_for("jobs to end", lambda: not self.run([self.squeue, "-h", "-o", "%i"], 5).split(), 15)
        except (AssertionError, OSError, subprocess.SubprocessError):
            pass  # the controller is already gone; stop the daemons regardless
        # Daemons a RebootProgram started again (detached, so not in procs): slurmds, agents; a
        # reboot still under way ("*-reboot.pid") first, so it starts nothing more.
        pidfiles = self.restarted_dir.glob("*.pid")
        for pidfile in sorted(pidfiles, key=lambda p: (not p.name.endswith("-reboot.pid"), p.name)):
            stop_pidfile(pidfile)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


SLURM_CONF = """\
ClusterName=vigiltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock{cred_expire}
CredType=cred/munge
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/linear
MpiDefault=none
ReturnToService={return_to_service}
SlurmctldTimeout=10
SlurmdTimeout=30
{node_lines}
PartitionName=gpu Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
{extra_conf}
"""


def start_cluster(root: Path, nodes: Sequence[str] = NODE_NAMES, *, return_to_service: int = 2,
                  extra_conf: Sequence[str] = (), node_conf: Mapping[str, str] | None = None,
                  cred_expire_seconds: int | None = None) -> SlurmCluster:
    """``return_to_service``: slurm.conf's ReturnToService (2: a DOWN node returns on any valid
    registration); ``extra_conf``: further slurm.conf lines, e.g. ``RebootProgram=...``;
    ``node_conf``: more of a node's NodeName line by node, e.g. ``Features=vigil_spare Weight=100``;
    ``cred_expire_seconds``: AuthInfo's cred_expire, which is also how long a requeued job waits
    before it may start again (slurm.conf(5): 120 s by default)."""
    paths = {name: _which(name) for name in (*BINARIES, "scancel")}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        pytest.skip(
            f"Slurm test cluster needs {', '.join(missing)} (apt-get install munge slurmctld slurmd slurm-client)"
        )
    bins = {name: str(path) for name, path in paths.items()}
    for sub in ("state", "spool", "restarted"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()}"
        f" CPUs=1 RealMemory=100 State=UNKNOWN {(node_conf or {}).get(n, '')}".rstrip()
        for n in nodes
    )
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            root=root, ctld_port=_free_port(), user=getpass.getuser(), node_lines=node_lines, nodes=",".join(nodes),
            return_to_service=return_to_service, extra_conf="\n".join(extra_conf),
            cred_expire="" if cred_expire_seconds is None else f",cred_expire={cred_expire_seconds}",
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": SEARCH_PATH}
    cluster = SlurmCluster(
        root=root,
        nodes=list(nodes),
        env=env,
        scontrol=bins["scontrol"],
        sinfo=bins["sinfo"],
        sbatch=bins["sbatch"],
        squeue=bins["squeue"],
    )
    log = (root / "daemons.out").open("ab")

    def spawn(argv: list[str]) -> None:
        cluster.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))

    try:
        # --force: munged refuses to run as root (the CI container's user) without it.
        spawn(
            [
                bins["munged"],
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={root}/munge.sock",
                f"--pid-file={root}/munged.pid",
                f"--log-file={root}/munged.log",
                f"--seed-file={root}/munge.seed",
            ]
        )
        cluster.wait_for("munged socket", (root / "munge.sock").exists, 10)
        spawn([bins["slurmctld"], "-D", "-f", str(conf)])
        for n in nodes:
            spawn([bins["slurmd"], "-D", "-f", str(conf), "-N", n])

        def all_idle() -> bool:
            try:
                return all(cluster.sinfo_state(n) == "idle" for n in nodes)
            except subprocess.SubprocessError:
                return False

        cluster.wait_for("every node idle", all_idle, START_TIMEOUT_SECONDS)
    except (AssertionError, OSError) as exc:
        cluster.stop()
        tail = (root / "slurmctld.log").read_text()[-2000:] if (root / "slurmctld.log").exists() else ""
        # The programs are installed (a missing one skipped above): not starting is a failure.
        pytest.fail(f"the Slurm test cluster did not come up: {exc}\n{tail}")
    finally:
        log.close()
    return cluster


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    # A short path: munge's socket path must fit in sun_path (108 bytes).
    root = tmp_path_factory.mktemp("slurm")
    cluster = start_cluster(root)
    try:
        yield cluster
    finally:
        cluster.stop()
