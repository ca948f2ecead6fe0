"""Application-signal detector: what the training job itself says (its loss, its logs), attributed to
a node only where the evidence names one, otherwise to the job.

It reads each rank's summary windows (loss and non-finite steps), the job's incarnations
(``aggregator/job_runs.py``) and the training-log events the agents forward (``nccl_timeout``,
``cuda_error``, ``nccl_warn``, ``nccl_ras``). A NaN loss or a loss spike is a job alert, a divergence
reproduced after a restart holds the job (``hold_job``), and a log line naming a node is an alert on
that node; it never removes a node on a log line alone (the xid and memory detectors judge the
hardware's own reports). Evidence windows, thresholds, persistence, designed false-positive rates and
lookalikes: docs/detectors.md, "crash_loop, app_signals".
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field
from functools import partial
from itertools import compress
from operator import and_, attrgetter, ge, is_not, not_
from statistics import median
from typing import Any

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.hang import JOB_NODES_NAMED
from vigil.aggregator.fleet import FleetView, JobState, RankHistory
from vigil.aggregator.fleet.history import (
    LOSS_UNKNOWN,
    NONFINITE,
    NONFINITE_LOSS,
    RANK_LAST,
    STEPLESS,
    RankColumns,
    flag_table,
)
from vigil.aggregator.job_runs import MAX_INCARNATIONS, JobRun, JobRuns
from vigil.aggregator.nccl_peers import PeerNames
from vigil.contract.validation import StrictModel
from vigil.contract.wire import Event

NAME = "app_signals"
LOG_KINDS = ("nccl_timeout", "cuda_error", "nccl_warn", "nccl_ras")
# 1.4826 * MAD estimates a Gaussian's sigma (Rousseeuw & Croux, JASA 1993), as the straggler's.
_MAD_TO_SIGMA = 1.4826
# Log episodes kept (subject, job, kind): far beyond the jobs and nodes that log at once; the
# oldest go first.
_LOG_EPISODES_KEPT = 4096
_MESSAGE_CHARS = 200
_WINDOW_END = attrgetter("window_end_ts")
_STEPS = attrgetter("steps")
_LOSS = attrgetter("loss_p50")
_NONFINITE = attrgetter("nonfinite_steps")
_NONFINITE_LOSS = attrgetter("nonfinite_loss_steps")
_KNOWN = partial(is_not, None)
# RankColumns.flags to 1 where: a step was not finite (loss or other); the window had steps and a loss.
_ANY_NONFINITE = flag_table(lambda b: bool(b & (NONFINITE | NONFINITE_LOSS)))
_LOSS_KNOWN = flag_table(lambda b: not b & (STEPLESS | LOSS_UNKNOWN))
# 0 and 1 swapped (a skip mask into a fresh one).
_FLIP = bytes([1, 0]) + bytes(254)


class AppSignalsConfig(StrictModel):
    """The job's own loss and training logs: NaN loss, spikes, NCCL/CUDA lines (docs/detectors.md)."""
    enabled: bool = True
    # A NaN/inf loss reproduced after a restart holds the job when both were seen within this long
    # (the crash-loop detector's window: four runs of a large job).
    window_seconds: float = Field(default=21600.0, gt=0)
    hold_action: Action = Action.HOLD_JOB
    # Loss spikes: the job's window loss (median over its ranks of each new window's median loss)
    # against the median of its last ``spike_history_windows`` windows (5 min at 5 s windows),
    # judged once ``spike_min_history_windows`` (1 min) are known. A spike is at least
    # ``spike_ratio`` above that median (1.5x: PaLM's training-instability spikes, Chowdhery et
    # al. 2022 section 5.1, are multiples of the running loss, where a bad batch or an LR warm-up
    # end moves it by percent) and ``spike_z`` robust sigma above it (6: p ~ 1e-9 per window if
    # the windows' losses were Gaussian), in ``spike_windows`` consecutive windows (one window's
    # median already ignores one bad step; two are >= 10 s of a raised loss).
    spike_history_windows: int = Field(default=60, ge=4)
    spike_min_history_windows: int = Field(default=12, ge=3)
    spike_ratio: float = Field(default=0.5, gt=0)
    spike_z: float = Field(default=6.0, gt=0)
    spike_windows: int = Field(default=2, ge=1)
    # The spread never counts as less than this share of the median (a flat loss, quantised).
    spike_min_spread_ratio: float = Field(default=0.01, gt=0)
    # A training-log alert stays open this long after its latest line; lines of one subject and
    # kind closer together than this are one episode (an NCCL timeout is logged by every rank).
    log_episode_seconds: float = Field(default=600.0, gt=0)
    # CUDA errors whose message names the hardware (case-insensitive substrings): the node that
    # logged them is alerted on, not the job. CUDA's own text for an uncorrectable ECC error
    # (cudaErrorECCUncorrectable: "uncorrectable ECC error encountered").
    hardware_error_patterns: list[str] = Field(default_factory=lambda: ["uncorrectable ecc"])


@dataclass(slots=True)
class _Nan:
    ts: float  # aggregator clock, the evaluation that saw it
    step: int  # the first step whose loss was not finite (or the window's last step)
    rank: int


@dataclass(slots=True)
class _JobSignals:
    loss_seen: bool = False  # a finite loss was reported: the job reports its loss
    nan_since: _Nan | None = None  # the open NaN episode (alert)
    nan_by_incarnation: dict[int, _Nan] = field(default_factory=dict)
    hold_since: float | None = None
    hold_evidence: dict[str, Any] = field(default_factory=dict)
    losses: deque[float] = field(default_factory=deque)
    spike_run: int = 0
    spike_since: float | None = None
    spike_evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Judged:
    """A job's ranks as of ``members_revision`` (in the job's order) and the end of the last window
    judged of each, in the same order: what ``_judge_bulk`` reads with C-level list operations. While
    it is kept, its ``windows`` stand for the job's entries in ``_judged`` (written back, ``_settle``,
    before the long way reads them)."""

    job: JobState
    members_revision: int
    ranks: list[RankHistory]
    windows: MutableSequence[float]
    # The fleet revision (FleetView.revision) at which ``windows`` were last compared with the
    # ranks' window ends: while the job's ``windows_revision`` is no later, no window end moved.
    revision: int
    # The fleet revision at which no rank's summary counted a non-finite step (-1: not known so):
    # while the job's ``runs_revision`` is no later, none does.
    finite_revision: int = -1
    # The job's columns (JobState.columns) where they held exactly its ranks when this was made:
    # ``ranks`` are then in their slot order and ``windows`` an array('d'), and ``_judge_columns``
    # reads the columns instead of the ranks' summaries (None: the lists are read).
    columns: RankColumns | None = None


@dataclass(slots=True)
class _LogEpisode:
    since: float
    latest: float
    count: int
    node: str  # WHOLE_JOB for the job's
    job: str | None
    kind: str
    action: Action
    reason: str
    evidence: dict[str, Any]


class AppSignalsDetector:
    name = NAME

    def __init__(self, config: AppSignalsConfig) -> None:
        self.config = config
        self.runs = JobRuns(config.window_seconds)
        self._jobs: dict[str, _JobSignals] = {}
        # job -> rank -> the end of the last window judged (every rank of the job once judged:
        # the same size as the job's ranks means the same ranks); job -> the ranks whose latest
        # window with steps had a non-finite loss.
        self._judged: dict[str, dict[int, float]] = {}
        self._nan_now: dict[str, set[int]] = {}
        # job -> its ranks and their judged window ends as lists (``_Judged``), for a view with
        # change markers (``FleetView.revision``): the bulk path's record.
        self._bulk: dict[str, _Judged] = {}
        self.bulk_judged = 0  # jobs judged on the bulk path (a test's witness that it is taken)
        self.columns_judged = 0  # ... of which their new windows were read from the job's columns
        # node -> the last event seen in its ring (identity), so each event is read once.
        self._event_marker: dict[str, tuple[float, Event]] = {}
        self._logs: dict[tuple[str, str, str], _LogEpisode] = {}

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        self.runs.observe(view, now)
        out: list[Finding] = []
        for job in view.jobs.values():
            run = self.runs.get(job.name)
            if run is not None:
                out.extend(self._judge_job(job, run, now, view.revision))
        for name in [n for n in self._bulk if n not in view.jobs]:
            del self._bulk[name]  # its job's record in ``_judged`` goes below
        for name in [j for j in self._jobs if self.runs.get(j) is None]:
            del self._jobs[name]
        # Forget the ranks (and jobs) no longer in the view. Every rank of a job in it was judged
        # just now, so a job's table of the same size as its ranks holds exactly them.
        for name, windows in list(self._judged.items()):
            live = view.jobs.get(name)
            if live is None:
                del self._judged[name]
            elif len(windows) != len(live.ranks):
                for rank in [r for r in windows if r not in live.ranks]:
                    del windows[rank]
        for name, nan_ranks in list(self._nan_now.items()):
            live = view.jobs.get(name)
            if live is None:
                del self._nan_now[name]
            else:
                nan_ranks.difference_update([r for r in nan_ranks if r not in live.ranks])
        out.extend(self._judge_logs(view, now))
        return out

    # -- loss --------------------------------------------------------------------------------------

    def _judge_job(self, job: JobState, run: JobRun, now: float, revision: int | None = None) -> list[Finding]:
        state = self._jobs.get(job.name)
        if state is None:
            state = self._jobs[job.name] = _JobSignals(losses=deque(maxlen=self.config.spike_history_windows))
        nan_now = self._nan_now.get(job.name)
        if nan_now is None:
            nan_now = self._nan_now[job.name] = set()
        new_losses = self._judge_bulk(job, state, nan_now, revision) if revision is not None else None
        if new_losses is None:
            new_losses = self._judge_ranks(job, run, state, nan_now, now)
            if revision is not None:
                ranks = list(job.ranks.values())
                judged = self._judged[job.name]
                # A rank with no window end has a new window at each report (its arrival time),
                # which no change marker tells: the record is then never taken as up to date.
                known = None not in map(_WINDOW_END, map(RANK_LAST, ranks))
                # Columns holding exactly the job's ranks (the fleet's; a job built by hand has none):
                # the record follows their slot order (once per change of the job's ranks).
                held = job.columns
                columns: RankColumns | None = None
                if len(held.ranks) == len(ranks) and all(
                        r.columns is held and job.ranks.get(r.rank) is r for r in held.ranks):
                    ranks, columns = list(held.ranks), held
                # A rank not in ``judged`` (a window end at or below -1: a hand-made clock) is judged
                # as if it were there at -1.0, the long way's default.
                windows = [judged.get(r.rank, -1.0) for r in ranks]
                self._bulk[job.name] = _Judged(job, job.members_revision, ranks,
                                               windows if columns is None else array("d", windows),
                                               revision if known else -1, columns=columns)
        else:
            self.bulk_judged += 1
            state.nan_since = None  # as the long way leaves it: no rank's latest window is non-finite
        return self._findings(job, run, state, new_losses, now)

    def _judge_bulk(self, job: JobState, state: _JobSignals, nan_now: set[int], revision: int) -> list[float] | None:
        """The job's new windows judged as ``_judge_ranks`` judges them, in C-level list operations
        over its ranks (``_Judged``): the new windows' losses. None (nothing changed): a rank
        joined or left, a window end is unknown, a rank of the job had a non-finite loss or has one
        now; the long way judges those. A job none of whose window ends moved since the last pass
        (``JobState.windows_revision``) costs O(1); at 5 s windows and 2.5 s passes that is every
        other pass. Otherwise each C-level read of 100,000 ranks' summaries costs ~8 ms (~80 ns a
        rank, most of it the cache misses of summaries scattered in memory; a Python loop reading
        one field is ~1.3x that, the long way ~1 us a rank)."""
        rec = self._bulk.get(job.name)
        if rec is None or rec.job is not job or rec.members_revision != job.members_revision or nan_now:
            return None
        if job.windows_revision <= rec.revision:
            return []  # no rank's window end moved since they were judged (``judged >= window`` each)
        if rec.columns is not None:
            judged = self._judge_columns(job, state, rec, rec.columns, revision)
            if judged is not None:
                return judged
        lasts = list(map(RANK_LAST, rec.ranks))
        ends = list(map(_WINDOW_END, lasts))
        old = rec.windows
        if ends == old:
            rec.revision = revision
            return []  # no rank's window moved: each was judged (``judged >= window``)
        if None in ends:
            return None  # the arrival time stands for the window end: the long way
        skip = list(map(ge, old, ends))  # as the long way: judged >= window, not a new window
        skipped = skip.count(True)
        if skipped == len(skip):
            rec.revision = revision
            return []
        fresh = list(compress(lasts, map(not_, skip))) if skipped else lasts
        steps = list(map(_STEPS, fresh))
        active = list(compress(fresh, steps)) if 0 in steps else fresh
        finite = job.runs_revision <= rec.finite_revision
        if not finite and not any(map(_NONFINITE, lasts)) and not any(map(_NONFINITE_LOSS, lasts)):
            rec.finite_revision, finite = revision, True  # every rank's steps finite (checked once)
        if not finite and any(map(_NONFINITE_LOSS, active)):
            return None  # a non-finite loss: the long way notes it
        losses = list(map(_LOSS, active))
        unknown = losses.count(None)
        # A window with steps and no finite loss, in a job that reports its loss (before or in this
        # pass), is a non-finite loss where one of its steps was not finite (an agent predating
        # nonfinite_loss_steps): the long way. One of a job that does not report it adds no loss
        # and clears nothing.
        if (unknown and not finite and (state.loss_seen or unknown < len(losses))
                and any(map(_NONFINITE, active))):
            return None
        if unknown:
            losses = list(filter(_KNOWN, losses)) if unknown < len(losses) else []
        windows = [w if s else e for w, e, s in zip(old, ends, skip, strict=True)] if skipped else ends
        rec.windows = windows if rec.columns is None else array("d", windows)
        rec.revision = revision
        if losses:
            state.loss_seen = True
        return losses

    def _judge_columns(self, job: JobState, state: _JobSignals, rec: _Judged, columns: RankColumns,
                       revision: int) -> list[float] | None:
        """``_judge_bulk`` read from the job's columns (``rec.columns``, in ``rec.ranks``'s order) in
        the usual case, every rank's window end known and every step finite: the new windows'
        losses. None (nothing changed) where it is not that case: the summaries are read. Each
        column read is one C-level pass over contiguous memory (~0.1 ms for a byte compare or a
        translate of 100,000 flags, ~2 ms for a min or max of 100,000 doubles) where each read of a
        field of the ranks' summaries is ~8 ms at 12,500 nodes."""
        ends = columns.marks
        old = rec.windows
        assert isinstance(old, array)
        # Byte-equal doubles are equal (no mark is NaN; a NaN of ``old`` differs from every mark).
        if ends.tobytes() == old.tobytes():
            rec.revision = revision
            return []  # no rank's window moved: each was judged (``judged >= window``)
        newest = min(ends, default=0.0)
        if newest == -math.inf:
            return None  # an unknown window end (the arrival time stands for it), or not a number
        finite = job.runs_revision <= rec.finite_revision
        flags = columns.flags
        if not finite:
            if 1 in flags.translate(_ANY_NONFINITE):
                return None  # a non-finite step: the list path weighs it
            rec.finite_revision = revision  # every rank's steps finite (checked once)
        # Every judged end below every new one (the usual pass after windows ended: ~4 ms where
        # comparing rank by rank is ~8 ms): no rank skips. ``max`` passes over a NaN of ``old``
        # unless it comes first (then the bound fails), and ``ge`` finds a NaN below every end.
        if max(old, default=-math.inf) < newest:
            skip = b""
            skipped = 0
        else:
            skip = bytes(map(ge, old, ends))  # as the long way: judged >= window, not a new window
            skipped = skip.count(1)
            if skipped == len(skip):
                rec.revision = revision
                return []
        # Every step finite: the new windows with steps and a loss give theirs (None adds nothing).
        known: bytes | bytearray = flags.translate(_LOSS_KNOWN)
        if skipped:
            known = bytes(map(and_, known, skip.translate(_FLIP)))
        if 1 not in known:
            losses = []  # no new window with a loss (a job that does not report it: bench_evaluation's)
        else:
            losses = list(compress(columns.losses, known)) if 0 in known else columns.losses.tolist()
        total = sum(losses)
        if total != total:
            return None  # a loss that is not a number (sent so, not None): the list path keeps it
        rec.windows = array("d", [w if s else e for w, e, s in zip(old, ends, skip, strict=True)]) if skipped \
            else ends[:]
        rec.revision = revision
        self.columns_judged += 1
        if losses:
            state.loss_seen = True
        return losses

    def _settle(self, name: str) -> None:
        """The bulk record's window ends into ``_judged`` (the long way's record), and the record dropped."""
        rec = self._bulk.pop(name, None)
        if rec is None:
            return
        judged = self._judged.get(name)
        if judged is None:
            judged = self._judged[name] = {}
        for r, window in zip(rec.ranks, rec.windows, strict=True):
            judged[r.rank] = window

    def _judge_ranks(self, job: JobState, run: JobRun, state: _JobSignals, nan_now: set[int],
                     now: float) -> list[float]:
        """The long way: each rank's new window, if any; the new windows' losses."""
        self._settle(job.name)
        new_losses: list[float] = []
        judged = self._judged.get(job.name)
        if judged is None:
            judged = self._judged[job.name] = {}
        for r in job.ranks.values():
            s = r.last
            window = s.window_end_ts if s.window_end_ts is not None else r.last_seen
            if judged.get(r.rank, -1.0) >= window:
                continue
            judged[r.rank] = window
            if s.steps == 0:
                continue
            if s.loss_p50 is not None:
                new_losses.append(s.loss_p50)
            # A step whose loss was not finite (an agent that predates nonfinite_loss_steps: not
            # one finite loss in a window with steps, in a job that reports its loss). A step whose
            # gradient norm alone overflowed keeps its loss: AMP's loss scaling skips it by design.
            nan_loss = s.nonfinite_loss_steps > 0 or (s.loss_p50 is None and s.nonfinite_steps > 0
                                                      and state.loss_seen)
            if not nan_loss:
                if s.loss_p50 is not None and s.nonfinite_steps == 0:
                    nan_now.discard(r.rank)  # a clean window: this rank trains on
            else:
                nan_now.add(r.rank)
                nan = _Nan(now, s.nonfinite_first_step if s.nonfinite_first_step is not None else s.last_step, r.rank)
                if state.nan_since is None:
                    state.nan_since = nan
                inc = run.incarnation_of(r.rank)
                if inc is not None and (inc not in state.nan_by_incarnation
                                        or nan.step < state.nan_by_incarnation[inc].step):
                    state.nan_by_incarnation[inc] = nan
            state.loss_seen = state.loss_seen or s.loss_p50 is not None
        if nan_now.isdisjoint(job.ranks):
            state.nan_since = None
        return new_losses

    def _findings(self, job: JobState, run: JobRun, state: _JobSignals, new_losses: list[float],
                  now: float) -> list[Finding]:
        out: list[Finding] = []
        named: list[list[str]] = []

        def nodes() -> list[str]:
            """The job's first nodes by name (evidence), listed only when a finding needs them."""
            if not named:
                named.append(sorted(job.nodes())[:JOB_NODES_NAMED])
            return named[0]

        if state.nan_since is not None:
            nan = state.nan_since
            out.append(Finding(
                detector=NAME, node=WHOLE_JOB, job=job.name, action=Action.ALERT, since=nan.ts, key="nonfinite_loss",
                reason=f"job {job.name}: loss is NaN/inf from step {nan.step} (rank {nan.rank})",
                evidence={"signal": "nonfinite_loss", "first_step": nan.step, "rank": nan.rank,
                          "incarnation": run.incarnation_of(nan.rank), "job_nodes": nodes()}))
        hold = self._hold(job, run, state, now, nodes)
        if hold is not None:
            out.append(hold)
        spike = self._spike(job, state, new_losses, now, nodes)
        if spike is not None:
            out.append(spike)
        return out

    def _hold(self, job: JobState, run: JobRun, state: _JobSignals, now: float,
              nodes: Callable[[], list[str]]) -> Finding | None:
        """The divergence again in a later incarnation, before the job got past where it diverged."""
        cfg = self.config
        nans = state.nan_by_incarnation
        oldest = run.latest.index - MAX_INCARNATIONS
        for inc in [i for i, n in nans.items() if now - n.ts > cfg.window_seconds or i < oldest]:
            del nans[inc]
        if state.hold_since is not None:
            diverged = max(n.step for n in nans.values()) if nans else None
            latest = run.latest
            if diverged is None or (latest.index not in nans and latest.best_step is not None
                                    and latest.best_step > diverged):
                state.hold_since = None  # got past it (or it is long ago): the episode is over
        if state.hold_since is None:
            order = sorted(nans)
            for a, i in enumerate(order):
                earlier = run.get(i)
                reached = max(nans[i].step, earlier.best_step or 0) if earlier is not None else nans[i].step
                again = [j for j in order[a + 1:] if nans[j].step <= reached]
                if again:
                    state.hold_since = nans[i].ts
                    state.hold_evidence = {
                        "signal": "nonfinite_loss", "restarts": again[-1] - i, "best_step": run.best_step(),
                        "nonfinite_first_steps": [[k, nans[k].step] for k in order[a:]],
                        "steps_per_incarnation": [[x.start_step, x.best_step] for x in list(run.incarnations)[-8:]],
                        "job_nodes": nodes()}
                    break
        if state.hold_since is None:
            return None
        steps = state.hold_evidence["nonfinite_first_steps"]
        return Finding(
            detector=NAME, node=WHOLE_JOB, job=job.name, action=cfg.hold_action, since=state.hold_since,
            key="nonfinite_loss_repeat",
            reason=(f"job {job.name}: loss NaN/inf again after a restart (first steps by incarnation {steps}): "
                    f"restarting it only loops; hold it for a person (no node is at fault)"),
            evidence=state.hold_evidence)

    def _spike(self, job: JobState, state: _JobSignals, new_losses: list[float], now: float,
               nodes: Callable[[], list[str]]) -> Finding | None:
        cfg = self.config
        if new_losses:
            value = median(new_losses)
            history = state.losses
            spiking = False
            if len(history) >= cfg.spike_min_history_windows:
                med = median(history)
                spread = max(_MAD_TO_SIGMA * median(abs(x - med) for x in history),
                             cfg.spike_min_spread_ratio * abs(med), 1e-12)
                excess = value - med
                spiking = excess >= cfg.spike_ratio * abs(med) and excess / spread >= cfg.spike_z
                if spiking:
                    state.spike_run += 1
                    if state.spike_since is None:
                        state.spike_since = now
                    state.spike_evidence = {"signal": "loss_spike", "loss": value, "median": med,
                                            "robust_z": round(excess / spread, 1), "windows": state.spike_run,
                                            "history_windows": len(history), "job_nodes": nodes()}
            if not spiking:
                state.spike_run, state.spike_since = 0, None
            history.append(value)
        if state.spike_since is None or state.spike_run < cfg.spike_windows:
            return None
        ev = state.spike_evidence
        return Finding(
            detector=NAME, node=WHOLE_JOB, job=job.name, action=Action.ALERT, since=state.spike_since, key="loss_spike",
            reason=(f"job {job.name}: loss {ev['loss']:.4g} against its recent median {ev['median']:.4g} "
                    f"({ev['robust_z']} robust sigma) for {ev['windows']} windows"),
            evidence=ev)

    # -- training logs ------------------------------------------------------------------------------

    def _judge_logs(self, view: FleetView, now: float) -> list[Finding]:
        cfg = self.config
        names: PeerNames | None = None  # built when a peer is named
        for node in view.nodes.values():
            marker = self._event_marker.get(node.name)
            fresh: list[tuple[float, Event]] = []
            for item in reversed(node.events):
                if item is marker:
                    break
                fresh.append(item)
            if node.events:
                self._event_marker[node.name] = node.events[-1]
            for ts, event in reversed(fresh):
                if event.kind not in LOG_KINDS or now - ts > cfg.log_episode_seconds:
                    continue
                peer_node = None
                if event.peer is not None:
                    if names is None:
                        names = PeerNames(view)
                    peer_node = names.resolve(event.peer)
                self._note(node.name, peer_node, ts, event)
        for name in [n for n in self._event_marker if n not in view.nodes]:
            del self._event_marker[name]
        out: list[Finding] = []
        for key, ep in list(self._logs.items()):
            if now - ep.latest > cfg.log_episode_seconds or (ep.node and ep.node not in view.nodes):
                del self._logs[key]
                continue
            out.append(Finding(detector=NAME, node=ep.node, job=ep.job, action=ep.action, since=ep.since,
                               key=f"log:{ep.kind}", reason=ep.reason, latest=ep.latest,
                               evidence={**ep.evidence, "lines": ep.count}))
        return out

    def _note(self, reporter: str, peer_node: str | None, ts: float, event: Event) -> None:
        """One training-log event into its episode: about the peer node it names, the node that
        logged a hardware error, or its job."""
        cfg = self.config
        text = event.message.lower()
        job = event.job
        action = Action.ALERT
        if peer_node is not None and peer_node != reporter:
            node, kind = peer_node, f"{event.kind}:peer"
            reason = (f"training logs on {reporter} name this node ({event.peer}) in {event.kind} lines"
                      f"{f' of job {job}' if job else ''}: check its GPUs and links (log evidence only: no removal)")
        elif event.kind == "cuda_error" and any(p.lower() in text for p in cfg.hardware_error_patterns):
            node, kind = reporter, "cuda_error:hardware"
            reason = (f"a CUDA error naming the hardware in the training log{f' of job {job}' if job else ''} on "
                      f"this node: {event.message[:_MESSAGE_CHARS]} (the xid and memory detectors judge the GPU's "
                      f"own reports)")
        elif job is not None:
            node, kind = WHOLE_JOB, event.kind
            peer = f" naming peer {event.peer} (not a node vigil knows by that name)" if event.peer else ""
            reason = (f"job {job}: {event.kind} in its training log on {reporter}{peer}: "
                      f"{event.message[:_MESSAGE_CHARS]}")
        else:
            node, kind, action = reporter, event.kind, Action.OBSERVE
            reason = f"{event.kind} in a training log of no known job on this node: {event.message[:_MESSAGE_CHARS]}"
        key = (node, job or "", kind)
        ep = self._logs.get(key)
        if ep is not None and ts - ep.latest <= cfg.log_episode_seconds:
            ep.latest = max(ep.latest, ts)
            ep.count += event.count
            reporters = ep.evidence["reported_by"]
            if reporter not in reporters and len(reporters) < JOB_NODES_NAMED:
                reporters.append(reporter)
            return
        if ep is None and len(self._logs) >= _LOG_EPISODES_KEPT:
            del self._logs[min(self._logs, key=lambda k: self._logs[k].latest)]
        self._logs[key] = _LogEpisode(
            since=ts, latest=ts, count=event.count, node=node, job=job, kind=kind, action=action, reason=reason,
            evidence={"signal": "training_log", "kind": event.kind, "job": job, "rank": event.rank,
                      "peer": event.peer, "reported_by": [reporter], "message": event.message[:_MESSAGE_CHARS]})
