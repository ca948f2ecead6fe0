"""A plain-DDP hang in a 4-node job, through a real aggregator process and four real agents, for the
hang test (tests/e2e/test_ddp_hang.py) and bench_hang.

Each node runs a real ``vigil agent`` (fake NVML backend, its own heartbeat socket, tests/training/
agents.py), started one after another, so their collection and report cycles run at independent
phases; one rank process per node (tests/e2e/hang_rank.py) admitted to one Slurm job in its node's
process table. The ranks step together from a shared wall-clock start and all stop at the same
step at the same moment, then stay alive (a collective that never returns). Each agent marks its
rank "hung" when its own ``hang_seconds`` clock crosses, at its own moment. ``run`` polls the
aggregator's decisions and notes when each first appeared (wall clock of this process). Every
process is bounded in time and stopped by pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.aggregator.aggregator_process import AggregatorProcess, wait_for
from tests.training.agents import Agent

RANK = Path(__file__).with_name("hang_rank.py")
NODES = ("node-a", "node-b", "node-c", "node-d")
SLURM_JOB = "7301"
POLL_SECONDS = 0.25


@dataclass
class HangRun:
    stop_wall: float  # when every rank made its last step (this process's wall clock)
    # decision id -> (seconds after the stop it was first seen, the decision as the API gives it)
    seen: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    def of(self, action: str) -> list[tuple[float, dict[str, Any]]]:
        return sorted((t, d) for t, d in self.seen.values() if d["action"] == action and d.get("job") == SLURM_JOB)

    @property
    def removals(self) -> list[dict[str, Any]]:
        """Every decision that would take a node (drain, reset, reboot, inspection), any detector."""
        return [d for _, d in self.seen.values()
                if d["action"] in ("drain", "reset_gpu", "reboot_node", "inspect_hardware")]


def run(root: Path, *, hang_seconds: list[float], aggregator: dict[str, Any], interval_seconds: float,
        step_seconds: float, steps: int, until_after_stop: float, training: dict[str, Any] | None = None) -> HangRun:
    """``hang_seconds``: each agent's own hang clock (one per node); ``aggregator``: the aggregator's
    config; ``until_after_stop``: watch this long after the stop (or until a restart_job shows)."""
    agg = AggregatorProcess(root, aggregator)
    agg.start()
    agents: list[Agent] = []
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        for node, hang in zip(NODES, hang_seconds, strict=True):
            agents.append(Agent(root, node, agg.url, training={"hang_seconds": hang, **(training or {})},
                                interval_seconds=interval_seconds))
        for agent in agents:
            wait_for(f"agent {agent.node}", agent.healthy, 30.0)
        start = time.time() + 2.0  # after every rank is admitted to the job
        for rank, agent in enumerate(agents):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "ddp-hang",
                   "VIGIL_HEARTBEAT_ADDR": f"unix:{agent.socket_path}"}
            log = (root / f"rank{rank}.log").open("wb")
            ranks.append(subprocess.Popen([sys.executable, str(RANK), repr(start), repr(step_seconds), str(steps),
                                           repr(until_after_stop + 60.0)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
            log.close()
            agent.admit(ranks[-1].pid, int(SLURM_JOB))
        result = HangRun(stop_wall=start + steps * step_seconds)
        deadline = result.stop_wall + until_after_stop
        while time.time() < deadline and not result.of("restart_job"):
            decisions, _ = agg.decisions()
            now = time.time()
            for d in decisions:
                result.seen.setdefault(d["id"], (round(now - result.stop_wall, 2), d))
            time.sleep(POLL_SECONDS)
        # A few evaluations more: whatever the restart came with is seen too.
        end = time.time() + 3.0 * aggregator.get("evaluate_interval_seconds", 2.5)
        while time.time() < end:
            decisions, _ = agg.decisions()
            for d in decisions:
                result.seen.setdefault(d["id"], (round(time.time() - result.stop_wall, 2), d))
            time.sleep(POLL_SECONDS)
        return result
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for agent in agents:
            agent.stop()
        agg.stop()
