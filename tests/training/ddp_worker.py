"""One rank of a small real data-parallel job (torch.distributed, gloo, CPU) for the training tests.

argv: modes, comma-separated, each run in turn for the given seconds ("timed": DDP with the
StepTimer's comm hook; "fsdp": FSDP2 (fully_shard) with ``StepTimer.watch`` on its blocks;
"steps": DDP with hb.step(n) only), then the rank to slow down and by how many seconds of compute
per step. With several modes each sends as job "<job>-<mode>". Identity and addresses come from
the environment as torchrun sets them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID) plus VIGIL_HEARTBEAT_ADDR for this rank's node agent.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from vigil_heartbeat import Heartbeat
from vigil_heartbeat.pytorch import StepTimer

LAYERS = 4


class Block(torch.nn.Module):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)  # this rank's GPU is slow: every kernel of it takes longer
        return torch.relu(self.lin(x))


def keep_going(deadline: float) -> bool:
    """Every rank agrees when to stop, so no rank is left waiting in a collective."""
    go = torch.ones(1) if time.monotonic() < deadline else torch.zeros(1)
    dist.all_reduce(go, op=dist.ReduceOp.MIN)
    return bool(go.item() > 0)


def run(mode: str, hb: Heartbeat, seconds: float, delay: float) -> int:
    torch.manual_seed(0)
    blocks = [Block(delay / LAYERS) for _ in range(LAYERS)]
    model: torch.nn.Module = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 8))
    timer = None
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        timer = StepTimer(hb)
        timer.watch(*blocks)  # after fully_shard: FSDP's all-gather wait runs before our hook
    else:
        model = DistributedDataParallel(model)
        if mode == "timed":
            timer = StepTimer(hb)
            model.register_comm_hook(dist.group.WORLD, timer.ddp_comm_hook())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + seconds
    step = 0
    while keep_going(deadline):
        step += 1
        x, y = torch.randn(32, 64), torch.randn(32, 8)
        if timer is not None and mode == "timed":
            with timer.compute():
                torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if timer is not None:
            timer.step(step)
        else:
            hb.step(step)
    return step


def main() -> None:
    modes, seconds, slow_rank, slow_seconds = sys.argv[1].split(","), float(sys.argv[2]), int(sys.argv[3]), \
        float(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    job = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    print(f"rank {rank}: process group up", flush=True)
    for mode in modes:
        hb = Heartbeat(job=f"{job}-{mode}" if len(modes) > 1 else job)
        steps = run(mode, hb, seconds, slow_seconds if rank == slow_rank else 0.0)
        print(f"rank {rank} {mode}: {steps} steps, {hb.sent} heartbeats sent, {hb.dropped} dropped", flush=True)
    # Both ranks past their last collective before the group goes; then leave without the
    # interpreter's teardown of torch's C++ threads, which once aborted a rank under load
    # ("terminate called without an active exception") after all its work was done and reported.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
