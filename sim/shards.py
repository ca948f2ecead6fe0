"""A large healthy fleet run as independent shards in parallel processes, verdicts merged.

It cuts a scenario into the groups of jobs that share nodes (each group's nodes renamed from 0,
its own seed), runs each through the real agent and aggregator (sim.run) in its own process,
and merges what they decided: node-days summed, decisions unioned under the fleet's own node
names, every shard's seed kept. The shards share no aggregator, so nothing fleet-wide is judged
across them (the topology correlations of a leaf or rack, the gate's breaker, fleet-wide
baselines): this is for healthy-fleet statistics (false removals per node-day), and it refuses a
scenario with faults, expectations or any feature that needs the whole fleet. It decides nothing
itself: sim.score scores each shard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from vigil.sim.run import SimDecision, probing_enabled, run_scenario
from vigil.sim.scenario import REMOVAL_ACTIONS, Scenario, ScenarioError, parse_scenario
from vigil.sim.score import removal_key, score

# Stated with every sharded result (and in docs/simulator.md): what a shard cannot see.
CAVEAT = ("shards share no aggregator: fleet-wide detectors (topology correlation of a leaf or rack, "
          "fleet baselines) and the gate's breaker judged each shard alone, so this measures a healthy "
          "fleet's per-node false removals, not fleet-wide behaviour")


def shard_refusal(sc: Scenario) -> str | None:
    """Why ``sc`` cannot be sharded honestly, or None: anything that expects a decision or acts
    across nodes needs one aggregator over the whole fleet."""
    reasons = []
    if sc.faults:
        reasons.append(f"{len(sc.faults)} faults")
    if sc.expect:
        reasons.append(f"{len(sc.expect)} expectations")
    if sc.allow:
        reasons.append("allowed removals")
    if sc.expect_breaker != "any":
        reasons.append(f"expect_breaker: {sc.expect_breaker}")
    if sc.remediation is not None:
        reasons.append("remediation")
    if sc.isolations or probing_enabled(sc):
        reasons.append("probes")
    if not sc.jobs:
        reasons.append("no jobs to shard by")
    jobless = set(sc.node_names()) - {n for j in sc.jobs for n in sc.resolve_nodes(j.nodes)}
    if jobless:
        reasons.append(f"{len(jobless)} nodes in no job (a shard is a group of jobs)")
    if not reasons:
        return None
    return (f"scenario {sc.name}: cannot be run in shards ({', '.join(reasons)}); shards are for "
            "healthy-fleet statistics only: " + CAVEAT)


def job_shards(sc: Scenario, seed: int | None = None) -> list[Scenario]:
    """``named_shards`` without the names."""
    return [shard for shard, _ in named_shards(sc, seed)]


def named_shards(sc: Scenario, seed: int | None = None) -> list[tuple[Scenario, list[str]]]:
    """The fleet cut into independent pieces: the jobs that share nodes, on those nodes (renamed
    from 0, in fleet order), each with its own seed (``seed`` or the scenario's, x 1000 + the
    shard's index); GPU profiles and every other setting kept; each with its nodes' fleet names
    (shard node i is names[i]). Raises ScenarioError where
    ``shard_refusal`` says why not."""
    refused = shard_refusal(sc)
    if refused is not None:
        raise ScenarioError(refused)
    base = sc.seed if seed is None else seed
    groups: list[tuple[set[str], list[Any]]] = []
    for job in sc.jobs:
        nodes = set(sc.resolve_nodes(job.nodes))
        touching = [g for g in groups if g[0] & nodes]
        for g in touching[1:]:  # a job that bridges two groups joins them
            touching[0][0].update(g[0])
            touching[0][1].extend(g[1])
            groups.remove(g)
        if touching:
            touching[0][0].update(nodes)
            touching[0][1].append(job)
        else:
            groups.append((nodes, [job]))
    order = {n: i for i, n in enumerate(sc.node_names())}
    out = []
    for k, (nodes, jobs) in enumerate(groups):
        names = sorted(nodes, key=order.__getitem__)
        rename = {n: sc.fleet.name_format.format(i) for i, n in enumerate(names)}
        data = sc.model_dump(exclude_none=True)
        data["name"] = f"{sc.name}-shard{k}"
        data["seed"] = base * 1000 + k
        data["fleet"]["nodes"] = len(names)
        data["fleet"]["profiles"] = [
            {"nodes": [rename[n] for n in sc.resolve_nodes(g.nodes) if n in rename], "profile": g.profile}
            for g in sc.fleet.profiles if any(n in rename for n in sc.resolve_nodes(g.nodes))]
        data["jobs"] = [{**j.model_dump(exclude_none=True), "nodes": [rename[n] for n in sc.resolve_nodes(j.nodes)]}
                        for j in sorted(jobs, key=sc.jobs.index)]
        data["faults"], data["expect"], data["allow"] = [], [], []
        out.append((parse_scenario(data, data["name"]), names))
    return out


@dataclass(frozen=True)
class ShardResult:
    """One shard's verdict, compact enough to come back from a worker process."""

    name: str
    seed: int
    nodes: int
    simulated_seconds: float
    reports: int
    passed: bool
    removals: int  # distinct removals the scorer counted
    proposed_removals: int  # distinct removing decisions proposed, admitted or not
    false_removals: int
    decisions: list[dict[str, Any]]  # every decision, its node under the fleet's name
    wall_seconds: float
    cpu_seconds: float
    # Of ``cpu_seconds``, the start-up and the first report interval (building every node's agent,
    # its first GPU, RDMA, PCIe and configuration reads): paid once however long the run.
    start_cpu_seconds: float = 0.0
    # Of ``cpu_seconds``, everything up to the simulation's last step; the rest (closing every node,
    # scoring) is paid once too.
    steps_cpu_seconds: float = 0.0

    @property
    def node_days(self) -> float:
        return self.nodes * self.simulated_seconds / 86400.0


@dataclass(frozen=True)
class ShardedResult:
    scenario: str
    shards: list[ShardResult]
    max_removals: int | None
    wall_seconds: float
    caveat: str = CAVEAT
    workers: int = 1

    @property
    def node_days(self) -> float:
        return sum(s.node_days for s in self.shards)

    @property
    def cpu_seconds(self) -> float:
        return sum(s.cpu_seconds for s in self.shards)

    @property
    def reports(self) -> int:
        return sum(s.reports for s in self.shards)

    @property
    def removals(self) -> int:
        return sum(s.removals for s in self.shards)

    @property
    def proposed_removals(self) -> int:
        return sum(s.proposed_removals for s in self.shards)

    @property
    def false_removals(self) -> int:
        return sum(s.false_removals for s in self.shards)

    @property
    def passed(self) -> bool:
        capped = self.max_removals is None or self.removals <= self.max_removals
        return capped and all(s.passed for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "pass": self.passed, "sharded": True, "caveat": self.caveat,
            "workers": self.workers, "node_days": round(self.node_days, 3), "reports": self.reports,
            "removals": self.removals, "max_removals": self.max_removals,
            "proposed_removals": self.proposed_removals, "false_drains": self.false_removals,
            "false_removals_per_1000_node_days": round(self.false_removals * 1000.0 / self.node_days, 3)
            if self.node_days else None,
            "wall_seconds": round(self.wall_seconds, 3), "cpu_seconds": round(self.cpu_seconds, 3),
            "decisions": sorted((d for s in self.shards for d in s.decisions),
                                key=lambda d: (d["t"], d.get("node") or "", d["action"])),
            "shards": [{"name": s.name, "seed": s.seed, "nodes": s.nodes, "node_days": round(s.node_days, 3),
                        "pass": s.passed, "removals": s.removals, "false_drains": s.false_removals,
                        "wall_seconds": round(s.wall_seconds, 3), "cpu_seconds": round(s.cpu_seconds, 3)}
                       for s in self.shards],
        }


def run_shard(shard: Scenario, fleet_names: Sequence[str] | None = None) -> ShardResult:
    """One shard through the real pipeline and the scorer; its decisions' nodes renamed back to
    ``fleet_names`` (shard node i is ``fleet_names[i]``)."""
    cpu0 = time.process_time()
    started: list[float] = []
    stepped = [0.0]

    def progress(done: float, total: float, decisions: int) -> None:
        del total, decisions
        stepped[0] = time.process_time() - cpu0
        if not started and done >= shard.report_interval_seconds:
            started.append(stepped[0])

    result = run_scenario(shard, progress=progress)
    s = score(result)
    back = dict(zip(shard.node_names(), fleet_names, strict=True)) if fleet_names is not None else {}
    decisions = [fleet_decision(d, shard.name, back) for d in result.decisions]
    return ShardResult(
        name=shard.name, seed=result.seed, nodes=shard.fleet.nodes, simulated_seconds=result.simulated_seconds,
        reports=result.reports, passed=s.passed, removals=s.removal_count,
        proposed_removals=len({removal_key(d) for d in result.decisions if d.action in REMOVAL_ACTIONS}),
        false_removals=len(s.false_removals), decisions=decisions, wall_seconds=result.wall_seconds,
        cpu_seconds=time.process_time() - cpu0, start_cpu_seconds=started[0] if started else 0.0,
        steps_cpu_seconds=stepped[0])


def fleet_decision(d: SimDecision, shard: str, fleet_names: dict[str, str]) -> dict[str, Any]:
    """A shard's decision as the merged result lists it: a node under its fleet name, with the
    shard it came from; a rack's, a row's or a leaf's subject keeps the shard's own name (a
    shard's topology is its nodes renumbered from 0, not the fleet's: ``CAVEAT``)."""
    data = d.to_json()
    if d.node is not None:
        data["node"] = fleet_names.get(d.node, d.node)
    data["shard"] = shard
    return data


def _run_one(job: tuple[Scenario, list[str]]) -> ShardResult:
    return run_shard(*job)


def default_workers() -> int:
    """One worker per core this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def run_sharded(sc: Scenario, *, workers: int, seed: int | None = None,
                on_shard: Callable[[ShardResult], None] | None = None) -> ShardedResult:
    """``sc`` as ``job_shards`` in ``workers`` processes (1: in this one), largest shard first;
    ``on_shard`` hears each as it finishes."""
    jobs = sorted(named_shards(sc, seed), key=lambda j: -j[0].fleet.nodes * j[0].duration_seconds)
    wall0 = time.perf_counter()
    done: dict[str, ShardResult] = {}
    if workers <= 1 or len(jobs) == 1:
        for job in jobs:
            done[job[0].name] = r = _run_one(job)
            if on_shard is not None:
                on_shard(r)
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            for r in pool.map(_run_one, jobs):
                done[r.name] = r
                if on_shard is not None:
                    on_shard(r)
    ordered = [done[f"{sc.name}-shard{k}"] for k in range(len(jobs))]
    return ShardedResult(scenario=sc.name, shards=ordered, max_removals=sc.max_removals,
                         wall_seconds=time.perf_counter() - wall0, workers=workers)
