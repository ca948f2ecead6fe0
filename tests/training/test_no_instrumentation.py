"""The fallback that needs no rank timing, end to end: three real agents (fake NVML), one node's
GPUs clock-capped by a power brake; the job's ranks send only ``hb.step(n)``. The aggregator flags
that node as the likely straggler (gpu_peer, alert) and no other, and says the job has no
per-rank timing. No torch needed."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.aggregator.aggregator_process import AggregatorProcess, wait_for
from tests.training.agents import Agent, cluster
from vigil_heartbeat import Heartbeat

NODES = ("node-a", "node-b", "node-c")
CAPPED = "node-c"
SLURM_JOB = 7001  # the job's ranks (this test's process) run in it on every node


def capped_scenario(root: Path) -> str:
    # Every GPU held at 80% of its maximum SM clock by a power brake for the whole run: slower
    # than its peers, yet above the thermal detector's absolute 75% line.
    path = root / "capped.yaml"
    path.write_text(yaml.safe_dump({
        "description": "all GPUs power-braked to 80% SM clock", "profile": "h100-sxm-80gb", "gpus": 8,
        "load": {"utilization": 0.92, "noise": 0.05, "memory_used_ratio": 0.85},
        "faults": [{"at_seconds": 0, "gpu": g, "kind": "power_brake", "duration_seconds": 3600,
                    "clock_ratio": 0.8} for g in range(8)],
    }))
    return str(path)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[AggregatorProcess, dict[str, Agent]]]:
    with cluster(tmp_path, list(NODES), {
        "dry_run": True, "evaluate_interval_seconds": 1.0,
        # A test-sized window: 6 s of reports instead of the shipped 60 s.
        "detectors": {"gpu_peer": {"persistence_seconds": 6.0, "min_reports": 3}},
    }, lambda n: capped_scenario(tmp_path) if n == CAPPED else "healthy-h100") as running:
        yield running


def test_capped_node_in_a_step_only_job_is_flagged_and_no_other(fleet: Any) -> None:
    aggregator, agents = fleet
    stop = threading.Event()
    for agent in agents.values():
        agent.admit(os.getpid(), SLURM_JOB)
    clients = [Heartbeat(job="steps-only", rank=i * 8 + g, gpu=g, addr=agents[n].socket_path, env={})
               for i, n in enumerate(NODES) for g in range(8)]

    def train() -> None:  # a synchronous job: every rank steps together, one line per step
        step = 0
        while not stop.wait(0.25):
            step += 1
            for hb in clients:
                hb.step(step)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        def flagged() -> list[dict[str, Any]]:
            found, _ = aggregator.decisions()
            return [d for d in found if d["detector"] == "gpu_peer" and d["action"] == "alert"]

        wait_for("the gpu_peer alert", lambda: bool(flagged()), 60.0)
        alerts = flagged()
        assert {d["node"] for d in alerts} == {CAPPED}, alerts
        ev = alerts[0]["evidence"]
        assert alerts[0]["job"] == str(SLURM_JOB) and ev["gpus"] == list(range(8))  # the scheduler's id
        assert ev["sm_clock_ratio"] <= 0.85 and "hw_power_brake_slowdown" in ev["clock_event_reasons"]
        def said_it_cannot_rank() -> bool:  # judged on complete summary windows: may come a round later
            found, _ = aggregator.decisions()
            return any(d["action"] == "observe" and "no per-rank timing" in d["reason"] for d in found)

        wait_for("the observe decision saying the ranks cannot be ranked", said_it_cannot_rank, 30.0)
        found, _ = aggregator.decisions()
        assert not [d for d in found if d["action"] == "drain"], found
    finally:
        stop.set()
        thread.join(5)
        for hb in clients:
            hb.close()
