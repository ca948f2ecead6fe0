"""``vigil sim``: run a fleet scenario through the real agent and aggregator on a simulated clock.

Prints a short verdict (or one JSON object with ``--json``) with the jobs' goodput (ETTR and the
GPU time lost by stage, without vigil, with it and for an oracle: sim/goodput.py), optionally
writes a report page with plots, and exits 0 only when every expectation is met, every removal is justified and nothing
forbidden happened. Progress goes to stderr, never stdout (so ``--json`` stays one JSON object): a bar
on a terminal, otherwise a line at most every ``--progress-every`` wall seconds (simulated time, %
done, decisions so far). It decides nothing itself: sim.score does.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

# A line every 5 s of wall time: a minutes-long run shows it is alive without flooding a CI log.
PROGRESS_EVERY_SECONDS = 5.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sim", help="run a simulated fleet scenario and score the decisions",
                       description="Run a fleet scenario (scenarios/*.yaml) through the real agent and "
                                   "aggregator on a simulated clock; exit 0 when every expectation is met.")
    p.add_argument("--scenario", required=True, metavar="FILE|NAME",
                   help="a scenario file, or the name of a shipped one (e.g. slow-node-1024)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the full result")
    p.add_argument("--report", metavar="DIR", help="write index.html and PNG plots to DIR")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="simulate only the first SECONDS (faults and expectations after it are dropped)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="healthy-fleet statistics: split the fleet into independent shards (the jobs that "
                        "share nodes) and run them in N processes (0: one per core), merging their verdicts; "
                        "refused for a scenario with faults, expectations, remediation or probes, since shards "
                        "share no aggregator (fleet-wide detectors and the breaker judge each shard alone)")
    p.add_argument("--trace", metavar="DIR",
                   help="record the aggregator's trace of the run in DIR (aggregator/trace.py) with the run's "
                        "scenario and decisions, for vigil replay (docs/replay.md); not with --workers")
    p.add_argument("--log-level", default="ERROR", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--progress-every", type=float, default=PROGRESS_EVERY_SECONDS, metavar="SECONDS",
                   help="when stderr is not a terminal: a progress line at most every SECONDS of wall time "
                        f"(default {PROGRESS_EVERY_SECONDS:g}; 0: every simulated step; a negative value: none)")


class ProgressBar:
    """A one-line bar on a terminal; silent otherwise (CI logs stay clean)."""

    def __init__(self, stream: TextIO, width: int = 40) -> None:
        self._stream = stream
        self._width = width
        self._last = -1

    def __call__(self, done: float, total: float, decisions: int = 0) -> None:
        share = min(1.0, done / total) if total > 0 else 1.0
        filled = int(share * self._width)
        if filled == self._last and share < 1.0:
            return
        self._last = filled
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r[{bar}] {share * 100:5.1f}%  {done:,.0f}/{total:,.0f} simulated s, "
                           f"decisions: {decisions:,}")
        if share >= 1.0:
            self._stream.write("\n")
        self._stream.flush()


class ProgressLines:
    """One line per ``every_seconds`` of wall time (``clock``), for a stderr that is not a terminal
    (a log, a pipe, a CI job): simulated time, % done, decisions so far; the last step always."""

    def __init__(self, stream: TextIO, *, every_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._every_seconds = every_seconds
        self._clock = clock
        self._start = clock()
        self._last = self._start

    def __call__(self, done: float, total: float, decisions: int = 0) -> None:
        now = self._clock()
        final = done >= total
        if not final and now - self._last < self._every_seconds:
            return
        self._last = now
        share = min(1.0, done / total) if total > 0 else 1.0
        self._stream.write(f"vigil sim: {done:,.0f}/{total:,.0f} simulated s ({share * 100:.1f}%), "
                           f"decisions so far: {decisions:,}, {now - self._start:,.0f} s wall\n")
        self._stream.flush()


def run(args: argparse.Namespace) -> int:
    try:
        import numpy  # noqa: F401  (the simulator's job model; not installed on agent-only nodes)
    except ModuleNotFoundError:
        print("vigil sim: the simulator needs numpy: pip install 'vigil-fleet[sim]'", file=sys.stderr)
        return 2
    from vigil.sim.run import run_scenario
    from vigil.sim.scenario import ScenarioError, load_scenario, shortened
    from vigil.sim.score import score, summary

    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        scenario = load_scenario(args.scenario)
        if args.duration is not None:
            scenario = shortened(scenario, args.duration)
    except ScenarioError as exc:
        print(f"vigil sim: {exc}", file=sys.stderr)
        return 2
    if args.workers is not None:
        if args.trace:
            print("vigil sim: --trace records one aggregator's trace: not with --workers", file=sys.stderr)
            return 2
        return _run_sharded(scenario, args)
    trace_dir = None if args.trace is None else Path(args.trace)
    if trace_dir is not None and trace_dir.exists() and any(trace_dir.iterdir()):
        print(f"vigil sim: --trace {trace_dir}: not empty (a trace directory holds one run)", file=sys.stderr)
        return 2
    progress: Callable[[float, float, int], None] | None = None
    if sys.stderr.isatty():
        progress = ProgressBar(sys.stderr)
    elif args.progress_every >= 0:
        progress = ProgressLines(sys.stderr, every_seconds=args.progress_every)
    result = run_scenario(scenario, seed=args.seed, progress=progress, trace_dir=trace_dir)
    if trace_dir is not None:
        from vigil.sim.replay import record_run

        record_run(result, trace_dir)
    s = score(result)
    data = summary(result, s)
    if scenario.jobs and scenario.goodput.represents_seconds is not None:
        from vigil.sim.goodput import ledger

        data["goodput"] = ledger(result).to_json()
    if args.report:
        from vigil.sim.report import write_report

        index = write_report(result, s, Path(args.report))
        data["report"] = str(index)
    if args.json:
        print(json.dumps(data, indent=None, default=str))
    else:
        _print_text(data)
    return 0 if s.passed else 1


def _run_sharded(scenario: Any, args: argparse.Namespace) -> int:
    """``--workers``: the scenario as independent shards in parallel processes (sim/shards.py)."""
    from vigil.sim.scenario import ScenarioError
    from vigil.sim.shards import default_workers, run_sharded

    if args.report:
        print("vigil sim: --report draws one simulation's plots; it cannot be used with --workers", file=sys.stderr)
        return 2
    if args.workers < 0:
        print("vigil sim: --workers must be >= 0", file=sys.stderr)
        return 2
    workers = args.workers or default_workers()

    def done(r: Any) -> None:
        if args.progress_every >= 0:
            print(f"vigil sim: shard {r.name} (seed {r.seed}, {r.nodes} nodes): {'PASS' if r.passed else 'FAIL'}, "
                  f"{r.removals} removals, {r.wall_seconds:,.0f} s wall", file=sys.stderr, flush=True)

    try:
        result = run_sharded(scenario, workers=workers, seed=args.seed, on_shard=done)
    except ScenarioError as exc:
        print(f"vigil sim: {exc}", file=sys.stderr)
        return 2
    data = result.to_json()
    if args.json:
        print(json.dumps(data, indent=None, default=str))
    else:
        print(f"scenario {data['scenario']} in {len(data['shards'])} shards ({workers} workers): "
              f"{'PASS' if data['pass'] else 'FAIL'}")
        print(f"  {data['node_days']:,.2f} node-days ({data['reports']:,} reports) in {data['wall_seconds']:,.0f} s "
              f"wall, {data['cpu_seconds']:,.0f} s CPU")
        cap = data["max_removals"]
        print(f"  removals {data['removals']}{'' if cap is None else f' (cap {cap})'}, proposed "
              f"{data['proposed_removals']}, false drains {data['false_drains']} "
              f"({data['false_removals_per_1000_node_days']} per 1,000 node-days)")
        for d in data["decisions"]:
            print(f"  {d['action']} {d.get('node') or d.get('job')} by {d['detector']} at {d['t']:g} s "
                  f"({d['shard']}): {d['reason']}")
        for sh in data["shards"]:
            print(f"  shard {sh['name']}: seed {sh['seed']}, {sh['nodes']} nodes, {sh['node_days']:g} node-days, "
                  f"{'PASS' if sh['pass'] else 'FAIL'}")
        print(f"  note: {data['caveat']}")
    return 0 if result.passed else 1


def _print_text(data: dict[str, Any]) -> None:
    print(f"scenario {data['scenario']} (seed {data['seed']}): {'PASS' if data['pass'] else 'FAIL'}")
    print(f"  {data['nodes']} nodes, {data['simulated_seconds']:g} simulated s in {data['wall_seconds']:g} s wall")
    for e in data["expectations"]:
        state = "met   " if e["met"] else "MISSED"
        lat = "-" if e["latency_seconds"] is None else f"{e['latency_seconds']:g} s"
        print(f"  {state} {e['subject']}: {'/'.join(e['action'])} within {e['within_seconds']:g} s "
              f"(latency {lat})")
    for d in data["false_drain_decisions"]:
        print(f"  UNJUSTIFIED {d['action']} {d['node']} by {d['detector']} at {d['t']:g} s ({d['why']}): "
              f"{d['reason']}")
    for v in data["forbid_violations"]:
        d = v["decision"]
        print(f"  FORBIDDEN {d['action']} {d['node']} by {d['detector']} at {d['t']:g} s: {v['forbid']}")
    cap = data["max_removals"]
    over = cap is not None and data["removals"] > cap
    print(f"  removals {data['removals']}{'' if cap is None else f' (cap {cap})'}{' OVER CAP' if over else ''}, "
          f"alerts {data['alerts']}")
    lat = data["detection_latency_seconds"]
    print(f"  precision {data['precision']}, recall {data['recall']}, false drains {data['false_drains']}, "
          f"latency p50 {lat['p50']} p95 {lat['p95']} max {lat['max']}")
    for action, r in data["return_to_service"]["by_action"].items():
        gone = ", ".join(f"{n} {state.replace('_', ' ')}" for state, n in r["not_returned"].items() if n)
        sec = r["seconds"]
        times = f", fault to resume p50 {sec['p50']:g} s max {sec['max']:g} s" if r["returned"] else ""
        print(f"  return to service after {action}: {r['returned']}/{r['removed']} back{times}"
              f"{f' (not back: {gone})' if gone else ''}")
    for iso in data.get("isolations", []):
        bound = iso["information_bound"]
        ratio = f", {iso['tests_used'] / bound:.2f}x" if bound else ""
        print(f"  isolation {iso['name']} ({iso['state']}): {len(iso['faulty'])} faulty of {len(iso['nodes'])} "
              f"({', '.join(iso['faulty']) or 'none'}) in {iso['tests_used']} tests "
              f"(information bound {bound:g}{ratio})")
    if "goodput" in data:
        _print_goodput(data["goodput"])
    b = data["breaker"]
    if b["expected"] != "any":
        print(f"  breaker: expected {b['expected']}, tripped {b['tripped']}")
    if "report" in data:
        print(f"  report: {data['report']}")


_ARM_NAMES = {"no_vigil": "no vigil", "vigil": "vigil", "oracle": "oracle"}


def _print_goodput(g: dict[str, Any]) -> None:
    print(f"  goodput ({g['accounting']}; checkpoint every {g['assumptions']['checkpoint_every_seconds']:g} s, "
          f"restart {g['assumptions']['restart_seconds']:g} s):")
    for i, r in enumerate(g["rates"]):
        whose = "the scenario's own" if i == 0 else "stated"
        print(f"    at {r['rate_per_1000_node_days']:g} interruptions a day per 1,000 nodes ({whose}):")
        for arm, a in r["arms"].items():
            stages = ", ".join(f"{k} {v:,.0f}" for k, v in a["by_stage_gpu_hours"].items()) or "nothing"
            jobs = ", ".join(f"{j} {v['ettr'] * 100:.2f}%" for j, v in a["jobs"].items())
            print(f"      {_ARM_NAMES[arm]:<8} ETTR {a['ettr'] * 100:6.2f}%  {a['gpu_hours_lost']:,.0f} GPU-h lost "
                  f"({stages}); per job {jobs}")
        if i == 0:
            arms = r["arms"]
            causes = sorted({c for a in arms.values() for c in a["by_cause_gpu_hours"]},
                            key=lambda c: -arms["no_vigil"]["by_cause_gpu_hours"].get(c, 0.0))
            print("      by cause, GPU-h no vigil / vigil / oracle: " + ", ".join(
                f"{c} {' / '.join(format(a['by_cause_gpu_hours'].get(c, 0.0), ',.0f') for a in arms.values())}"
                for c in causes))
