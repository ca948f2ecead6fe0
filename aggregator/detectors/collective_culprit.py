"""Collective culprit detector: the rank(s) that never entered the collective the rest of its process
group waits in, named from PyTorch Flight Recorder dumps, and the node that holds them.

It reads each node's latest ``collectives`` (``wire.CollectiveState``: per rank and process group the
newest collective entered and completed, bound to the scheduler's job by the agent). Per job and group,
one node holding every missing rank is drained (key "hang", the heartbeat hang detector's episode) and
missing ranks on several nodes are an alert naming them; it judges nothing without a consistent set of
fresh dumps from every rank and node of the group. What counts as enough dumps, persistence, witness
nodes, the designed false-removal rate and lookalikes: docs/detectors.md, "collective_culprit".
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.fleet import FleetView
from vigil.aggregator.fleet.view import MarkedNodes
from vigil.aggregator.job_telemetry import JobNodes
from vigil.contract.validation import StrictModel
from vigil.contract.wire import CollectiveState

NAME = "collective_culprit"
# Ranks named in a finding's evidence (a decision body stays small for a 1,000-node job).
RANKS_NAMED = 64


class CollectiveCulpritConfig(StrictModel):
    """The rank that never entered the collective its group waits in, from Flight Recorder dumps (the agent's
    collectors.flight_recorder; docs/detectors.md)."""
    enabled: bool = True
    # Dumps of one group are compared only when taken within this of each other (dump_ts placed on
    # the aggregator's clock): a job's ranks dump on the same collective timeout (NCCL's watchdog,
    # TORCH_NCCL_... ; the job's own stall watchdog) within seconds, and a rank dumped a minute
    # earlier may be behind only because it was dumped earlier. 60 s is far above the agents'
    # clock-offset tolerance (5 s) and the agent's read interval (5 s).
    dump_skew_seconds: float = Field(default=60.0, gt=0)
    # A node whose last report is older than this says nothing current about its ranks (6 report
    # intervals of 2.5 s): its dumps are not judged and the job is not judgeable.
    stale_seconds: float = Field(default=15.0, gt=0)
    # The same missing ranks in the same collective for this long before acting: two report
    # intervals, so a cut read while one rank's dump file was still being written passes by. The
    # issue's budget: the culprit named within 30 s of the dump (agent read 5 s + report 2.5 s +
    # this + evaluation 2.5 s).
    persist_seconds: float = Field(default=5.0, ge=0)
    # A group of fewer ranks than this is not judged (one rank cannot wait for itself).
    min_ranks: int = Field(default=2, ge=2)
    # A drain needs waiting ranks on at least this many nodes besides the culprit. Each node's
    # dumps are its own word (root on a node can write any dump for its own ranks): one node that
    # claims its ranks wait in collective N+1 would otherwise make its only peer the culprit. With
    # two witnesses, a lying node can at most draw an alert; a 2-node job's culprit is alerted.
    min_witness_nodes: int = Field(default=2, ge=2)


@dataclass(frozen=True, slots=True)
class _Rank:
    state: CollectiveState
    node: str
    dump_ts: float  # on the aggregator's clock


class CollectiveCulpritDetector:
    name = NAME

    def __init__(self, config: CollectiveCulpritConfig) -> None:
        self.config = config
        # (job, group, seq, missing ranks) -> the evaluation that first saw it.
        self._first_seen: dict[tuple[str, str, int, tuple[int, ...]], float] = {}
        self._job_nodes = JobNodes()  # which nodes hold each job's GPUs, listed again when that changed

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        cfg = self.config
        # job -> group -> rank -> its state; job -> nodes with dumps; refusals of a group
        groups: dict[str, dict[str, dict[int, _Rank]]] = {}
        conflicted: set[tuple[str, str]] = set()
        dumped_nodes: dict[str, set[str]] = {}
        # The fleet marks the nodes with Flight Recorder state (MarkedNodes.collectives): only those
        # are read, in the fleet's order (a walk of 12,500 nodes: 10 ms a pass, issue 47).
        marked = view.marked if view.revision is not None else None
        for node in view.nodes.values() if marked is None else MarkedNodes.in_order(marked.collectives):
            if now - node.last_seen > cfg.stale_seconds:
                continue
            for s in node.collectives:
                ranks = groups.setdefault(s.job, {}).setdefault(s.group, {})
                if s.rank in ranks:
                    conflicted.add((s.job, s.group))  # one rank from two places: trust neither
                ranks[s.rank] = _Rank(s, node.name, s.dump_ts - node.clock_offset_seconds)
                dumped_nodes.setdefault(s.job, set()).add(node.name)
        out: list[Finding] = []
        seen: set[tuple[str, str, int, tuple[int, ...]]] = set()
        for job, by_group in sorted(groups.items()):
            if not self._nodes_of(view, job) <= dumped_nodes[job]:
                continue  # a node the job runs on sent no dump: not enough to judge
            job_ranks = {r for ranks in by_group.values() for r in ranks}
            named: set[str] = set()
            for group, ranks in sorted(by_group.items()):
                if (job, group) in conflicted:
                    continue
                f = self._judge(job, group, ranks, job_ranks, now, seen)
                if f is not None and f.node not in named:  # one finding per node and job
                    named.add(f.node)
                    out.append(f)
        for key in [k for k in self._first_seen if k not in seen]:
            del self._first_seen[key]
        return out

    def _nodes_of(self, view: FleetView, job: str) -> set[str]:
        """The nodes the fleet places the job on: its GPUs' attribution and its ranks' reports."""
        if view.revision is None:
            nodes = {n.name for n in view.nodes.values() if any(g.last.job == job for g in n.gpus.values())}
        else:  # the job's listing (JobNodes: kept while no GPU's attribution changed), not every GPU
            nodes = set(self._job_nodes.of(view).get(job, ()))
        state = view.jobs.get(job)
        return nodes | (state.nodes() if state is not None else set())

    def _judge(self, job: str, group: str, ranks: dict[int, _Rank], job_ranks: set[int], now: float,
               seen: set[tuple[str, str, int, tuple[int, ...]]]) -> Finding | None:
        cfg = self.config
        sizes = [r.state.group_size for r in ranks.values() if r.state.group_size is not None]
        expected = max(sizes) if sizes else len(job_ranks)
        if len(ranks) < max(expected, cfg.min_ranks):
            return None  # not every rank of the group dumped
        times = [r.dump_ts for r in ranks.values()]
        if max(times) - min(times) > cfg.dump_skew_seconds:
            return None  # not one cut: a rank dumped earlier may only look behind
        seq = max((r.state.last_entered_seq or 0) for r in ranks.values())
        waiting = sorted(n for n, r in ranks.items() if r.state.last_entered_seq == seq
                         and (r.state.last_completed_seq or 0) < seq)
        missing = sorted(n for n, r in ranks.items() if (r.state.last_entered_seq or 0) < seq)
        if not waiting or not missing:
            return None  # everyone past N, or everyone waiting in it: no rank to blame
        key = (job, group, seq, tuple(missing))
        seen.add(key)
        first = self._first_seen.setdefault(key, now)
        if now - first < cfg.persist_seconds:
            return None
        nodes = sorted({ranks[n].node for n in missing})
        waiting_nodes = {ranks[n].node for n in waiting}
        op = ranks[waiting[0]].state.op
        evidence = {
            "signal": "flight_recorder", "group": group, "seq": seq, "op": op,
            "size_bytes": ranks[waiting[0]].state.size_bytes,
            "waiting_ranks": waiting[:RANKS_NAMED], "missing_ranks": missing[:RANKS_NAMED],
            "culprit_nodes": nodes[:RANKS_NAMED],
            "dump_ts": round(max(times), 3),
        }
        what = f"ranks {missing[:8]} never entered {op or 'collective'} #{seq} of process group {group}"
        if len(nodes) == 1 and len(waiting_nodes - set(nodes)) >= cfg.min_witness_nodes:
            return Finding(detector=NAME, node=nodes[0], job=job, action=Action.DRAIN, since=first, key="hang",
                           reason=f"job {job}: {what}, which {len(waiting)} ranks on other nodes wait in "
                                  f"(Flight Recorder)", evidence=evidence)
        return Finding(detector=NAME, node=WHOLE_JOB, job=job, action=Action.ALERT, since=first, key="hang",
                       reason=f"job {job}: {what}; the missing ranks are on {', '.join(nodes[:8])}: "
                              + ("no single culprit node" if len(nodes) != 1 else
                                 f"waiting ranks on fewer than {cfg.min_witness_nodes} other nodes")
                              + " (Flight Recorder)", evidence=evidence)
