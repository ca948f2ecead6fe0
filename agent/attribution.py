"""Which job each GPU belongs to, from the process table: no instrumentation needed.

It reads each GPU's running compute processes from NVML (through the backend), then each PID's
``/proc/<pid>/cgroup`` (a Slurm job id from cgroup v1 ``/slurm/uid_U/job_J/...`` or v2
``/system.slice/slurmstepd.scope/job_J/...``) or ``/proc/<pid>/environ`` (torchrun's run id or
Slurm's job id, read as the heartbeat client reads them), and last a Kubernetes pod uid from the
cgroup path (``pod/<uid>``). It emits a GPU index -> job map for the report; it judges nothing and
never raises: an unreadable process is skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vigil_heartbeat.client import FALLBACK_JOB, resolve_identity

log = logging.getLogger(__name__)

# /proc/<pid>/environ of a training process is a few KiB; a bound keeps a hostile one cheap.
MAX_PROC_FILE_BYTES = 64 * 1024
# Slurm's cgroup plugins name the job's directory job_<id> (cgroup/v1: /slurm[_<node>]/uid_<uid>/
# job_<id>/step_<s>/task_<t>; cgroup/v2: /system.slice/[<node>_]slurmstepd.scope/job_<id>/...;
# https://slurm.schedmd.com/cgroup_v2.html).
_SLURM_JOB = re.compile(r"/job_(\d+)(?:/|$)")
# kubelet's pod cgroups: cgroupfs driver /kubepods/<qos>/pod<uid>/<container>; systemd driver
# /kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid with _ for ->.slice/<runtime>-<id>.scope
_POD_CGROUPFS = re.compile(r"/pod([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(?:/|$)")
_POD_SYSTEMD = re.compile(r"-pod([0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12})\.slice")


def job_from_cgroup(text: str) -> tuple[str | None, str | None]:
    """(Slurm job id, Kubernetes pod uid) named by a /proc/<pid>/cgroup file's paths."""
    slurm = pod = None
    for line in text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")  # hierarchy-id:controllers:path (v2: 0::path)
        if slurm is None and ("slurm" in path):
            match = _SLURM_JOB.search(path)
            if match:
                slurm = match.group(1)
        if pod is None and "kubepods" in path:
            match = _POD_CGROUPFS.search(path)
            if match:
                pod = match.group(1)
            else:
                match = _POD_SYSTEMD.search(path)
                if match:
                    pod = match.group(1).replace("_", "-")
    return slurm, pod


def job_from_environ(raw: bytes) -> str | None:
    """The job a process's environment names, as the heartbeat client would (None if none)."""
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in (b"TORCHELASTIC_RUN_ID", b"SLURM_JOB_ID"):
            env[key.decode("ascii", "replace")] = value.decode("utf-8", "replace")
    job, _, _ = resolve_identity(env)
    return None if job == FALLBACK_JOB else job[:128]


def _read(path: Path) -> bytes | None:
    try:
        with path.open("rb") as f:
            return f.read(MAX_PROC_FILE_BYTES)
    except OSError:  # gone, or not ours to read: skip the process
        return None


def job_of_pid(pid: int, proc_root: Path) -> str | None:
    """The job of one process: the Slurm job of its cgroup, else its environment's job, else its
    Kubernetes pod (``pod/<uid>``, which groups one pod's GPUs only)."""
    base = proc_root / str(pid)
    cgroup = _read(base / "cgroup")
    slurm, pod = job_from_cgroup(cgroup.decode("utf-8", "replace")) if cgroup is not None else (None, None)
    if slurm is not None:
        return slurm
    environ = _read(base / "environ")
    job = job_from_environ(environ) if environ is not None else None
    if job:
        return job
    return f"pod/{pod}" if pod is not None else None


class ProcessAttribution:
    """GPU index -> job, refreshed every ``interval_seconds`` (processes start and stop rarely).

    ``nvml`` is the agent's NVML backend (``running_pids(index)``); ``proc_root`` the process table.
    """

    def __init__(self, nvml: Any, *, proc_root: Path = Path("/proc"), interval_seconds: float = 10.0) -> None:
        self._nvml = nvml
        self._proc_root = proc_root
        self._interval = interval_seconds
        self._due = float("-inf")
        self._jobs: dict[int, str] = {}
        self.failures = 0

    def jobs(self, indices: Sequence[int], now: float) -> dict[int, str]:
        if self._nvml is None or now < self._due:
            return self._jobs
        self._due = now + self._interval
        jobs: dict[int, str] = {}
        for index in indices:
            try:
                pids = self._nvml.running_pids(index)
            except Exception as exc:  # noqa: BLE001 - attribution is best effort, never a crash
                self.failures += 1
                log.debug("running processes of GPU %d: %s", index, exc)
                continue
            for pid in pids or ():
                job = job_of_pid(pid, self._proc_root)
                if job is not None:
                    jobs[index] = job  # one job per GPU in practice; the last process wins
                    break
        self._jobs = jobs
        return jobs
