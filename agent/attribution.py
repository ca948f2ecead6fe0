"""Which job and pod a process belongs to, from the process table: GPUs without instrumentation,
and the sender of each heartbeat.

It reads each GPU's running compute processes from NVML (through the backend: pid, and the MIG
GPU/compute instance ids where the backend gives them), then each PID's ``/proc/<pid>/cgroup``
(a Slurm job id from cgroup v1 ``/slurm/uid_U/job_J/...`` or v2
``/system.slice/slurmstepd.scope/job_J/...``; a Kubernetes pod uid and container id from the
kubelet's cgroup path, systemd or cgroupfs driver). ``ProcessIdentities`` gives the same for the
kernel-verified pid of a heartbeat's sender, cached per (pid, start time). Job keys have one
canonical form (``job_key``): the Slurm job id, ``pod/<uid>``, or for a process in no scheduler's
cgroup ``uid/<uid>/<name>`` (its environment's name, scoped by its owner). Pod names (namespace,
pod, container) come only from an optional resolver the caller passes in. It judges nothing and
never raises: an unreadable process is skipped.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.contract.wire import GPU_PROCESSES_MAX, GpuProcess, replace
from vigil_heartbeat.client import FALLBACK_JOB, resolve_identity

log = logging.getLogger(__name__)

# /proc/<pid>/environ of a training process is a few KiB; a bound keeps a hostile one cheap.
MAX_PROC_FILE_BYTES = 64 * 1024
# Slurm's cgroup plugins name the job's directory job_<id> right below their own (cgroup/v1:
# /slurm[_<node>]/uid_<uid>/job_<id>/step_<s>/task_<t>; cgroup/v2:
# /system.slice/[<node>_]slurmstepd.scope/job_<id>/...; https://slurm.schedmd.com/cgroup_v2.html).
# The job must sit directly under Slurm's directory: a job_<id> anywhere else is a name anyone
# with a delegated cgroup subtree can create.
_SLURM_JOB = re.compile(r"/(?:slurm(?:_[^/]+)?/uid_\d+|(?:[^/]+_)?slurmstepd\.scope)/job_(\d+)(?:/|$)")
# kubelet's pod cgroups: cgroupfs driver /kubepods[/<qos>]/pod<uid>/<container>; systemd driver
# /kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid with _ for ->.slice/<runtime>-<id>.scope
# (a containerised reader with its own cgroup namespace sees these below /../..).
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_POD_CGROUPFS = re.compile(r"(?:/kubepods(?:/(?:burstable|besteffort|guaranteed))?|^(?:/\.\.)+)/pod(" + _UUID
                           + r")(?:/|$)")
_POD_SYSTEMD = re.compile(r"(?:^|/)kubepods(?:-(?:burstable|besteffort|guaranteed))?-pod("
                          r"[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12})\.slice(?:[/:]|$)")
# A user's own delegated subtree (systemd's user@<uid>.service): whatever is below it the user
# named, so it names no job or pod.
_USER_TREE = re.compile(r"(?:^|/)(?:user\.slice|user@\d+\.service)(?:/|$)")
# The container's own cgroup, 64 hex digits: systemd driver `<runtime>-<id>.scope` (runtime
# cri-containerd, crio, docker); containerd on cgroup v1 with the systemd driver also writes the
# unconverted `<pod slice>:cri-containerd:<id>`; cgroupfs driver `pod<uid>/<id>` (CRI-O: crio-<id>).
_CONTAINER_SCOPE = re.compile(r"(?:^|[/:])(?:cri-containerd|crio|docker)[-:]([0-9a-f]{64})(?:\.scope)?(?:/|$)")
_CONTAINER_AFTER_POD = re.compile(r"/pod[0-9a-f_-]{36}(?:\.slice)?/(?:[a-z-]+-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)")
# NVML's "no MIG instance" id in nvmlProcessInfo_t.gpuInstanceId / computeInstanceId.
_NO_MIG_INSTANCE = 0xFFFFFFFF

PROCESS_INFO = MetricSpec(
    "vigil_gpu_process_info", MetricKind.INFO,
    "A compute process on the GPU and whom it belongs to (job: the Slurm job id, pod/<uid>, or uid/<uid>/<name> "
    "outside any scheduler; "
    f"Kubernetes pod uid, container id, names when resolved; MIG instance ids); empty when unknown; "
    f"at most {GPU_PROCESSES_MAX} per GPU.",
    ("gpu", "uuid", "pid", "job", "slurm_job", "pod_uid", "container_id", "namespace", "pod", "container",
     "gpu_instance_id", "compute_instance_id"))


POD_KEY_PREFIX = "pod/"
UID_KEY_PREFIX = "uid/"


@dataclass(frozen=True)
class CgroupIdentity:
    """What one /proc/<pid>/cgroup file names; None where it names nothing."""

    slurm_job: str | None = None
    pod_uid: str | None = None
    container_id: str | None = None


@dataclass(frozen=True)
class PodNames:
    """Kubernetes names for a pod uid (and container), from a resolver; "" where unknown."""

    namespace: str = ""
    pod: str = ""
    container: str = ""


# (pod uid, container id or None) -> names, or None when it cannot say. Must be cheap and must not
# raise for a pod it does not know (it is called once per process per attribution interval).
PodResolver = Callable[[str, str | None], PodNames | None]


def parse_cgroup(text: str) -> CgroupIdentity:
    """The Slurm job, Kubernetes pod uid and container id a /proc/<pid>/cgroup file's paths name.

    Only the outermost match of a path counts (a process can create cgroups only below its own),
    paths in a user's delegated tree count for nothing, and hierarchies (cgroup v1) that name two
    different jobs or pods name neither."""
    slurm: set[str] = set()
    pods: set[str] = set()
    container = None
    for line in text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")  # hierarchy-id:controllers:path (v2: 0::path)
        if _USER_TREE.search(path):
            continue
        if "slurm" in path:
            match = _SLURM_JOB.search(path)
            if match:
                slurm.add(match.group(1))
        if "pod" in path:
            match = _POD_CGROUPFS.search(path)
            if match:
                pods.add(match.group(1))
            else:
                match = _POD_SYSTEMD.search(path)
                if match:
                    pods.add(match.group(1).replace("_", "-"))
            if container is None and match:
                found = _CONTAINER_SCOPE.search(path) or _CONTAINER_AFTER_POD.search(path)
                if found:
                    container = found.group(1)
    pod = next(iter(pods)) if len(pods) == 1 else None
    return CgroupIdentity(next(iter(slurm)) if len(slurm) == 1 else None, pod,
                          container if pod is not None else None)


def job_key(ident: CgroupIdentity) -> str | None:
    """The canonical job key of a scheduler identity: the Slurm job id, else ``pod/<uid>``."""
    if ident.slurm_job is not None:
        return ident.slurm_job
    return f"{POD_KEY_PREFIX}{ident.pod_uid}" if ident.pod_uid is not None else None


def uid_key(uid: int, name: str) -> str:
    """The key of a job in no scheduler's cgroup: its name, scoped by the owner's uid."""
    return f"{UID_KEY_PREFIX}{uid}/{name}"


def job_from_cgroup(text: str) -> tuple[str | None, str | None]:
    """(Slurm job id, Kubernetes pod uid) named by a /proc/<pid>/cgroup file's paths."""
    ident = parse_cgroup(text)
    return ident.slurm_job, ident.pod_uid


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


def uid_of_status(raw: bytes) -> int | None:
    """The real uid in a /proc/<pid>/status file (its ``Uid:`` line), or None."""
    for line in raw.splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return None


def process_of_pid(pid: int, proc_root: Path, resolver: PodResolver | None = None) -> GpuProcess:
    """One process and whom it belongs to. ``job``: the canonical key of its scheduler identity
    (the Slurm job of its cgroup, else its Kubernetes pod ``pod/<uid>``); for a process in no
    scheduler's cgroup, its environment's job scoped by its owner (``uid/<uid>/<name>``): a name a
    process gives itself never stands for a scheduler's job."""
    base = proc_root / str(pid)
    cgroup = _read(base / "cgroup")
    ident = parse_cgroup(cgroup.decode("utf-8", "replace")) if cgroup is not None else CgroupIdentity()
    job = job_key(ident)
    if job is None:
        environ = _read(base / "environ")
        name = job_from_environ(environ) if environ is not None else None
        status = _read(base / "status") if name else None
        uid = uid_of_status(status) if status is not None else None
        job = uid_key(uid, name) if name and uid is not None else None
    names = None
    if ident.pod_uid is not None and resolver is not None:
        try:
            names = resolver(ident.pod_uid, ident.container_id)
        except Exception as exc:  # noqa: BLE001 - a resolver's failure costs the names, not the process
            log.debug("pod names of %s: %s", ident.pod_uid, exc)
    return GpuProcess(pid=pid, job=job, slurm_job=ident.slurm_job, pod_uid=ident.pod_uid,
                      container_id=ident.container_id,
                      namespace=(names.namespace or None) if names else None,
                      pod=(names.pod or None) if names else None,
                      container=(names.container or None) if names else None)


def job_of_pid(pid: int, proc_root: Path) -> str | None:
    """The job of one process (see process_of_pid)."""
    return process_of_pid(pid, proc_root).job


def start_ticks_of_stat(raw: bytes) -> int | None:
    """A process's start time (clock ticks after boot, field 22 of /proc/<pid>/stat), or None.
    With the pid it names one process for good: a reused pid has a later start time."""
    _, paren, rest = raw.rpartition(b")")  # the command name may hold spaces and parentheses
    fields = rest.split()
    if not paren or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


Trust = Literal["scheduler", "uid", "unverified", "in_process"]


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent a heartbeat, as far as the agent can tell (docs/training.md "Job identity").

    ``scheduler``: a kernel-verified pid (SCM_CREDENTIALS) in a Slurm job or Kubernetes pod;
    ``job`` is that job's key. ``uid``: a verified pid in no scheduler's cgroup, taken because the
    site opted in (collectors.training.unscheduled: by_uid); keyed by its uid. ``unverified``: a
    loopback UDP/HTTP sender (no peer credentials), taken because the site opted in.
    ``in_process``: code inside the agent's own process (configured log files, the simulator),
    whose names are configuration."""

    trust: Trust
    job: str | None = None
    pid: int | None = None
    uid: int | None = None

    @property
    def verified(self) -> bool:
        """Its job slots are the node's real jobs' (scheduler identity, or the agent's own config)."""
        return self.trust in ("scheduler", "in_process")


UNVERIFIED = Sender("unverified")
IN_PROCESS = Sender("in_process")


@dataclass(frozen=True, slots=True)
class _Cached:
    start_ticks: int
    identity: CgroupIdentity
    expires_at: float


class ProcessIdentities:
    """A heartbeat sender's pid -> its scheduler identity (``parse_cgroup`` of
    ``proc_root/<pid>/cgroup``), cached per (pid, start time) so a reused pid never inherits its
    predecessor's job. At most ``max_entries`` pids are kept (least recently used go first), each
    for ``ttl_seconds`` (a process moved into a job's cgroup, as pam_slurm_adopt does, is seen
    within that). ``lookup`` returns None when the process is gone or unreadable."""

    def __init__(self, proc_root: Path = Path("/proc"), *, max_entries: int = 4096, ttl_seconds: float = 30.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._proc_root = proc_root
        self._max = max_entries
        self._ttl = ttl_seconds
        self._monotonic = monotonic
        self._cache: OrderedDict[int, _Cached] = OrderedDict()
        self.reads = 0  # cgroup files read (cache misses), for tests and benchmarks

    def lookup(self, pid: int) -> CgroupIdentity | None:
        base = self._proc_root / str(pid)
        stat = _read(base / "stat")
        start = start_ticks_of_stat(stat) if stat is not None else None
        if start is None:
            self._cache.pop(pid, None)
            return None
        now = self._monotonic()
        cached = self._cache.get(pid)
        if cached is not None and cached.start_ticks == start and now < cached.expires_at:
            self._cache.move_to_end(pid)
            return cached.identity
        cgroup = _read(base / "cgroup")
        self.reads += 1
        # Read the start time again: a pid that died and was reused while we read is nobody.
        again = _read(base / "stat")
        if cgroup is None or again is None or start_ticks_of_stat(again) != start:
            self._cache.pop(pid, None)
            return None
        identity = parse_cgroup(cgroup.decode("utf-8", "replace"))
        self._cache[pid] = _Cached(start, identity, now + self._ttl)
        self._cache.move_to_end(pid)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return identity

    def __len__(self) -> int:
        return len(self._cache)


def _mig_id(value: Any) -> int | None:
    if value is None:
        return None
    value = int(value)
    return None if value == _NO_MIG_INSTANCE or value < 0 or value > 1 << 20 else value


class ProcessAttribution:
    """GPU index -> its compute processes and their job/pod, refreshed every ``interval_seconds``
    (processes start and stop rarely).

    ``nvml`` is the agent's NVML backend: ``running_processes(index)`` (objects with ``pid``,
    ``gpuInstanceId``, ``computeInstanceId``, as pynvml returns them) where it has it, else
    ``running_pids(index)`` (no MIG ids). ``proc_root`` is the process table. ``resolver`` names
    a pod uid (namespace, pod, container); without one only the uid and container id are known.
    At most ``max_processes_per_gpu`` processes per GPU are kept (NVML's order); the rest are
    counted in ``processes_left_out``.
    """

    def __init__(self, nvml: Any, *, proc_root: Path = Path("/proc"), interval_seconds: float = 10.0,
                 resolver: PodResolver | None = None, max_processes_per_gpu: int = GPU_PROCESSES_MAX) -> None:
        self._nvml = nvml
        self._proc_root = proc_root
        self._interval = interval_seconds
        self._resolver = resolver
        self._max = min(max_processes_per_gpu, GPU_PROCESSES_MAX)
        self._due = float("-inf")
        self._jobs: dict[int, str] = {}
        self._processes: dict[int, tuple[GpuProcess, ...]] = {}
        self.failures = 0
        self.processes_left_out = 0

    def jobs(self, indices: Sequence[int], now: float) -> dict[int, str]:
        """GPU index -> the job of its first attributed process."""
        self.refresh(indices, now)
        return self._jobs

    def processes(self, indices: Sequence[int], now: float) -> dict[int, tuple[GpuProcess, ...]]:
        """GPU index -> its compute processes (at most the bound), attributed or not."""
        self.refresh(indices, now)
        return self._processes

    def refresh(self, indices: Sequence[int], now: float) -> None:
        if self._nvml is None or now < self._due:
            return
        self._due = now + self._interval
        jobs: dict[int, str] = {}
        processes: dict[int, tuple[GpuProcess, ...]] = {}
        for index in indices:
            listed = self._list(index)
            if not listed:
                continue
            if len(listed) > self._max:
                self.processes_left_out += len(listed) - self._max
                listed = listed[:self._max]
            out = []
            for pid, gi, ci in listed:
                proc = process_of_pid(pid, self._proc_root, self._resolver)
                if gi is not None or ci is not None:
                    proc = replace(proc, gpu_instance_id=gi, compute_instance_id=ci)
                out.append(proc)
                if index not in jobs and proc.job is not None:
                    jobs[index] = proc.job  # one job per GPU in practice; the first attributed wins
            processes[index] = tuple(out)  # GpuState.processes, as it goes on the wire
        self._jobs = jobs
        self._processes = processes

    def _list(self, index: int) -> list[tuple[int, int | None, int | None]]:
        try:
            running = getattr(self._nvml, "running_processes", None)
            if running is not None:
                procs = running(index)
                return [(int(p.pid), _mig_id(getattr(p, "gpuInstanceId", None)),
                         _mig_id(getattr(p, "computeInstanceId", None)))
                        for p in procs or () if getattr(p, "pid", None)]
            return [(pid, None, None) for pid in self._nvml.running_pids(index) or ()]
        except Exception as exc:  # noqa: BLE001 - attribution is best effort, never a crash
            self.failures += 1
            log.debug("running processes of GPU %d: %s", index, exc)
            return []


def process_samples(gpu_labels: tuple[tuple[str, str], ...], processes: Iterable[GpuProcess]) -> list[Sample]:
    """``vigil_gpu_process_info`` for one GPU's processes; ``gpu_labels`` are its (gpu, uuid) pairs."""
    out = []
    for p in processes:
        values = (str(p.pid), p.job or "", p.slurm_job or "", p.pod_uid or "", p.container_id or "",
                  p.namespace or "", p.pod or "", p.container or "",
                  "" if p.gpu_instance_id is None else str(p.gpu_instance_id),
                  "" if p.compute_instance_id is None else str(p.compute_instance_id))
        out.append(Sample(PROCESS_INFO.name, 1.0, (*gpu_labels, *zip(PROCESS_INFO.labels[2:], values, strict=True))))
    return out


def kubernetes_labels(samples: Iterable[Sample]) -> dict[str, dict[str, str]]:
    """For the dcgm-exporter compatibility layer: GPU uuid (the ``uuid`` label) -> dcgm-exporter's
    ``pod``, ``namespace``, ``container`` label values, from the snapshot's
    ``vigil_gpu_process_info`` samples. Only GPUs with a process in a pod whose names a resolver
    gave appear (dcgm-exporter labels a GPU only when the kubelet names its pod); the first such
    process in NVML's order wins."""
    out: dict[str, dict[str, str]] = {}
    for s in samples:
        if s.name != PROCESS_INFO.name:
            continue
        labels = dict(s.labels)
        uuid = labels.get("uuid", "")
        if uuid in out or not labels.get("pod"):
            continue
        out[uuid] = {"pod": labels["pod"], "namespace": labels.get("namespace", ""),
                    "container": labels.get("container", "")}
    return out
