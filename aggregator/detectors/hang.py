"""Hang detector: training jobs whose ranks stopped making progress, caught in seconds.

It reads each rank's latest step summary (last progress time on its agent's clock, state, step, step
time, phase) and the NCCL log events of the job's nodes. A job stopped by one or two nodes (their ranks
stopped, crashed or went silent apart from the rest) gets those nodes drained and the job restarted,
while a job stopped everywhere with no culprit is a job alert and a restart naming no node, NCCL lines
naming one peer add at most an alert about it; it does not judge slow-but-moving ranks (straggler).
Stall limits, blame, NCCL witnesses, false-removal rate:
docs/detectors.md, "hang, silence, memory, pcie_nvlink".
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from statistics import median

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.fleet import FleetView, JobState, RankHistory
from vigil.aggregator.fleet.history import BUSY, RANK_LAST, RANK_LAST_SEEN, RANK_REPORT_TS, RANK_STATE, flag_table
from vigil.aggregator.nccl_peers import PeerNames, Suspect, job_nccl_events, suspect
from vigil.contract.validation import StrictModel

NAME = "hang"
LONG_PHASES = ("checkpointing", "evaluating")
_GAPS_KEPT = 8
# Nodes named in a job-level finding's evidence (``job_nodes``): enough for an actuator to check the
# job runs where it was reported, bounded for a 1,000-node job's decision body.
JOB_NODES_NAMED = 16
# NCCL log events carried in a finding's evidence (``nccl_events``), the latest first.
NCCL_EVENTS_NAMED = 16
# Evaluations whose progress times a job's pace record holds before they are folded into its
# ranks' records (``_Pace``): the fold is the same per-rank work, paid once per this many passes.
_PACE_RING = 16
_PROGRESS_TS = attrgetter("last_progress_ts")
_PHASE = attrgetter("phase")
_NODE_SEEN = attrgetter("last_seen")
_NODE_INTERVAL = attrgetter("interval_seconds")
# RankColumns.flags to 1 where the rank is not running or announced a phase.
_BUSY = flag_table(lambda b: bool(b & BUSY))


class HangConfig(StrictModel):
    enabled: bool = True
    # DESIGN.md section 9: a stopped rank or job with 2 s steps is detected within 30 s. 20 s, plus
    # up to one report interval (2.5 s) for the summary to arrive and one evaluation interval
    # (2.5 s), stays under 30 s; it is ten missed 2 s steps, far beyond step-time jitter.
    min_stall_seconds: float = Field(default=20.0, gt=0)
    # Jobs with long steps get a limit of a few of their own steps (an 8-step stall at 10 s/step).
    step_multiple: float = Field(default=8.0, gt=0)
    # A log printed every N iterations advances only every N steps: a few of the rank's own usual
    # gaps (the agent's training collector uses the same factor, HANG_GAP_FACTOR).
    gap_multiple: float = Field(default=3.0, gt=0)
    # Announced phases have their own limits: checkpoints of 100B+ models to a parallel file
    # system and full evaluation passes take minutes to tens of minutes.
    checkpoint_seconds: float = Field(default=1800.0, gt=0)
    evaluation_seconds: float = Field(default=1800.0, gt=0)
    # A job stopped everywhere with no culprit is alerted at once and restarted after this long:
    # half of PyTorch's default NCCL watchdog timeout (600 s, torch.distributed
    # init_process_group), so the restart comes before the job tears itself down blind.
    stall_seconds: float = Field(default=300.0, gt=0)
    # A rank whose last progress (its agent's clock, placed on the aggregator's) is this much, plus
    # its own usual gap between progress updates, earlier than the latest-stopped rank of its job,
    # at a lower step, stopped the job. Far above the agents' clock-offset tolerance (5 s, fleet
    # clock_offset_tolerance_seconds) and a report interval (2.5 s), so clocks and report phases
    # never set a rank apart; in synchronous training the ranks stop within one step of each other.
    skew_seconds: float = Field(default=30.0, gt=0)
    # More culprit nodes than this is not a node fault: restart the job, drain nobody.
    max_culprit_nodes: int = Field(default=2, ge=1)
    # A rank the agent of a live node stopped reporting this many intervals ago has ended.
    rank_gone_intervals: float = Field(default=4.0, gt=0)
    node_silent_seconds: float = Field(default=30.0, gt=0)
    # A node whose report is this many intervals late says nothing new about its ranks: while
    # their peers progress, time since its last report is not a stall (an agent restart or a
    # network blip on a healthy node is not a hang; a dead node is the silence detector's case).
    late_report_intervals: float = Field(default=2.0, gt=0)
    # NCCL's own words (training-log events nccl_timeout, nccl_warn, nccl_ras of the job's nodes)
    # from this long before the stop on are evidence: twice the ~30 s NCCL's IB transport retries
    # before it logs a completion error (NCCL_IB_TIMEOUT 20: 4.096 us x 2^20 = 4.3 s a try,
    # NCCL_IB_RETRY_CNT 7), so the error that stopped the job is in the window.
    nccl_lead_seconds: float = Field(default=60.0, ge=0)
    # In a job stopped with no single culprit, a peer that the NCCL events of this many distinct
    # witnesses (ranks, or nodes where NCCL's line names no rank) name is the suspect: alerted, never
    # drained on log lines alone. One rank's warning is not enough: a transient IB retry error is
    # logged by the one rank that saw it.
    nccl_min_witnesses: int = Field(default=2, ge=2)


@dataclass(slots=True)
class _Progress:
    ts: float  # the rank's last progress time seen
    gaps: deque[float]  # its recent gaps between progress updates


@dataclass(slots=True)
class _Pace:
    """A job whose every rank was live and judged at the last evaluation, so that an evaluation
    finding all of them running, recently progressed and on reporting nodes (``_all_running``)
    only notes their progress times (C-level list reads) instead of walking each rank in Python.
    The noted evaluations are folded into the ranks' ``_Progress`` records in order (``_fold``),
    exactly as each evaluation would have updated them, before anything reads those records."""

    job: JobState
    members_revision: int
    nodes: list[str]  # the nodes the job's ranks report from, as of members_revision
    ranks: list[RankHistory] | None = None  # the ranks (in the job's order) the records are kept for
    # Per deferred evaluation: each rank's last_progress_ts, and its phase (None: every rank's was None);
    # the times in the columns' slot order (an array, ``slots``) or in ``ranks``'s (a list).
    ring: list[tuple[Sequence[float], list[str | None] | None]] = field(default_factory=list)
    # Each of ``ranks``'s slot in the job's columns (JobState.columns) where those hold exactly its
    # ranks (None: they do not, or not yet checked: ``checked``): ``_all_running`` then reads them.
    slots: list[int] | None = None
    checked: bool = False
    # The fleet revision (FleetView.revision) at which every rank was found running with no phase:
    # while the job's ``runs_revision`` is no later (no state or phase changed since), they still are.
    quiet_revision: int = -1


class HangDetector:
    name = NAME

    def __init__(self, config: HangConfig) -> None:
        self.config = config
        # job -> rank -> [last progress ts seen, recent gaps between progress updates], for the
        # job's live ranks (those judged in the last evaluation).
        self._progress: dict[str, dict[int, _Progress]] = {}
        # (job, rank) -> when it was first seen exited (the evaluation's ``now``), live ranks only.
        self._exited: dict[tuple[str, int], float] = {}
        # job -> its pace record (``_Pace``): the evaluations not yet folded into ``_progress``.
        self._pace: dict[str, _Pace] = {}
        self.columns_noted = 0  # evaluations of a job noted from its columns (a test's witness)

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        for job in view.jobs.values():
            out.extend(self._judge(view, job, now, view.revision is not None))
        for name in [n for n in self._progress if n not in view.jobs]:
            del self._progress[name]
            self._pace.pop(name, None)
        if self._exited:
            for key in [k for k in self._exited if k[1] not in self._progress.get(k[0], ())]:
                del self._exited[key]
        return out

    def _all_running(self, view: FleetView, pace: _Pace, now: float) -> bool:
        """Whether every rank of the job (``pace.ranks``, all live at the last evaluation) is live
        now, running, and progressed within the least stall limit, so that ``_judge`` would find
        nothing and only update the progress records; if so, the progress times are noted in
        ``pace.ring``. Conservative: bounds over the job (its latest report, its earliest progress)
        stand for each rank, and a bound that does not hold sends the job the long way.
        Subtraction and multiplication are monotonic in floating point, so a bound holding
        means each rank's own test (as ``_judge`` computes it) holds."""
        cfg = self.config
        job = pace.job
        if view.jobs.get(job.name) is not job or job.members_revision != pace.members_revision:
            return False  # a rank moved: the nodes are listed again on the long way
        ranks = pace.ranks
        assert ranks is not None
        # The job's nodes, read in C: all in the view, none silent (the earliest seen is not), the
        # latest report, and the least gone limit (a positive multiple of the least interval:
        # multiplication is monotonic in floating point, so it is the least product).
        held = list(map(view.nodes.get, pace.nodes))
        if None in held:
            return False
        node_seen = list(map(_NODE_SEEN, held))
        if now - min(node_seen) >= cfg.node_silent_seconds:
            return False
        seen_max = max(node_seen)
        gone_min = cfg.rank_gone_intervals * min(map(_NODE_INTERVAL, held))
        revision = view.revision
        quiet = revision is not None and job.runs_revision <= pace.quiet_revision
        columns = job.columns if pace.slots is not None else None
        if columns is not None and (quiet or 1 not in columns.flags.translate(_BUSY)):
            # The job's columns (RankColumns), each read in C over contiguous doubles (~2 ms for a
            # min of 100,000) where each read of the ranks' summaries is ~8 ms at 12,500 nodes.
            if not quiet and revision is not None:
                pace.quiet_revision = revision  # every rank running, none in a phase
            seen_min = min(columns.seen)
            if not seen_max - seen_min <= gone_min:  # as below
                return False
            progress = columns.progress[:]
            bound = (now - seen_min) + max(0.0, max(columns.report_ts) - min(progress))
            if not bound < min(cfg.min_stall_seconds, cfg.checkpoint_seconds, cfg.evaluation_seconds):
                return False
            self.columns_noted += 1
            return self._note(pace, progress, None)
        lasts = list(map(RANK_LAST, ranks))
        phases: list[str | None] | None = None
        if not quiet:
            states = list(map(RANK_STATE, lasts))
            if states.count("running") != len(states):
                return False
            phases = list(map(_PHASE, lasts))
            if phases.count(None) == len(phases):
                phases = None
                if revision is not None:
                    pace.quiet_revision = revision  # every rank running, none in a phase
        rank_seen = list(map(RANK_LAST_SEEN, ranks))
        seen_min = min(rank_seen)
        # A rank is live when its node's latest report minus its own is within the gone limit.
        if not seen_max - seen_min <= gone_min:
            return False
        tss = list(map(_PROGRESS_TS, lasts))
        # min/max skip a NaN unless it comes first (then NaN, and the bound fails): a rank with a
        # NaN progress time adds nothing to its stall (max(0.0, nan) is 0.0), as in ``_stall``.
        bound = (now - seen_min) + max(0.0, max(map(RANK_REPORT_TS, ranks)) - min(tss))
        if not bound < min(cfg.min_stall_seconds, cfg.checkpoint_seconds, cfg.evaluation_seconds):
            return False
        return self._note(pace, tss, phases)

    def _note(self, pace: _Pace, tss: Sequence[float], phases: list[str | None] | None) -> bool:
        """One evaluation's progress times into the pace record (folded into the ranks' every
        ``_PACE_RING``): True."""
        pace.ring.append((tss, phases))
        if len(pace.ring) >= _PACE_RING:
            self._fold(pace, self._progress[pace.job.name])
        return True

    @staticmethod
    def _fold(pace: _Pace, progress: dict[int, _Progress]) -> None:
        """The evaluations noted in ``pace.ring`` into the ranks' records, oldest first, as
        ``_judge`` updates them (a gap when a rank advanced in training or no announced phase)."""
        ring = pace.ring
        if not ring:
            return
        assert pace.ranks is not None
        slots = pace.slots
        rows = [(tss, phases, slots is not None and isinstance(tss, array)) for tss, phases in ring]
        for i, rank in enumerate(pace.ranks):
            entry = progress[rank.rank]
            last = entry.ts
            gaps = entry.gaps
            slot = slots[i] if slots is not None else i
            for tss, phases, by_slot in rows:
                ts = tss[slot] if by_slot else tss[i]
                if ts > last:
                    if phases is None or phases[i] is None or phases[i] == "training":
                        gaps.append(ts - last)
                    last = ts
            entry.ts = last
        ring.clear()

    @staticmethod
    def _gaps(live: list[RankHistory], progress: dict[int, _Progress]) -> dict[int, float]:
        """Each live rank's usual seconds between progress updates (0 until two were seen)."""
        out: dict[int, float] = {}
        for r in live:
            gaps = progress[r.rank].gaps
            out[r.rank] = median(gaps) if gaps else 0.0
        return out

    def limit(self, job: JobState, live: list[RankHistory], gaps: dict[int, float]) -> tuple[float, str]:
        """The job's stall limit now, and the phase it follows."""
        cfg = self.config
        phases = {r.last.phase for r in live}
        if "checkpointing" in phases:
            return cfg.checkpoint_seconds, "checkpointing"
        if "evaluating" in phases:
            return cfg.evaluation_seconds, "evaluating"
        steps = [r.last.step_seconds_p50 for r in live if r.last.step_seconds_p50 is not None]
        step = median(steps) if steps else 0.0
        gap = median(gaps.values()) if gaps else 0.0
        fast = max(cfg.min_stall_seconds, cfg.step_multiple * step, cfg.gap_multiple * gap)
        if not all(gaps.values()):
            # A rank not yet seen advancing twice has no known pace (a log printed every 100
            # iterations, or an aggregator that just started): only the long limit applies.
            return max(fast, cfg.stall_seconds), "training"
        return fast, "training"

    def _judge(self, view: FleetView, job: JobState, now: float, shortcut: bool = True) -> list[Finding]:
        cfg = self.config
        live: list[RankHistory] = []
        silent_node_ranks: list[RankHistory] = []
        late: set[int] = set()  # ranks on nodes whose report is overdue (not yet silent)
        nodes = view.nodes
        silent_seconds, gone_intervals, late_intervals = \
            cfg.node_silent_seconds, cfg.rank_gone_intervals, cfg.late_report_intervals
        # Whether any live rank may be stopped: not running, or stalled for the least any limit
        # is (``limit``). None may: nothing below finds anything (the usual job, in O(ranks)).
        min_stall = min(cfg.min_stall_seconds, cfg.checkpoint_seconds, cfg.evaluation_seconds)
        maybe_stopped = False
        # Each live rank's progress into its record: a gap when it advanced (not in an announced
        # phase: a pause there is not the rank's pace), and when it was first seen exited.
        progress = self._progress.get(job.name)
        if progress is None:
            progress = self._progress[job.name] = {}
        job_ranks = list(job.ranks.values())
        pace = self._pace.get(job.name)
        if pace is not None:
            if shortcut and pace.ranks is not None and job_ranks == pace.ranks and self._all_running(view, pace, now):
                return []  # noted in pace.ring: nothing below could find anything
            self._fold(pace, progress)
        for rank in job_ranks:
            node = nodes.get(rank.node)
            if node is None:
                continue
            node_seen = node.last_seen
            if now - node_seen >= silent_seconds:
                silent_node_ranks.append(rank)
            elif node_seen - rank.last_seen <= gone_intervals * node.interval_seconds:
                live.append(rank)
                if now - node_seen > late_intervals * node.interval_seconds:
                    late.add(rank.rank)
                s = rank.last
                ts = s.last_progress_ts
                if s.state != "running":
                    maybe_stopped = True
                    if s.state == "exited":
                        self._exited.setdefault((job.name, rank.rank), now)
                elif not maybe_stopped:
                    maybe_stopped = (now - rank.last_seen) + max(0.0, rank.report_ts - ts) >= min_stall
                entry = progress.get(rank.rank)
                if entry is None:
                    progress[rank.rank] = _Progress(ts, deque(maxlen=_GAPS_KEPT))
                elif ts > entry.ts:
                    if s.phase is None or s.phase == "training":
                        entry.gaps.append(ts - entry.ts)
                    entry.ts = ts
        if len(progress) != len(live):  # every live rank has a record: equal sizes, no other
            alive = {r.rank for r in live}
            for gone in [k for k in progress if k not in alive]:
                del progress[gone]
        if shortcut:
            # Every rank live: each has a record, and the next evaluations may be noted in a ring.
            if pace is None or pace.job is not job or pace.members_revision != job.members_revision:
                pace = self._pace[job.name] = _Pace(job, job.members_revision, sorted(job.nodes()))
            pace.ranks = job_ranks if len(live) == len(job_ranks) else None
            if pace.ranks is not None and not pace.checked:
                # Once a pace record (its ranks are fixed while members_revision is): the columns
                # hold exactly the job's ranks (the fleet's do; a job built by hand has none).
                pace.checked = True
                columns = job.columns
                if len(columns.ranks) == len(job_ranks) and all(
                        r.columns is columns and columns.ranks[r.slot] is r for r in job_ranks):
                    pace.slots = [r.slot for r in job_ranks]
        if shortcut and not maybe_stopped:
            return []  # every live rank progressed within the least limit: none stopped
        gaps = self._gaps(live, progress)
        if not live or all(r.last.state == "exited" for r in live):
            return []  # finished, or nothing left to judge
        limit, phase = self.limit(job, live, gaps)
        stall = {r.rank: self._stall(r, now) for r in live}
        # The agent's own "hung" (no step for its hang_seconds) does not know the job's phase.
        hung_counts = phase == "training"
        stopped = [r for r in live if stall[r.rank] >= limit or r.last.state == "exited"
                   or (hung_counts and r.last.state == "hung")]
        # Moving: progressed at least half a stall limit after the stopped ranks last did. When a
        # job ends, its agents report the exits a report interval or two apart, and the ranks not
        # yet reported exited have not progressed since: they are not peers moving past a crash.
        latest_stop = max((stall[r.rank] for r in stopped), default=0.0)
        # ... and at a step at least as far as the stopped ranks reached: a peer stepping below it
        # is a restarted run replaying from its checkpoint (a restart loop's srun, a requeue), whose
        # other ranks' agents have not yet reported their new processes (issue 40: the old run's
        # "exited" made a node whose rank started a few seconds later a culprit).
        reached = max((r.last.last_step for r in stopped), default=0)
        stopped_ids = {id(r) for r in stopped}  # ``r not in stopped`` was O(live x stopped): minutes at 4,000 nodes
        moving = [r for r in live if id(r) not in stopped_ids
                  and (not stopped or (stall[r.rank] + limit / 2 <= latest_stop and r.last.last_step >= reached))]
        if stopped and not moving and len(stopped) < len(live):
            return []  # the rest has neither stopped nor moved on since: not judgeable yet
        if moving:
            # Peers progress, so a late node's ranks count as stopped only on what its agent last
            # said (its own stall at report time, or a hung/exited state), not on report delay.
            stopped = [r for r in stopped if r.rank not in late or r.last.state in ("hung", "exited")
                       or r.report_ts - r.last.last_progress_ts >= limit]
        if moving and not stopped:
            # A silent node whose peers still progress is not holding the job up (in synchronous
            # training they could not progress without it): that is the silence detector's case.
            return []
        if moving:
            culprits = stopped
            why = "ranks stopped while their peers progressed"
        else:
            culprits = self._blame(view, job.name, live, gaps, silent_node_ranks, limit, now)
            why = "ranks stopped first; the rest of the job waits on them"
            if not culprits and min(stall.values()) < limit:
                return []
        since = min(now - stall[r.rank] for r in stopped) if stopped else min(r.last_seen for r in silent_node_ranks)
        culprit_nodes = sorted({r.node for r in culprits})
        all_nodes = job.nodes()
        evidence_base = {
            "signal": "step_progress", "ranks": len(job.ranks), "stopped_ranks": len(stopped),
            "max_stall_seconds": round(max(stall.values()), 1),
            "stall_seconds_threshold": round(limit, 1), "phase": phase,
            # The nodes its ranks reported from (the first JOB_NODES_NAMED by name): a job-level
            # decision names no node, and an actuator acts on the job only where it runs on one.
            "job_nodes": sorted(all_nodes)[:JOB_NODES_NAMED],
        }
        nccl = job_nccl_events(view, PeerNames(view), job.name, all_nodes, since - cfg.nccl_lead_seconds, now)
        evidence_base["nccl_events"] = [e.evidence() for e in reversed(nccl[-NCCL_EVENTS_NAMED:])]
        out: list[Finding] = []
        if culprit_nodes and len(culprit_nodes) <= cfg.max_culprit_nodes and len(culprit_nodes) < len(all_nodes):
            # The rank whose step count stopped first: the longest stall, then the lowest step.
            first_stop = min(culprits, key=lambda r: (-self._stall(r, now), r.last.last_step, r.rank))
            for culprit in culprit_nodes:
                ranks = sorted(r.rank for r in culprits if r.node == culprit)
                out.append(Finding(
                    detector=NAME, node=culprit, job=job.name, action=Action.DRAIN, since=since, key="hang",
                    reason=f"job {job.name}: {why} (ranks {ranks[:8]} on this node)",
                    evidence={**evidence_base, "culprit_ranks": ranks, "first_stopped_rank": first_stop.rank}))
            out.append(Finding(
                detector=NAME, node=WHOLE_JOB, job=job.name, action=Action.RESTART_JOB, since=since, key="hang",
                reason=(f"job {job.name} stalled by {', '.join(culprit_nodes)} (rank {first_stop.rank} stopped "
                        f"first, at step {first_stop.last.last_step}): restart without them"),
                evidence={**evidence_base, "culprit_nodes": culprit_nodes, "first_stopped_rank": first_stop.rank}))
            return out
        if moving:
            return []  # many stopped ranks while others move: not one node's fault, not a hang
        whole = min(stall.values())
        action = Action.RESTART_JOB if whole >= max(cfg.stall_seconds, limit) else Action.ALERT
        named = suspect(nccl, cfg.nccl_min_witnesses)
        out.append(Finding(
            detector=NAME, node=WHOLE_JOB, job=job.name, action=action, since=since, key="hang",
            reason=(f"job {job.name}: every rank stopped for {whole:.0f} s (limit {limit:.0f} s, {phase}), "
                    f"no single culprit" + ("" if action is Action.RESTART_JOB
                                            else f"; restart after {cfg.stall_seconds:.0f} s")
                    + _suspect_text(named)),
            evidence={**evidence_base, "culprit_nodes": [],
                      "nccl_suspect": None if named is None else {"peer": named.peer, "node": named.node,
                                                                  "witnesses": named.witnesses}}))
        if named is not None and named.node is not None and named.node in view.nodes:
            # NCCL's words name a node the step counts could not: an alert about it, never a drain.
            out.append(Finding(
                detector=NAME, node=named.node, job=job.name, action=Action.ALERT, since=since, key="hang",
                reason=(f"job {job.name} stopped with no single culprit; NCCL log events of {named.witnesses} "
                        f"ranks name this node ({named.peer}): suspected culprit (log evidence only: no removal)"),
                evidence={**evidence_base, "signal": "nccl_logs", "peer": named.peer,
                          "witnesses": named.witnesses}))
        return out

    @staticmethod
    def _stall(r: RankHistory, now: float) -> float:
        """Seconds since the rank last progressed: its agent's view at report time, plus the time
        since that report arrived (each on its own clock, so skew between them does not count)."""
        return (now - r.last_seen) + max(0.0, r.report_ts - r.last.last_progress_ts)

    def _blame(self, view: FleetView, job: str, live: list[RankHistory], gaps: dict[int, float],
               silent_node_ranks: list[RankHistory], limit: float, now: float) -> list[RankHistory]:
        """In a job stopped everywhere, the ranks that stopped it: on a silent node, crashed while
        the rest still ran, or stopped well before the rest at a lower step. An agent's "hung" is
        not among them: every agent says it once its own clock crosses, each at its own phase."""
        cfg = self.config
        if silent_node_ranks:
            return silent_node_ranks
        # When each rank last progressed, on the aggregator's clock (as RankHistory.observe places
        # window ends), so a node's clock offset does not set its ranks apart.
        stopped_at = {r.rank: r.last.last_progress_ts - self._offset(view, r.node) for r in live}
        waiting = [r for r in live if r.last.state != "exited"]
        latest = max((stopped_at[r.rank] for r in waiting), default=max(stopped_at.values()))
        # A crash: the process was gone before the rest had waited a stall limit. Exits seen later
        # are the job tearing itself down (the NCCL watchdog, an operator), one rank after another.
        crashed = [r for r in live if r.last.state == "exited"
                   and self._exited.get((job, r.rank), now) - latest < limit]
        if crashed and len(crashed) < len(live):
            return crashed
        top = max(r.last.last_step for r in live)
        return [r for r in waiting if r.last.last_step < top
                and latest - stopped_at[r.rank] >= cfg.skew_seconds + gaps.get(r.rank, 0.0)]

    @staticmethod
    def _offset(view: FleetView, node: str) -> float:
        state = view.nodes.get(node)
        return state.clock_offset_seconds if state is not None else 0.0


def _suspect_text(named: Suspect | None) -> str:
    if named is None:
        return ""
    where = f"node {named.node}" if named.node is not None else "no node vigil knows"
    return f"; NCCL log events of {named.witnesses} ranks name peer {named.peer} ({where}) as the suspect"
