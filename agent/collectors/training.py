"""Training collector: per-rank progress from heartbeats (fed to ``ingest`` with their sender) and tailed logs.

Emits last step, step and phase times, last progress time and window quantiles per job and rank;
contributes per-rank window summaries (``RankSummary``: progress, restarts, loss and gradient norm,
the latest announced checkpoint) to the Report; raises urgent ``hang`` and ``rank_exit`` events,
once per episode; and forwards the application error lines of followed logs (agent.app_log). Jobs
are keyed by the sender's scheduler identity (agent.attribution ``Sender``), never by the name a
heartbeat claims; a (job, rank) belongs to the first verified process that sends it while that
process lives. It owns no socket and reads no
/proc (the agent's server identifies the sender) and judges no slowness: comparing ranks and nodes
is the aggregator's work.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec
import psutil
from pydantic import Field, field_validator, model_validator

from vigil.agent.app_log import KINDS as APP_SIGNAL_KINDS
from vigil.agent.app_log import AppLogSignals
from vigil.agent.attribution import Sender, Trust, uid_key
from vigil.agent.collectors.collector import Collection, CollectorConfig, StrictModel
from vigil.agent.file_follower import FileFollower
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.step_log import LineError, StepLine, StepParser, compile_step_regex, make_parser
from vigil.contract.validation import HostPort, split_host_port
from vigil.contract.wire import Event, Heartbeat, JobPhase, RankSummary, WireError, convert

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

log = logging.getLogger(__name__)

PidAlive = Callable[[int], bool]


class LogFileConfig(StrictModel):
    """A training log to follow when the job cannot be changed to send heartbeats."""

    path: str
    format: Literal["megatron", "deepspeed", "regex"] = "megatron"
    regex: str | None = None  # format "regex": named groups step and step_seconds or step_ms
    job: str | None = Field(default=None, min_length=1, max_length=128)  # default: the file's stem
    # Megatron and DeepSpeed print on one rank only (the last, resp. rank 0), so one file is one rank.
    rank: int = Field(default=0, ge=0)
    gpu: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _regex_matches_format(self) -> LogFileConfig:
        if self.format == "regex":
            if self.regex is None:
                raise ValueError("format 'regex' needs a regex")
            compile_step_regex(self.regex)
        elif self.regex is not None:
            raise ValueError(f"regex is only used with format 'regex', not {self.format!r}")
        return self

    @property
    def job_name(self) -> str:
        return self.job or Path(self.path).stem or self.path


class TrainingConfig(CollectorConfig):
    # Heartbeats are taken in as they arrive (ingest); a cycle only summarises the window for
    # /metrics and the report, so it runs at the report cadence rather than every second.
    interval_seconds: float = Field(default=2.5, gt=0)
    # The node-local heartbeat address: UDP datagrams, and (http: true) POST /v1/heartbeat over TCP
    # on the same host:port, from loopback peers only. Neither carries the sender's identity
    # (see accept_unverified); the Unix socket does.
    udp_listen: HostPort = "127.0.0.1:9401"
    http: bool = True
    # UDP and HTTP heartbeats carry no sender identity: refused (counted, reason "unverified")
    # unless true; then keyed unverified/<name>, with their own job cap, never a scheduler's job.
    accept_unverified: bool = False
    # The heartbeat Unix datagram socket (the client's default: /run/vigil/heartbeat.sock). Every
    # datagram carries its sender's pid and uid as the kernel knows them (SCM_CREDENTIALS), and
    # the pid's cgroup names its Slurm job or pod: the job's key (docs/training.md "Job identity").
    unix_socket: str | None = None
    # The socket's mode; default 0666 (438): any local process may send, because what a sender
    # can claim is bound to its own verified process and job. 0660 with unix_socket_group
    # narrows who may send at all.
    unix_socket_mode: int = Field(default=0o666, ge=0, le=0o777)
    # The socket's group (a name or gid), with a unix_socket_mode such as 0660; unset: the agent's.
    unix_socket_group: str | None = None
    # A verified sender in no Slurm job or pod: refused (counted, "unscheduled"), or with by_uid
    # keyed uid/<uid>/<name> (bare-metal sites without a scheduler), with the unverified cap.
    unscheduled: Literal["refuse", "by_uid"] = "refuse"
    # The process table the sender's cgroup is read from; None: /proc (a containerised agent with
    # the host's /proc mounted elsewhere, or a test, sets it).
    proc_root: str | None = None
    # Summaries cover complete, non-overlapping windows of this length aligned on the clock
    # ([k*W, (k+1)*W)); each report carries the latest complete one and its end, so the
    # aggregator judges every window exactly once instead of re-reading a sliding window. 5 s
    # holds 2-5 steps per rank at the 1-2 s steps of large LLM jobs (16-40 samples per 8-rank
    # node), and three consecutive windows plus the window in progress, one collector cycle and
    # one report (5 + 15 + 2.5 + 2.5 s) keep a 10%-slow node's drain within the 30 s budget
    # (docs/detectors.md).
    window_seconds: float = Field(default=5.0, gt=0)
    # No step for this long while the process lives is a hang. PyTorch's NCCL process group
    # times out a stuck collective after 10 minutes by default (torch.distributed
    # init_process_group, timeout=timedelta(minutes=10)); 5 minutes flags the hang before NCCL
    # kills the job, and stays above the checkpoint saves and evaluations that pause steps for
    # a few minutes in large jobs.
    hang_seconds: float = Field(default=300.0, gt=0)
    # A rank not heard from for this long and not known to be alive is forgotten, so series of
    # finished jobs do not accumulate; longer than hang_seconds so a hang is reported first.
    evict_after_seconds: float = Field(default=900.0, gt=0)
    # Jobs per node from verified senders (a Slurm job or pod of this node, or a configured log
    # file); unverified and uid-keyed ones have their own, smaller cap and give way to verified
    # ranks when the node's rank table is full, so invented names never lock a real job out.
    max_jobs: int = Field(default=16, ge=1)
    # Jobs per node from unverified (accept_unverified) and uid-keyed senders, apart from
    # max_jobs: a few for a site's opted-in tools, never enough to matter to a real job.
    max_unverified_jobs: int = Field(default=4, ge=0)
    max_ranks: int = Field(default=256, ge=1)  # per node: 8 GPUs, with room for CPU-side ranks
    # One job's ranks on this node: 8 GPUs with up to 8 processes each (MPS, CPU-side ranks), so
    # one job cannot fill the node's rank table alone.
    max_ranks_per_job: int = Field(default=64, ge=1)
    max_steps_per_rank: int = Field(default=2048, ge=16)  # ring buffer for the window's quantiles
    max_payload_bytes: int = Field(default=4096, ge=256)
    log_files: list[LogFileConfig] = Field(default_factory=list)

    @field_validator("udp_listen")
    @classmethod
    def _valid_listen(cls, value: str) -> str:
        split_host_port(value)
        return value

    @property
    def udp_address(self) -> tuple[str, int]:
        return split_host_port(self.udp_listen)


REJECT_REASONS = ("too_large", "invalid_json", "not_object", "unknown_field", "schema", "bad_text",
                  "bad_job_name", "job_mismatch", "rank_taken", "too_many_jobs", "too_many_unverified_jobs",
                  "too_many_ranks", "too_many_ranks_per_job")
UNVERIFIED_KEY_PREFIX = "unverified/"
# A claimed name that has the shape of a job key: a Slurm job id, or one of the key prefixes. From a
# sender whose own key differs, it names someone else's job and is refused (job_mismatch).
_KEY_SHAPED = re.compile(r"^(?:\d+|(?:pod|uid|unverified)/.*)$")
# A name that becomes part of a key (unverified/<name>, uid/<uid>/<name>): plain characters only,
# no list separators, patterns, whitespace or '/' (a key's namespace separator).
_KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
PHASES = ("compute", "comm", "data")
# RankSummary's quantile fields, step then the phases: (p50, p90).
LOG_ERROR_REASONS = ("unreadable", "parse")
# Bytes of one training log read per cycle: a backlog (a log appended while the agent was down)
# is taken in 1 MiB steps, so one cycle stays short; the rest is read next cycle.
LOG_READ_BYTES = 1 << 20

_JR = ("job", "rank")
LAST_STEP = MetricSpec("vigil_training_last_step", MetricKind.GAUGE,
                       "Last step number reported by the rank.", labels=_JR)
STEP_SECONDS = MetricSpec("vigil_training_step_seconds", MetricKind.GAUGE,
                          "Duration of the rank's last reported step.", labels=_JR, unit="seconds")
PHASE_SECONDS = MetricSpec("vigil_training_phase_seconds", MetricKind.GAUGE,
                           "Time the rank's last step spent in a phase (compute, comm, data).",
                           labels=(*_JR, "phase"), unit="seconds")
WINDOW_STEP_SECONDS = MetricSpec("vigil_training_window_step_seconds", MetricKind.GAUGE,
                                 "Percentile (50, 90) of step duration over the summary window.",
                                 labels=(*_JR, "percentile"), unit="seconds")
LAST_PROGRESS = MetricSpec("vigil_training_last_progress_timestamp_seconds", MetricKind.GAUGE,
                           "Unix time at which the rank's step last advanced.", labels=_JR, unit="seconds")
RANK_STATE = MetricSpec("vigil_training_rank_state", MetricKind.GAUGE,
                        "1 for the rank's current state (running, hung, exited), 0 for the others.",
                        labels=(*_JR, "state"))
HEARTBEATS = MetricSpec("vigil_training_heartbeats_received_total", MetricKind.COUNTER,
                        "Heartbeats accepted from the rank.", labels=_JR)
REJECTED = MetricSpec("vigil_training_heartbeats_rejected_total", MetricKind.COUNTER,
                      "Heartbeats dropped, by reason (job_mismatch: the claimed job is not the sender's; "
                      "rank_taken: another live process owns the rank; bad_text: control characters or "
                      "unpaired surrogates; too_many_*: a cap).", labels=("reason",))
JOB_INFO = MetricSpec("vigil_training_job_info", MetricKind.INFO,
                      "A job tracked on this node: its key (Slurm job id, pod/<uid>, uid/<uid>/<name>, "
                      "unverified/<name>), how its sender was identified (trust), and the name its "
                      "heartbeats claim (a display label only).", labels=("job", "trust", "name"))
RANKS = MetricSpec("vigil_training_ranks", MetricKind.GAUGE, "Ranks currently tracked on this node.")
EVICTED = MetricSpec("vigil_training_ranks_evicted_total", MetricKind.COUNTER,
                     "Ranks forgotten after being idle for evict_after_seconds.")
LOG_LINES = MetricSpec("vigil_training_log_steps_total", MetricKind.COUNTER,
                       "Progress lines parsed from a followed log file.", labels=("path",))
LOG_ERRORS = MetricSpec("vigil_training_log_errors_total", MetricKind.COUNTER,
                        "Problems following a log file, by reason (unreadable, parse, and NCCL RAS report "
                        "lines refused: ras_malformed, ras_bad_host, ras_bad_rank, ras_too_many).",
                        labels=("path", "reason"))
LOG_ROTATIONS = MetricSpec("vigil_training_log_rotations_total", MetricKind.COUNTER,
                           "Times a followed log file was rotated or truncated.", labels=("path",))
LOG_SIGNALS = MetricSpec("vigil_training_log_signals_total", MetricKind.COUNTER,
                         "Application error lines matched in a followed log file, by kind (nccl_timeout, "
                         "cuda_error, nccl_warn, nccl_ras); forwarded as report events, repeats collapsed.",
                         labels=("path", "kind"))
LOSS = MetricSpec("vigil_training_loss", MetricKind.GAUGE,
                  "The rank's latest finite loss, as its heartbeats report it.", labels=_JR)
GRAD_NORM = MetricSpec("vigil_training_grad_norm", MetricKind.GAUGE,
                       "The rank's latest finite global gradient norm, as its heartbeats report it.", labels=_JR)
NONFINITE = MetricSpec("vigil_training_nonfinite_steps_total", MetricKind.COUNTER,
                       "Heartbeats of the rank whose loss or gradient norm was NaN or infinite.", labels=_JR)
CHECKPOINT_STEP = MetricSpec("vigil_training_checkpoint_step", MetricKind.GAUGE,
                             "The step the rank's latest completed announced checkpoint saved.", labels=_JR)
CHECKPOINT_TS = MetricSpec("vigil_training_checkpoint_timestamp_seconds", MetricKind.GAUGE,
                           "Unix time at which the rank's latest announced checkpoint ended.", labels=_JR,
                           unit="seconds")
CHECKPOINT_SECONDS = MetricSpec("vigil_training_checkpoint_duration_seconds", MetricKind.GAUGE,
                                "How long the rank's latest announced checkpoint took.", labels=_JR,
                                unit="seconds")

SPECS = (LAST_STEP, STEP_SECONDS, PHASE_SECONDS, WINDOW_STEP_SECONDS, LAST_PROGRESS, RANK_STATE, HEARTBEATS,
         REJECTED, JOB_INFO, RANKS, EVICTED, LOG_LINES, LOG_ERRORS, LOG_ROTATIONS, LOG_SIGNALS, LOSS, GRAD_NORM,
         NONFINITE, CHECKPOINT_STEP, CHECKPOINT_TS, CHECKPOINT_SECONDS)

_HEARTBEAT_FIELDS = frozenset(Heartbeat.__struct_fields__)
# RankSummary's application-signal fields, as ``_signal_fields`` fills them.
_SIGNAL_FIELDS = ("loss_p50", "loss_last", "grad_norm_p50", "grad_norm_max", "nonfinite_steps",
                  "nonfinite_first_step", "nonfinite_loss_steps")
_replace = msgspec.structs.replace
# Missing three of its usual progress intervals in a row is not jitter.
HANG_GAP_FACTOR = 3.0


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")  # json accepts NaN/Infinity unless told not to


def _signals(state: _Rank, record: _Record) -> None:
    """Take in a heartbeat's loss and gradient norm (at least one is present)."""
    state.signals = True
    loss, norm = record.loss, record.grad_norm
    if isinstance(loss, str) or isinstance(norm, str):
        state.nonfinite += 1
    if isinstance(loss, float):
        state.last_loss = loss
    if isinstance(norm, float):
        state.last_grad_norm = norm


def _checkpointed(summary: RankSummary, ckpt: _Checkpoint | None) -> RankSummary:
    """``summary`` with ``ckpt`` as its latest checkpoint (None: none)."""
    if ckpt is None:
        return _replace(summary, checkpoint_step=None, checkpoint_ts=None, checkpoint_seconds=None)
    return _replace(summary, checkpoint_step=ckpt.step, checkpoint_ts=ckpt.ts, checkpoint_seconds=ckpt.seconds)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def p50_p90(sorted_values: Sequence[float]) -> tuple[float, float]:
    """``percentile`` at 0.5 and 0.9, the same floats in one call. A window of one value (the
    simulator's usual one heartbeat per rank and report, or a slow job's single step) is that
    value plus 0.0, as percentile's arithmetic gives it (-0.0 becomes 0.0). Inlined rather than
    two calls of ``percentile``: four of these run per rank and cycle (the simulator: 8,000 ranks
    a cycle), and the calls were most of their cost; tests/agent/collectors/test_training_incremental.py
    holds them equal."""
    n = len(sorted_values)
    if n == 1:
        only = sorted_values[0] + 0.0
        return only, only
    if n == 0:
        raise ValueError("percentile of no values")
    last = n - 1
    pos = last * 0.5
    lo = int(pos)  # floor: pos >= 0
    a = sorted_values[lo]
    p50 = a + (sorted_values[lo + 1 if lo < last else last] - a) * (pos - lo)
    pos = last * 0.9
    lo = int(pos)
    a = sorted_values[lo]
    return p50, a + (sorted_values[lo + 1 if lo < last else last] - a) * (pos - lo)


@dataclass(slots=True)
class _Record:
    ts: float
    step: int
    step_seconds: float | None
    compute_seconds: float | None
    comm_seconds: float | None
    data_seconds: float | None
    # "checkpointing" / "evaluating" as the client says (its own, longer limits at the
    # aggregator); None: training.
    phase: str | None = None
    # The step's loss and gradient norm: a float, or "nan"/"inf"/"-inf" (wire NonFinite).
    loss: float | str | None = None
    grad_norm: float | str | None = None


@dataclass(slots=True)
class _Checkpoint:
    """A completed announced checkpoint: the step it saved, when it ended (agent clock), how long."""

    step: int
    ts: float
    seconds: float


@dataclass(slots=True)
class _Rank:
    job: str
    rank: int
    gpu: int | None
    pid: int | None
    last: _Record
    trust: Trust
    # The kernel-verified process that owns this (job, rank) while it lives (None: unverified).
    owner_pid: int | None
    last_progress_ts: float
    last_seen_ts: float
    history: deque[_Record]
    # Seconds between the last two advances: a log printed every 100 iterations advances rarely.
    progress_gap: float = 0.0
    received: int = 0
    # Step reached before the oldest record in history: the baseline for "steps in window".
    baseline_step: int | None = None
    state: Literal["running", "hung", "exited"] = "running"
    hang_reported: bool = False
    exit_reported: bool = False
    # The checkpoint in progress (when its announcement arrived, the step it repeats) and the
    # latest one that ended: a heartbeat whose phase is not "checkpointing" ends it.
    saving_since: float | None = None
    saving_step: int = 0
    checkpoint: _Checkpoint | None = None
    # Application signals: the latest finite loss and gradient norm, and every heartbeat whose
    # loss or gradient norm was NaN or infinite (a counter); signals: the rank sent either once.
    last_loss: float | None = None
    last_grad_norm: float | None = None
    nonfinite: int = 0
    signals: bool = False
    # Records that left history from its old end (trimmed, or pushed out of the ring): with the
    # window's end, what decides whether ``window`` still holds (``TrainingCollector._summary``).
    dropped: int = 0
    # The latest complete window's summary fields, as computed: (window end, ``dropped`` then,
    # whether a record at or after the end was in history then, history's length then, fields).
    window: tuple[float, int, bool, int, dict[str, Any]] | None = None
    # This rank's sample label tuples, built once (``TrainingCollector._samples``).
    labels: _RankLabels | None = None
    # The samples built from ``last`` (its record, and what only a record changes: progress,
    # heartbeats, signals, checkpoint), as (that record, samples before the window's quantiles,
    # after them), and the window's two quantile samples with their values: reused while those
    # are unchanged (``TrainingCollector._samples``).
    sampled: tuple[_Record, tuple[Sample, ...], tuple[Sample, ...]] | None = None
    window_samples: tuple[float, float, tuple[Sample, Sample]] | None = None
    # The rank's summary with only what never changes set (job, rank, window width): each cycle's
    # summary is a copy of it (``TrainingCollector._summary``).
    template: RankSummary | None = None
    # The rank's last summary and what it was built from: (the window's fields dict, ``last``,
    # state, gpu, pid, last progress, checkpoint), compared by identity for the objects. Reused
    # whole while all of them are unchanged; copied with the rank's own fields while only the
    # window's fields are (``TrainingCollector._summary``).
    summary: RankSummary | None = None
    summary_of: tuple[dict[str, Any], _Record, str, int | None, int | None, float, _Checkpoint | None] | None = None


@dataclass(frozen=True, slots=True)
class _RankLabels:
    """A rank's label tuples in the specs' label order (job, rank, then the extra label)."""

    jr: tuple[tuple[str, str], ...]
    phases: tuple[tuple[tuple[str, str], ...], ...]  # compute, comm, data
    p50: tuple[tuple[str, str], ...]
    p90: tuple[tuple[str, str], ...]
    # Per state, the rank's three state samples (1 for its state, 0 for the others): they change
    # only when the state does.
    states: dict[str, tuple[Sample, ...]]

    @staticmethod
    def of(job: str, rank: int) -> _RankLabels:
        jr = (("job", job), ("rank", str(rank)))
        states = ("running", "hung", "exited")
        return _RankLabels(jr, tuple((*jr, ("phase", p)) for p in PHASES), (*jr, ("percentile", "50")),
                           (*jr, ("percentile", "90")),
                           {now: tuple(Sample(RANK_STATE.name, 1.0 if st == now else 0.0, (*jr, ("state", st)))
                                       for st in states) for now in states})

    def state_samples(self, state: str) -> tuple[Sample, ...]:
        return self.states[state]


@dataclass(slots=True)
class _Tail:
    config: LogFileConfig
    follower: FileFollower
    parser: StepParser
    signals: AppLogSignals
    steps: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOG_ERROR_REASONS, 0))


_VERIFIED: frozenset[Trust] = frozenset(("scheduler", "in_process"))
# Refusals that say someone tried to speak for another job or rank, or to forge text: logged.
_LOGGED_REASONS = frozenset(("job_mismatch", "rank_taken", "bad_text", "too_many_unverified_jobs"))


def job_key_of(claim: str, sender: Sender) -> tuple[str, str] | str:
    """(job key, display name) for a heartbeat that claims job ``claim``, or the refusal reason.

    A scheduler-identified sender's job is its scheduler's (the claim, if it is a free name such
    as a torchrun run id, is kept as the display name only; one naming another job is refused).
    A uid-keyed or unverified sender's key is its plain name in its own namespace. Configuration
    (log files) and the simulator name their jobs themselves."""
    trust = sender.trust
    if trust == "in_process":
        return claim, ""
    if trust == "scheduler" and sender.job is not None:
        if claim == sender.job:
            return claim, ""
        return "job_mismatch" if _KEY_SHAPED.match(claim) else (sender.job, claim)
    if _KEY_SHAPED.match(claim):
        return "job_mismatch"
    if not _KEY_NAME.match(claim):
        return "bad_job_name"
    if trust == "uid" and sender.uid is not None:
        return uid_key(sender.uid, claim), claim
    if trust == "unverified":
        return UNVERIFIED_KEY_PREFIX + claim, claim
    return "job_mismatch"  # a verified sender without its identity: never keyed by its claim


# job_key_of's answers for the (claim, trust, scheduler job, uid) seen lately (all of a sender it
# reads): a rank sends the same ones every step, and two regular expressions a heartbeat were a
# tenth of its Python path; the tuple is hashed in C, where a Sender's dataclass __hash__ was a
# Python call per datagram. Bounded: cleared when full, so invented names cost a recomputation,
# never memory.
_KEYED_MAX = 1024
_keyed: dict[tuple[str, Trust, str | None, int | None], tuple[str, str] | str] = {}


def _job_key_of_seen(claim: str, sender: Sender) -> tuple[str, str] | str:
    """``job_key_of(claim, sender)``, remembered (it is a pure function of the claim and the
    sender's trust, job and uid)."""
    seen = (claim, sender.trust, sender.job, sender.uid)
    keyed = _keyed.get(seen)
    if keyed is None:
        keyed = job_key_of(claim, sender)
        if len(_keyed) >= _KEYED_MAX:
            _keyed.clear()
        _keyed[seen] = keyed
    return keyed


# The strict heartbeat decoding as one C call (wire.decode's lookup of its decoder was a Python
# frame per datagram).
_DECODE_HEARTBEAT = msgspec.json.Decoder(Heartbeat).decode


def decode_heartbeat(payload: bytes) -> Heartbeat | str:
    """``payload`` as a Heartbeat, or the reason it is refused (invalid_json, not_object,
    unknown_field, schema, bad_text). The common case is one strict msgspec decode in C (unknown
    fields, types, bounds: 1e999 is out of every bound); anything it refuses is classified again
    by ``decode_heartbeat_by_steps``, the reference, so every refusal keeps the reason the
    step-by-step checks give (msgspec stops at the first problem it meets, which may not be the
    one those checks name first) and what only json accepts (a UTF-8 byte-order mark, an escaped
    lone surrogate, refused as bad_text) is judged as before. A datagram cost 2.5x a bare
    receiver's with json.loads, a dict and a conversion on every one (bench/bench_heartbeat.py)."""
    try:
        hb = _DECODE_HEARTBEAT(payload)
    except (WireError, ValueError, RecursionError):  # ValueError: msgspec's UnicodeDecodeError
        return decode_heartbeat_by_steps(payload)
    return hb if hb.job.isprintable() else "bad_text"


def decode_heartbeat_by_steps(payload: bytes) -> Heartbeat | str:
    """The reference decoding, check by check in the order the reasons are named."""
    try:
        data = json.loads(payload, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "invalid_json"
    if not isinstance(data, dict):
        return "not_object"
    if not data.keys() <= _HEARTBEAT_FIELDS:
        return "unknown_field"
    try:
        hb = convert(data, Heartbeat)
    except WireError:
        return "schema"
    # json reads 1e999 as infinity, which passes a `ge=0` bound.
    if not all(math.isfinite(v) for v in (hb.step_seconds, hb.compute_seconds, hb.comm_seconds,
                                          hb.data_seconds) if v is not None):
        return "schema"
    # A newline, an ANSI escape or an unpaired surrogate (which no exposition can encode) in the
    # one free-text field: refused here, so it never reaches a label, a log line or a cycle.
    if not hb.job.isprintable():
        return "bad_text"
    return hb


class TrainingCollector:
    name = "training"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: TrainingConfig, *, pid_alive: PidAlive = psutil.pid_exists,
                 samples: bool = True) -> None:
        self._config = config
        self._max_payload_bytes = config.max_payload_bytes  # read once a heartbeat
        self._pid_alive = pid_alive
        # False: ``collect`` builds no /metrics samples, only the report's summaries and the events
        # (the simulator's healthy-fleet statistics, which never scrape: docs/simulator.md).
        self._build_samples = samples
        self._lock = threading.Lock()  # ingest runs on the server's thread, collect on a worker
        self._ranks: dict[tuple[str, int], _Rank] = {}
        self._names: dict[str, str] = {}  # job key -> the free name its heartbeats claim (a label)
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        # The samples of ``_rejected`` as of the counts they were built from (``_samples``).
        self._rejected_samples: tuple[dict[str, int], list[Sample]] | None = None
        self._evicted = 0
        self._tails = [
            _Tail(lf, FileFollower(lf.path, max_bytes=LOG_READ_BYTES), make_parser(lf.format, lf.regex),
                  AppLogSignals(lf.job_name))
            for lf in config.log_files
        ]

    @property
    def config(self) -> TrainingConfig:
        return self._config

    def ingest(self, payload: bytes, now: float, sender: Sender) -> str | None:
        """Accept one heartbeat (a datagram or an HTTP body) from ``sender``. Thread-safe.

        Returns None when accepted, else the reason it was dropped (also counted).

        The usual heartbeat (a known rank's next step from its own process, no checkpoint, no loss)
        costs three Python frames (this, decode_heartbeat, ``_step``); everything else goes the
        long way (``_observe``), which keeps the whole of the rules. Each call, attribute and
        frame is paid at a cold cache once per datagram: with a frame per step of the path
        (ingest, _ingest, decode, the cached job key, a Sender hash, _observe, _checkpoint) the
        agent's CPU per heartbeat was 1.40-1.63x a bare asyncio receiver's (bench_heartbeat).
        """
        if len(payload) > self._max_payload_bytes:
            return self._refused("too_large", sender)
        hb = decode_heartbeat(payload)
        if isinstance(hb, str):
            return self._refused(hb, sender)
        claim = hb.job
        keyed = _keyed.get((claim, sender.trust, sender.job, sender.uid))
        if keyed is None:
            keyed = _job_key_of_seen(claim, sender)
        if isinstance(keyed, str):
            return self._refused(keyed, sender)
        key, name = keyed
        # A verified sender's pid is the kernel's (in the agent's pid namespace); the claimed one
        # is what the process believes (its own namespace's) and is used only when unverified.
        owner = sender.pid
        pid = owner if owner is not None else hb.pid
        phase = hb.phase
        record = _Record(now, hb.step, hb.step_seconds, hb.compute_seconds, hb.comm_seconds, hb.data_seconds,
                         None if phase is None or phase == "training" else phase, hb.loss, hb.grad_norm)
        rank = hb.rank
        with self._lock:
            state = self._ranks.get((key, rank))
            if (state is None or (owner is not None and owner != state.owner_pid)
                    or (pid is not None and pid != state.pid) or state.saving_since is not None
                    or phase == "checkpointing" or record.loss is not None or record.grad_norm is not None):
                reason = self._observe(key, rank, hb.gpu, pid, record, heartbeat=True, trust=sender.trust,
                                       owner=owner, name=name)
            else:
                reason = None
                self._step(state, record, hb.gpu, key, name)
        return None if reason is None else self._refused(reason, sender)  # counted outside the lock

    def _step(self, state: _Rank, record: _Record, gpu: int | None, key: str, name: str) -> None:
        """``_observe``'s steps for a known rank's heartbeat from its own process with no checkpoint
        to follow and no application signal (the caller holds the lock)."""
        # Less those that cannot apply here (a new owner or process, a checkpoint, application
        # signals): tests/agent/collectors/test_training_ingest_fast.py holds the two to the same
        # state over random streams.
        now = record.ts
        if record.step != state.last.step:
            if not state.hang_reported:
                state.progress_gap = now - state.last_progress_ts
            state.last_progress_ts = now
            state.hang_reported = False
        if gpu is not None:
            state.gpu = gpu
        state.last = record
        state.last_seen_ts = now
        if name:
            self._names[key] = name
        state.received += 1
        history = state.history
        if len(history) == history.maxlen:
            state.baseline_step = history[0].step
            state.dropped += 1
        history.append(record)

    def _refused(self, reason: str, sender: Sender) -> str:
        """Count (and the first time, for a reason that names someone, log) a refused heartbeat."""
        with self._lock:
            first = self._rejected[reason] == 0
            self._rejected[reason] += 1
        if first and reason in _LOGGED_REASONS:  # once per reason: a flood must not become a log flood
            log.warning("heartbeat refused (%s) from pid %s uid %s (%s); further refusals are only counted "
                        "in %s", reason, sender.pid, sender.uid, sender.trust, REJECTED.name)
        return reason

    def _observe(self, job: str, rank: int, gpu: int | None, pid: int | None, record: _Record, *,
                 heartbeat: bool, trust: Trust, owner: int | None = None, name: str = "") -> str | None:
        key = (job, rank)
        state = self._ranks.get(key)
        if state is None:
            refused = self._admit(job, trust)
            if refused is not None:
                return refused
            state = _Rank(job=job, rank=rank, gpu=gpu, pid=pid, last=record, trust=trust, owner_pid=owner,
                          last_progress_ts=record.ts, last_seen_ts=record.ts,
                          history=deque(maxlen=self._config.max_steps_per_rank))
            self._ranks[key] = state
            self._checkpoint(state, record)
        else:
            if owner is not None and owner != state.owner_pid:
                # The rank is its first verified process's while that process lives; after it
                # exits, the next one (a restart) takes the rank over.
                if state.owner_pid is not None and self._alive(state.owner_pid):
                    return "rank_taken"
                state.owner_pid = owner
            if record.step != state.last.step:
                # Any change counts as progress: a lower step is a restart from a checkpoint.
                if not state.hang_reported:  # a hang's stall is not the rank's usual pace
                    state.progress_gap = record.ts - state.last_progress_ts
                state.last_progress_ts = record.ts
                state.hang_reported = False
            if pid is not None and pid != state.pid:
                state.exit_reported = False  # a new process for this rank: a new episode
                state.saving_since = None  # a save its process did not live to end is no checkpoint
            elif record.step < state.last.step:
                state.saving_since = None  # nor one the job restarted from an older checkpoint during
            self._checkpoint(state, record)
            state.pid = pid if pid is not None else state.pid
            state.gpu = gpu if gpu is not None else state.gpu
            state.last = record
            state.last_seen_ts = record.ts
        if name:
            self._names[job] = name  # one per tracked job: dropped with its last rank
        if record.loss is not None or record.grad_norm is not None:
            _signals(state, record)
        if heartbeat:
            state.received += 1
        if len(state.history) == state.history.maxlen:
            state.baseline_step = state.history[0].step
            state.dropped += 1
        state.history.append(record)
        return None

    @staticmethod
    def _checkpoint(state: _Rank, record: _Record) -> None:
        """Follow the rank's announced checkpoints: one starts at a "checkpointing" heartbeat
        (repeating the last step, the one saved) and ends at the next heartbeat in any other phase
        (the client's return to training, or its next step if that announcement was lost)."""
        if record.phase == "checkpointing":
            if state.saving_since is None:
                state.saving_since, state.saving_step = record.ts, record.step
        elif state.saving_since is not None:
            state.checkpoint = _Checkpoint(state.saving_step, record.ts, max(0.0, record.ts - state.saving_since))
            state.saving_since = None

    def _admit(self, job: str, trust: Trust) -> str | None:
        """None if a new rank of ``job`` fits the node's caps, else the reason it does not. Caps
        are counted per trust: unverified jobs never fill the verified jobs' slots, and give way."""
        verified = trust in _VERIFIED
        same_tier = {j for (j, _), r in self._ranks.items() if (r.trust in _VERIFIED) == verified}
        if job not in same_tier:
            if verified and len(same_tier) >= self._config.max_jobs:
                return "too_many_jobs"
            if not verified and len(same_tier) >= self._config.max_unverified_jobs:
                return "too_many_unverified_jobs"
        if sum(1 for j, _ in self._ranks if j == job) >= self._config.max_ranks_per_job:
            return "too_many_ranks_per_job"
        if len(self._ranks) >= self._config.max_ranks and not (verified and self._evict_one_unverified()):
            return "too_many_ranks"
        return None

    def _evict_one_unverified(self) -> bool:
        """Forget the unverified rank heard from least recently, for a verified one. False if none."""
        unverified = [(r.last_seen_ts, key) for key, r in self._ranks.items() if r.trust not in _VERIFIED]
        if not unverified:
            return False
        _, key = min(unverified)
        del self._ranks[key]
        self._evicted += 1
        return True

    def _alive(self, pid: int) -> bool:
        try:
            return bool(self._pid_alive(pid))
        except Exception as exc:  # noqa: BLE001 - an unknown answer keeps the owner
            log.warning("pid check for %s failed: %s", pid, exc)
            return True

    def collect(self, now: float) -> Collection:
        self._read_logs(now)
        events: list[Event] = [ev for tail in self._tails for ev in tail.signals.drain(now)]
        start, end = self._window(now)
        hang_seconds = self._config.hang_seconds
        pid_alive = self._pid_alive
        summary = self._summary
        summaries: list[RankSummary] = []
        with self._lock:
            # Eviction first, on its own: its pid check may raise (the cycle fails), and it must do
            # so before any rank's hang or exit is marked reported, or that event would be lost.
            self._evict(now)
            ranks = list(self._ranks.values())
            # Then one pass per rank (trim, watch, summary) in the order the separate passes took:
            # each step reads only its own rank, so the outcome is the same; the usual rank
            # (history already trimmed, alive and advancing) costs no call beyond its pid check
            # and its summary (8,000 ranks a cycle in the simulator).
            # tests/agent/collectors/test_training_cycle.py holds it to the separate passes.
            for r in ranks:
                hist = r.history
                if hist and hist[0].ts < start:
                    self._trim(r, start)
                alive = True
                pid = r.pid
                if pid is not None:
                    try:
                        alive = pid_alive(pid)
                    except Exception as exc:  # noqa: BLE001 - an unknown answer is not an exit
                        log.warning("pid check for %s failed: %s", pid, exc)
                if alive and (r.last.phase is not None or now - r.last_progress_ts < hang_seconds):
                    r.state = "running"  # _watch's answer without its thresholds: not stalled long enough
                else:
                    self._watch(r, now, events, alive)
                summaries.append(summary(r, end))
            samples = self._samples(ranks, summaries) if self._build_samples else []
            tracked = {r.job for r in ranks}
            for job in [j for j in self._names if j not in tracked]:
                del self._names[job]
        return Collection(samples=samples, events=events, report={"ranks": summaries})

    def _read_logs(self, now: float) -> None:
        for tail in self._tails:
            try:
                lines = tail.follower.read_lines()
            except FileNotFoundError:
                continue  # not there yet (or rotated away and not recreated): nothing new, no error
            except OSError as exc:
                tail.errors["unreadable"] += 1
                log.warning("training log %s: %s", tail.config.path, exc)
                continue
            for line in lines:
                tail.signals.feed(line, now)  # an error line is never a progress line: both look
                try:
                    parsed = tail.parser.feed(line)
                except LineError as exc:
                    tail.errors["parse"] += 1
                    log.debug("training log %s: %s", tail.config.path, exc)
                    continue
                if parsed is not None:
                    tail.steps += 1
                    self._observe_line(tail.config, parsed, now)

    def _observe_line(self, lf: LogFileConfig, line: StepLine, now: float) -> None:
        record = _Record(now, line.step, line.step_seconds, line.compute_seconds, line.comm_seconds,
                         line.data_seconds)
        with self._lock:
            reason = self._observe(lf.job_name, lf.rank, lf.gpu, None, record, heartbeat=False,
                                   trust="in_process")
            if reason is not None:
                # Counted like a heartbeat over the limits, so the operator sees the same reason.
                self._rejected[reason] += 1

    def _evict(self, now: float) -> None:
        evict_after = self._config.evict_after_seconds
        for key, r in list(self._ranks.items()):
            idle = now - r.last_seen_ts
            # Never before its hang could be reported and seen for a while (evict_after first: the
            # floor of that bound, and what a rank heard from lately is below).
            if idle < evict_after or idle < max(evict_after, 2 * self._hang_threshold(r)):
                continue
            # A hung rank whose process still lives stays: forgetting it would look like recovery.
            if r.pid is not None and r.state != "exited" and self._pid_alive(r.pid):
                continue
            del self._ranks[key]
            self._evicted += 1

    def _window(self, now: float) -> tuple[float, float]:
        """The latest complete summary window [start, end) at ``now``."""
        width = self._config.window_seconds
        end = math.floor(now / width) * width
        return end - width, end

    @staticmethod
    def _trim(r: _Rank, start: float) -> None:
        """Drop the records before the window that starts at ``start`` from the rank's history."""
        hist = r.history
        while hist and hist[0].ts < start:
            r.baseline_step = hist.popleft().step
            r.dropped += 1

    def _watch(self, r: _Rank, now: float, events: list[Event], alive: bool) -> None:
        """The rank's state at ``now``, its process ``alive`` (pid_alive's answer, True when
        unknown); a hang or an exit, the first time, goes into ``events``."""
        if not alive:
            r.state = "exited"
            if not r.exit_reported:
                r.exit_reported = True
                events.append(Event(kind="rank_exit", ts=now, urgent=True, source="heartbeat", job=r.job,
                                    rank=r.rank, gpu=r.gpu,
                                    message=f"process {r.pid} of rank {r.rank} is gone at step {r.last.step}"))
        elif (r.last.phase is None and now - r.last_progress_ts >= self._config.hang_seconds
              and now - r.last_progress_ts >= self._hang_threshold(r)):  # the first: the threshold's floor
            r.state = "hung"
            if not r.hang_reported:
                r.hang_reported = True
                stalled = now - r.last_progress_ts
                events.append(Event(kind="hang", ts=now, urgent=True, source="heartbeat", job=r.job,
                                    rank=r.rank, gpu=r.gpu,
                                    message=f"rank {r.rank} has not advanced past step {r.last.step} "
                                            f"for {stalled:.0f} s"))
        else:
            r.state = "running"

    def _hang_threshold(self, r: _Rank) -> float:
        # A rank that normally advances less often than hang_seconds (a log line every N
        # iterations, very long steps) is hung only after missing a few of its own beats.
        return max(self._config.hang_seconds, HANG_GAP_FACTOR * r.progress_gap)

    def _summary(self, r: _Rank, end: float) -> RankSummary:
        """The rank's summary for the report, of the complete window that ends at ``end``.

        Built as a copy of the rank's own template (its job, rank and window width; every other
        field its default) with every field this cycle decides given by name: the same Struct as
        ``RankSummary(...)`` with these fields, at a fraction of its cost (msgspec's keyword
        constructor of a 31-field Struct took 2.6-3.5 us with the window's fields spread in).
        It is copied twice, the window's fields then the rank's own: msgspec's ``structs.replace``
        took 0.3 us with 14 keywords and 0.9-1.1 us with 15 to 17 (a cliff, measured on this
        build), so two copies of 11 and 6 cost half of one of 17.
        tests/agent/collectors/test_training_window.py holds the two equal.

        What the summary is built from is kept with it: while none of it changed (a rank heard
        from less than once a cycle: at 2.5 s reports the simulator's ranks are in about three
        cycles of four, and a 5 s window is summarised twice: 13% of its summaries) the last
        summary is the answer, and while only the rank's own fields did (a heartbeat in the
        window in progress) it is the base of the second copy, the window's fields kept.
        Summaries are never changed once built, so sharing one between reports is safe.
        tests/agent/collectors/test_training_cycle.py holds both to a summary built afresh."""
        fields = self._window_fields(r, end)
        last = r.last
        ckpt = r.checkpoint
        built = r.summary_of
        base = r.summary
        if built is not None and built[0] is fields and base is not None:
            if (built[1] is last and built[2] == r.state and built[3] == r.gpu and built[4] == r.pid
                    and built[5] == r.last_progress_ts and built[6] is ckpt):
                return base
            base_ckpt = built[6]
        else:
            template = r.template
            if template is None:
                template = r.template = RankSummary(job=r.job, rank=r.rank, window_seconds=self._config.window_seconds,
                                                    steps=0, last_step=0, last_progress_ts=0.0)
            get = fields.get
            base = _replace(
                template, window_end_ts=end, steps=fields["steps"],
                step_seconds_p50=get("step_seconds_p50"), step_seconds_p90=get("step_seconds_p90"),
                compute_seconds_p50=get("compute_seconds_p50"), compute_seconds_p90=get("compute_seconds_p90"),
                comm_seconds_p50=get("comm_seconds_p50"), comm_seconds_p90=get("comm_seconds_p90"),
                data_seconds_p50=get("data_seconds_p50"), data_seconds_p90=get("data_seconds_p90"),
                first_step=fields["first_step"])
            if "nonfinite_steps" in fields:  # the window's application signals (_signal_fields)
                base = _replace(base, **{k: fields[k] for k in _SIGNAL_FIELDS})
            base_ckpt = None  # the template's: none
        summary = _replace(base, gpu=r.gpu, pid=r.pid, state=r.state, last_step=last.step,
                           last_progress_ts=r.last_progress_ts, phase=cast("JobPhase | None", last.phase))
        if ckpt is not base_ckpt:
            summary = _checkpointed(summary, ckpt)
        r.summary = summary
        r.summary_of = (fields, last, r.state, r.gpu, r.pid, r.last_progress_ts, ckpt)
        return summary

    @staticmethod
    def _window_fields(r: _Rank, end: float) -> dict[str, Any]:
        """The complete window's steps and quantiles: what the records before ``end`` say. History
        holds the complete window then the one in progress (``_trim``); only the complete window
        is summarised, so consecutive summaries share no step. Records only join history at its
        new end, so while none has left its old end (``dropped``) the window's records are the
        same as when last computed if one at or after ``end`` was already there (the scan stops
        at it), or if the first to join since is at or after ``end``, or if none has joined:
        then the fields computed then stand (a report interval shorter than the window
        summarises each window more than once)."""
        hist = r.history
        cached = r.window
        if cached is not None and cached[0] == end and cached[1] == r.dropped:
            closed, n = cached[2], cached[3]
            if closed or n == len(hist) or hist[n].ts >= end:
                return cached[4]
        if hist:  # a window of one record without signals: the loop's result, without its lists
            rec = hist[0]
            if rec.ts < end and (len(hist) == 1 or hist[1].ts >= end) and rec.loss is None and rec.grad_norm is None:
                one = TrainingCollector._one_record_fields(r.baseline_step, rec)
                r.window = (end, r.dropped, len(hist) > 1, len(hist), one)
                return one
            # Two records without signals (the simulator's other usual window: a 3.4 s step in a
            # 5 s window holds one or two): the loop's result without its lists and sorts.
            if (len(hist) > 1 and rec.ts < end and hist[1].ts < end and (len(hist) == 2 or hist[2].ts >= end)
                    and rec.loss is None and rec.grad_norm is None and hist[1].loss is None
                    and hist[1].grad_norm is None):
                two = TrainingCollector._two_record_fields(r.baseline_step, rec, hist[1])
                r.window = (end, r.dropped, len(hist) > 2, len(hist), two)
                return two
        # One pass over the window into one list per phase: this runs for every rank every cycle
        # (8,000 ranks a cycle in the simulator), so the loop reads each field once and the rare
        # application signals are gathered by a second pass only when a record carries one.
        steps = 0
        prev = r.baseline_step
        first_step: int | None = None
        step_v: list[float] = []
        compute_v: list[float] = []
        comm_v: list[float] = []
        data_v: list[float] = []
        signals = False
        closed = False
        in_window = 0
        for rec in hist:
            if rec.ts >= end:
                closed = True
                break
            in_window += 1
            step = rec.step
            if prev is None:
                steps += 1  # the first step ever seen
            elif step > prev:
                steps += step - prev
            prev = step
            if first_step is None or step < first_step:
                first_step = step  # below an earlier window's last step: the job restarted
            if not signals and (rec.loss is not None or rec.grad_norm is not None):
                signals = True
            value = rec.step_seconds
            if value is not None and rec.phase is None:  # a phase announcement is no step
                step_v.append(value)
            value = rec.compute_seconds
            if value is not None:
                compute_v.append(value)
            value = rec.comm_seconds
            if value is not None:
                comm_v.append(value)
            value = rec.data_seconds
            if value is not None:
                data_v.append(value)
        fields: dict[str, Any] = {"steps": steps, "first_step": first_step}
        if step_v:
            step_v.sort()
            fields["step_seconds_p50"], fields["step_seconds_p90"] = p50_p90(step_v)
        if compute_v:
            compute_v.sort()
            fields["compute_seconds_p50"], fields["compute_seconds_p90"] = p50_p90(compute_v)
        if comm_v:
            comm_v.sort()
            fields["comm_seconds_p50"], fields["comm_seconds_p90"] = p50_p90(comm_v)
        if data_v:
            data_v.sort()
            fields["data_seconds_p50"], fields["data_seconds_p90"] = p50_p90(data_v)
        if signals:
            TrainingCollector._signal_fields(hist, in_window, fields)
        r.window = (end, r.dropped, closed, len(hist), fields)
        return fields

    @staticmethod
    def _one_record_fields(baseline_step: int | None, rec: _Record) -> dict[str, Any]:
        """``_window_fields`` of a window that holds the one record ``rec``, without application
        signals: what the loop and ``p50_p90`` give for it, without the lists, sorts and calls
        (each quantile of one value is that value plus 0.0, so -0.0 becomes 0.0). The simulator's
        ranks send about one heartbeat a window (8,000 ranks a cycle at 1,000 nodes); the window
        tests hold the two equal over random histories."""
        step = rec.step
        fields: dict[str, Any] = {
            "steps": 1 if baseline_step is None else step - baseline_step if step > baseline_step else 0,
            "first_step": step}
        value = rec.step_seconds
        if value is not None and rec.phase is None:  # a phase announcement is no step
            fields["step_seconds_p50"] = fields["step_seconds_p90"] = value + 0.0
        value = rec.compute_seconds
        if value is not None:
            fields["compute_seconds_p50"] = fields["compute_seconds_p90"] = value + 0.0
        value = rec.comm_seconds
        if value is not None:
            fields["comm_seconds_p50"] = fields["comm_seconds_p90"] = value + 0.0
        value = rec.data_seconds
        if value is not None:
            fields["data_seconds_p50"] = fields["data_seconds_p90"] = value + 0.0
        return fields

    @staticmethod
    def _two_record_fields(baseline_step: int | None, a: _Record, b: _Record) -> dict[str, Any]:
        """``_window_fields`` of a window that holds the two records ``a`` then ``b``, without
        application signals: the loop's steps and first step, and per phase what ``p50_p90`` gives
        for the two values sorted (a stable sort: ``b`` first only when below ``a``) or for the
        one present; the window tests hold the two equal over random histories."""
        step_a, step_b = a.step, b.step
        steps = 1 if baseline_step is None else step_a - baseline_step if step_a > baseline_step else 0
        if step_b > step_a:
            steps += step_b - step_a
        fields: dict[str, Any] = {"steps": steps, "first_step": step_b if step_b < step_a else step_a}
        for k50, k90, x, y in (
                ("step_seconds_p50", "step_seconds_p90", a.step_seconds if a.phase is None else None,
                 b.step_seconds if b.phase is None else None),  # a phase announcement is no step
                ("compute_seconds_p50", "compute_seconds_p90", a.compute_seconds, b.compute_seconds),
                ("comm_seconds_p50", "comm_seconds_p90", a.comm_seconds, b.comm_seconds),
                ("data_seconds_p50", "data_seconds_p90", a.data_seconds, b.data_seconds)):
            if x is None:
                if y is not None:
                    fields[k50] = fields[k90] = y + 0.0
            elif y is None:
                fields[k50] = fields[k90] = x + 0.0
            else:
                lo, hi = (y, x) if y < x else (x, y)
                fields[k50] = lo + (hi - lo) * 0.5
                fields[k90] = lo + (hi - lo) * 0.9
        return fields

    @staticmethod
    def _signal_fields(hist: deque[_Record], n: int, fields: dict[str, Any]) -> None:
        """The application signals of the window's ``n`` records (history's first ``n``, at least
        one with a loss or a gradient norm) into ``fields``."""
        losses: list[float] = []
        norms: list[float] = []
        nonfinite = nonfinite_loss = 0
        nonfinite_first: int | None = None
        for i, rec in enumerate(hist):
            if i == n:
                break
            loss, norm = rec.loss, rec.grad_norm
            if loss is None and norm is None:
                continue
            if isinstance(loss, str) or isinstance(norm, str):
                nonfinite += 1
                nonfinite_loss += isinstance(loss, str)
                if nonfinite_first is None:
                    nonfinite_first = rec.step
            if isinstance(loss, float):
                losses.append(loss)
            if isinstance(norm, float):
                norms.append(norm)
        loss_last = losses[-1] if losses else None
        losses.sort()
        fields.update(loss_p50=percentile(losses, 0.5) if losses else None, loss_last=loss_last,
                      grad_norm_p50=percentile(sorted(norms), 0.5) if norms else None,
                      grad_norm_max=max(norms) if norms else None, nonfinite_steps=nonfinite,
                      nonfinite_first_step=nonfinite_first, nonfinite_loss_steps=nonfinite_loss)

    def _samples(self, ranks: list[_Rank], summaries: list[RankSummary]) -> list[Sample]:
        # Built directly in the specs' label order (job, rank, then the extra label): this runs
        # for every rank every cycle, and the simulator runs it for 8,000 ranks.
        out: list[Sample] = []
        append = out.append
        for r, s in zip(ranks, summaries, strict=True):
            labels = r.labels
            if labels is None:
                labels = r.labels = _RankLabels.of(r.job, r.rank)
            last = r.last
            sampled = r.sampled
            # Only _observe changes what these say, and it always puts a new record in ``last``: a
            # rank that sent nothing since the last cycle keeps its samples (a Sample costs ~1 us).
            if sampled is None or sampled[0] is not last:
                sampled = r.sampled = (last, *self._record_samples(r, labels))
            out.extend(sampled[1])
            p50, p90 = s.step_seconds_p50, s.step_seconds_p90
            if p50 is not None and p90 is not None:
                window = r.window_samples
                if window is None or window[0] != p50 or window[1] != p90:  # the quantiles are never -0.0
                    window = r.window_samples = (p50, p90, (Sample(WINDOW_STEP_SECONDS.name, p50, labels.p50),
                                                            Sample(WINDOW_STEP_SECONDS.name, p90, labels.p90)))
                out.extend(window[2])
            append(sampled[2][0])  # the last progress
            out.extend(labels.state_samples(r.state))
            out.extend(sampled[2][1:])
        cached = self._rejected_samples
        if cached is None or cached[0] != self._rejected:  # refusals are rare: the same samples most cycles
            cached = self._rejected_samples = (dict(self._rejected), [
                Sample.of(REJECTED, n, reason=reason) for reason, n in self._rejected.items()])
        out.extend(cached[1])
        trusts = {r.job: r.trust for r in ranks}
        out.extend(Sample.of(JOB_INFO, 1.0, job=job, trust=trust, name=self._names.get(job, ""))
                   for job, trust in trusts.items())
        out.append(Sample.of(RANKS, len(ranks)))
        out.append(Sample.of(EVICTED, self._evicted))
        for tail in self._tails:
            path = tail.config.path
            out.append(Sample.of(LOG_LINES, tail.steps, path=path))
            out.append(Sample.of(LOG_ROTATIONS, tail.follower.rotations + tail.follower.truncations, path=path))
            out.extend(Sample.of(LOG_ERRORS, n, path=path, reason=reason) for reason, n in tail.errors.items())
            out.extend(Sample.of(LOG_ERRORS, n, path=path, reason=reason) for reason, n in tail.signals.refused.items())
            out.extend(Sample.of(LOG_SIGNALS, tail.signals.matched[kind], path=path, kind=kind)
                       for kind in APP_SIGNAL_KINDS)
        return out

    @staticmethod
    def _record_samples(r: _Rank, labels: _RankLabels) -> tuple[tuple[Sample, ...], tuple[Sample, ...]]:
        """The rank's samples that only its records change, built in the specs' label order (job,
        rank, then the extra label): those before the window's quantiles, and those after (the
        last progress first; the state samples go after it)."""
        jr = labels.jr
        last = r.last
        head = [Sample(LAST_STEP.name, float(last.step), jr)]
        if last.step_seconds is not None:
            head.append(Sample(STEP_SECONDS.name, last.step_seconds, jr))
        for phase_labels, value in zip(labels.phases, (last.compute_seconds, last.comm_seconds,
                                                       last.data_seconds), strict=True):
            if value is not None:
                head.append(Sample(PHASE_SECONDS.name, value, phase_labels))
        tail = [Sample(LAST_PROGRESS.name, r.last_progress_ts, jr)]
        if r.received:
            tail.append(Sample(HEARTBEATS.name, float(r.received), jr))
        if r.signals:
            if r.last_loss is not None:
                tail.append(Sample(LOSS.name, r.last_loss, jr))
            if r.last_grad_norm is not None:
                tail.append(Sample(GRAD_NORM.name, r.last_grad_norm, jr))
            tail.append(Sample(NONFINITE.name, float(r.nonfinite), jr))
        ckpt = r.checkpoint
        if ckpt is not None:
            tail.append(Sample(CHECKPOINT_STEP.name, float(ckpt.step), jr))
            tail.append(Sample(CHECKPOINT_TS.name, ckpt.ts, jr))
            tail.append(Sample(CHECKPOINT_SECONDS.name, ckpt.seconds, jr))
        return tuple(head), tuple(tail)

    def close(self) -> None:
        for tail in self._tails:
            tail.follower.close()


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = TrainingConfig


def build(config: AgentConfig, seams: Seams) -> TrainingCollector:
    # The simulator may replace the process table; a real agent asks psutil.
    pid_alive = seams.extra.get("pid_alive", psutil.pid_exists)
    # The simulator's healthy-fleet statistics leave the /metrics samples out (it never scrapes).
    return TrainingCollector(config.collectors.training, pid_alive=pid_alive,
                             samples=bool(seams.extra.get("training_samples", True)))
