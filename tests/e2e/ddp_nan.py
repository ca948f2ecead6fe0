"""One rank of a real data-parallel job (torch.distributed, gloo, CPU) run by a Slurm job step, for
the NaN-loss test (tests/e2e/test_nan_loss_ddp.py): it reports its loss with every step through
the real heartbeat client (``hb.step(n, loss=...)``), saves a checkpoint every few steps (``with
hb.checkpointing():``) and resumes from it when started again. At a fixed step a bad batch (an
inf in rank 0's input) makes the loss non-finite: DDP's gradient all-reduce carries the NaN to
every rank's weights, so every rank's loss is NaN from the next step on; after three NaN steps
the loop gives up (FloatingPointError, a non-zero exit), as a NaN guard with a short patience
does: the run ends within one of the agents' 1 s summary windows of its first NaN, a window that
also holds finite losses (the agent counts non-finite losses apart: RankSummary.nonfinite_loss_steps). Started
again from its checkpoint (before the bad step) it meets the same batch: NaN again, at the same step.

argv: the work directory (checkpoint, events log), the agents' directory (``<node>.sock``,
``<node>-proc``: see train_rank.py for why the rank writes its own cgroup line there), the step of
the bad batch. Rank, world
size and master address come from Slurm's environment of the step and the batch script.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.agent.proc_table import in_slurm_job
from tests.e2e.train_rank import log_event
from vigil_heartbeat import Heartbeat

CHECKPOINT_EVERY_STEPS = 5
NAN_STEPS_TO_CRASH = 3  # the loop's NaN guard gives up after this many non-finite losses (0.75 s)
STEP_SECONDS = 0.25  # the pace of a step (the model is tiny; a real step takes this long)
MAX_STEPS = 200  # bound: a run that never meets the bad batch still ends


def main() -> int:
    work, agents, bad_batch_step = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    node, job = os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    in_slurm_job(agents / f"{node}-proc", os.getpid(), int(job))
    hb = Heartbeat(addr=str(agents / f"{node}.sock"))  # a str: a Unix socket path
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                                        torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    saved = work / "ddp-checkpoint.pt"
    step = 0
    if saved.exists():
        state = torch.load(saved)
        model.module.load_state_dict(state["model"])
        step = int(state["step"])
    log_event(work, event="start", node=node, job=job, rank=rank, step=step)
    nan_steps = 0
    data = torch.Generator().manual_seed(1234)
    while step < MAX_STEPS:
        started = time.perf_counter()
        step += 1
        x, y = torch.randn(32, 16, generator=data), torch.randn(32, 1, generator=data)
        if step == bad_batch_step and rank == 0:  # an inf in the input, every run
            x[0, 0] = math.inf
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        time.sleep(max(0.0, STEP_SECONDS - (time.perf_counter() - started)))
        hb.step(step, loss=value)
        if not math.isfinite(value):
            nan_steps += 1
            log_event(work, event="nan", node=node, rank=rank, step=step)
            if nan_steps >= NAN_STEPS_TO_CRASH:
                log_event(work, event="crash", node=node, rank=rank, step=step)
                raise FloatingPointError(f"rank {rank}: loss is {value} at step {step}")
        if step % CHECKPOINT_EVERY_STEPS == 0 and nan_steps == 0:  # never save a diverged model
            with hb.checkpointing():
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "step": step}, saved)
                dist.barrier()
            log_event(work, event="checkpoint", node=node, rank=rank, step=step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
