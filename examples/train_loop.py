"""A PyTorch-style training loop instrumented for vigil: one import, one line per step.

Run beside `vigil agent`, inside a Slurm job (`srun python examples/train_loop.py [steps]`) or a
pod, with the vigil_heartbeat client installed. It sends its heartbeats to the agent's Unix socket,
/run/vigil/heartbeat.sock (or $VIGIL_HEARTBEAT_ADDR); the agent keys them by the Slurm job or pod of
this process, so "example" below is only a display name (docs/training.md "Job identity"). Rank
comes from torchrun's or Slurm's environment. Without torch installed it times a sleep stand-in.
"""
import sys
import time

from vigil_heartbeat import Heartbeat

try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

hb = Heartbeat(job="example")  # a label: the job is the scheduler's
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
for step in range(1, steps + 1):
    with hb.phase("data"):
        if torch is not None:
            batch = torch.randn(64, 512)
        else:
            time.sleep(0.01)
    with hb.phase("compute"):
        if torch is not None:
            model(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
        else:
            time.sleep(0.08)
    hb.step(step)  # the one line: data and compute phases and the step's wall time are measured
print(f"sent {hb.sent} heartbeats, dropped {hb.dropped}")
