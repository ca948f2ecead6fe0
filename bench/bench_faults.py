"""Time to the right decision for each fault class of issue 38, with shipped defaults at 2.5 s.

Runs one shipped scenario per class (``ROWS``) through the real agent pipeline and aggregator on
simulated clocks (``run_scenario``, scored by ``sim.score``), in parallel processes, one per
core. A scenario that expects a decision gives the scorer's latency for its first expectation
(inf when it is missed), its false removals in the note; a lookalike (no expectation) gives its
removals, budget 0. A row whose scenario is not shipped (yet) says so; a scenario that does not
run at 2.5 s reports with no agent, aggregator or gate override is run as shipped and flagged.
It asserts nothing: it prints figures beside their budgets.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.measure import Measurement
from vigil.sim.run import run_scenario
from vigil.sim.scenario import REMOVAL_ACTIONS, SCENARIO_DIR, Scenario, load_scenario
from vigil.sim.score import removal_key, score

# The agent's default report cadence (agent/config.py, report interval_seconds), which the
# issue's figures are stated at.
REPORT_SECONDS = 2.5

# One row per fault class of issue 38, then the lookalikes that must remove nobody:
# (shipped scenario, what it is).
ROWS: tuple[tuple[str, str], ...] = (
    ("slow-gpu-1024", "one GPU 25% slow in a 1,024-node job"),
    ("slow-data-loader", "one node's slow data loader"),
    ("mixed-h100-h200", "mixed H100/H200 nodes in one job"),
    ("rack-thermal", "a rack's GPUs thermally throttled"),
    ("leaf-port-errors-30s", "a leaf whose ports err over 30 s"),
    ("ddp-hang-4", "a plain DDP hang in a 4-node job (simulated; bench_hang: real processes)"),
    ("job-slowdown", "lookalike: the whole job slower"),
    ("data-loader-stall", "lookalike: a job-wide data stall"),
    ("node-own-heat", "lookalike: one node's own heat"),
)


def overrides(sc: Scenario) -> list[str]:
    """What keeps ``sc`` from being a shipped-defaults run at 2.5 s reports (empty: nothing)."""
    out = [f"reports every {sc.report_interval_seconds:g} s"] if sc.report_interval_seconds != REPORT_SECONDS else []
    for part in ("agent", "aggregator", "gate"):
        keys = _key_paths(getattr(sc, part))
        if keys:
            out.append(f"{part} overrides {', '.join(keys)}")
    return out


def _key_paths(data: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in data.items():
        out.extend(_key_paths(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"])
    return out


def _run(name: str) -> dict[str, Any]:
    """One scenario in a worker: what its row needs (or why it could not run)."""
    try:
        sc = load_scenario(SCENARIO_DIR / f"{name}.yaml")
        result = run_scenario(sc)
        s = score(result)
    except Exception:  # noqa: BLE001 - a scenario that cannot run is its row's note, not the bench's end
        return {"name": name, "error": traceback.format_exc(limit=2).strip().splitlines()[-1]}
    first = s.expectations[0] if s.expectations else None
    return {
        "name": name, "error": None, "overrides": overrides(sc), "passed": s.passed,
        "expects": first is not None,
        "subject": None if first is None else f"{'/'.join(first.expectation.actions)} {first.expectation.subject}",
        "within": None if first is None else first.expectation.within_seconds,
        "met": first is not None and first.met,
        "latency": None if first is None else first.latency_seconds,
        "decided_by": None if first is None or first.decision is None else first.decision.detector,
        "removals": s.removal_count,
        "proposed": len({removal_key(d) for d in result.decisions if d.action in REMOVAL_ACTIONS}),
        "false": [f"{d.action} {d.node if d.component is None else d.component} by {d.detector} at {d.t:g} s"
                  for d in s.false_removals],
        "nodes": sc.fleet.nodes, "seconds": sc.duration_seconds, "wall": result.wall_seconds,
    }


def _row(label: str, r: dict[str, Any]) -> Measurement:
    name = r["name"]
    if r.get("missing"):
        return Measurement(f"{label}: scenario missing", math.nan, "", None,
                           note=f"scenarios/{name}.yaml is not shipped: nothing measured")
    if r["error"] is not None:
        return Measurement(f"{label}: scenario failed to run", math.nan, "", None, note=f"{name}: {r['error']}")
    flags = "; NOT shipped defaults at 2.5 s (run as shipped): " + "; ".join(r["overrides"]) if r["overrides"] else ""
    false = r["false"]
    run = (f"{name}: {r['nodes']} nodes, {r['seconds']:g} simulated s, {r['wall']:.0f} s wall, "
           f"scenario {'PASS' if r['passed'] else 'FAIL'}")
    if not r["expects"]:
        return Measurement(f"{label}: removals", float(r["removals"]), "", 0.0,
                           note=f"{run}; {r['proposed']} removals proposed (admitted or not)"
                                + (f": {'; '.join(false[:3])}" if false else "") + flags)
    latency = r["latency"] if r["met"] else math.inf
    late = "" if r["met"] or r["latency"] is None else f" (decided {r['latency']:g} s after the fault: too late)"
    return Measurement(f"{label}: time to the right decision", latency, "s", r["within"],
                       note=f"{run}; {r['subject']}" + (f" by {r['decided_by']}" if r["decided_by"] else "") + late
                            + f"; {len(false)} false removals" + (f": {'; '.join(false[:3])}" if false else "")
                            + flags)


def _workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def measure(names: Sequence[str] = (), table: Sequence[tuple[str, str]] = ROWS) -> list[Measurement]:
    """Every row of ``table`` (or those ``names`` name), in the table's order."""
    rows = [(n, label) for n, label in table if not names or n in names]
    shipped = [n for n, _ in rows if (SCENARIO_DIR / f"{n}.yaml").exists()]
    out: dict[str, dict[str, Any]] = {n: {"name": n, "missing": True} for n, _ in rows}
    if shipped:
        with ProcessPoolExecutor(max_workers=min(_workers(), len(shipped))) as pool:
            out.update(zip(shipped, pool.map(_run, shipped), strict=True))
    return [_row(label, out[n]) for n, label in rows]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="scenarios of the table to run (default: every row)")
    for m in measure(parser.parse_args().names):
        ok = {True: "ok", False: "OVER", None: "-"}[m.within_budget]
        print(f"{m.what:70s} {m.value:>10g} {m.unit:4s} budget {m.budget}  {ok}  {m.note}")
    sys.exit(0)
