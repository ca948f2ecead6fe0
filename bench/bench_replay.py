"""Replay (sim/replay.py) speed in node-days per wall minute, and the trace's size (aggregator/trace.py)
in bytes per node-day, for the reports the agent really sends at its 2.5 s cadence (compact after the
first, the telemetry every 30 s: vigil/cli/agent_reports.py builds them with the agent's own pipeline).

A real service over an in-memory store takes NODES nodes' reports for ROUNDS rounds, each body decoded
as the HTTP path decodes it, and evaluates every 2.5 s, its trace written as a running aggregator
writes it; the trace is then replayed with the same configuration (recorded schedule). One thread.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench.bench_agent import FIXTURE_IB
from bench.measure import Measurement
from vigil.aggregator.config import parse_config
from vigil.aggregator.gate import GateConfig
from vigil.aggregator.service import Accepted, AggregatorService, trace_header
from vigil.aggregator.trace import TraceWriter, read_trace, segments
from vigil.cli.agent_reports import INTERVAL_SECONDS, agent_reports, for_node
from vigil.sim.replay import ReplayClock, replay

NODES = 256
# 5 simulated minutes per node (121 reports: one whole, then compact): 0.90 node-days in all. 256
# nodes rather than fewer: an evaluation pass has a cost per pass besides its cost per node, and a
# replay is of a fleet, not of a handful of nodes.
ROUNDS = 121
SECONDS_PER_DAY = 86_400.0
# docs/architecture.md section 9. A replay runs the aggregator's own intake and judging, so its
# speed is the aggregator's cost per report (<= 150 us all included, HTTP too: ~5 s of CPU per
# node-day at 34,560 reports, a ceiling near 11 node-days per minute): >= 6 node-days per wall
# minute on one core replays a day of a 256-node partition in ~45 min, a week of a 100-node canary
# group in ~2 h.
BUDGET_NODE_DAYS_PER_MINUTE = 6.0
# <= 4 MiB per node-day: the default trace.max_bytes (1 GiB) holds ~250 node-days (a 100-node group
# for 2.5 days); a day of a 12,500-node fleet <= 50 GiB. The bench's nodes send values they share
# (one agent's reports given each node's name), which compress better than a real fleet's: the
# budget leaves room for that.
BUDGET_MIB_PER_NODE_DAY = 4.0


def record(directory: Path) -> tuple[float, int]:
    """The trace of NODES nodes x ROUNDS reports; (node-days, reports taken)."""
    templates = agent_reports(ROUNDS, FIXTURE_IB / "mlx5_0", compact=True)
    config = parse_config({"trace": {"enabled": True, "directory": str(directory)}})
    clock = ReplayClock(templates[0]["ts"])
    writer = TraceWriter(config.trace, trace_header(config, clock.now, clock.now), background=False, wall=clock)
    service = AggregatorService.in_memory(config, GateConfig(), clock=clock, started=clock.now, trace=writer)
    taken = 0
    for seq, template in enumerate(templates, start=1):
        ts = templates[0]["ts"] + seq * INTERVAL_SECONDS
        for n in range(NODES):
            clock.now = ts + n * INTERVAL_SECONDS / NODES  # the nodes' phases spread over the interval
            body = json.dumps(for_node(template, n, f"gpu-{n:05d}", f"{n:032x}", seq, ts)).encode()
            taken += isinstance(service.receive(body), Accepted)
        clock.now = ts + INTERVAL_SECONDS
        service.evaluate_now()
    writer.close()
    return NODES * ROUNDS * INTERVAL_SECONDS / SECONDS_PER_DAY, taken


def measure() -> list[Measurement]:
    with tempfile.TemporaryDirectory(prefix="vigil-bench-replay-") as tmp:
        directory = Path(tmp)
        node_days, taken = record(directory)
        size = sum(p.stat().st_size for p in segments(directory))
        reading = read_trace(directory)
        started = time.perf_counter()
        replayed = replay(reading, parse_config({}), GateConfig())
        wall = time.perf_counter() - started
    assert replayed.reports == taken and not replayed.refused, (taken, replayed.refused)
    note = (f"{NODES} nodes x {ROUNDS} compact reports at {INTERVAL_SECONDS:g} s ({node_days:.2f} node-days, "
            f"{replayed.evaluations} evaluations) replayed in {wall:.1f} s; trace {size / 1024:,.0f} KiB")
    return [
        Measurement("replay speed (compact 8-GPU reports, 2.5 s cadence)", node_days / (wall / 60.0),
                    "node-days/min", BUDGET_NODE_DAYS_PER_MINUTE, higher_is_better=True, note=note),
        Measurement("trace size per node-day (compact reports, 2.5 s cadence)", size / node_days / (1 << 20),
                    "MiB", BUDGET_MIB_PER_NODE_DAY),
    ]


if __name__ == "__main__":
    for m in measure():
        print(m)
