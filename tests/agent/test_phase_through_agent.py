"""The job's phase from the heartbeat client through the agent's training collector into the
report: the aggregator's hang detector gives checkpoints and evaluations their own limits only if
the rank summaries carry the phase, and the agent must not mark a rank "hung" while it is
checkpointing or evaluating."""

from __future__ import annotations

import json

from vigil.agent.attribution import IN_PROCESS
from vigil.agent.collectors.training import TrainingCollector, TrainingConfig


def beat(step: int, phase: str | None = None) -> bytes:
    body = {"job": "llm", "rank": 0, "step": step, "step_seconds": 2.0, "pid": 4242}
    if phase is not None:
        body["phase"] = phase
    return json.dumps(body).encode()


def test_a_checkpoint_announced_by_the_client_reaches_the_report_and_is_not_a_hang() -> None:
    collector = TrainingCollector(TrainingConfig(hang_seconds=300.0), pid_alive=lambda pid: True)
    t = 0.0
    for step in range(1, 11):
        assert collector.ingest(beat(step), t, IN_PROCESS) is None
        t += 2.0
    assert collector.ingest(beat(10, "checkpointing"), t, IN_PROCESS) is None  # accepted: the wire knows the field
    summary = collector.collect(t + 400.0).report["ranks"][0]
    assert summary.phase == "checkpointing"
    assert summary.state == "running"  # 400 s without a step, but saving, not hung
