"""GPU -> job from the process table: recorded real /proc/<pid>/cgroup files of Slurm (cgroup v1
and v2) and Kubernetes processes, NVML's running processes through the real backend over FakeNvml,
and the job carried in the GPU collector's report."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vigil.agent.attribution import (
    ProcessAttribution,
    ProcessIdentities,
    job_from_cgroup,
    job_from_environ,
    job_key,
    job_of_pid,
    start_ticks_of_stat,
)
from vigil.agent.collectors.gpu import GpuCollector, GpuConfig
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cgroup"
# file -> the job it names (tests/fixtures/cgroup/PROVENANCE.md)
RECORDED = {
    "slurm-v1-ex3.cgroup": "748468",
    "slurm-v1-devices.cgroup": "280678",
    "slurm-v2-fox.cgroup": "1392969",
    "k8s-v1-gke.cgroup": "pod/74c13223-5a00-11e9-b385-42010a80018d",
    "k8s-v2-crio-kubic.cgroup": "pod/042efd86-1f3b-4f2f-8736-f31c58e95bbc",
}


def proc_tree(root: Path, pid: int, cgroup: str | None = None, environ: bytes | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    if cgroup is not None:
        shutil.copy(FIXTURES / cgroup, d / "cgroup")
    if environ is not None:
        (d / "environ").write_bytes(environ)


@pytest.mark.parametrize(("name", "job"), sorted(RECORDED.items()))
def test_recorded_cgroup_files_name_their_job_or_pod(tmp_path: Path, name: str, job: str) -> None:
    proc_tree(tmp_path, 4242, name)
    assert job_of_pid(4242, tmp_path) == job


def test_non_job_processes_and_lookalikes_name_nothing() -> None:
    for text in ("0::/user.slice/user-1000.slice/session-1.scope\n", "0::/system.slice/slurmd.service\n",
                 "0::/user.slice/myjob_17/step_0\n", "12:memory:/docker/abc123\n", "0::/\n", ""):
        assert job_from_cgroup(text) == (None, None), text


def test_environment_names_the_job_as_the_heartbeat_client_does(tmp_path: Path) -> None:
    env = b"PATH=/usr/bin\0TORCHELASTIC_RUN_ID=none\0SLURM_JOB_ID=9001\0RANK=3\0"
    assert job_from_environ(env) == "9001"
    assert job_from_environ(b"TORCHELASTIC_RUN_ID=llama-70b\0SLURM_JOB_ID=9001\0") == "llama-70b"
    assert job_from_environ(b"PATH=/bin\0") is None
    # A pod's process is its pod's (the scheduler's word), whatever run id its environment names:
    # a name a process gives itself never stands for a job.
    proc_tree(tmp_path, 7, "k8s-v1-gke.cgroup", b"TORCHELASTIC_RUN_ID=pretrain-7\0")
    assert job_of_pid(7, tmp_path) == "pod/74c13223-5a00-11e9-b385-42010a80018d"
    # Slurm's cgroup (the kernel's word) wins over an environment that says otherwise.
    proc_tree(tmp_path, 8, "slurm-v2-fox.cgroup", b"SLURM_JOB_ID=1\0")
    assert job_of_pid(8, tmp_path) == "1392969"
    # A process in no scheduler's cgroup: its environment's name, scoped by its owner's uid, so it
    # can never be taken for Slurm job 9001.
    proc_tree(tmp_path, 9, None, b"SLURM_JOB_ID=9001\0")
    (tmp_path / "9" / "cgroup").write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
    (tmp_path / "9" / "status").write_text("Name:\tpython\nUid:\t1000\t1000\t1000\t1000\n")
    assert job_of_pid(9, tmp_path) == "uid/1000/9001"


@pytest.mark.parametrize("text", [
    # A user's own delegated cgroup tree (systemd user@.service) can hold any directory names.
    "0::/user.slice/user-1000.slice/user@1000.service/app.slice/slurm/uid_0/job_4242/step_0\n",
    "0::/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_4242\n",
    "0::/user.slice/user-1000.slice/user@1000.service/kubepods-burstable-pod"
    "042efd86_1f3b_4f2f_8736_f31c58e95bbc.slice/x.scope\n",
    "0::/user.slice/user-1000.slice/user@1000.service/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d\n",
    # job_<id> not directly under Slurm's own directory.
    "0::/system.slice/slurmd.service/job_4242\n", "0::/slurm/extra/job_4242/step_0\n",
    # v1 hierarchies that disagree name nothing.
    "4:freezer:/slurm/uid_1/job_1/step_0\n3:devices:/slurm/uid_2/job_2/step_0\n",
])
def test_cgroup_names_a_user_can_create_name_nothing(text: str) -> None:
    assert job_from_cgroup(text) == (None, None), text


def test_the_outermost_job_counts_and_a_containerised_reader_sees_pods_below_dotdot() -> None:
    # A process of job 77 that created job_4242 below its own cgroup is still job 77's.
    assert job_from_cgroup("0::/system.slice/slurmstepd.scope/job_77/step_0/user/slurmstepd.scope/job_4242\n") == (
        "77", None)
    assert job_from_cgroup("0::/../../kubepods-burstable-pod042efd86_1f3b_4f2f_8736_f31c58e95bbc.slice/"
                           "cri-containerd-" + "a" * 64 + ".scope\n") == (
        None, "042efd86-1f3b-4f2f-8736-f31c58e95bbc")


def test_unreadable_or_vanished_processes_are_skipped(tmp_path: Path) -> None:
    assert job_of_pid(99, tmp_path) is None
    (tmp_path / "100").mkdir()
    (tmp_path / "100" / "cgroup").write_bytes(b"\xff\xfe garbage")
    assert job_of_pid(100, tmp_path) is None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_nvml_processes_to_jobs_through_the_real_backend_and_into_the_report(tmp_path: Path) -> None:
    clock = Clock()
    fake = FakeNvml(load_node_scenario("healthy-h100"), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    proc_tree(tmp_path, 1001, "slurm-v1-ex3.cgroup")
    proc_tree(tmp_path, 1002, "slurm-v2-fox.cgroup")
    proc_tree(tmp_path, 1003)  # gone mid-read: no files
    fake.running_pids = {0: [1001], 1: [1001], 2: [1003, 1002]}
    attribution = ProcessAttribution(backend, proc_root=tmp_path, interval_seconds=10.0)
    collector = GpuCollector(GpuConfig(xid_events=False), backend, clock, attribution)
    states = {g.index: g.job for g in collector.collect(0.0).report["gpus"]}
    assert states[0] == states[1] == "748468" and states[2] == "1392969" and states[3] is None
    # Processes move on; the map is refreshed on its own cadence, not every cycle.
    fake.running_pids = {3: [1002]}
    assert {g.index: g.job for g in collector.collect(5.0).report["gpus"]}[3] is None
    assert {g.index: g.job for g in collector.collect(10.0).report["gpus"]}[3] == "1392969"
    collector.close()


def _stat(pid: int, start_ticks: int) -> str:
    # /proc/<pid>/stat: pid (comm) state ppid ... with starttime the 22nd field.
    return f"{pid} (py (x) y) S 1 " + " ".join(["0"] * 17) + f" {start_ticks} 0 0\n"


def test_sender_identities_are_cached_per_pid_and_start_time(tmp_path: Path) -> None:
    clock = Clock()
    identities = ProcessIdentities(tmp_path, max_entries=2, ttl_seconds=30.0, monotonic=clock)
    proc_tree(tmp_path, 500, "slurm-v2-fox.cgroup")
    (tmp_path / "500" / "stat").write_text(_stat(500, 1000))
    assert start_ticks_of_stat((tmp_path / "500" / "stat").read_bytes()) == 1000
    first = identities.lookup(500)
    assert first is not None and job_key(first) == "1392969"
    assert identities.lookup(500) == first and identities.reads == 1  # cached
    # The pid is reused by a process of another job: a new start time, never the old job.
    shutil.copy(FIXTURES / "k8s-v1-gke.cgroup", tmp_path / "500" / "cgroup")
    (tmp_path / "500" / "stat").write_text(_stat(500, 2000))
    reused = identities.lookup(500)
    assert reused is not None and job_key(reused) == "pod/74c13223-5a00-11e9-b385-42010a80018d"
    assert identities.reads == 2
    # A cached entry lives ttl_seconds (a process moved into a job's cgroup is seen after that).
    clock.t = 31.0
    identities.lookup(500)
    assert identities.reads == 3
    # Bounded: the least recently used pid goes first.
    for pid in (501, 502):
        proc_tree(tmp_path, pid, "slurm-v1-ex3.cgroup")
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, 5))
        assert identities.lookup(pid) is not None
    assert len(identities) == 2
    # Gone, or a stat that does not parse: nobody.
    assert identities.lookup(999) is None
    (tmp_path / "502" / "stat").write_text("garbage")
    assert identities.lookup(502) is None
