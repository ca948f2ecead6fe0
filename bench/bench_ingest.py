"""Aggregator ingest rate, for the compact reports (what the agent sends once a report was
accepted) and the whole ones (its first, or after a 409 delta_base): JSON bytes -> the node token check ->
``wire.decode_report`` (strict, as the service validates) -> the intake checks ->
``Engine.ingest``.

The reports are what the real agent sends: consecutive reports of one agent built by the agent's
own pipeline (FakeNvml 8x H100 SXM, 8 ConnectX-7 ports from the recorded sysfs tree with their
traffic counters moving, 8 training ranks), given each of NODES node names, boot ids and rank
numbers, so counter deltas, ring buffers and job membership all do their work (vigil/cli/agent_reports.py
builds them; ``vigil loadgen`` sends the same). One thread, one core.
"""

from __future__ import annotations

import gc
import json
import time

from bench.bench_agent import FIXTURE_IB
from bench.measure import Measurement
from vigil.aggregator.app import tune_gc
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.engine import Engine
from vigil.aggregator.ledger import Ledger
from vigil.cli.agent_reports import INTERVAL_SECONDS, agent_reports, for_node
from vigil.contract.wire import decode_report

NODES = 500
# docs/architecture.md section 9 (issue #20): 100,000 GPUs at one report per 2.5 s take
# 5,000 reports/s; three times that leaves a core for judging, HTTP and bursts.
BUDGET_REPORTS_PER_SECOND = 15_000
# The first round is whole; of the 12 compact ones after it, the last carries the telemetry that
# moved (the agent sends it every 30 s, agent_reports.TELEMETRY_SECONDS): the share it has in a
# node's steady stream of reports.
ROUNDS = 13
# Timed passes over the same reports, each on a fresh engine; the best is the figure (timeit's
# convention: on a shared machine the slower passes measure the other load) and every pass is
# printed beside it. Instructions, the same on a busy machine: bench_ingest_instructions.
PASSES = 5


def payloads(compact: bool = False, nodes: int = NODES) -> list[tuple[float, bytes]]:
    """``nodes`` nodes' reports, round by round: the first round whole, then what the agent
    sends, whole, or with ``compact`` relative to the round before."""
    templates = agent_reports(ROUNDS, FIXTURE_IB / "mlx5_0", compact=compact)
    out: list[tuple[float, bytes]] = []
    for seq, template in enumerate(templates, start=1):
        ts = 1.7e9 + seq * INTERVAL_SECONDS
        for n in range(nodes):
            report = for_node(template, n, f"gpu-{n:05d}", f"{n:032x}", seq, ts)
            out.append((ts, json.dumps(report).encode()))
    return out


def measure() -> list[Measurement]:
    return [_measure(compact=True), _measure(compact=False)]


def _measure(compact: bool) -> Measurement:
    bodies = payloads(compact)
    # The service's own collector settings (aggregator.app.serve applies the same).
    thresholds = gc.get_threshold()
    tune_gc()
    # Steady state: the first round is whole in either version.
    size = sum(len(b) for _, b in bodies[NODES:]) / (len(bodies) - NODES)
    rates = sorted((_pass(bodies) for _ in range(PASSES)), reverse=True)
    decode_us, update_us = _split(bodies)
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    what = "compact (version 3, what changed: what the agent sends)" if compact else "whole (version 3)"
    return Measurement(f"aggregator ingest, 8-GPU reports, {what}, one core", round(rates[0]), "reports/s",
                       BUDGET_REPORTS_PER_SECOND if compact else None, higher_is_better=True,
                       note=f"{size / 1024:.1f} KiB JSON each, built by the agent pipeline; token check + strict "
                            f"validation + intake checks + ingest, {NODES} nodes x {ROUNDS - 1} rounds, CPU time; "
                            f"the best of {PASSES} passes on fresh engines (all: "
                            f"{', '.join(f'{r:,.0f}' for r in rates)}; a slower pass measures the machine's other "
                            "load, as timeit's documentation says); apart, report by report on a further engine: "
                            f"decode + strict validation {decode_us:.0f} us, fleet update {update_us:.0f} us a report")


def _pass(bodies: list[tuple[float, bytes]]) -> float:
    """Reports a CPU second, on a fresh engine: the first round (whole) creates every node's
    state untimed; the steady rounds after it are what the budget is about."""
    engine = Engine(AggregatorConfig(), Ledger.in_memory())
    secret = b"bench-site-secret-0123456789abcdef"
    credentials = Credentials(site_secret=secret)
    node_of = {name: node_token(secret, name).encode() for name in {json.loads(b)["node"] for _, b in bodies}}
    fleet = engine.fleet
    ingest = engine.ingest

    def intake(ts: float, body: bytes, token: bytes) -> None:
        roles, _ = credentials.roles_of(token)
        report = decode_report(body)
        if roles and fleet.refusal(report, ts) is None:
            ingest(report, ts)

    warm = NODES
    work = [(ts, body, node_of[json.loads(body)["node"]]) for ts, body in bodies]
    for ts, body, token in work[:warm]:
        intake(ts, body, token)
    gc.collect()
    started = time.process_time()
    for ts, body, token in work[warm:]:
        intake(ts, body, token)
    cpu = time.process_time() - started
    assert sum(n.reports for n in fleet.view().nodes.values()) == len(bodies)  # nothing refused
    return (len(bodies) - warm) / cpu


def _split(bodies: list[tuple[float, bytes]]) -> tuple[float, float]:
    """CPU per steady-state report (after the warm-up round) of decoding with strict validation
    and of the fleet update, timed report by report on a fresh engine (the clock reads cost
    ~1 us a report on top)."""
    engine = Engine(AggregatorConfig(), Ledger.in_memory())
    for ts, body in bodies[:NODES]:
        engine.ingest(decode_report(body), ts)
    clock = time.process_time
    decoded = updated = 0.0
    for ts, body in bodies[NODES:]:
        t0 = clock()
        report = decode_report(body)
        t1 = clock()
        engine.ingest(report, ts)
        t2 = clock()
        decoded += t1 - t0
        updated += t2 - t1
    n = len(bodies) - NODES
    return decoded / n * 1e6, updated / n * 1e6

if __name__ == "__main__":
    for m in measure():
        print(m)
