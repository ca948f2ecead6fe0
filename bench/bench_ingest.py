"""Aggregator ingest rate: JSON bytes -> the node token check -> ``Report.model_validate_json``
(strict, as the service validates) -> the intake checks -> ``Engine.ingest``.

The reports are what the real agent sends: consecutive reports of one agent built by the agent's
own pipeline (FakeNvml 8x H100 SXM, 8 ConnectX-7 ports from the recorded sysfs tree with their
traffic counters moving, 8 training ranks), given each of NODES node names, boot ids and rank
numbers, so counter deltas, ring buffers and job membership all do their work. One thread, one core.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_agent import Clock, build_node
from bench.measure import Measurement
from vigil.agent.runner import collect_once
from vigil.agent.wire import Report
from vigil.aggregator.app import tune_gc
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.engine import Engine
from vigil.aggregator.sink import RecordingSink

NODES = 500
ROUNDS = 8
INTERVAL_SECONDS = 2.5
# Counters that move on a busy NDR port between two reports (bytes are in 4-byte words in sysfs).
_TRAFFIC = {"port_xmit_data": 2_500_000_000, "port_rcv_data": 2_500_000_000, "port_xmit_packets": 2_400_000,
            "port_rcv_packets": 2_400_000, "unicast_xmit_packets": 2_400_000, "unicast_rcv_packets": 2_400_000,
            "port_xmit_wait": 30_000}


def agent_reports(rounds: int) -> list[dict[str, Any]]:
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="vigil-ingest-") as d:
        agent = build_node(Path(d), clock)
        training = next(c for c in agent.collectors if c.name == "training")
        files = [(f, _TRAFFIC[f.name]) for f in Path(d).glob("sys/class/infiniband/*/ports/*/counters/*")
                 if f.name in _TRAFFIC]
        out = []
        try:
            for seq in range(rounds + 1):
                clock.t += INTERVAL_SECONDS
                for f, step in files:
                    f.write_text(f"{int(f.read_text()) + step}\n")
                for rank in range(8):
                    for step_n in (2 * seq, 2 * seq + 1):
                        hb = {"job": "llm-405b", "rank": rank, "step": step_n, "step_seconds": 1.21,
                              "compute_seconds": 0.91, "comm_seconds": 0.28, "data_seconds": 0.02, "gpu": rank,
                              "pid": 4000 + rank}
                        training.ingest(json.dumps(hb).encode(), clock.t)  # type: ignore[attr-defined]
                for c in agent.collectors:
                    agent.snapshot.put(c.name, collect_once(c, clock.t))
                report = agent.reporter.next_report()[0]
                if seq > 0:  # the first cycle has no deltas yet
                    out.append(report.model_dump(mode="json", exclude_none=True))
        finally:
            for c in agent.collectors:
                c.close()
    return out


def payloads() -> list[tuple[float, bytes]]:
    templates = agent_reports(ROUNDS)
    out: list[tuple[float, bytes]] = []
    for seq, template in enumerate(templates, start=1):
        ts = 1.7e9 + seq * INTERVAL_SECONDS
        for n in range(NODES):
            topology = {"row": f"row-{n // 256}", "rack": f"rack-{n // 8}", "leaf_switch": f"leaf-{n // 32}"}
            report = dict(template, node=f"gpu-{n:05d}", boot_id=f"{n:032x}", seq=seq, ts=ts, topology=topology)
            report["ranks"] = [dict(r, rank=n * 8 + r["rank"], last_progress_ts=ts) for r in template["ranks"]]
            out.append((ts, json.dumps(report).encode()))
    return out


def measure() -> list[Measurement]:
    bodies = payloads()
    # The service's own collector settings (aggregator.app.serve applies the same).
    thresholds = gc.get_threshold()
    tune_gc()
    size = sum(len(b) for _, b in bodies) / len(bodies)
    engine = Engine(AggregatorConfig(), RecordingSink())
    secret = b"bench-site-secret-0123456789abcdef"
    credentials = Credentials(site_secret=secret)
    node_of = {name: node_token(secret, name).encode() for name in {json.loads(b)["node"] for _, b in bodies}}
    fleet = engine.fleet
    ingest = engine.ingest

    def intake(ts: float, body: bytes, token: bytes) -> None:
        roles, _ = credentials.roles_of(token)
        report = Report.model_validate_json(body, strict=True)
        if roles and fleet.refusal(report, ts) is None:
            ingest(report, ts)

    # Warm-up: the first round creates every node's state; steady state is what the budget is about.
    warm = NODES
    work = [(ts, body, node_of[json.loads(body)["node"]]) for ts, body in bodies]
    for ts, body, token in work[:warm]:
        intake(ts, body, token)
    started = time.process_time()
    for ts, body, token in work[warm:]:
        intake(ts, body, token)
    cpu = time.process_time() - started
    assert sum(n.reports for n in fleet.view().nodes.values()) == len(bodies)  # nothing refused
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    rate = (len(bodies) - warm) / cpu
    return [Measurement("aggregator ingest, 8-GPU reports, one core", round(rate), "reports/s", 5000,
                        higher_is_better=True,
                        note=f"{size / 1024:.1f} KiB JSON each, built by the agent pipeline; token check + strict "
                             "validation + intake checks + ingest, "
                             f"{NODES} nodes x {ROUNDS - 1} rounds, CPU time")]


if __name__ == "__main__":
    for m in measure():
        print(m)
