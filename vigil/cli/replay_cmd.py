"""``vigil replay``: a trace of what an aggregator took (or ``vigil sim --trace`` recorded) run again
with a given aggregator configuration, and the decisions that would change.

It reads the trace directory, the configuration file and optionally the decision store the trace's
aggregator wrote, runs sim/replay.py and prints the diff (added, removed, changed action, verdict or
timing, each with its evidence) and, for a simulated run or a store holding outcome labels, precision
and recall of both. It acts on
nothing and writes nothing (docs/replay.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# sim/replay.py's SCHEDULES; named here so that building the parser imports no simulator code (the
# aggregator's image has no numpy, and `vigil --version` builds every parser). A test holds them equal.
SCHEDULE_CHOICES = ("auto", "recorded", "cadence")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a recorded trace against an aggregator configuration",
                       description="Run a trace (aggregator trace.enabled, or vigil sim --trace) through the "
                                   "fleet, detectors and gate with CONFIG on a simulated clock, and print the "
                                   "decisions that differ from those recorded at the time.")
    p.add_argument("trace", metavar="TRACE_DIR", help="the trace directory (trace.directory, or vigil sim --trace)")
    p.add_argument("--config", metavar="FILE", help="the aggregator configuration to replay with (default: a "
                   "simulated run's own; else the defaults); its gate section is the gate's")
    p.add_argument("--store", metavar="PATH", help="the SQLite decision store the traced aggregator wrote: its "
                   "decisions within the trace's span are the recorded ones (a simulated run's are in its run file)")
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="auto",
                   help="when the replayed service evaluates: where the recorded one did (recorded), every "
                        "evaluate_interval_seconds and after urgent reports (cadence), or recorded when the "
                        "cadence is the recorded one (auto, the default)")
    p.add_argument("--tolerance", type=float, default=None, metavar="SECONDS",
                   help="a timing change smaller than this is none (default: sim/replay.py's "
                        "TIMING_TOLERANCE_SECONDS, 2.5)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    try:
        import numpy  # noqa: F401  (the simulator's pipeline, which a replay runs; not in the aggregator's image)
    except ModuleNotFoundError:
        print("vigil replay: a replay runs the simulator's pipeline, which needs numpy: "
              "pip install 'vigil-fleet[sim]'", file=sys.stderr)
        return 2
    from vigil.aggregator.config import ConfigError, load_config
    from vigil.aggregator.store import Store, StoreError
    from vigil.aggregator.trace import read_trace
    from vigil.sim.replay import (
        TIMING_TOLERANCE_SECONDS,
        ReplayError,
        recorded_from_store,
        replay_directory,
        trace_span,
    )

    directory = Path(args.trace)
    try:
        config = load_config(args.config) if args.config else None
    except ConfigError as exc:
        print(f"vigil replay: {exc}", file=sys.stderr)
        return 2
    recorded = None
    labels: dict[str, str] | None = None
    if args.store:
        if not Path(args.store).exists():
            print(f"vigil replay: no decision store at {args.store}", file=sys.stderr)
            return 2
        try:
            store = Store(args.store)
            try:
                rows = store.decisions(limit=1_000_000)
                outcomes = store.outcomes()
            finally:
                store.close()
        except StoreError as exc:
            print(f"vigil replay: {exc}", file=sys.stderr)
            return 2
        recorded = recorded_from_store(rows, *trace_span(read_trace(directory)))
        # Each followed removal's label (aggregator/precision.py writes them; '' while still followed).
        labels = {decision_id: label for decision_id, _, _, _, _, label, _ in outcomes} if outcomes else None
    try:
        tolerance = TIMING_TOLERANCE_SECONDS if args.tolerance is None else args.tolerance
        report = replay_directory(directory, config, schedule=args.schedule, recorded=recorded,
                                  tolerance_seconds=tolerance, labels=labels)
    except ReplayError as exc:
        print(f"vigil replay: {exc}", file=sys.stderr)
        return 2
    data = report.to_json()
    if args.json:
        print(json.dumps(data, default=str))
    else:
        _print_text(data)
    return 0


def _who(d: dict[str, Any]) -> str:
    gpu = f" gpu {d['gpu']}" if d.get("gpu") is not None else ""
    return f"{d.get('node') or 'job ' + str(d.get('job'))}{gpu}"


def _print_text(data: dict[str, Any]) -> None:
    print(f"replayed {data['reports']:,} reports, {data['alerts']} Alertmanager batches, {data['evaluations']:,} "
          f"evaluations ({data['schedule']} schedule) over {data['simulated_seconds']:,.0f} s in "
          f"{data['wall_seconds']:g} s wall: {len(data['decisions'])} decisions")
    for problem in data["problems"]:
        print(f"  UNREADABLE {problem}")
    for reason, n in sorted(data["refused"].items()):
        print(f"  refused by the replayed configuration: {n} reports ({reason})")
    if data["recorded_decisions"] is None:
        print("  no recorded decisions to compare with (a live trace needs --store)")
    elif not data["changes"]:
        print(f"  no change against the {data['recorded_decisions']} recorded decisions")
    else:
        print(f"  {len(data['changes'])} changes against the {data['recorded_decisions']} recorded decisions:")
        print(f"  {'t (s)':>9}  {'change':<15}  {'subject':<20}  {'detector':<14}  before -> after")
        for c in data["changes"]:
            b, a = c["before"], c["after"]
            side = a or b
            what = (f"{b['action'] if b else '-'}{'' if not b or b.get('admitted') else ' (refused)'} @ "
                    f"{b['t']:g} -> " if b else "- -> ")
            what += f"{a['action']}{'' if a.get('admitted') else ' (refused)'} @ {a['t']:g}" if a else "-"
            print(f"  {c['t']:>9.1f}  {c['kind']:<15}  {_who(side):<20}  {c['detector']:<14}  {what}")
            print(f"  {'':>9}  evidence: {side['reason']}; {json.dumps(side.get('evidence', {}), default=str)[:200]}")
    for which, q in data["quality"].items():
        print(f"  {which:<9} precision {q['precision']}, recall {q['recall']}, removals {q['removals']:g}, "
              f"false removals {q['false_removals']:g}")
    scored = data.get("outcomes")
    if scored is not None:
        print("  from the store's outcome labels (confirmed / not confirmed / unlabelled removals):")
        for which in ("recorded", "replayed"):
            q = scored[which]
            recall = f", recall of the confirmed {_ratio(q['recall'])}" if which == "replayed" else ""
            print(f"  {which:<9} precision {_ratio(q['precision'])} over {q['removals']:g} removals: "
                  f"{q['confirmed']:g} / {q['not_confirmed']:g} / {q['unlabelled']:g}{recall}")
        d = scored["dropped"]
        print(f"  dropped   {d['removals']:g} removals: {d['confirmed']:g} confirmed (lost true positives), "
              f"{d['not_confirmed']:g} not confirmed (avoided false removals), {d['unlabelled']:g} unlabelled")
        print(f"  added     {scored['added']['removals']:g} removals nobody followed (unlabelled)")
    elif data["recorded_decisions"] is not None and data["quality"] == {}:
        print("  no outcome labels in the store: precision from outcomes needs precision.enabled")


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
