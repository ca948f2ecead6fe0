"""The CPU of one evaluation pass (``Engine.evaluate``: forget idle jobs, the view, every default
detector, the topology pass, the decisions) over a warmed-up fleet of 1,000 and of 12,500 nodes.

The fleet is what production holds: each node (8 GPUs, 8 ConnectX-7 ports, 8 training ranks of
one job of 128-256 nodes) sends one report every 2.5 s, and every node reports once between two
passes. Its reports come from one agent's (vigil/cli/agent_reports.py: the real agent pipeline over
FakeNvml): the first whole, then the compact ones (version 3) cycling through that agent's
rounds, decoded once and given, per node and round, the node's name, seq and time, its job and
rank numbers, monotonic steps, and a per-node and per-round wander of its step times, clocks,
temperatures and power (about 1%, as peers differ), built as wire ``Report`` structs directly so
that building 400,000 of them costs less than ingesting them. WARMUP_ROUNDS rounds (32: the
state rings and the rank windows are full) precede the timed passes; each pass is timed with
``time.process_time`` (CPU, not wall: the machine is shared), the shipped default
``AggregatorConfig`` (dry run), with the per-detector split taken by a timing wrapper around each
detector. It judges a healthy fleet: nothing is found, so the figure is the cost of looking.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from bench.bench_agent import FIXTURE_IB
from bench.measure import Measurement
from vigil.aggregator.app import tune_gc
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import Finding
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import FleetView
from vigil.aggregator.ledger import Ledger
from vigil.cli.agent_reports import INTERVAL_SECONDS, RANKS, report_forms, topology_of
from vigil.contract.wire import GpuState, RankSummary, Report, convert

SMALL_NODES = 1_000
LARGE_NODES = 12_500
# Issue 47: 100,000 GPUs (12,500 8-GPU nodes) judged every few seconds on a share of one core.
BUDGET_LARGE_SECONDS = 0.25
# The rings are full after 32 reports (fleet.state_history_reports; 16 rank windows of 5 s).
WARMUP_ROUNDS = 32
# Timed passes, each after one more round of reports; the median is the figure.
PASSES = 5
QUICK_PASSES = 2
# Jobs of these many nodes, in turn (the last one takes what is left).
JOB_NODES = (128, 192, 256)
TEMPLATE_ROUNDS = 13  # the agent's rounds: the 13th compact one carries the telemetry that moved
T0 = 1.7e9


class _Timed:
    """A detector whose evaluations' CPU is summed (the engine calls it as the detector)."""

    def __init__(self, detector: Any) -> None:
        self.detector = detector
        self.name: str = detector.name
        self.cpu_seconds = 0.0

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        started = time.process_time()
        try:
            return list(self.detector.evaluate(view, now))
        finally:
            self.cpu_seconds += time.process_time() - started


def _jobs(nodes: int) -> list[tuple[str, int]]:
    """Per node: its job's name and its place in the job (its ranks are 8 * place + local)."""
    out: list[tuple[str, int]] = []
    j = 0
    while len(out) < nodes:
        size = min(JOB_NODES[j % len(JOB_NODES)], nodes - len(out))
        out += [(f"train-{j:04d}", k) for k in range(size)]
        j += 1
    return out


class Fleet:
    """The simulated fleet's reports, round by round."""

    def __init__(self, nodes: int) -> None:
        forms = report_forms(TEMPLATE_ROUNDS, FIXTURE_IB / "mlx5_0")
        self.whole: Report = convert(forms[0].whole, Report)
        self.compact: list[Report] = [convert(f.compact, Report) for f in forms[1:] if f.compact is not None]
        self.nodes = nodes
        self.names = [f"node-{n:05d}" for n in range(nodes)]
        self.boots = [f"{n:016x}-{n:08x}" for n in range(nodes)]
        self.jobs = _jobs(nodes)
        self.topology = [topology_of(n) for n in range(nodes)]
        # A node's own speed (+-1%) and clock; its rounds wander on top of it.
        self.speed = [1.0 + 0.01 * (((n * 37) % 21) - 10) / 10 for n in range(nodes)]
        self.seq = 0

    def round(self) -> Iterator[tuple[float, Report]]:
        """The next round: every node's report, each at its own time within the 2.5 s."""
        self.seq += 1
        seq = self.seq
        start = T0 + seq * INTERVAL_SECONDS
        template = self.whole if seq == 1 else self.compact[(seq - 2) % len(self.compact)]
        replace = msgspec.structs.replace
        for n in range(self.nodes):
            ts = start + INTERVAL_SECONDS * n / self.nodes
            job, place = self.jobs[n]
            wander = 1.0 + 0.004 * (((n * 13 + seq * 7) % 11) - 5) / 5
            speed = self.speed[n] * wander
            shift = ts - template.ts
            ranks = [self._rank(r, job, place * RANKS + r.rank, seq, shift, speed) for r in template.ranks]
            gpus = [self._gpu(g, job, n, seq) for g in template.gpus]
            extra: dict[str, Any] = {"topology": self.topology[n]} if seq == 1 else {"base_seq": seq - 1}
            yield ts, replace(template, node=self.names[n], boot_id=self.boots[n], seq=seq, ts=ts, ranks=ranks,
                              gpus=gpus, **extra)

    @staticmethod
    def _rank(r: RankSummary, job: str, rank: int, seq: int, shift: float, speed: float) -> RankSummary:
        changes: dict[str, Any] = {"job": job, "rank": rank, "last_step": 2 * seq + 1,
                                   "last_progress_ts": r.last_progress_ts + shift}
        if r.window_end_ts is not None:
            changes["window_end_ts"] = r.window_end_ts + shift
        if r.first_step is not None:
            changes["first_step"] = 2 * seq
        for name in ("step_seconds_p50", "step_seconds_p90", "compute_seconds_p50", "compute_seconds_p90",
                     "comm_seconds_p50", "comm_seconds_p90"):
            value = getattr(r, name)
            if value is not None:
                changes[name] = value * speed
        return msgspec.structs.replace(r, **changes)

    @staticmethod
    def _gpu(g: GpuState, job: str, n: int, seq: int) -> GpuState:
        wobble = (((n * 7 + g.index * 3 + seq) % 5) - 2)
        changes: dict[str, Any] = {}
        if seq == 1:
            changes["job"] = job
        if g.sm_clock_hertz is not None:
            changes["sm_clock_hertz"] = g.sm_clock_hertz + wobble * 15e6
        if g.temperature_celsius is not None:
            changes["temperature_celsius"] = g.temperature_celsius + wobble
        if g.power_watts is not None:
            changes["power_watts"] = g.power_watts + wobble * 1.5
        return msgspec.structs.replace(g, **changes) if changes else g


def run(nodes: int, passes: int) -> tuple[list[float], dict[str, float], int]:
    """Warm a fleet of ``nodes`` up, then time ``passes`` passes, each after one more round;
    returns each pass's CPU seconds, each detector's CPU summed over the passes, and the
    findings of the last pass."""
    fleet = Fleet(nodes)
    engine = Engine(AggregatorConfig(), Ledger.in_memory())
    timed = [_Timed(d) for d in engine.detectors]
    engine.detectors = timed  # type: ignore[assignment]  # the same protocol
    ingest = engine.ingest
    now = T0
    for r in range(WARMUP_ROUNDS):
        for ts, report in fleet.round():
            ingest(report, ts)
        now = T0 + (fleet.seq + 1) * INTERVAL_SECONDS
        if r >= WARMUP_ROUNDS - 4:  # the detectors' own memory warms up too
            engine.evaluate(now)
    for t in timed:
        t.cpu_seconds = 0.0
    cpu: list[float] = []
    for _ in range(passes):
        for ts, report in fleet.round():
            ingest(report, ts)
        now = T0 + (fleet.seq + 1) * INTERVAL_SECONDS
        gc.collect()
        started = time.process_time()
        engine.evaluate(now)
        cpu.append(time.process_time() - started)
    return cpu, {t.name: t.cpu_seconds for t in timed}, len(engine.last_findings)


def _row(nodes: int, passes: int, budget: float | None) -> Measurement:
    cpu, split, found = run(nodes, passes)
    figure = sorted(cpu)[len(cpu) // 2]
    total = sum(split.values())
    top = sorted(split.items(), key=lambda kv: kv[1], reverse=True)[:3]
    shares = ", ".join(f"{name} {s / passes * 1e3:.0f} ms ({s / total:.0%})" for name, s in top) if total else "-"
    return Measurement(
        f"evaluation pass CPU, {nodes:,} nodes", round(figure, 4), "s", budget,
        note=f"median of {passes} passes (all: {', '.join(f'{c:.3f}' for c in cpu)} s), default detectors, dry run, "
             f"8 GPUs + 8 ports + 8 ranks a node, jobs of {'-'.join(map(str, JOB_NODES))} nodes, after "
             f"{WARMUP_ROUNDS} rounds of 2.5 s reports, one round between passes; {found} findings; detectors "
             f"{total / passes * 1e3:.0f} ms a pass, top 3: {shares}")


def measure(quick: bool = False) -> list[Measurement]:
    passes = QUICK_PASSES if quick else PASSES
    thresholds, switch = gc.get_threshold(), sys.getswitchinterval()
    tune_gc()  # the service's own collector settings (aggregator.app.serve)
    try:
        rows = [_row(SMALL_NODES, passes, None)]
        if not quick:
            rows.append(_row(LARGE_NODES, passes, BUDGET_LARGE_SECONDS))
        return rows
    finally:
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(switch)
        gc.unfreeze()


if __name__ == "__main__":
    # ``python -m bench.bench_evaluation [--quick] [NODES]``: quick is 1,000 nodes, two passes.
    args = sys.argv[1:]
    if args and args[-1].isdigit():
        nodes = int(args[-1])
        q = "--quick" in args
        print(_row(nodes, QUICK_PASSES if q else PASSES, BUDGET_LARGE_SECONDS if nodes >= LARGE_NODES else None))
    else:
        for m in measure(quick="--quick" in args):
            print(m)
