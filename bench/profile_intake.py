"""Where a real aggregator process's main thread spends its CPU at report intake: ``vigil
loadgen``'s nodes against a spawned aggregator (dry run, as bench_loadgen) whose main thread runs
under cProfile on its own thread CPU clock (``time.thread_time``: the GIL waits and the other
processes of a shared machine are not counted). The profiler is switched on by a
``sitecustomize`` module this script writes into a temporary directory on the child's
PYTHONPATH: the shipped aggregator has no profiling hook. It reads the loadgen plan, prints the
aggregator's main-thread CPU per report (/proc) and the top functions by own and cumulative time.

    python -m bench.profile_intake [nodes] [seconds] [--no-judging]

``--no-judging`` sets the aggregator's ``evaluate_interval_seconds`` to an hour: what is left is the
intake alone (HTTP, auth, decode, ingest).
"""

from __future__ import annotations

import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_agent import FIXTURE_IB
from vigil.cli.loadgen import Plan, SpawnedAggregator, run_load, summary_lines

SITECUSTOMIZE = '''\
import atexit, cProfile, os, signal, time
_profile = cProfile.Profile(timer=time.thread_time)  # the main thread's CPU, not its waits
def _dump(*_):
    _profile.disable()
    _profile.dump_stats(os.environ["VIGIL_BENCH_PROFILE"])
signal.signal(signal.SIGUSR2, _dump)
_profile.enable()
'''
TOP = 35


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    nodes = int(args[0]) if args else 2_000
    seconds = float(args[1]) if len(args) > 1 else 30.0
    extra = {"evaluate_interval_seconds": 3600.0} if "--no-judging" in sys.argv else None
    with tempfile.TemporaryDirectory(prefix="vigil-profile-intake-") as d:
        site = Path(d, "site")
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        stats_path = Path(d, "main-thread.prof")
        env_before = dict(os.environ)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        os.environ["VIGIL_BENCH_PROFILE"] = str(stats_path)
        aggregator = SpawnedAggregator(Path(d), extra)
        try:
            aggregator.start()
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        try:
            s = run_load(aggregator.target(), Plan(nodes=nodes, duration_seconds=seconds, warmup_seconds=40.0),
                         FIXTURE_IB / "mlx5_0")
            assert aggregator.proc is not None
            os.kill(aggregator.proc.pid, signal.SIGUSR2)
            for _ in range(100):  # bounded: the child writes the file within a second
                if stats_path.exists() and stats_path.stat().st_size:
                    break
                time.sleep(0.1)
            time.sleep(0.5)
        finally:
            aggregator.stop()
        for line in summary_lines(s):
            print(line)
        stats = pstats.Stats(str(stats_path))
        total = stats.total_tt  # type: ignore[attr-defined]
        print(f"profiled main-thread CPU {total:.1f} s (warm-up and measured span together), "
              f"{s['sent']} measured reports")
        stats.sort_stats("tottime").print_stats(TOP)
        stats.sort_stats("cumulative").print_stats(TOP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
