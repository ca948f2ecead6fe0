"""Hang blame by when each rank stopped, not by whose agent said "hung" first (issue 38).

Four nodes' agents run at independent phases (each collects and reports every 2.5 s at its own
offset, on its own clock) and mark a rank "hung" once their own clock says it has not stepped for
``hang_seconds`` (300 s, the agent's default), each at its own moment. The real engine (every
detector, shipped defaults) evaluates every 2.5 s on its own phase. A plain DDP hang (every rank at
the same step at the same moment) must drain nobody: the job is alerted, then restarted after
``stall_seconds``, both naming the job and no node. The faults beside it must still be blamed: a
node that stopped well before the rest, and a rank that crashed while the rest still ran.
"""

from __future__ import annotations

import pytest

from tests.aggregator.conftest import proposals_ledger
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.engine import Engine
from vigil.contract.wire import RankSummary, Report

REPORT_SECONDS = 2.5
EVALUATE_SECONDS = 2.5
STEP_SECONDS = 2.0
RANKS_PER_NODE = 8
AGENT_HANG_SECONDS = 300.0  # agent/collectors/training.py TrainingConfig.hang_seconds
STOP = 200.0  # the job's steps stop here (aggregator clock)


class PhasedAgent:
    """One node's agent: reports at ``phase`` + k x 2.5 s on the aggregator's clock, stamping on its
    own clock (``offset`` ahead); its ranks stop at ``stop`` (their own last step), ``state`` from
    its own hang clock, or exited from ``exit_at``."""

    def __init__(self, index: int, phase: float, offset: float = 0.0, stop: float = STOP,
                 exit_at: float | None = None) -> None:
        self.index, self.phase, self.offset, self.stop, self.exit_at = index, phase, offset, stop, exit_at
        self.name = f"node-{index}"
        self.seq = 0

    def report(self, t: float) -> Report:
        self.seq += 1
        progress = min(t, self.stop)
        progress -= progress % STEP_SECONDS
        stalled = t - progress
        if self.exit_at is not None and t >= self.exit_at:
            state = "exited"
        else:
            state = "hung" if stalled >= AGENT_HANG_SECONDS else "running"
        ranks = [RankSummary(job="ddp", rank=self.index * RANKS_PER_NODE + i, gpu=i, pid=100 + i,
                             state=state, window_seconds=5.0, steps=0 if stalled > 5.0 else 2,  # type: ignore[arg-type]
                             last_step=int(progress / STEP_SECONDS), last_progress_ts=progress + self.offset,
                             step_seconds_p50=STEP_SECONDS, window_end_ts=t - t % 5.0 + self.offset)
                 for i in range(RANKS_PER_NODE)]
        return Report(node=self.name, boot_id=f"boot-{self.index}", seq=self.seq, ts=t + self.offset,
                      interval_seconds=REPORT_SECONDS, ranks=ranks)


def run(agents: list[PhasedAgent], until: float, config: dict | None = None) -> list[tuple[float, Decision]]:
    """Every (time, hang decision) the engine admitted, reports and evaluations interleaved by time."""
    engine = Engine(parse_config({"dry_run": True, **(config or {})}), proposals_ledger())
    ticks = sorted([(a.phase + k * REPORT_SECONDS, 0, i) for i, a in enumerate(agents)
                    for k in range(int(until / REPORT_SECONDS))]
                   + [(0.9 + k * EVALUATE_SECONDS, 1, -1) for k in range(int(until / EVALUATE_SECONDS))])
    out: list[tuple[float, Decision]] = []
    for t, what, i in ticks:
        if what == 0:
            assert engine.ingest(agents[i].report(t), t) == {}
        else:
            out.extend((t, d) for d in engine.evaluate(t) if d.detector == "hang")
    return out


PHASES = [(0.0, 0.6, 1.2, 1.8), (2.4, 0.1, 1.3, 0.7), (0.5, 0.5, 2.0, 2.2), (1.0, 2.49, 0.01, 1.6)]


@pytest.mark.parametrize("phases", PHASES)
def test_plain_ddp_hang_with_agents_crossing_their_hang_clock_apart_drains_nobody(phases):
    decisions = run([PhasedAgent(i, p) for i, p in enumerate(phases)], STOP + 400.0)
    assert [d.action for _, d in decisions if d.action in (Action.DRAIN, Action.RESET_GPU)] == []
    acts = [(d.action, d.node, d.job) for _, d in decisions]
    assert acts == [(Action.ALERT, None, "ddp"), (Action.RESTART_JOB, None, "ddp")], acts
    alert_at, restart_at = (t for t, _ in decisions)
    assert alert_at - STOP <= 30.0 and restart_at - STOP >= 300.0


def test_skewed_clocks_do_not_set_a_node_apart():
    # node-1 is 3 s ahead (within the fleet's 5 s tolerance, not corrected), node-2 90 s behind
    # (measured and placed on the aggregator's clock): the job still stopped together.
    agents = [PhasedAgent(0, 0.3), PhasedAgent(1, 1.1, offset=3.0), PhasedAgent(2, 1.9, offset=-90.0),
              PhasedAgent(3, 0.8)]
    decisions = run(agents, STOP + 400.0)
    assert [(d.action, d.node) for _, d in decisions] == [(Action.ALERT, None), (Action.RESTART_JOB, None)]


def test_a_node_that_stopped_well_before_the_rest_is_still_blamed():
    # The fault beside it: node-2's ranks stopped 40 s (20 steps) before the rest did.
    agents = [PhasedAgent(0, 0.3), PhasedAgent(1, 1.1), PhasedAgent(2, 1.9, stop=STOP - 40.0),
              PhasedAgent(3, 0.8)]
    decisions = run(agents, STOP + 100.0)
    drains = {d.node for _, d in decisions if d.action is Action.DRAIN}
    assert drains == {"node-2"}
    restart = [d for _, d in decisions if d.action is Action.RESTART_JOB]
    assert len(restart) == 1 and restart[0].node is None and restart[0].evidence["culprit_nodes"] == ["node-2"]


def test_a_rank_crash_is_blamed_and_the_watchdog_teardown_after_the_hang_is_not():
    # node-3's processes die as the job stops (a crash): the rest block in the collective.
    crashed = run([PhasedAgent(0, 0.3), PhasedAgent(1, 1.1), PhasedAgent(2, 1.9),
                   PhasedAgent(3, 0.8, exit_at=STOP + 1.0)], STOP + 60.0)
    assert {d.node for _, d in crashed if d.action is Action.DRAIN} == {"node-3"}
    # A plain hang, then the NCCL watchdog (600 s) kills the ranks, node-3's agent seeing it first:
    # the exits follow the stop by far more than a stall limit, so they blame nobody.
    teardown = run([PhasedAgent(0, 0.3, exit_at=STOP + 605.0), PhasedAgent(1, 1.1, exit_at=STOP + 605.0),
                    PhasedAgent(2, 1.9, exit_at=STOP + 605.0), PhasedAgent(3, 0.8, exit_at=STOP + 601.0)],
                   STOP + 620.0)
    assert [d.action for _, d in teardown if d.action is Action.DRAIN] == []
