"""A plain-DDP hang in a 4-node job through the real aggregator process and four real agents at
independent phases (tests/e2e/ddp_hang.py): every rank stops at the same step at the same moment,
and each agent's own hang clock crosses at a different moment. Issue 38: the aggregator drained
the nodes whose agents said "hung" first. Now: no node is drained, the job is alerted and then
restarted, both decisions naming the job and no node.

The clocks are shortened so the test is bounded (about 40 s): each agent's ``hang_seconds`` (the
training collector's knob, 300 s shipped) is 8, 11, 14 and 17 s, so the four cross one by one and
all before the aggregator's restart at ``stall_seconds`` = 20 s (300 s shipped); the aggregator's
stall floor ``min_stall_seconds`` is 6 s (20 s shipped). Steps are 0.5 s, reports every second.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.ddp_hang import NODES, SLURM_JOB, run

HANG_SECONDS = [8.0, 11.0, 14.0, 17.0]
STALL_SECONDS = 20.0
MIN_STALL_SECONDS = 6.0


def test_plain_ddp_hang_drains_nobody_and_names_the_job_not_a_node(tmp_path: Path) -> None:
    result = run(tmp_path, hang_seconds=HANG_SECONDS, interval_seconds=1.0, step_seconds=0.5, steps=16,
                 until_after_stop=STALL_SECONDS + 20.0, aggregator={
                     "dry_run": True, "evaluate_interval_seconds": 1.0,
                     "detectors": {"hang": {"min_stall_seconds": MIN_STALL_SECONDS,
                                            "stall_seconds": STALL_SECONDS}}})
    assert result.removals == [], result.removals
    alerts, restarts = result.of("alert"), result.of("restart_job")
    assert [(d["detector"], d["node"]) for _, d in alerts] == [("hang", None)], result.seen
    assert [(d["detector"], d["node"]) for _, d in restarts] == [("hang", None)], result.seen
    [(alert_at, _)], [(restart_at, restart)] = alerts, restarts
    # The alert comes with the stop, the restart only after stall_seconds (never before it).
    assert alert_at < restart_at and restart_at >= STALL_SECONDS - 1.0
    assert sorted(restart["evidence"]["job_nodes"]) == list(NODES) and restart["job"] == SLURM_JOB
    assert restart["evidence"]["culprit_nodes"] == []
