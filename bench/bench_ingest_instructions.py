"""Instructions per steady report, compact (version 3, what the agent sends) and whole (its first,
and what the simulator hands the service), decode with strict validation and the fleet update
apart, counted by valgrind's callgrind over the same agent-built reports as bench_ingest. A count,
not a time: it is the same on a busy machine, so two versions of the code compare by it where
bench_ingest's rate moves by a third from one run to the next.

The reports are built here and handed to a child interpreter run under callgrind, which counts
only inside ``functools.reduce`` (``--toggle-collect``), the call that wraps exactly the measured
loop: the child's start-up, the first (whole) round and the decoding before the fleet update are
not counted. Each counted call adds ~0.6k instructions of ``reduce`` and lambda a report. Where
valgrind is not installed (``apt-get install valgrind``) it says so and measures nothing.
``--update`` counts the fleet update alone (compact and whole side by side: ~2 minutes where the
four counts take ~4), to compare two versions of aggregator/fleet.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import bench_ingest
from bench.measure import Measurement
from vigil.contract.wire import decode_report

# 100 nodes x 12 steady rounds: 1,200 reports, enough for a stable mean (callgrind runs the
# interpreter ~50 times slower; the four counts run two at a time, ~4 minutes).
NODES = 100
_COLLECTED = re.compile(r"Collected : (\d+)")


def measure(phases: tuple[str, ...] = ("decode", "update")) -> list[Measurement]:
    """``phases``: what to count of each kind of report, "decode" and/or "update"."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("bench_ingest_instructions: valgrind is not installed (apt-get install valgrind): nothing measured",
              file=sys.stderr)
        return []
    counts: dict[tuple[str, str], float] = {}
    steady = 0
    with tempfile.TemporaryDirectory(prefix="vigil-bench-") as tmp:
        jobs: list[tuple[str, str, Path]] = []
        for kind in ("compact", "whole"):
            bodies = bench_ingest.payloads(compact=kind == "compact", nodes=NODES)
            steady = len(bodies) - NODES
            path = Path(tmp) / f"{kind}.json"
            path.write_text(json.dumps([[ts, body.decode()] for ts, body in bodies]))
            jobs += [(kind, phase, path) for phase in phases]
        for batch in (jobs[i:i + 2] for i in range(0, len(jobs), 2)):  # two at a time
            runs = {(kind, phase): subprocess.Popen(
                [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", "--collect-atstart=no",
                 "--toggle-collect=functools_reduce", sys.executable, "-m", "bench.bench_ingest_instructions",
                 phase, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for kind, phase, path in batch}
            for (kind, phase), run in runs.items():
                _, err = run.communicate(timeout=1800)
                found = _COLLECTED.search(err)
                if run.returncode != 0 or found is None:
                    raise RuntimeError(f"callgrind ({kind} {phase}) exited {run.returncode}: {err[-2000:]}")
                counts[kind, phase] = int(found.group(1)) / steady
    note = (f"callgrind, {NODES} nodes x {bench_ingest.ROUNDS - 1} steady rounds of the agent's reports "
            f"({steady:,} reports); the same on a busy machine")
    return [
        Measurement(f"aggregator ingest: {what}, instructions a {kind} report",
                    round(counts[kind, phase] / 1000, 1), "k instr", None, note=note)
        for kind in ("compact", "whole")
        for phase, what in (("decode", "decode + strict validation"), ("update", "fleet update (Engine.ingest)"))
        if phase in phases]


def _child(phase: str, path: str) -> None:
    """Under callgrind: the first round ingested uncounted, then the steady rounds through
    ``functools.reduce``, the only call counted."""
    from vigil.aggregator.app import tune_gc
    from vigil.aggregator.config import AggregatorConfig
    from vigil.aggregator.engine import Engine
    from vigil.aggregator.ledger import Ledger

    bodies = [(ts, body.encode()) for ts, body in json.loads(Path(path).read_text())]
    tune_gc()
    engine = Engine(AggregatorConfig(), Ledger.in_memory())
    for ts, body in bodies[:NODES]:
        engine.ingest(decode_report(body), ts)
    steady = bodies[NODES:]
    if phase == "decode":
        functools.reduce(lambda _, item: decode_report(item[1]), steady, None)
        return
    reports = [(ts, decode_report(body)) for ts, body in steady]
    ingest = engine.ingest
    functools.reduce(lambda _, item: ingest(item[1], item[0]), reports, None)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        _child(sys.argv[1], sys.argv[2])
    else:
        for m in measure(("update",) if sys.argv[1:] == ["--update"] else ("decode", "update")):
            print(m)
