"""Hang detector: training jobs whose ranks stopped making progress.

It reads each rank's latest step summary (last progress time on the agent's own clock, state,
last step). A job that stopped everywhere gets ``restart_job``; a job stopped by one or two
nodes (their ranks exited, hung first, fell behind or went silent) gets those nodes drained and
the job restarted. It does not judge slow-but-moving ranks (that is the straggler detector).
"""

from __future__ import annotations

from pydantic import Field

from agent.collectors.collector import StrictModel
from aggregator.decision import Action, Finding
from aggregator.fleet import FleetView, JobState, RankHistory

NAME = "hang"


class HangConfig(StrictModel):
    enabled: bool = True
    # No step for five minutes: half of PyTorch's default NCCL watchdog timeout (600 s,
    # torch.distributed init_process_group), so we act before the job tears itself down blind.
    stall_seconds: float = Field(default=300.0, gt=0)
    # A rank that stopped this much earlier than the rest of its job stopped the job.
    skew_seconds: float = Field(default=30.0, gt=0)
    # More culprit nodes than this is not a node fault: restart the job, drain nobody.
    max_culprit_nodes: int = Field(default=2, ge=1)
    # A rank the agent of a live node stopped reporting this many intervals ago has ended.
    rank_gone_intervals: float = Field(default=4.0, gt=0)
    node_silent_seconds: float = Field(default=30.0, gt=0)


class HangDetector:
    name = NAME

    def __init__(self, config: HangConfig) -> None:
        self.config = config

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        for job in view.jobs.values():
            out.extend(self._judge(view, job, now))
        return out

    def _judge(self, view: FleetView, job: JobState, now: float) -> list[Finding]:
        cfg = self.config
        live: list[RankHistory] = []
        silent_node_ranks: list[RankHistory] = []
        for rank in job.ranks.values():
            node = view.nodes.get(rank.node)
            if node is None:
                continue
            if now - node.last_seen >= cfg.node_silent_seconds:
                silent_node_ranks.append(rank)
            elif node.last_seen - rank.last_seen <= cfg.rank_gone_intervals * node.interval_seconds:
                live.append(rank)
        if not live or all(r.last.state == "exited" for r in live):
            return []  # finished, or nothing left to judge
        stall: dict[int, float] = {}
        for r in live:
            stall[r.rank] = (now - r.last_seen) + max(0.0, r.report_ts - r.last.last_progress_ts)
        stopped = [r for r in live if stall[r.rank] >= cfg.stall_seconds or r.last.state in ("hung", "exited")]
        moving = [r for r in live if r not in stopped]
        if moving and not stopped:
            # A silent node whose peers still progress is not holding the job up (in synchronous
            # training they could not progress without it): that is the silence detector's case.
            return []
        if moving:
            culprits = stopped
            why = "ranks stopped while their peers progressed"
        else:
            culprits = self._blame(live, stall, silent_node_ranks)
            why = "ranks stopped first; the rest of the job waits on them"
            if not culprits and min(stall.values()) < cfg.stall_seconds:
                return []
        first = min(job.ranks.values(), key=lambda r: r.rank)
        since = min(now - stall[r.rank] for r in stopped) if stopped else min(r.last_seen for r in silent_node_ranks)
        culprit_nodes = sorted({r.node for r in culprits})
        all_nodes = job.nodes()
        evidence_base = {
            "signal": "step_progress", "ranks": len(job.ranks), "stopped_ranks": len(stopped),
            "max_stall_seconds": round(max(stall.values()), 1),
            "stall_seconds_threshold": cfg.stall_seconds,
        }
        out: list[Finding] = []
        if culprit_nodes and len(culprit_nodes) <= cfg.max_culprit_nodes and len(culprit_nodes) < len(all_nodes):
            for culprit in culprit_nodes:
                ranks = sorted(r.rank for r in culprits if r.node == culprit)
                out.append(Finding(
                    detector=NAME, node=culprit, job=job.name, action=Action.DRAIN, since=since, key="hang",
                    reason=f"job {job.name}: {why} (ranks {ranks[:8]} on this node)",
                    evidence={**evidence_base, "culprit_ranks": ranks}))
            out.append(Finding(
                detector=NAME, node=first.node, job=job.name, action=Action.RESTART_JOB, since=since, key="hang",
                reason=f"job {job.name} stalled by {', '.join(culprit_nodes)}: restart without them",
                evidence={**evidence_base, "culprit_nodes": culprit_nodes}))
            return out
        if moving:
            return []  # many stopped ranks while others move: not one node's fault, not a hang
        out.append(Finding(
            detector=NAME, node=first.node, job=job.name, action=Action.RESTART_JOB, since=since, key="hang",
            reason=f"job {job.name}: every rank stopped for >= {cfg.stall_seconds:.0f} s, no single culprit",
            evidence={**evidence_base, "culprit_nodes": []}))
        return out

    def _blame(self, live: list[RankHistory], stall: dict[int, float],
               silent_node_ranks: list[RankHistory]) -> list[RankHistory]:
        """In a job stopped everywhere, the ranks that stopped it: exited or hung per their agent,
        behind on steps, on a silent node, or stalled well before the others."""
        cfg = self.config
        states = [r for r in live if r.last.state in ("hung", "exited")]
        if states and len(states) < len(live):
            return states + silent_node_ranks
        if silent_node_ranks:
            return silent_node_ranks
        top = max(r.last.last_step for r in live)
        behind = [r for r in live if r.last.last_step < top]
        if behind and len(behind) < len(live) / 2:
            return behind
        youngest = min(stall.values())
        return [r for r in live if stall[r.rank] - youngest >= cfg.skew_seconds]
