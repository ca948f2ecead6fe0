"""One rank of a training job run by a real Slurm job step (``srun``) for the job-recovery tests
(tests/e2e/test_job_recovery_slurm.py): steps at a fixed pace and beats each step through the
real heartbeat client to its node's real ``vigil agent``, announces a checkpoint every few steps
(``with hb.checkpointing():``, the save written to a file), resumes from that file when started
again, and can crash at a fixed step (the same step every run: a job that makes no progress).

No collective: the ranks keep pace by each stepping every ``--step-seconds``; a slow node's rank
reports more compute in the same step (the fast ranks' rest is comm: they wait for it), as a
synchronous job's ranks do. Its node, job and rank come from Slurm's environment of the step
(SLURMD_NODENAME, SLURM_JOB_ID, SLURM_PROCID). The agent binds a heartbeat to its sender's Slurm
job from the sender's cgroup; Slurm here tracks processes by process group (no cgroups), so the
rank first writes its own cgroup line, as Slurm's cgroup plugin would place it, into its node
agent's process table (collectors.training.proc_root; tests/agent/proc_table.py). Everything it
does is appended to ``<work>/events.jsonl`` (one JSON line each, wall clock) for the test to read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from tests.agent.proc_table import in_slurm_job
from vigil_heartbeat import Heartbeat


def log_event(work: Path, **fields: Any) -> None:
    line = json.dumps({"ts": time.time(), **fields}) + "\n"
    fd = os.open(work / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of a short line with O_APPEND: lines never interleave
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True, help="events log and checkpoints")
    parser.add_argument("--agents", type=Path, required=True, help="<node>.sock and <node>-proc of each agent")
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--compute-seconds", type=float, default=0.12)
    parser.add_argument("--slow-node", default="", help="this node's compute is --slow-factor slower")
    parser.add_argument("--slow-factor", type=float, default=1.0)
    parser.add_argument("--checkpoint-every-steps", type=int, default=0)
    parser.add_argument("--checkpoint-seconds", type=float, default=0.5)
    parser.add_argument("--crash-at-step", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="bound: exit 0 after this long")
    args = parser.parse_args()

    node, job, rank = os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"], int(os.environ["SLURM_PROCID"])
    in_slurm_job(args.agents / f"{node}-proc", os.getpid(), int(job))
    hb = Heartbeat(addr=str(args.agents / f"{node}.sock"))  # a str: a Unix socket path
    saved = args.work / f"checkpoint-{rank}"
    step = int(saved.read_text()) if saved.exists() else 0
    restart = int(os.environ.get("RESTART", "0"))
    log_event(args.work, event="start", node=node, job=job, rank=rank, step=step,
              restart=restart, slurm_restarts=int(os.environ.get("SLURM_RESTART_COUNT", "0")))

    def terminated(signum: int, frame: FrameType | None) -> None:
        log_event(args.work, event="terminated", node=node, rank=rank, step=step)
        sys.exit(143)

    signal.signal(signal.SIGTERM, terminated)
    compute = args.compute_seconds * (args.slow_factor if node == args.slow_node else 1.0)
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        time.sleep(args.step_seconds)
        step += 1
        hb.step(step, args.step_seconds, compute_seconds=compute, comm_seconds=args.step_seconds - compute)
        if args.crash_at_step and step == args.crash_at_step:
            log_event(args.work, event="crash", node=node, rank=rank, step=step)
            return 1
        if args.checkpoint_every_steps and step % args.checkpoint_every_steps == 0:
            start = time.time()
            with hb.checkpointing():
                time.sleep(args.checkpoint_seconds)
                saved.write_text(f"{step}\n")
            log_event(args.work, event="checkpoint", node=node, rank=rank, step=step, start=start, end=time.time())
    log_event(args.work, event="done", node=node, rank=rank, step=step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
