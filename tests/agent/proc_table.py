"""A fake process table for the tests of heartbeat identity: the real pid of a real process (so
the kernel's SCM_CREDENTIALS name it), with a cgroup file that puts it in a Slurm job or pod that
the test cannot really create, and its real /proc/<pid>/stat (its start time)."""

from __future__ import annotations

from pathlib import Path

SLURM_V2 = "0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n"
POD_V2 = ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/"
          "cri-containerd-" + "c" * 64 + ".scope\n")
UNSCHEDULED = "0::/user.slice/user-1000.slice/session-4.scope\n"


def place(root: Path, pid: int, cgroup: str) -> None:
    """Put real process ``pid`` into ``cgroup`` (a /proc/<pid>/cgroup file's text) under ``root``."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_bytes(Path(f"/proc/{pid}/stat").read_bytes())
    (d / "cgroup").write_text(cgroup)


def in_slurm_job(root: Path, pid: int, job: int) -> None:
    place(root, pid, SLURM_V2.format(job=job))


def in_pod(root: Path, pid: int, pod_uid: str) -> None:
    place(root, pid, POD_V2.format(uid_=pod_uid.replace("-", "_")))
