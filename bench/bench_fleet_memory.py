"""The aggregator's memory per node and its intake while a large fleet is judged.

Memory: tracemalloc over ``Fleet.ingest`` (the service's fleet, as the engine builds it) of
MEMORY_NODES nodes x MEMORY_ROUNDS of the real agent-built reports (vigil/cli/agent_reports.py: 8
GPUs, 8 ConnectX-7 ports, 8 ranks; the first whole, then compact in the version the agent sends:
a compact entry's unchanged values are the base's objects, shared), what the fleet keeps per
node, and how many of its objects the cyclic garbage collector walks; then the same nodes silent past
``fleet.forget_after_seconds``, and what is left once they are forgotten (departed nodes leave
memory).

Cardinality (issue 37): one node's valid credential sending, in every report, a new job name for
each of its 1,024 ranks (or 1,024 new ranks of one job), 16 new GPU indices and 16 new ports with
new counter names, beside an honest node: what the fleet holds for it after CARDINALITY_ROUNDS and
after four times as many (flat: the per-node caps hold it), against CARDINALITY_BUDGET_KIB.

Intake: the real application (aiohttp, on loopback, in this process) holding a fleet of
JUDGED_NODES nodes, evaluated every EVALUATE_SECONDS with every default detector, while a probe
posts real reports of those nodes at PROBE_PER_SECOND and times each answer from when it was due
(a send held up behind a stalled loop counts its wait); the event loop's lag
is the service's own histogram. Twice: the detectors on the event loop (an executor that runs
them inline: how the service judged before) and on the judging thread (how it does now).
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
import tracemalloc
from concurrent.futures import Executor, Future
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from bench.bench_agent import FIXTURE_IB
from bench.measure import Measurement
from vigil.aggregator.app import METRICS_KEY, make_app, tune_gc
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.metrics import GC_GENERATIONS
from vigil.cli.agent_reports import INTERVAL_SECONDS, agent_reports, for_node
from vigil.contract.wire import Report, convert

MEMORY_NODES = 300
MEMORY_ROUNDS = 12  # 30 s of reports: the rings fill with what a steady node keeps
JUDGED_NODES = 5_000  # the largest this shared 2-core machine holds in one process next to its probe
EVALUATE_SECONDS = 2.0  # "judged every few seconds" (issue #20)
PROBE_SECONDS = 12.0
PROBE_PER_SECOND = 100
P99_BUDGET_MS = 100.0  # issue #20: intake p99 while the fleet is judged
SECRET = b"bench-fleet-memory-secret-0123456789"
# Objects of the fleet the cyclic garbage collector walks, per node: ~70-120 now (histories, their
# rings, counter baselines; ~95 while the GPU states' sequences were lists). With its samples
# tracked (NamedTuples) the fleet had ~620 and a full collection at 2,000 nodes stopped the service
# ~0.6 s (docs/reports.md).
MAX_TRACKED_PER_NODE = 200


class InlineExecutor(Executor):
    """Runs the submitted call at once on the caller's thread: the detectors on the event loop."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting side, as a thread pool does
            future.set_exception(exc)
        return future


# Reports of the attack measured: at the 20 reports a second the seq bound lets one node send, 100
# is 5 s of it; the flat check compares with four times as many.
CARDINALITY_ROUNDS = 100
# What one node's credential may make the aggregator hold, at the default caps (fleet.max_*_per_node):
# 512 ranks with their windows, 64 GPU and 64 port histories (1.2 MiB measured). 2 MiB a node is 25 GiB only if every
# one of 12,500 nodes attacked at once; an attacker's own node is the usual bound.
CARDINALITY_BUDGET_KIB = 2048.0


def _attack_report(n: int, ts: float, new_jobs: bool) -> Report:
    """Report ``n`` of the attacking node: every rank, GPU, port and counter name in it is new."""
    ranks = [{"job": f"atk-{n}-{r}" if new_jobs else "atk", "rank": r if new_jobs else 1024 * n + r,
              "window_seconds": 5.0, "window_end_ts": ts, "steps": 3, "last_step": 100, "last_progress_ts": ts,
              "step_seconds_p50": 1.1, "compute_seconds_p50": 1.0, "comm_seconds_p50": 0.1} for r in range(1024)]
    gpus = [{"index": 256 * n + i, "uuid": f"GPU-atk-{n}-{i}"} for i in range(16)]
    ports = [{"device": f"atk{n}_{p}", "port": 1, "counters": {f"c{n}_{p}_{k}": k for k in range(64)}}
             for p in range(16)]
    return convert({"node": "mallory", "boot_id": "mallory-boot", "seq": n + 1, "ts": ts,
                    "interval_seconds": INTERVAL_SECONDS, "ranks": ranks, "gpus": gpus, "ports": ports}, Report)


def cardinality() -> list[Measurement]:
    rows = []
    for new_jobs, what in ((True, "a new job per rank per report"), (False, "1,024 new ranks per report")):
        fleet = Engine(parse_config({}), Ledger.in_memory()).fleet
        t0 = 1.7e9
        fleet.ingest(_attack_report(0, t0, new_jobs), t0)  # one-offs (interned names, code paths)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            held: list[float] = []
            refused = 0
            for n in range(1, 4 * CARDINALITY_ROUNDS + 1):
                ts = t0 + n * 0.05
                refused += sum(fleet.ingest(_attack_report(n, ts, new_jobs), ts).values())
                if n in (CARDINALITY_ROUNDS, 4 * CARDINALITY_ROUNDS):
                    gc.collect()
                    held.append(tracemalloc.get_traced_memory()[0] - before)
        finally:
            tracemalloc.stop()
        node = fleet.view().nodes["mallory"]
        rows.append(Measurement(
            f"aggregator memory held for one node under the cardinality attack ({what})", round(held[1] / 1024),
            "KiB", CARDINALITY_BUDGET_KIB,
            note=f"tracemalloc after {4 * CARDINALITY_ROUNDS} attack reports ({held[0] / 1024:,.0f} KiB after "
                 f"{CARDINALITY_ROUNDS}: flat); it holds {len(node.ranks)} ranks, "
                 f"{len({j for j, _ in node.ranks})} jobs, {len(node.gpus)} GPUs, {len(node.ports)} ports; "
                 f"{refused:,} entries refused, {sum(fleet.evicted.values()):,} evicted"))
    return rows


def _report(template: dict[str, Any], n: int, seq: int, ts: float) -> Report:
    return convert(for_node(template, n, f"gpu-{n:05d}", f"{n:032x}", seq, ts), Report)


def memory() -> list[Measurement]:
    templates = agent_reports(MEMORY_ROUNDS, FIXTURE_IB / "mlx5_0", compact=True)
    # The service's fleet: the port counters its detectors judge are the ones it keeps deltas of.
    fleet = Engine(parse_config({"fleet": {"forget_after_seconds": 3600}}), Ledger.in_memory()).fleet
    t0 = 1.7e9
    fleet.ingest(_report(templates[0], 99_999, 1, t0), t0)  # first-node one-offs (interned names)
    gc.collect()
    tracked_before = len(gc.get_objects())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq, template in enumerate(templates, start=1):
            ts = t0 + seq * INTERVAL_SECONDS
            for n in range(MEMORY_NODES):
                fleet.ingest(_report(template, n, seq, ts), ts)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracked = len(gc.get_objects()) - tracked_before
        later = t0 + 3700
        fleet.ingest(_report(templates[0], 99_999, len(templates) + 1, later), later)  # whole
        gone = len(fleet.forget_departed(later))
        fleet.forget_idle_jobs(later + 3600)
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert gone == MEMORY_NODES
    return [
        Measurement("aggregator fleet memory per node (8 GPUs, 8 ports, 8 ranks)", round(held / MEMORY_NODES / 1024),
                    "KiB", None, note=f"tracemalloc, {MEMORY_NODES} nodes x {MEMORY_ROUNDS} real reports; "
                    f"x 12,500 nodes = {held / MEMORY_NODES * 12_500 / 2**30:.1f} GiB"),
        Measurement("aggregator fleet objects the garbage collector walks, per node", round(tracked / MEMORY_NODES),
                    "objects", MAX_TRACKED_PER_NODE, note="tracked by the cyclic collector after the same reports: "
                    "a full collection stops intake for as long as it walks them (the samples and wire states "
                    f"are untracked); x 12,500 nodes = {tracked / MEMORY_NODES * 12_500 / 1e6:.1f} million"),
        Measurement("aggregator memory left per departed node", round(left / MEMORY_NODES / 1024, 2), "KiB", 1.0,
                    note="after fleet.forget_after_seconds (the fleet, its jobs' ranks, the histories)"),
    ]


async def _probe(executor: Executor | None, templates: list[dict[str, Any]]) -> dict[str, float]:
    config = parse_config({"evaluate_interval_seconds": EVALUATE_SECONDS, "dry_run": True})
    sink = Ledger.in_memory()
    engine = Engine(config, sink)
    now = time.time()
    for seq, template in enumerate(templates[:2], start=1):
        for n in range(JUDGED_NODES):
            engine.ingest(_report(template, n, seq, now), now)
    app = make_app(config, engine, sink, credentials=Credentials(site_secret=SECRET), judge_executor=executor)
    metrics = app[METRICS_KEY]
    latencies: list[float] = []
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        start = time.perf_counter()
        sent = 0
        while time.perf_counter() - start < PROBE_SECONDS:
            n = sent % JUDGED_NODES
            template = templates[2 + (sent // JUDGED_NODES) % (len(templates) - 2)]
            body = json.dumps(for_node(template, n, f"gpu-{n:05d}", f"{n:032x}", 3 + sent // JUDGED_NODES,
                                       time.time()))
            due = start + sent / PROBE_PER_SECOND
            resp = await client.post("/v1/reports", data=body, headers={
                "Authorization": f"Bearer {node_token(SECRET, f'gpu-{n:05d}')}", "Content-Type": "application/json"})
            # From when the report was due: a send held up behind a stalled loop counts its wait
            # (the client shares the loop, as a remote agent shares the server's).
            latencies.append(time.perf_counter() - due)
            assert resp.status == 202, await resp.text()
            resp.release()
            sent += 1
            await asyncio.sleep(max(0.0, start + sent / PROBE_PER_SECOND - time.perf_counter()))
    lag = next(iter(metrics.loop_lag_observed.collect())).samples
    judged = next(iter(metrics.evaluate_seconds.collect())).samples
    count = next(s.value for s in lag if s.name.endswith("_count"))
    lag_sum = next(s.value for s in lag if s.name.endswith("_sum"))
    evaluations = next(s.value for s in judged if s.name.endswith("_count"))
    eval_sum = next(s.value for s in judged if s.name.endswith("_sum"))
    latencies.sort()
    return {**_gc_pauses(next(iter(metrics.gc_pause_seconds.collect())).samples),
            "p50": latencies[len(latencies) // 2], "p99": latencies[int(0.99 * (len(latencies) - 1))],
            "max": latencies[-1], "lag_mean": lag_sum / count if count else 0.0,
            "lag_max": _max_bucket(lag), "evaluations": evaluations,
            "evaluate_mean": eval_sum / evaluations if evaluations else 0.0, "sent": len(latencies)}


def _gc_pauses(samples: list[Any]) -> dict[str, float]:
    """From the service's GC pause histogram: collections, full ones, the longest's bucket bound."""
    by_generation = {g: [s for s in samples if s.labels.get("generation") == g] for g in GC_GENERATIONS}
    counts = {g: next(s.value for s in got if s.name.endswith("_count")) for g, got in by_generation.items()}
    longest = max((_max_bucket(got) for g, got in by_generation.items() if counts[g]), default=0.0)
    return {"gc_collections": sum(counts.values()), "gc_full": counts["2"], "gc_max": longest}


def _max_bucket(samples: list[Any]) -> float:
    """The upper bound of the highest histogram bucket holding a measurement."""
    buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
    total = buckets[-1][1]
    return next(le for le, v in buckets if v >= total)


def _bound(upper: float) -> str:
    return "> 2.5 s" if upper == float("inf") else f"<= {upper * 1000:.0f} ms"


def intake() -> list[Measurement]:
    templates = agent_reports(6, FIXTURE_IB / "mlx5_0")
    rows = []
    for label, executor in (("detectors on the event loop (before)", InlineExecutor()),
                            ("detectors on the judging thread (now)", None)):
        gc.collect()
        r = asyncio.run(_probe(executor, templates))
        what = f"intake p99, {JUDGED_NODES:,} nodes judged every {EVALUATE_SECONDS:g} s, {label}"
        note = (f"p50 {r['p50'] * 1000:.1f} ms, max {r['max'] * 1000:.0f} ms over {r['sent']:.0f} real reports; "
                f"event loop lag mean {r['lag_mean'] * 1000:.1f} ms, max {_bound(r['lag_max'])}; "
                f"{r['evaluations']:.0f} evaluations of {r['evaluate_mean']:.2f} s each; {r['gc_collections']:.0f} "
                f"garbage collections ({r['gc_full']:.0f} full), the longest {_bound(r['gc_max'])}; "
                "shared 2-core machine")
        rows.append(Measurement(what, round(r["p99"] * 1000, 1), "ms", P99_BUDGET_MS, note=note))
    return rows


def measure() -> list[Measurement]:
    thresholds, switch = gc.get_threshold(), sys.getswitchinterval()
    tune_gc()  # the service's own collector and thread-switch settings
    try:
        return memory() + cardinality() + intake()
    finally:
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(switch)
        gc.unfreeze()


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
