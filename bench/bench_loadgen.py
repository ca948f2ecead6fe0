"""The aggregator over HTTP under the fleet's real cadence: ``vigil loadgen``'s open-loop schedule
(vigil/loadgen.py) against a real ``vigil aggregator`` process it starts (dry run), with the same
agent-built reports as bench_ingest (the recorded ConnectX-7 HCA, 8 times): each node sends its
first report whole as version 1, its second whole in the newest compact version (3) once the
answer lists it, then compact reports (version 3, what changed), as the agent does.

Runs of RUN_SECONDS, after WARMUP_SECONDS sent and not measured: 2,000 nodes, then the largest of
CANDIDATES (12,500 = 100,000 GPUs at one report per 2.5 s) the machine sustains (every report
accepted, no errors, intake p99 within issue #20's 250 ms, the generator on its schedule), tried
largest first, skipping those
far beyond the capacity the 2,000-node run's CPU per report implies.
Prints p99 intake latency against issue #20's 250 ms, errors, the aggregator's CPU per report
and the reports/s per core it extrapolates to, memory per node, and the generator's own CPU.
"""

from __future__ import annotations

import sys

from bench.bench_agent import FIXTURE_IB
from bench.measure import Measurement
from vigil.agent_reports import INTERVAL_SECONDS
from vigil.loadgen import Plan, run_spawned, summary_lines

RUN_SECONDS = 30.0
# Sent first and not measured: 32 reports a node fill the fleet's sample rings and the detectors'
# windows, as in an aggregator that has run for a while (from an empty fleet the judging passes
# read half as much and the figures flatter it).
WARMUP_SECONDS = 80.0
BASE_NODES = 2_000
CANDIDATES = (12_500, 8_000, 5_000, 4_000, 3_000)
SKIP_ABOVE_CAPACITY = 1.5
P99_BUDGET_MS = 250.0  # issue #20: intake p99 at 12,500 nodes
PER_CORE_BUDGET = 5_000  # reports/s: 12,500 nodes at one report per 2.5 s on one core
# The generator spends ~0.5 ms of CPU a send (aiohttp client): past ~1,500 reports/s one
# process is the bottleneck, so larger runs split the nodes over two processes.
WORKERS_ABOVE_NODES = 3_000


def _run(nodes: int) -> dict:
    plan = Plan(nodes=nodes, duration_seconds=RUN_SECONDS, warmup_seconds=WARMUP_SECONDS,
                workers=2 if nodes > WORKERS_ABOVE_NODES else 1)
    summary = run_spawned(plan, FIXTURE_IB / "mlx5_0")
    for line in summary_lines(summary):
        print(f"  {line}", file=sys.stderr, flush=True)
    return summary


def _sustained(s: dict) -> bool:
    """The generator on schedule (else the run measured it), every report accepted, no errors,
    and the intake p99 within budget (a saturated machine accepts everything late: its queue, not
    a load it sustains)."""
    return (s["valid"] and not s["errors"] and s["accepted"] == s["sent"]
            and s["latency_seconds"]["p99"] * 1000 <= P99_BUDGET_MS)


def _rows(s: dict) -> list[Measurement]:
    n, agg, lat = s["nodes"], s["aggregator"], s["latency_seconds"]
    what = f"loadgen {n:,} nodes over HTTP"
    note = (("INVALID, generator behind schedule: " if not s["valid"] else "")
            + f"offered {s['offered_reports_per_second']:,.0f}/s of {s['target_reports_per_second']:,.0f}/s, accepted "
            f"{s['accepted_reports_per_second']:,.0f}/s, late sends {s['late_sends']}, errors "
            f"{sum(s['errors'].values())} {s['errors'] or ''}; accepted by form "
            f"{', '.join(f'{k} {v:,}' for k, v in s['accepted_by_form'].items())}, rebased {s['rebased']}; "
            f"p50 {lat['p50'] * 1000:.0f} ms, max "
            f"{lat['max'] * 1000:.0f} ms; aggregator {agg['cores']:.2f} cores, loadgen {s['loadgen_cores']:.2f} cores "
            f"({s['workers']} process(es)), shared 2-core machine")
    return [
        Measurement(f"{what}: intake p99", round(lat["p99"] * 1000, 1), "ms", P99_BUDGET_MS, note=note),
        Measurement(f"{what}: aggregator CPU per report", round(agg["cpu_seconds_per_report"] * 1e6), "us", None),
        Measurement(f"{what}: reports/s per aggregator core", agg["reports_per_second_per_core"], "reports/s",
                    PER_CORE_BUDGET, higher_is_better=True, note="extrapolated: 1 / CPU per report (HTTP, "
                    "validation, ingest and the evaluation passes together)"),
        Measurement(f"{what}: memory per node", round(agg["rss_bytes_per_node"] / 1024), "KiB", None,
                    note=f"aggregator RSS growth / nodes; RSS {agg['rss_bytes'] / 2**20:,.0f} MiB at the end"),
    ]


def measure() -> list[Measurement]:
    base = _run(BASE_NODES)
    rows = _rows(base)
    # The aggregator judges and takes reports on one event loop: one core. A candidate offering
    # more than SKIP_ABOVE_CAPACITY x what the base run's CPU per report allows one core is not
    # run (it would only time out for RUN_SECONDS).
    per_report = base["aggregator"]["cpu_seconds_per_report"]
    capacity = 1 / per_report if per_report else float("inf")
    tried: list[str] = []
    largest_run: dict | None = None  # the largest N run: its CPU per report is the best basis to extrapolate
    found: dict | None = base if _sustained(base) else None
    for nodes in CANDIDATES:
        offered = nodes / INTERVAL_SECONDS
        if offered > SKIP_ABOVE_CAPACITY * capacity or (found is not None and nodes <= found["nodes"]):
            continue
        s = _run(nodes)
        largest_run = largest_run or s
        tried.append(f"{nodes:,} (p99 {s['latency_seconds']['p99'] * 1000:,.0f} ms, accepted {s['accepted']:,} of "
                     f"{s['sent']:,}, errors {sum(s['errors'].values())})")
        if _sustained(s):
            found = s
            break
    if largest_run is not None:
        rows += _rows(largest_run)
    if found is not None and found is not base and found is not largest_run:
        rows += _rows(found)
    largest = found["nodes"] if found is not None else 0
    return [*rows, Measurement(f"loadgen: largest N sustained of {CANDIDATES}", largest, "nodes", None,
                               note=f"generator on schedule, every report accepted, no errors, p99 <= "
                                    f"{P99_BUDGET_MS:g} ms; tried "
                                    f"{'; '.join(tried) or 'none'} (skipped those above {SKIP_ABOVE_CAPACITY:g}x the "
                                    f"{capacity:,.0f} reports/s one aggregator core takes at {BASE_NODES:,} nodes)")]


def main() -> int:
    """``make bench`` runs this after bench.run's table: the same columns."""
    rows = measure()
    width = max(len(r.what) for r in rows)
    for r in rows:
        budget = f"{'>=' if r.higher_is_better else '<='} {r.budget:,.0f} {r.unit}" if r.budget is not None else "-"
        verdict = {True: "ok", False: "OVER BUDGET", None: ""}[r.within_budget]
        print(f"{r.what:<{width}}  {f'{r.value:,.1f} {r.unit}':>16}  {budget:>16}  {verdict}")
        if r.note:
            print(f"{'':<{width}}    note: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
