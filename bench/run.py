"""``make bench``: run every benchmark and print one table against DESIGN.md section 9's budgets.

The benchmark modules are an explicit table; each exposes ``measure() -> list[Measurement]``.
A module that fails is reported as such in the table, not hidden. Exit code is always 0:
budgets are read by people, not asserted (shared machines make timings noisy).
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback

from bench.measure import Measurement

MODULES = [
    "bench.bench_agent",
    "bench.bench_gpu",
    "bench.bench_xid",
    "bench.bench_heartbeat",
    "bench.bench_hang",
    "bench.bench_uninstrumented_hang",
    "bench.bench_ingest",
    "bench.bench_ingest_instructions",
    "bench.bench_evaluation",
    "bench.bench_latency",
    "bench.bench_alertmanager_batch",
    "bench.bench_rdma",
    "bench.bench_sim",
    "bench.bench_replay",
    "bench.bench_judgments",
    "bench.bench_faults",
    "bench.bench_probe_recovery",
    "bench.bench_failover",
    "bench.bench_goodput",
]


def _fmt(v: float) -> str:
    # Two decimals from 10 to 100: an ETTR of 99.56% is not 99.6% (bench_goodput).
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}" if abs(v) >= 10 else f"{v:.3g}"


def main(argv: list[str]) -> int:
    only = set(argv)
    rows: list[Measurement] = []
    failures: list[str] = []
    for name in MODULES:
        if only and name.rsplit(".", 1)[-1] not in only and name not in only:
            continue
        start = time.perf_counter()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(name)
            rows.extend(module.measure())
        except Exception:  # noqa: BLE001 - a broken benchmark is a row in the table, not a crash
            failures.append(f"{name}: {traceback.format_exc(limit=3)}")
        print(f"  {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    width = max((len(r.what) for r in rows), default=20)
    print()
    print(f"{'what':<{width}}  {'measured':>14}  {'budget':>14}  verdict")
    print(f"{'-' * width}  {'-' * 14}  {'-' * 14}  -------")
    for r in rows:
        op = ">=" if r.higher_is_better else "<="
        budget = f"{op} {_fmt(r.budget)} {r.unit}" if r.budget is not None else "-"
        verdict = {True: "ok", False: "OVER BUDGET", None: ""}[r.within_budget]
        print(f"{r.what:<{width}}  {_fmt(r.value) + ' ' + r.unit:>14}  {budget:>14}  {verdict}")
        if r.note:
            print(f"{'':<{width}}    note: {r.note}")
    for f in failures:
        print(f"\nFAILED {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
