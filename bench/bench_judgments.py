"""Judgement quality with shipped defaults, measured with ``vigil sim`` against DESIGN.md section 9.

Runs the real agent pipeline and the real aggregator (detectors, gate in dry run) on simulated
clocks, every report at the agent's real 2.5 s cadence, with no agent or aggregator overrides:
false removals of a healthy noisy fleet per 1,000 node-days (over >= 100 node-days), straggler
precision and recall over several seeds for 5-30% slowdowns, the time to drain a 10%-slow node
in a 1,024-node job, and the removals of a job-wide application Xid. Independent simulations
run in parallel processes (one per core); the healthy fleet is split by job (sim/shards.py), whose
statistics are independent. It asserts nothing: it prints figures beside their budgets.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.measure import Measurement
from vigil.sim.run import run_scenario
from vigil.sim.scenario import REMOVAL_ACTIONS, Scenario, load_scenario, parse_scenario, shortened
from vigil.sim.score import removal_key, score
from vigil.sim.shards import job_shards

HEALTHY = "healthy-2s5-100-node-days"
SEEDS = (1, 2, 3)
FACTORS = (1.05, 1.10, 1.20, 1.30)
PR_NODES = 128


def _run(sc: Scenario) -> dict[str, Any]:
    """One simulation in a worker: what the figures need, not the whole result."""
    cpu0 = time.process_time()
    result = run_scenario(sc)
    s = score(result)
    proposed = {removal_key(d) for d in result.decisions if d.action in REMOVAL_ACTIONS}
    return {
        "name": sc.name, "nodes": sc.fleet.nodes, "seconds": sc.duration_seconds,
        "removals": s.removal_count, "false": len(s.false_removals),
        "justified": len(s.removals) - len(s.false_removals),
        "proposed": len(proposed), "met": s.met, "expected": len(s.expectations),
        "latency": s.latencies[0] if s.latencies else None, "wall": result.wall_seconds,
        "cpu": time.process_time() - cpu0,
        "false_detail": [f"{d.action} {d.node} by {d.detector} at {d.t:g} s" for d in s.false_removals][:3],
    }


def slow_node(nodes: int, seed: int, factor: float, fault_at: float = 100.0, deadline: float = 30.0,
              after: float = 10.0) -> Scenario:
    """One job on ``nodes`` nodes, one of them ``factor`` times slower from ``fault_at`` and
    expected drained within ``deadline``; the run goes on ``after`` seconds more, so a late
    drain or one of the wrong node still counts against precision. The slow-node-1024 job with
    the shipped agent and aggregator defaults (no overrides)."""
    data = load_scenario("slow-node-1024").model_dump(exclude_none=True)
    data.update(agent={}, aggregator={}, gate={}, seed=seed, duration_seconds=fault_at + deadline + after)
    data["fleet"]["nodes"] = nodes
    culprit = f"node-{(seed * 7919) % nodes:04d}"
    data["faults"] = [{"kind": "slow_node", "node": culprit, "at_seconds": fault_at, "factor": factor}]
    data["expect"] = [{"node": culprit, "action": "drain", "within_seconds": deadline}]
    data["name"] = f"slow-node-{nodes}-x{factor:g}-seed{seed}"
    return parse_scenario(data, data["name"])


def _workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def measure(node_days: float = 100.0) -> list[Measurement]:
    """Every figure; ``node_days`` < 100 runs only the first part of the healthy fleet's hours
    (a quick look; the budget is stated over >= 100 node-days)."""
    healthy = load_scenario(HEALTHY)
    seconds = min(healthy.duration_seconds, node_days * 86400.0 / healthy.fleet.nodes)
    shards = job_shards(shortened(healthy, seconds))
    pr = [slow_node(PR_NODES, seed, f, after=60.0) for f in FACTORS for seed in SEEDS]
    big = slow_node(1024, 7, 1.10)
    xid13 = load_scenario("xid13-job-wide")
    runs = [*shards, *pr, big, xid13]
    wall0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=_workers()) as pool:
        # the longest (the healthy shards) first, so the pool is not left waiting on one of them
        out = dict(zip([r.name for r in runs], pool.map(_run, runs), strict=True))
    wall = time.perf_counter() - wall0
    hs = [out[s.name] for s in shards]
    node_days = sum(h["nodes"] * h["seconds"] for h in hs) / 86400.0
    removed = sum(h["proposed"] for h in hs)
    healthy_cpu = sum(h["cpu"] for h in hs)
    reports = sum(h["nodes"] * h["seconds"] for h in hs) / healthy.report_interval_seconds
    detail = "; ".join(x for h in hs for x in h["false_detail"])[:200]
    prs = [out[s.name] for s in pr]
    justified = sum(r["justified"] for r in prs)
    false = sum(r["false"] for r in prs)
    met = sum(r["met"] for r in prs)
    expected = sum(r["expected"] for r in prs)
    per_factor = ", ".join(
        f"{f:g}x: {sum(out[s.name]['met'] for s in pr if f'-x{f:g}-' in s.name)}/{len(SEEDS)}" for f in FACTORS)
    b = out[big.name]
    x = out[xid13.name]
    return [
        Measurement("healthy fleet at 2.5 s, jitter <= 0.08: removals per 1,000 node-days",
                    round(removed * 1000.0 / node_days, 2), "", 0.0,
                    note=f"{removed} removals proposed (admitted or not) in {node_days:.1f} node-days of {HEALTHY} "
                         f"with shipped defaults; {healthy_cpu / 60:.1f} CPU-min ({healthy_cpu / reports * 1e6:.0f} us "
                         f"per node report) in {len(shards)} parallel simulations"
                         + (f"; e.g. {detail}" if detail else "")),
        Measurement("straggler precision, 5-30% slowdowns", round(justified / (justified + false), 3)
                    if justified + false else float("nan"), "", 0.99, higher_is_better=True,
                    note=f"{PR_NODES}-node jobs, 2.5 s reports, shipped defaults, factors {FACTORS} x seeds {SEEDS}, "
                         f"90 s after each slowdown: {justified} justified removals, {false} unjustified"
                         + ("" if justified + false else " (no removal at all: precision undefined)")),
        Measurement("straggler recall within 30 s, 5-30% slowdowns", round(met / expected, 3), "", None,
                    higher_is_better=True, note=f"{met} of {expected} slow nodes drained in time ({per_factor})"),
        Measurement("10% slow node in a 1,024-node job, shipped defaults: drained after",
                    b["latency"] if b["latency"] is not None else float("inf"), "s", 30.0,
                    note=f"simulated seconds from the slowdown to the drain; {b['false']} other removals; "
                         f"{b['wall']:.0f} s wall"),
        Measurement("application Xid 13 on every GPU of a 128-GPU job: removals", float(x["proposed"]), "", 0.0,
                    note=f"xid13-job-wide: {x['proposed']} removals proposed, {x['removals']} admitted "
                         f"(bench wall {wall / 60:.1f} min on {_workers()} workers)"),
    ]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--node-days", type=float, default=100.0,
                        help="simulated node-days of the healthy fleet (default and budget: 100)")
    for m in measure(parser.parse_args().node_days):
        ok = {True: "ok", False: "OVER", None: "-"}[m.within_budget]
        print(f"{m.what:70s} {m.value:>10g} {m.unit:4s} budget {m.budget}  {ok}  {m.note}")
    sys.exit(0)
