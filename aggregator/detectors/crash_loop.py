"""Crash-loop detector: jobs that restart without progressing, and nodes on which many jobs crash.

It reads each job's incarnations (``aggregator/job_runs.py``) and each rank's state. A job whose last
restarts each ended without progress is held (``hold_job``, job-level: no node named or removed), and
a node whose ranks exited first in several different multi-node jobs is sent to inspection (a
"lemon"); it does not judge hangs or slow ranks (hang, straggler). Evidence windows, thresholds,
persistence, designed false-positive rates and lookalikes: docs/detectors.md, "crash_loop, app_signals".
"""

from __future__ import annotations

from collections import deque

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.hang import JOB_NODES_NAMED
from vigil.aggregator.fleet import FleetView, JobState
from vigil.aggregator.job_runs import Incarnation, JobRun, JobRuns
from vigil.contract.validation import StrictModel

NAME = "crash_loop"
# Incarnations named in a hold's evidence (``incarnations``): the latest few.
INCARNATIONS_NAMED = 8
# Crashes remembered per node for the lemon test: far beyond lemon_jobs.
_CRASHES_KEPT = 32


class CrashLoopConfig(StrictModel):
    """Jobs that restart without progress (hold_job) and nodes many jobs crash on (docs/detectors.md)."""
    enabled: bool = True
    # Restarts whose incarnation ended without progress before the job is held. NVIDIA's
    # resiliency extension stops a job that makes no progress across restarts (its ft_launcher's
    # progress tracker, docs "Operations and troubleshooting"); torchrun gives up after
    # --max-restarts (default 0, never restarted; PyTorch's elastic examples use 3). Three failed
    # restarts: four runs of the job, each crashing before it got past where the last one had got.
    max_restarts_without_progress: int = Field(default=3, ge=1)
    # The restarts counted began within this long: six hours hold four runs of a large job whose
    # start-up (image, data, checkpoint load) and replay to its crash take over an hour each.
    window_seconds: float = Field(default=21600.0, gt=0)
    # An incarnation progressed when its best step is at least this far past every earlier one's.
    # Where a crash lands varies by a step or two between ranks and runs (the last heartbeat may or
    # may not get out); real progress after a restart is a checkpoint interval (hundreds of steps).
    # A checkpoint the incarnation completed past the step it resumed at, beyond every earlier
    # one, is progress whatever its size (the resiliency extension's --ft-min-progress-iterations
    # default, 1, on the completed-checkpoint iteration).
    min_progress_steps: int = Field(default=10, ge=1)
    action: Action = Action.HOLD_JOB
    # Lemon node: first to exit in this many different jobs ...
    lemon_jobs: int = Field(default=3, ge=2)
    # ... within a day (each crash alone explainable: a user bug, an OOM; three jobs, a pattern).
    lemon_window_seconds: float = Field(default=86400.0, gt=0)
    # A node's ranks exited first when every other node of the job exited this much later or still
    # ran this long after: each agent notices an exit at its own collect phase (2.5 s) and pushes
    # it at once, the aggregator evaluates every 2.5 s; 10 s is twice that jitter, so a job that
    # crashes everywhere together (an exception at the same step, a teardown) singles out nobody.
    lemon_exit_skew_seconds: float = Field(default=10.0, gt=0)
    lemon_action: Action = Action.INSPECT_HARDWARE


class CrashLoopDetector:
    name = NAME

    def __init__(self, config: CrashLoopConfig) -> None:
        self.config = config
        self.runs = JobRuns(max(config.window_seconds, config.lemon_window_seconds))
        # job -> index of the first failed incarnation of the hold episode found (held until progress)
        self._anchor: dict[str, int] = {}
        # job -> rank -> when it was first seen exited in its current exit (a job with none exited and
        # no entry here has no crash to judge: skipped in O(1))
        self._exited: dict[str, dict[int, float]] = {}
        # (job, incarnation) whose crash was attributed (or found unattributable) already
        self._judged: dict[tuple[str, int], float] = {}
        # node -> recent crashes it was first in: (aggregator time, job)
        self._crashes: dict[str, deque[tuple[float, str]]] = {}
        self._lemon_since: dict[str, float] = {}

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        self.runs.observe(view, now)
        out: list[Finding] = []
        for job in view.jobs.values():
            run = self.runs.get(job.name)
            if run is None:
                continue
            hold = self._hold(job, run, now)
            if hold is not None:
                out.append(hold)
            self._crash(job, run, now, view.revision is not None)
        for name in [j for j in self._anchor if self.runs.get(j) is None]:
            del self._anchor[name]
        out.extend(self._lemons(view, now))
        return out

    # -- crash loop ------------------------------------------------------------------------------

    def _failures(self, run: JobRun, floor: int | None, now: float) -> list[Incarnation] | None:
        """The restarted incarnations that ended without progress since the last one that
        progressed, oldest first: from index ``floor`` on (None once one of those progressed), or
        else those begun within the window. One still running counts once it ends."""
        cfg = self.config
        streak: list[Incarnation] = []
        for inc in reversed(run.incarnations):
            if inc.index == 0 or (floor is not None and inc.index < floor) \
                    or (floor is None and now - inc.started > cfg.window_seconds):
                break
            if run.progressed(inc, cfg.min_progress_steps):
                if floor is not None:
                    return None
                break
            if inc.ended is not None:
                streak.append(inc)
        return streak[::-1]

    def _hold(self, job: JobState, run: JobRun, now: float) -> Finding | None:
        cfg = self.config
        n = cfg.max_restarts_without_progress
        anchor = self._anchor.get(job.name)
        failures = self._failures(run, anchor, now)
        if anchor is not None and (not failures or now - (failures[-1].ended or now) > cfg.window_seconds):
            del self._anchor[job.name]  # progressed (or the loop stopped long ago): the episode is over
            anchor, failures = None, self._failures(run, None, now)
        if not failures or len(failures) < n:
            return None
        if anchor is None:
            self._anchor[job.name] = failures[0].index
        # Every further n failures (a released job that loops again, or a hold that did not land)
        # are a new hold; within one batch the episode, and so the decision id, stays the same.
        first = failures[(len(failures) // n - 1) * n]
        best = run.best_step()
        shown = list(run.incarnations)[-INCARNATIONS_NAMED:]
        return Finding(
            detector=NAME, node=WHOLE_JOB, job=job.name, action=cfg.action, since=first.started, key="crash_loop",
            reason=(f"job {job.name} restarted {len(failures)} times without progress (none got "
                    f"{cfg.min_progress_steps} steps past step {best} or saved a new checkpoint; threshold {n} in "
                    f"{cfg.window_seconds:g} s): hold it for a person, do not restart it again"),
            evidence={"signal": "crash_loop", "restarts": len(failures), "best_step": best,
                      "checkpoint_step": run.best_checkpoint(),
                      "steps_per_incarnation": [[i.start_step, i.best_step] for i in shown],
                      "threshold": n, "window_seconds": cfg.window_seconds,
                      "job_nodes": sorted(job.nodes())[:JOB_NODES_NAMED]})

    # -- lemon node ------------------------------------------------------------------------------

    def _crash(self, job: JobState, run: JobRun, now: float, shortcut: bool = True) -> None:
        """Note when each rank of ``job``'s current incarnation was first seen exited; once its
        crash can be judged, the node whose ranks exited first, if one did by the skew, had it."""
        cfg = self.config
        exited = self._exited.get(job.name)
        if shortcut and not run.exited and not exited:
            return  # no rank exited, none noted: nothing below would change or be judged
        if exited is None:
            exited = self._exited[job.name] = {}
        first_exit: dict[str, float | None] = {}  # node -> when its first rank exited (None: none has)
        current = run.latest.index
        for r in job.ranks.values():
            if run.incarnation_of(r.rank) != current:
                continue  # a rank of an earlier run not restarted yet: that run's crash was judged
            ts: float | None = None
            if r.last.state == "exited":
                ts = exited.setdefault(r.rank, now)
            else:
                exited.pop(r.rank, None)
            held = first_exit.get(r.node)
            first_exit[r.node] = ts if held is None else held if ts is None else min(held, ts)
        exits = [ts for ts in first_exit.values() if ts is not None]
        episode = (job.name, current)
        if not exits or episode in self._judged or len(first_exit) < 2:
            return
        first = min(exits)
        culprits = [n for n, ts in first_exit.items() if ts == first]
        others = [ts for n, ts in first_exit.items() if n not in culprits]
        if any(ts is not None and ts - first < cfg.lemon_exit_skew_seconds for ts in others):
            self._judged[episode] = now  # exited together: nobody singled out
            return
        if now - first < cfg.lemon_exit_skew_seconds:
            return  # the rest may still follow within the skew
        self._judged[episode] = now
        # One node first; not one holding rank 0, whose extra duties (logging, gathering a
        # checkpoint, evaluation) make it the first to fail for the job's own reasons.
        if len(culprits) == 1 and all(r.rank != 0 for r in job.ranks.values() if r.node == culprits[0]):
            ring = self._crashes.setdefault(culprits[0], deque(maxlen=_CRASHES_KEPT))
            ring.append((first, job.name))

    def _lemons(self, view: FleetView, now: float) -> list[Finding]:
        cfg = self.config
        horizon = now - cfg.lemon_window_seconds
        out: list[Finding] = []
        for key in [k for k, ts in self._judged.items() if ts < horizon]:
            del self._judged[key]
        for name, exited in list(self._exited.items()):
            state = view.jobs.get(name)
            if state is None or not exited:
                del self._exited[name]
                continue
            for rank in [r for r in exited if r not in state.ranks]:
                del exited[rank]
        for node, ring in list(self._crashes.items()):
            while ring and ring[0][0] < horizon:
                ring.popleft()
            if not ring:
                del self._crashes[node]
                self._lemon_since.pop(node, None)
                continue
            jobs: dict[str, float] = {}
            for ts, job in ring:
                jobs.setdefault(job, ts)
            if len(jobs) < cfg.lemon_jobs or node not in view.nodes:
                self._lemon_since.pop(node, None)
                continue
            since = self._lemon_since.setdefault(node, min(jobs.values()))
            out.append(Finding(
                detector=NAME, node=node, action=cfg.lemon_action, since=since, key="lemon",
                reason=(f"the first of their job to exit in {len(jobs)} different jobs within "
                        f"{cfg.lemon_window_seconds:g} s (threshold {cfg.lemon_jobs}): each crash alone may be the "
                        f"job's, together they point at this node"),
                evidence={"signal": "lemon_node", "jobs": sorted(jobs),
                          "crashes": [[round(ts, 1), job] for ts, job in ring],
                          "threshold": cfg.lemon_jobs, "window_seconds": cfg.lemon_window_seconds}))
        return out
