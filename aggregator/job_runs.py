"""Job runs: each training job's incarnations (its runs between restarts), as its ranks show them.

It reads the view's jobs each evaluation (each rank's pid, state, steps and checkpoint step) and keeps, per
job key, its recent incarnations: when each began and ended on the aggregator's clock, its lowest and highest
step and latest checkpoint step, a restart being a new pid, a run after an exit, or (no pid) a step gone back.
It decides nothing: the crash-loop and application-signal detectors each keep one and judge from it
(docs/detectors.md, "crash_loop, app_signals").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from vigil.aggregator.fleet import FleetView, JobState, RankHistory
from vigil.aggregator.fleet.history import RANK_LAST, RANK_STATE

# Incarnations kept per job: far beyond any restart threshold (a few), bounded for a job that
# restarts all day; what dropped off is folded into the job's best step and checkpoint before it.
MAX_INCARNATIONS = 32
# (window end, last step) kept per rank without a pid, for its ``first_step`` test (two windows back).
_WINDOWS_KEPT = 4
_PID = attrgetter("pid")
_LAST_STEP = attrgetter("last_step")
_CHECKPOINT = attrgetter("checkpoint_step")


@dataclass(slots=True)
class Incarnation:
    """One run of a job between restarts. Steps are the ranks' own (``last_step``); ``started``
    and ``ended`` are the evaluations (aggregator clock) that first saw it begin and end."""

    index: int  # 0: the first run this aggregator saw
    started: float
    start_step: int | None = None  # the lowest step its ranks reported (where it resumed)
    best_step: int | None = None  # the highest
    checkpoint_step: int | None = None  # the latest completed announced checkpoint its ranks reported
    ended: float | None = None

    @property
    def steps(self) -> tuple[int | None, int | None]:
        return self.start_step, self.best_step


@dataclass(slots=True)
class _RankSeen:
    pid: int | None
    exited: bool
    last_step: int
    generation: int  # the index of the incarnation the rank runs in
    windows: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=_WINDOWS_KEPT))


class JobRun:
    """One job's incarnations, oldest first (at most MAX_INCARNATIONS)."""

    __slots__ = ("_folded_best", "_folded_checkpoint", "_steady", "_steady_pids", "_steady_revision", "_steady_slots",
                 "_steady_steps", "_steps_by_slot", "columns_observed", "exited", "incarnations", "job", "last_seen",
                 "ranks")

    def __init__(self, job: str, now: float) -> None:
        self.job = job
        self.incarnations: deque[Incarnation] = deque([Incarnation(0, now)])
        self.ranks: dict[int, _RankSeen] = {}
        # How many of ``ranks`` were exited when last observed (a job none of whose ranks exited
        # has no crash to judge: the crash-loop detector skips it in O(1)).
        self.exited = 0
        self.last_seen = now
        # The best step and checkpoint of incarnations no longer kept.
        self._folded_best: int | None = None
        self._folded_checkpoint: int | None = None
        # The ranks (in the view's order) of an observation after which each was the usual rank
        # (``observe``): a process of its own, none exited, all in the latest incarnation; their pids
        # then, and their steps as last observed (not yet written to ``ranks``' last_step). While
        # the same ranks keep those pids and none exits, an observation is the usual rank for every
        # one of them: a few C-level list reads instead of a Python step per rank.
        self._steady: list[RankHistory] | None = None
        self._steady_pids: list[int | None] = []
        self._steady_steps: list[int] | None = None
        # Each steady rank's slot in its job's columns (JobState.columns) where those held exactly the
        # steady ranks when they were found so (None: they did not): the quiet observation then reads
        # the steps from the columns, and ``_steady_steps`` is in their slot order (``_steady_slots``
        # set and ``_steps_by_slot``: ``_steady_ordered`` reorders them).
        self._steady_slots: list[int] | None = None
        self._steps_by_slot = False
        self.columns_observed = 0  # quiet observations read from the columns (a test's witness)
        # The fleet revision (FleetView.revision) of the latest observation that found the steady
        # ranks so: while their job's ``runs_revision`` is no later (no pid, state or checkpoint
        # changed, no step went back since), an observation needs only their steps' maximum.
        self._steady_revision: int | None = None

    @property
    def latest(self) -> Incarnation:
        return self.incarnations[-1]

    @property
    def restarts(self) -> int:
        """Restarts seen since the first incarnation."""
        return self.latest.index

    def incarnation_of(self, rank: int) -> int | None:
        seen = self.ranks.get(rank)
        return seen.generation if seen is not None else None

    def last_step_of(self, rank: int) -> int | None:
        """The rank's step as last observed (a steady observation's steps are kept aside)."""
        if self._steady is not None and self._steady_steps is not None:
            for r, step in zip(self._steady, self._steady_ordered(), strict=True):
                if r.rank == rank:
                    return step
        seen = self.ranks.get(rank)
        return seen.last_step if seen is not None else None

    def get(self, index: int) -> Incarnation | None:
        first = self.incarnations[0].index
        return self.incarnations[index - first] if first <= index <= self.latest.index else None

    def before(self, inc: Incarnation) -> tuple[int | None, int | None]:
        """The best step and the latest checkpoint step of the incarnations before ``inc``."""
        best, checkpoint = self._folded_best, self._folded_checkpoint
        for other in self.incarnations:
            if other.index >= inc.index:
                break
            best = _max(best, other.best_step)
            checkpoint = _max(checkpoint, other.checkpoint_step)
        return best, checkpoint

    def progressed(self, inc: Incarnation, min_steps: int) -> bool:
        """Whether ``inc`` moved the job forward: a step at least ``min_steps`` past every earlier
        incarnation's best, or a checkpoint it completed itself (past the step it resumed at)
        beyond every earlier one. The first incarnation seen has nothing to compare with: True."""
        if inc.index == self.incarnations[0].index and self._folded_best is None:
            return True
        best, checkpoint = self.before(inc)
        if inc.best_step is not None and (best is None or inc.best_step >= best + min_steps):
            return True
        ckpt = inc.checkpoint_step
        return (ckpt is not None and inc.start_step is not None and ckpt > inc.start_step
                and (checkpoint is None or ckpt > checkpoint))

    def best_step(self) -> int | None:
        best = self._folded_best
        for inc in self.incarnations:
            best = _max(best, inc.best_step)
        return best

    def best_checkpoint(self) -> int | None:
        checkpoint = self._folded_checkpoint
        for inc in self.incarnations:
            checkpoint = _max(checkpoint, inc.checkpoint_step)
        return checkpoint

    def _begin(self, now: float) -> Incarnation:
        latest = self.latest
        if latest.ended is None:
            latest.ended = now
        inc = Incarnation(latest.index + 1, now)
        if len(self.incarnations) == MAX_INCARNATIONS:
            old = self.incarnations.popleft()
            self._folded_best = _max(self._folded_best, old.best_step)
            self._folded_checkpoint = _max(self._folded_checkpoint, old.checkpoint_step)
        self.incarnations.append(inc)
        return inc

    def observe(self, ranks: Collection[RankHistory], now: float, shortcut: bool = True,
                job: JobState | None = None, revision: int | None = None) -> None:
        """The ranks' latest summaries at ``now``. ``shortcut`` False: every rank the long way
        (``_observe_rank``), the reference the inlined usual case is tested against. ``job`` and
        ``revision``: the ranks' job and the view's revision, whose change marker
        (``JobState.runs_revision``) lets a steady observation skip what did not change."""
        self.last_seen = now
        seen_of = self.ranks
        latest = self.incarnations[-1]
        if shortcut and self._steady is not None and list(ranks) == self._steady:
            if (job is not None and revision is not None and self._steady_revision is not None
                    and job.runs_revision <= self._steady_revision):
                # No pid, state or checkpoint changed and no step went back since the steady ranks
                # were last found so: what the path below finds of them holds still (their
                # checkpoints are in already, none went below the lowest step); only the highest
                # step can have moved. Read from the job's columns where they hold these ranks (a
                # copy and a max of a list, ~2 ms at 12,500 nodes where the summaries' were ~16 ms).
                if self._steady_slots is not None:
                    steps = self._steady_steps = job.columns.last_steps[:]
                    self._steps_by_slot = True
                    self.columns_observed += 1
                else:
                    steps = self._steady_steps = list(map(_LAST_STEP, map(RANK_LAST, self._steady)))
                    self._steps_by_slot = False
                high = max(steps)
                if latest.best_step is None or high > latest.best_step:
                    latest.best_step = high
                self._steady_revision = revision
                return
            lasts = list(map(RANK_LAST, self._steady))
            if list(map(_PID, lasts)) == self._steady_pids and "exited" not in map(RANK_STATE, lasts):
                # Each rank as the usual-rank path below takes it: none exited (nor was: ``exited``
                # stays 0), its step into the latest incarnation's lowest and highest, its checkpoint.
                steps = self._steady_steps = list(map(_LAST_STEP, lasts))
                self._steps_by_slot = False
                low, high = min(steps), max(steps)
                if latest.start_step is None or low < latest.start_step:
                    latest.start_step = low
                if latest.best_step is None or high > latest.best_step:
                    latest.best_step = high
                checkpoints = list(map(_CHECKPOINT, lasts))
                # Most ranks have no completed checkpoint to tell (None): counted in C, not filtered in Python.
                if checkpoints.count(None) != len(checkpoints):
                    checkpoint = max(c for c in checkpoints if c is not None)
                    if latest.checkpoint_step is None or checkpoint > latest.checkpoint_step:
                        latest.checkpoint_step = checkpoint
                self._steady_revision = revision
                return
        self._settle()
        for r in ranks:
            s = r.last
            seen = seen_of.get(r.rank)
            # The usual rank (the same process, still in the latest incarnation, not back from an
            # exit): ``_observe_rank``'s work inlined, with the same result.
            if shortcut and seen is not None and s.pid is not None and s.pid == seen.pid \
                    and seen.generation == latest.index:
                exited = s.state == "exited"
                if exited or not seen.exited:
                    if exited != seen.exited:
                        self.exited += 1 if exited else -1
                        seen.exited = exited
                    step = seen.last_step = s.last_step
                    if latest.start_step is None or step < latest.start_step:
                        latest.start_step = step
                    if latest.best_step is None or step > latest.best_step:
                        latest.best_step = step
                    checkpoint = s.checkpoint_step
                    if checkpoint is not None and (latest.checkpoint_step is None
                                                   or checkpoint > latest.checkpoint_step):
                        latest.checkpoint_step = checkpoint
                    continue
            self._observe_rank(r, now)
            latest = self.incarnations[-1]
        if len(seen_of) != len(ranks):  # every rank observed is in self.ranks: equal sizes, nothing left
            present = {r.rank for r in ranks}
            for gone in [k for k in seen_of if k not in present]:
                self.exited -= seen_of.pop(gone).exited
        latest = self.latest
        if latest.ended is None and ranks and all(r.last.state == "exited" for r in ranks):
            latest.ended = now
        # A rank without a pid (a tailed log) stops the test at once: the steady path is not for it.
        if shortcut and not self.exited and len(seen_of) == len(ranks) and None not in map(_PID, map(RANK_LAST, ranks)):
            listed = list(ranks)
            if all(seen_of[r.rank].generation == latest.index for r in listed):
                self._steady, self._steady_pids = listed, [r.last.pid for r in listed]
                self._steady_revision = revision
                columns = job.columns if job is not None else None
                if columns is not None and len(columns.ranks) == len(listed) and all(
                        r.columns is columns and columns.ranks[r.slot] is r for r in listed):
                    self._steady_slots = [r.slot for r in listed]

    def _steady_ordered(self) -> Sequence[int]:
        """The steady observations' steps in ``_steady``'s order."""
        steps = self._steady_steps
        assert steps is not None
        if self._steps_by_slot:
            assert self._steady_slots is not None
            return [steps[slot] for slot in self._steady_slots]
        return steps

    def _settle(self) -> None:
        """The steps of the steady observations into the ranks' records (their last_step), and the
        steady path off until every rank is the usual rank again."""
        if self._steady is not None and self._steady_steps is not None:
            for r, step in zip(self._steady, self._steady_ordered(), strict=True):
                self.ranks[r.rank].last_step = step
        self._steady, self._steady_steps, self._steady_revision = None, None, None
        self._steady_slots, self._steps_by_slot = None, False

    def _observe_rank(self, r: RankHistory, now: float) -> None:
        s = r.last
        exited = s.state == "exited"
        seen = self.ranks.get(r.rank)
        if seen is None:
            seen = self.ranks[r.rank] = _RankSeen(s.pid, False, s.last_step, self.latest.index)
        elif _restarted(seen, r):
            latest = self.latest
            # Its peers restarted already (this rank joins their incarnation), or it is the first.
            seen.generation = latest.index if latest.index > seen.generation else self._begin(now).index
            seen.windows.clear()
        seen.pid = s.pid if s.pid is not None else seen.pid
        if exited != seen.exited:
            self.exited += 1 if exited else -1
            seen.exited = exited
        seen.last_step = s.last_step
        end = s.window_end_ts
        if s.pid is None and end is not None and (not seen.windows or seen.windows[-1][0] < end):
            seen.windows.append((end, s.last_step))
        inc = self.get(seen.generation)
        if inc is None:
            return
        inc.start_step = s.last_step if inc.start_step is None else min(inc.start_step, s.last_step)
        inc.best_step = _max(inc.best_step, s.last_step)
        if s.checkpoint_step is not None:
            inc.checkpoint_step = _max(inc.checkpoint_step, s.checkpoint_step)


def _restarted(seen: _RankSeen, r: RankHistory) -> bool:
    s = r.last
    if s.pid is not None and seen.pid is not None:
        if s.pid != seen.pid:
            return True  # another process took the rank over
        return seen.exited and s.state != "exited"
    if seen.exited and s.state != "exited":
        return True
    if s.pid is not None or seen.pid is not None:
        return False
    # No process identity (a tailed log): the step going back is the only sign.
    if s.last_step < seen.last_step:
        return True
    if s.first_step is None or s.window_end_ts is None:
        return False
    # A summary's last_step may be past its window's end (the agent reads it when it reports), so
    # the window's lowest step is compared only with steps reported two windows before it began.
    horizon = s.window_end_ts - 2 * s.window_seconds
    reached = max((step for end, step in seen.windows if end <= horizon), default=None)
    return reached is not None and s.first_step < reached


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


class JobRuns:
    """Every job's runs, updated from the view at each evaluation (``observe``); a job not in the
    view for ``forget_seconds`` is forgotten."""

    def __init__(self, forget_seconds: float) -> None:
        self.forget_seconds = forget_seconds
        self._runs: dict[str, JobRun] = {}

    def observe(self, view: FleetView, now: float) -> None:
        for name, job in view.jobs.items():
            run = self._runs.get(name)
            if run is None:
                run = self._runs[name] = JobRun(name, now)
            # A view without change markers is judged the long way (FleetView.without_markers).
            run.observe(job.ranks.values(), now, view.revision is not None, job, view.revision)
        for name in [n for n, run in self._runs.items() if now - run.last_seen > self.forget_seconds]:
            del self._runs[name]

    def get(self, job: str) -> JobRun | None:
        return self._runs.get(job)

    def __iter__(self) -> Iterator[JobRun]:
        return iter(self._runs.values())
