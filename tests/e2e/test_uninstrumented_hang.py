"""A real torch (gloo) DDP job of 4 ranks on 4 fake nodes, with no vigil instrumentation, through a
real aggregator process and four real agents (tests/e2e/uninstrumented_cluster.py): the job's real
state drives each node's fake GPUs and InfiniBand counters (the harness's documented seam).

1. One rank stops inside a collective (rank 2 at step 8, stuck before its gradient all-reduce is
   handed to the process group; the other three wait in it). From telemetry alone (every GPU
   busy-spinning, every port flat) ``telemetry_hang`` decides on the job within 60 s of the stop;
   with the flight recorder on, the job's stall watchdog fires after 10 s in the collective, every
   rank dumps (the first signals the rest through the job's store, as NCCL's dump-on-timeout does),
   and ``collective_culprit`` drains rank 2's node, and no other, within 30 s of the last dump.
2. The same job healthy, then checkpointing for 25 s and evaluating for 10 s: no decision at all.

Windows, shortened so each test is bounded (about 60 s): ``telemetry_hang`` alerts after 10 s and
restarts after 40 s of the signature (60 s and 300 s shipped); in the lookalike test it alerts after
5 s, so the 25 s checkpoint is five alert windows, as a 5-minute checkpoint is against the shipped
60 s. Agents report, and send their GPU readings, every second (2.5 s and 30 s shipped); the
aggregator evaluates every second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.uninstrumented_cluster import NODES, SLURM_JOB, JobRun, run

pytestmark = pytest.mark.external

STOP_RANK, STOP_AT_STEP = 2, 8
DUMP_AFTER_SECONDS = 10  # the job's stall watchdog
ALERT_WITHIN_SECONDS = 60.0  # the bound from the stop to the telemetry decision
NAMED_WITHIN_SECONDS = 30.0  # the bound from the dump to the culprit decision
REMOVALS = ("drain", "reset_gpu", "reboot_node", "inspect_hardware")


def scenario(pid: int) -> dict[str, Any]:
    """A node of one H100 held by the rank (its real pid), busy training at the scenario's load."""
    return {"description": "one H100 running one rank of the uninstrumented job", "profile": "h100-sxm-80gb",
            "gpus": 1, "load": {"utilization": 0.93, "noise": 0.03, "memory_used_ratio": 0.8},
            "processes": [{"gpu": 0, "pid": pid}]}


def aggregator(alert_seconds: float) -> dict[str, Any]:
    return {"dry_run": True, "evaluate_interval_seconds": 1.0,
            "detectors": {"telemetry_hang": {"alert_seconds": alert_seconds, "restart_seconds": 40.0}}}


def phase_ts(root: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((root / "work" / f"phase-{rank}.json").read_text()))


def test_rank_stopped_in_a_collective_is_alerted_from_telemetry_and_its_node_named_by_the_flight_recorder(
        tmp_path: Path) -> None:
    def culprit_named(r: JobRun) -> bool:
        return any(d["detector"] == "collective_culprit" for _, d in r.seen.values())

    result = run(tmp_path, aggregator=aggregator(10.0), scenario=scenario, flight_recorder=True,
                 watch_seconds=75.0, until=culprit_named,
                 job={"stop_rank": STOP_RANK, "stop_at_step": STOP_AT_STEP,
                      "dump_after_seconds": DUMP_AFTER_SECONDS})
    stopped = phase_ts(tmp_path, STOP_RANK)
    assert (stopped["phase"], stopped["step"]) == ("collective", STOP_AT_STEP), stopped
    stop_wall = float(stopped["ts"])
    seen = [(round(t - stop_wall, 1), d["detector"], d["action"], d["node"]) for t, d in result.decisions()]

    # From telemetry: the whole job, no node, within 60 s of the stop.
    telemetry = result.decisions("telemetry_hang")
    assert telemetry, seen
    first_at, first = telemetry[0]
    assert first["action"] in ("alert", "restart_job") and first["node"] is None and first["job"] == SLURM_JOB, seen
    assert first_at - stop_wall <= ALERT_WITHIN_SECONDS, seen
    assert first["evidence"]["signal"] == "telemetry_hang" and sorted(first["evidence"]["job_nodes"]) == list(NODES)

    # From the flight recorder: rank 2's node, within 30 s of the last dump, and no other node.
    assert sorted(result.dumps) == [0, 1, 2, 3], result.dumps
    named = result.decisions("collective_culprit")
    assert named, seen
    named_at, culprit = named[0]
    assert (culprit["action"], culprit["node"], culprit["job"]) == ("drain", result.node_of(STOP_RANK), SLURM_JOB)
    assert named_at - max(result.dumps.values()) <= NAMED_WITHIN_SECONDS, seen
    evidence = culprit["evidence"]
    assert evidence["signal"] == "flight_recorder" and evidence["missing_ranks"] == [STOP_RANK], evidence
    assert sorted(evidence["waiting_ranks"]) == [r for r in range(len(NODES)) if r != STOP_RANK], evidence
    removed = {d["node"] for _, d in result.decisions() if d["action"] in REMOVALS}
    assert removed == {result.node_of(STOP_RANK)}, seen


def test_healthy_checkpointing_and_evaluating_job_gets_no_decision(tmp_path: Path) -> None:
    checkpoint_seconds, evaluate_seconds = 25.0, 10.0

    def trained_after_evaluating(r: JobRun) -> bool:
        try:
            return all(phase_ts(tmp_path, rank)["step"] >= 16 for rank in range(len(NODES)))
        except (OSError, ValueError):
            return False

    result = run(tmp_path, aggregator=aggregator(5.0), scenario=scenario, flight_recorder=True,
                 watch_seconds=70.0, until=trained_after_evaluating,
                 job={"checkpoint_at_step": 10, "checkpoint_seconds": checkpoint_seconds,
                      "evaluate_at_step": 12, "evaluate_seconds": evaluate_seconds})
    assert trained_after_evaluating(result), "the job did not get through its checkpoint and evaluation"
    assert [(d["detector"], d["action"], d["node"]) for _, d in result.decisions()] == []
    assert result.dumps == {}
    for state in result.nodes:  # each node showed both lookalikes after training, and never a spin
        modes = [mode for _, mode in state.modes]
        after = modes[modes.index("training"):]
        assert "idle" in after and "evaluating" in after and "busy_spin" not in modes, (state.node, modes)
