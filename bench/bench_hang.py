"""Hang detection latency for a job of 2 s steps, and a 5-minute checkpoint that must raise nothing.

A 16-node job (8 ranks per node, 2 s steps) reports as the agent does (a rank summary per report,
every 2.5 s, progress stamped on the agent's clock) into the aggregator's real engine (every
detector, shipped defaults), which evaluates every 2.5 s. On a simulated clock the job stops at
varied offsets against the report and evaluation ticks; the figure is the time from the stop to
the first hang decision (DESIGN.md section 9: <= 30 s). Then the same job announces a checkpoint
("checkpointing" phase) and saves for 5 minutes, its agents even marking the ranks hung at 300 s:
the figure is the number of hang decisions (budget 0).

Then a plain-DDP hang (issue 38) in a 4-node job through the real aggregator process and four real
agents (tests/e2e/ddp_hang.py): the agents start one after another, so their 2.5 s report cycles
run at independent phases, and each marks its rank "hung" when its own clock crosses. Every rank
stops at the same step at the same moment. Shipped defaults except the two 300 s clocks, both
scaled to 60 s so the run takes about 90 s: the agents' ``hang_seconds`` and the aggregator's
``stall_seconds`` (the race is between them). The figures: the time from the stop to the job's
alert (the right first decision), to its restart_job, and the node removals (budget 0; the
detector before issue 38 drained the nodes whose agents said "hung" first).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from statistics import median

from bench.measure import Measurement
from tests.e2e.ddp_hang import run
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.aggregator.ledger import Ledger
from vigil.contract.wire import RankSummary, Report

DDP_CLOCK_SECONDS = 60.0  # the agents' hang_seconds and the aggregator's stall_seconds (300 s shipped)

NODES = 16
RANKS_PER_NODE = 8
STEP_SECONDS = 2.0
REPORT_SECONDS = 2.5
EVALUATE_SECONDS = 2.5
TRIALS = 10
AGENT_HANG_SECONDS = 300.0  # the agent's training collector marks a rank "hung" after this


def _report(node: int, seq: int, now: float, last_progress: float, step: int, phase: str | None,
            hung: bool) -> Report:
    ranks = [RankSummary(job="pretrain", rank=node * RANKS_PER_NODE + i, gpu=i, pid=1000 + i,
                         state="hung" if hung else "running", window_seconds=60.0, steps=30,
                         last_step=step, last_progress_ts=last_progress, step_seconds_p50=STEP_SECONDS,
                         step_seconds_p90=STEP_SECONDS * 1.02, phase=phase)  # type: ignore[arg-type]
             for i in range(RANKS_PER_NODE)]
    return Report(node=f"node-{node:04d}", boot_id=f"boot-{node}", seq=seq, ts=now,
                  interval_seconds=REPORT_SECONDS, ranks=ranks)


def _run(stop_at: float, until: float, *, phase: str | None = None, phase_until: float | None = None,
         offset: float = 0.0) -> tuple[float | None, int]:
    """(seconds from the stop to the first hang decision or None, hang decisions in all)."""
    config = parse_config({"dry_run": True})
    engine = Engine(config, Ledger.in_memory())
    t = 0.0
    seq = 0
    first: float | None = None
    hangs = 0
    next_eval = offset
    while t <= until:
        seq += 1
        stopped = t >= stop_at and (phase_until is None or t < phase_until)
        last_progress = (stop_at if stopped else t) - (t % STEP_SECONDS if not stopped else 0.0)
        step = int(last_progress / STEP_SECONDS)
        in_phase = phase if stopped and phase else None
        hung = stopped and t - stop_at >= AGENT_HANG_SECONDS
        for node in range(NODES):
            engine.ingest(_report(node, seq, t, last_progress, step, in_phase, hung), t)
        while next_eval <= t:
            for decision in engine.evaluate(next_eval):
                if decision.detector == "hang":
                    hangs += 1
                    if first is None:
                        first = next_eval - stop_at
            next_eval += EVALUATE_SECONDS
        t += REPORT_SECONDS
    return first, hangs


def measure() -> list[Measurement]:
    latencies = []
    for i in range(TRIALS):
        stop = 120.0 + i * (REPORT_SECONDS / TRIALS) * 3  # varied against the report ticks
        first, _ = _run(stop, stop + 120.0, offset=(i % 5) * 0.5)
        latencies.append(first if first is not None else float("inf"))
    _, checkpoint_hangs = _run(120.0, 120.0 + 300.0 + 60.0, phase="checkpointing", phase_until=120.0 + 300.0)
    _, unannounced = _run(120.0, 120.0 + 300.0 + 60.0, phase_until=120.0 + 300.0)  # the control
    return [*_simulated(latencies, checkpoint_hangs, unannounced), *_ddp_hang()]


def _ddp_hang() -> list[Measurement]:
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp), hang_seconds=[DDP_CLOCK_SECONDS] * 4, interval_seconds=2.5, step_seconds=1.0,
                     steps=12, until_after_stop=DDP_CLOCK_SECONDS + 30.0, training={"window_seconds": 5.0},
                     aggregator={"dry_run": True, "detectors": {"hang": {"stall_seconds": DDP_CLOCK_SECONDS}}})
    alerts, restarts = result.of("alert"), result.of("restart_job")
    named = {d["node"] for _, d in alerts + restarts}
    alert_at = alerts[0][0] if alerts else float("inf")
    restart = f"{restarts[0][0]:.1f} s" if restarts else "none"
    where = "the job, no node" if named == {None} else f"nodes {sorted(map(str, named))}"
    return [
        Measurement("plain-DDP hang, 4-node job, real aggregator + agents: time to the job's alert", alert_at, "s",
                    30.0, note=(f"restart_job at {restart} (stall_seconds {DDP_CLOCK_SECONDS:.0f} s); decisions name "
                                f"{where}; reports every 2.5 s at independent phases")),
        Measurement("plain-DDP hang, 4-node job, real aggregator + agents: false removals", float(len(result.removals)),
                    "nodes", 0.0, note=(f"agents' hang_seconds = stall_seconds = {DDP_CLOCK_SECONDS:.0f} s "
                                        "(300 s shipped); before issue 38: the first agents to say hung drained")),
    ]


def _simulated(latencies: list[float], checkpoint_hangs: int, unannounced: int) -> list[Measurement]:
    return [
        Measurement("hang detection latency, 2 s steps (max of 10 stops)", max(latencies), "s", 30.0,
                    note=f"median {median(latencies):.1f} s; 16 nodes x 8 ranks, reports and evaluation every 2.5 s"),
        Measurement("hang decisions during a 5-minute announced checkpoint", float(checkpoint_hangs), "decisions",
                    0.0, note=("phase 'checkpointing' on every rank; the agents mark the ranks hung at 300 s; "
                               f"the same pause unannounced: {unannounced} hang decisions")),
    ]


if __name__ == "__main__":
    for m in measure():
        print(f"{m.what}: {m.value:.1f} {m.unit} (budget {m.budget}) {m.note}")
