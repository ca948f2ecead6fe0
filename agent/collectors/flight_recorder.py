"""Flight Recorder collector: PyTorch Flight Recorder dumps (JSON) that the ranks on this node wrote.

It reads the dump files under ``collectors.flight_recorder.dump_glob`` (new or changed ones only,
bounded in size, strict JSON, never pickle) and derives, per (rank, process group), the newest
collective entered and completed (collective_seq_id), its op, stage and input size; each dump is
bound to the scheduler's job of the process that owns it (file owner uid -> the one job on this node
running processes of that uid, through the agent's attribution), never to a job or rank named in
the file. It emits ``CollectiveState`` entries into the report while the dump is fresh and counts
every dump read or refused; it judges nothing (aggregator/detectors/collective_culprit.py does).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator

from vigil.agent.attribution import MAX_PROC_FILE_BYTES, job_of_pid, uid_of_status
from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.contract.wire import COLLECTIVES_MAX, CollectiveState

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

log = logging.getLogger(__name__)

# A global rank above this is not a rank (wire.Index's bound: 2**20).
RANK_MAX = 1 << 20
# Entries read from one dump: torch's ring holds TORCH_FR_BUFFER_SIZE entries (2,000 is the
# common setting in PyTorch's docs); more than this is not a Flight Recorder dump.
ENTRIES_MAX = 20_000
# Process groups per dump: data, tensor, pipeline and expert parallel groups, a few of each.
GROUPS_MAX = 64
# Processes looked at to bind dumps to jobs in one cycle (a node's process table is a few thousand).
PROCS_MAX = 65_536
# Bytes per element of torch dtypes as Flight Recorder names them (c10 ScalarType names).
DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
               "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
               "Float8_e4m3fn": 1, "Float8_e5m2": 1, "UInt16": 2, "UInt32": 4, "UInt64": 8}
# A dump's file name ends in the global rank: torch writes <TORCH_FR_DUMP_TEMP_FILE><rank>
# (torch/csrc/distributed/c10d/FlightRecorder; fr_trace's loader reads the rank from the name).
_RANK_SUFFIX = re.compile(r"(\d{1,7})(?:\.json)?$")

# torch names the default process group "0" (distributed_c10d: _process_group_name); it holds
# every rank, so a dump's rank must be below its size where the dump states it.
DEFAULT_GROUP = "0"
OUTCOMES = ("read", "malformed", "too_large", "not_a_file", "bad_rank", "no_job", "ambiguous_job", "rank_not_here")


class FlightRecorderConfig(CollectorConfig):
    # Off by default: only jobs that enable the recorder and dump it (docs/training.md) write here.
    enabled: bool = False
    interval_seconds: float = Field(default=5.0, gt=0)
    # Where the ranks' dumps are: a glob of files whose names end in the rank, e.g. the
    # TORCH_FR_DUMP_TEMP_FILE prefix a job sets, plus "*". Per-job directories work:
    # /var/tmp/vigil-fr/*/nccl_trace_rank_*.
    dump_glob: str = "/var/tmp/vigil-fr/*/nccl_trace_rank_*"
    # A dump older than this (its mtime) is no longer reported: a hang's dumps are written once,
    # on the collective timeout, and judged within minutes; an old one describes a past run.
    fresh_seconds: float = Field(default=300.0, gt=0)
    # 2,000 entries of about 700 bytes of JSON each are 1.4 MB; bigger is refused, unread.
    max_file_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    # Dump files looked at per cycle (a rank per GPU, a few runs' worth).
    max_files: int = Field(default=256, ge=1, le=4096)

    @field_validator("dump_glob")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path pattern")
        return value


DUMPS = MetricSpec("vigil_agent_flight_recorder_dumps_total", MetricKind.COUNTER,
                   "Flight Recorder dump files read (outcome=read) or refused (malformed, too_large, not_a_file, "
                   "bad_rank, no_job, ambiguous_job, rank_not_here), each new or changed file once.",
                   labels=("outcome",))
COLLECTIVES = MetricSpec("vigil_agent_flight_recorder_collectives", MetricKind.GAUGE,
                         "(rank, process group) collective states reported from fresh Flight Recorder dumps.")
SPECS = (DUMPS, COLLECTIVES)

# pid -> the scheduler's job key of that process (agent/attribution.py), or None.
JobOfPid = Callable[[int], "str | None"]


class DumpError(ValueError):
    """A dump refused; ``outcome`` is its counter label."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


@dataclass(frozen=True, slots=True)
class GroupProgress:
    """One process group's progress in one dump (no job yet: that comes from the file's owner)."""

    group: str
    group_size: int | None
    last_entered_seq: int | None
    last_completed_seq: int | None
    op: str | None
    stage: str | None
    size_bytes: int | None


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _int(value: Any, lo: int = 0) -> int | None:
    """A non-negative int from an int or a decimal string ("-1" and junk: None)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,18}", value):
        value = int(value)
    return value if isinstance(value, int) and lo <= value <= (1 << 62) else None


def _size_bytes(entry: dict[str, Any]) -> int | None:
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not isinstance(sizes, list) or not isinstance(dtypes, list) or len(sizes) != len(dtypes):
        return None
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=True):
        width = DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if width is None or not isinstance(shape, list) or len(shape) > 16:
            return None
        n = width
        for dim in shape:
            d = _int(dim)
            if d is None:
                return None
            n *= d
        total += n
    return total if total <= (1 << 62) else None


def _group_size(pg_config: Any, name: str) -> int | None:
    """The group's size where the dump's pg_config names it (NCCL does; gloo in torch 2.13 keys it
    by an empty name, so the size stays unknown)."""
    if not isinstance(pg_config, dict):
        return None
    cfg = pg_config.get(name)
    ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
    if isinstance(ranks, str) and re.fullmatch(r"\[[\d, ]{0,200000}\]", ranks):
        members = [r for r in ranks.strip("[]").split(",") if r.strip()]
        return len(members) or None
    return None


def parse_dump(raw: bytes, rank: int) -> list[GroupProgress]:
    """The per-group progress in one Flight Recorder JSON dump. Raises DumpError("malformed") on
    anything that is not one (not JSON, NaN, wrong shapes, too many entries or groups)."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_strict_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DumpError("malformed", f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("version"), str):
        raise DumpError("malformed", "not a Flight Recorder dump (no version)")
    entries = doc.get("entries", [])
    if not isinstance(entries, list) or len(entries) > ENTRIES_MAX:
        raise DumpError("malformed", "entries: not a bounded list")
    # pg_id -> (name, newest entry by seq, newest completed seq)
    groups: dict[str, tuple[str, dict[str, Any], int | None]] = {}
    for e in entries:
        if not isinstance(e, dict):
            raise DumpError("malformed", "an entry is not an object")
        if e.get("is_p2p") is True:
            continue  # send/recv have their own sequence (p2p_seq_id); collectives are judged
        seq, pg = _int(e.get("collective_seq_id"), lo=1), e.get("process_group")
        pg_id = e.get("pg_id")
        if seq is None or not isinstance(pg, list) or not pg or not isinstance(pg[0], str) \
                or not 0 < len(pg[0]) <= 256 or _int(pg_id) is None:
            raise DumpError("malformed", "an entry lacks collective_seq_id, pg_id or process_group")
        key = str(pg_id)
        name, newest, done = groups.get(key, (pg[0], e, None))
        if name != pg[0]:
            raise DumpError("malformed", f"pg_id {key} has two names")
        if seq >= (_int(newest.get("collective_seq_id"), lo=1) or 0):
            newest = e
        # Completed: the stage says so, or the work was retired (gloo records no stages: its
        # entries stay "scheduled" and are retired when the work finishes).
        if e.get("state") == "completed" or e.get("retired") is True:
            done = seq if done is None else max(done, seq)
        groups[key] = (name, newest, done)
        if len(groups) > GROUPS_MAX:
            raise DumpError("malformed", "too many process groups")
    status = doc.get("pg_status", {})
    if not isinstance(status, dict):
        raise DumpError("malformed", "pg_status is not an object")
    out: list[GroupProgress] = []
    for key, (name, newest, done) in groups.items():
        entered = _int(newest.get("collective_seq_id"), lo=1)
        st = status.get(key)
        if isinstance(st, dict):
            # The recorder's own counters outlive the ring (older entries are overwritten).
            enq, comp = _int(st.get("last_enqueued_collective"), lo=1), _int(st.get("last_completed_collective"), lo=1)
            entered = max(entered or 0, enq or 0) or None
            done = max(done or 0, comp or 0) or None
        size = _group_size(doc.get("pg_config"), name)
        if size is not None and name == DEFAULT_GROUP and rank >= size:
            raise DumpError("bad_rank", f"rank {rank} outside the default group's {size} ranks")
        op = newest.get("profiling_name")
        op = op.split(":", 1)[-1][:64] if isinstance(op, str) else None
        is_newest = _int(newest.get("collective_seq_id"), lo=1) == entered
        completed = done is not None and entered is not None and done >= entered
        stage = "completed" if completed else (newest.get("state") if is_newest and newest.get("state")
                                               in ("scheduled", "started") else None)
        out.append(GroupProgress(group=name, group_size=size, last_entered_seq=entered, last_completed_seq=done,
                                 op=op if is_newest else None, stage=stage,
                                 size_bytes=_size_bytes(newest) if is_newest else None))
    return out


@dataclass(frozen=True, slots=True)
class _Read:
    """A dump file as last read: its identity, owner and what it said (or why it was refused)."""

    stamp: tuple[int, int, int, int]  # (device, inode, size, mtime_ns)
    uid: int
    rank: int
    mtime: float
    groups: tuple[GroupProgress, ...]
    refused: str | None


def rank_of_environ(raw: bytes) -> int | None:
    """The global rank a process's environment declares (torchrun's RANK, else srun's SLURM_PROCID)."""
    env: dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in (b"RANK", b"SLURM_PROCID"):
            env[key] = value
    declared = env.get(b"RANK") or env.get(b"SLURM_PROCID")
    return int(declared) if declared is not None and declared.isdigit() and len(declared) <= 7 else None


# uid -> job -> the global ranks its processes on this node declare (empty: none declares one).
JobsByUid = dict[int, dict[str, set[int]]]


def jobs_by_uid(proc_root: Path, job_of: JobOfPid) -> JobsByUid:
    """uid -> the scheduler jobs with a live process of that uid on this node, and the ranks those
    processes declare in their environment (bounded scan)."""
    out: JobsByUid = {}
    try:
        pids = [p.name for p in proc_root.iterdir() if p.name.isdigit()][:PROCS_MAX]
    except OSError:
        return out
    for name in pids:
        try:
            with (proc_root / name / "status").open("rb") as f:
                uid = uid_of_status(f.read(MAX_PROC_FILE_BYTES))
        except OSError:
            continue  # gone, or not ours to read
        if uid is None:
            continue
        job = job_of(int(name))
        if job is None:
            continue
        ranks = out.setdefault(uid, {}).setdefault(job, set())
        try:
            with (proc_root / name / "environ").open("rb") as f:
                rank = rank_of_environ(f.read(MAX_PROC_FILE_BYTES))
        except OSError:
            rank = None
        if rank is not None:
            ranks.add(rank)
    return out


class FlightRecorderCollector:
    name = "flight_recorder"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: FlightRecorderConfig, *, root: Path = Path("/"),
                 jobs_of_uid: Callable[[], JobsByUid] | None = None) -> None:
        """``root``: the filesystem the dump glob is under; ``jobs_of_uid``: the node's live jobs by
        process owner, with the ranks they declare (default: a scan of /proc through
        agent/attribution.py)."""
        self._config = config
        self._root = root
        self._jobs_of_uid = jobs_of_uid or (lambda: jobs_by_uid(Path("/proc"),
                                                                 lambda pid: job_of_pid(pid, Path("/proc"))))
        self._reads: dict[str, _Read] = {}
        self._counts = dict.fromkeys(OUTCOMES, 0)

    def _paths(self) -> list[str]:
        return sorted(glob(str(self._root / self._config.dump_glob.lstrip("/"))))[: self._config.max_files]

    def _read(self, path: str, previous: _Read | None) -> _Read | None:
        """The file's current read: ``previous`` if unchanged, else a fresh read (counted)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None  # gone, or a link (O_NOFOLLOW): a dump is a plain file the job wrote
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if previous is not None and previous.stamp == stamp:
                return previous
            match = _RANK_SUFFIX.search(os.path.basename(path))
            rank = int(match.group(1)) if match else -1
            base = {"stamp": stamp, "uid": st.st_uid, "rank": rank, "mtime": st.st_mtime}
            if not stat.S_ISREG(st.st_mode):
                return self._refuse(base, "not_a_file", path)
            if rank < 0 or rank >= RANK_MAX:
                return self._refuse(base, "bad_rank", path)
            if st.st_size > self._config.max_file_bytes:
                return self._refuse(base, "too_large", path)
            raw = f.read(self._config.max_file_bytes + 1)
        if len(raw) > self._config.max_file_bytes:
            return self._refuse(base, "too_large", path)
        try:
            groups = parse_dump(raw, rank)
        except DumpError as exc:
            log.warning("flight recorder dump %s refused: %s", path, exc)
            return self._refuse(base, exc.outcome, path)
        return _Read(groups=tuple(groups), refused=None, **base)  # type: ignore[arg-type]

    def _refuse(self, base: dict[str, Any], outcome: str, path: str) -> _Read:
        self._counts[outcome] += 1
        log.debug("flight recorder dump %s: %s", path, outcome)
        return _Read(groups=(), refused=outcome, **base)

    def collect(self, now: float) -> Collection:
        cfg = self._config
        reads: dict[str, _Read] = {}
        for path in self._paths():
            r = self._read(path, self._reads.get(path))
            if r is not None:
                reads[path] = r
        changed = [p for p, r in reads.items() if self._reads.get(p) is not r]
        self._reads = reads
        fresh = [(p, r) for p, r in reads.items() if r.refused is None and now - r.mtime <= cfg.fresh_seconds]
        jobs = self._jobs_of_uid() if fresh else {}
        states: list[CollectiveState] = []
        for path, r in fresh:
            owners = jobs.get(r.uid, {})
            job, ranks = next(iter(owners.items())) if len(owners) == 1 else (None, set())
            refused = None
            if job is None:
                refused = "ambiguous_job" if owners else "no_job"
            elif ranks and r.rank not in ranks:
                # The rank must be one a process of the job on this node declares, where any
                # declares one: a dump cannot speak for a rank that runs elsewhere.
                refused = "rank_not_here"
            if path in changed:  # counted once per new or changed file, as every outcome
                self._counts[refused or "read"] += 1
            if job is None or refused is not None:
                continue
            states.extend(_states(job, r, now))
        states = states[:COLLECTIVES_MAX]
        samples = [Sample.of(DUMPS, n, outcome=o) for o, n in self._counts.items()]
        samples.append(Sample.of(COLLECTIVES, len(states)))
        return Collection(samples=samples, report={"collectives": states})

    def close(self) -> None:
        pass


def _states(job: str, r: _Read, now: float) -> Iterable[CollectiveState]:
    for g in r.groups:
        yield CollectiveState(job=job[:256], rank=r.rank, group=g.group, group_size=g.group_size,
                              last_entered_seq=g.last_entered_seq, last_completed_seq=g.last_completed_seq,
                              op=g.op, stage=g.stage, size_bytes=g.size_bytes,  # type: ignore[arg-type]
                              dump_ts=min(max(0.0, r.mtime), now), reason="")


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = FlightRecorderConfig
DESCRIPTION = "PyTorch Flight Recorder dumps of the jobs on this node (off by default; docs/training.md)."


def build(config: AgentConfig, seams: Seams) -> FlightRecorderCollector:
    proc_root = seams.proc_root
    return FlightRecorderCollector(
        config.collectors.section("flight_recorder", FlightRecorderConfig),
        jobs_of_uid=lambda: jobs_by_uid(proc_root, lambda pid: job_of_pid(pid, proc_root)))
