"""A DDP training loop instrumented for vigil: per-rank compute and collective wait, checkpoints.

Run beside `vigil agent` on each node: `torchrun --nproc-per-node 2 examples/train_ddp.py [steps]`
(gloo on the CPU, nccl on GPUs). The StepTimer reads CUDA events a step late (no synchronize) or,
without CUDA, the host clock; the comm hook separates DDP's overlapped all-reduce into the rank's
own compute and its exposed wait, so the aggregator can rank the slow rank first.
"""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from vigil_heartbeat import Heartbeat
from vigil_heartbeat.pytorch import StepTimer

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
device = torch.device("cuda", dist.get_rank() % max(1, torch.cuda.device_count())) if torch.cuda.is_available() \
    else torch.device("cpu")
model = DistributedDataParallel(torch.nn.Linear(1024, 1024).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)

hb = Heartbeat()  # job, rank and local GPU from torchrun's environment
timer = StepTimer(hb)
model.register_comm_hook(None, timer.ddp_comm_hook())

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
for step in range(1, steps + 1):
    with timer.data():
        batch = torch.randn(64, 1024, device=device)
    with timer.compute():
        model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad()
    timer.step(step)
    if step % 100 == 0:
        with hb.checkpointing():  # the hang detector gives saves their own, longer limit
            if dist.get_rank() == 0:
                torch.save(model.module.state_dict(), "/tmp/vigil-example.pt")
            dist.barrier()
dist.destroy_process_group()
