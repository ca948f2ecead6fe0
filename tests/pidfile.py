"""Pidfiles for processes a test does not start itself (a RebootProgram's detached daemons), and
stopping the ones it did start.

A pidfile holds "<pid> <start time>", the start time being field 22 of /proc/<pid>/stat (clock
ticks since boot), so a pid the kernel has since given to another process is never signalled.
Standard library only: the reboot program imports it outside pytest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)"; comm may hold spaces
    return int(fields[19])  # field 22 of the whole line: starttime


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited and closed its sockets; its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def write_pidfile(path: Path, pid: int) -> None:
    ticks = start_ticks(pid)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{pid} {ticks}\n")
    tmp.replace(path)


def read_pidfile(path: Path) -> int | None:
    """The pid the file names if that very process still runs, else None."""
    try:
        pid_text, ticks_text = path.read_text().split()
    except (OSError, ValueError):
        return None
    pid = int(pid_text)
    if not is_running(pid) or str(start_ticks(pid)) != ticks_text:
        return None
    return pid


def wait_gone(pid: int, timeout_seconds: float) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_pid(pid: int, timeout_seconds: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_seconds``; returns once it has exited (bounded)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not wait_gone(pid, timeout_seconds):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        wait_gone(pid, 5.0)


def stop_pidfile(path: Path, timeout_seconds: float = 10.0) -> None:
    pid = read_pidfile(path)
    if pid is not None:
        stop_pid(pid, timeout_seconds)


def stop_children(procs: list[subprocess.Popen[bytes]], timeout_seconds: float = 5.0) -> None:
    """Our own children: SIGTERM to all, then wait for each, SIGKILL past ``timeout_seconds``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout_seconds)
