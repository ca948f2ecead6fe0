#!/usr/bin/env python3
"""RebootProgram of the loopback Slurm test cluster: "reboots" the fake node whose slurmd ran it.

slurmd runs ``RebootProgram`` (``<python> reboot_program.py <cluster root>``) through system() when
slurmctld issues a reboot. This finds the node from its parent slurmd's ``-N`` argument, returns
at once (slurmd waits for the program in an RPC thread, and its shutdown waits for its threads),
and in a detached process does what a reboot does to that node: stops its agent and its slurmd,
writes a new kernel boot id to ``reboot/<node>/boot_id`` (the agent's ``--boot-id-file``), starts
the agent again from ``reboot/<node>/after-reboot.json`` (argv, cwd, env: the test chooses the
scenario the node comes back with), and starts slurmd again with ``-b``. It reboots nothing real.

``slurmd -b`` ("report node rebooted when daemon restarted", slurmd(8)) makes slurmd report an
uptime counted from its own start. slurmctld 22.05 takes ``now - up_time`` as the node's boot
time (job_mgr.c validate_jobs_on_node) and ignores a registration while that is before the reboot
request (node_mgr.c waiting_for_node_boot: ``boot_time < boot_req_time``); past ``ResumeTimeout``
after the request it marks the node DOWN, "reboot timed out" (check_reboot_nodes). So the new
slurmd starts at least two whole seconds after this program did (uptime is counted in whole
seconds, rounded up by sysinfo(2)): its boot time is then after the request.

Every process it starts is bounded by the test: each leaves a pidfile (tests/pidfile.py) in the
cluster's ``restarted/`` directory, which ``SlurmCluster.stop()`` stops by pid. Its log is
``reboot/<node>/reboot.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.pidfile, run outside pytest

from tests.pidfile import read_pidfile, stop_pid, write_pidfile

# How far up from this process the slurmd is: system() -> sh -c -> python, plus slack.
MAX_ANCESTORS = 8
# The reboot's own duration: whole seconds between this program's start and the new slurmd's
# (see the module docstring for why at least two).
MIN_REBOOT_SECONDS = 2
STOP_TIMEOUT_SECONDS = 10.0


def cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode() for a in raw.split(b"\0") if a]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def find_slurmd() -> tuple[int, list[str], str]:
    """(pid, argv, node name) of the slurmd this program runs under."""
    pid = os.getppid()
    for _ in range(MAX_ANCESTORS):
        if pid <= 1:
            break
        argv = cmdline(pid)
        if argv and Path(argv[0]).name == "slurmd" and "-N" in argv[:-1]:
            return pid, argv, argv[argv.index("-N") + 1]
        pid = parent_of(pid)
    raise SystemExit("reboot_program: no slurmd -N <node> among this process's ancestors")


def reboot(root: Path, node: str, slurmd_pid: int, slurmd_argv: list[str], started: float, log: TextIO) -> None:
    node_dir = root / "reboot" / node
    restarted = root / "restarted"

    def say(what: str) -> None:
        print(f"{time.time():.3f} {node}: {what}", file=log, flush=True)

    agent = read_pidfile(node_dir / "agent.pid")
    if agent is not None:
        stop_pid(agent, STOP_TIMEOUT_SECONDS)
        say(f"agent {agent} stopped")
    stop_pid(slurmd_pid, STOP_TIMEOUT_SECONDS)
    say(f"slurmd {slurmd_pid} stopped")

    boot_id = str(uuid.uuid4())
    (node_dir / "boot_id").write_text(boot_id + "\n")
    boots = node_dir / "boots"
    count = int(boots.read_text()) + 1 if boots.exists() else 1
    boots.write_text(f"{count}\n")
    say(f"boot {count}, boot id {boot_id}")

    spec = json.loads((node_dir / "after-reboot.json").read_text())
    with (node_dir / f"agent-boot{count}.log").open("ab") as out:
        proc = subprocess.Popen(spec["argv"], cwd=spec.get("cwd"), env=spec.get("env"), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    write_pidfile(restarted / f"{node}-agent.pid", proc.pid)
    write_pidfile(node_dir / "agent.pid", proc.pid)
    say(f"agent {proc.pid} started: {' '.join(spec['argv'])}")

    while time.time() < int(started) + MIN_REBOOT_SECONDS:
        time.sleep(0.05)
    argv = slurmd_argv if "-b" in slurmd_argv else [*slurmd_argv, "-b"]
    with (node_dir / f"slurmd-boot{count}.out").open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    write_pidfile(restarted / f"{node}-slurmd.pid", proc.pid)
    say(f"slurmd {proc.pid} started: {' '.join(argv)}")


def main() -> int:
    started = time.time()
    if len(sys.argv) != 2:
        print("usage: reboot_program.py <slurm test cluster root>", file=sys.stderr)
        return 2
    root = Path(sys.argv[1])
    slurmd_pid, slurmd_argv, node = find_slurmd()
    (root / "reboot" / node).mkdir(parents=True, exist_ok=True)
    # Detach (double fork, new session) so slurmd's RPC thread is free at once and the work
    # survives that slurmd's exit.
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return 0
    os.setsid()
    if os.fork():
        os._exit(0)
    # slurmd's descriptors (its listening socket among them) must not outlive it in us.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    # Nor its signal mask and the dispositions system() set: the daemons started here must stop
    # on SIGTERM.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    # Itself stoppable too, so a test that ends mid-reboot leaves nothing started behind it.
    mine = root / "restarted" / f"{node}-reboot.pid"
    write_pidfile(mine, os.getpid())
    status = 0
    with (root / "reboot" / node / "reboot.log").open("a") as log:
        try:
            reboot(root, node, slurmd_pid, slurmd_argv, started, log)
        except Exception as exc:  # noqa: BLE001 - a detached process: the log is all anyone sees
            print(f"{time.time():.3f} {node}: reboot failed: {exc!r}", file=log, flush=True)
            status = 1
    mine.unlink(missing_ok=True)
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
