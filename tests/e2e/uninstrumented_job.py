"""One rank of a real data-parallel job (torch.distributed, gloo, CPU) with NO vigil instrumentation,
for the uninstrumented-hang tests (tests/e2e/test_uninstrumented_hang.py): no heartbeat client, no
vigil import. It is the test's program, not vigil's: besides training it writes its phase
("computing", "collective", "checkpointing", "evaluating", "done") with its step to
``<work>/phase-<rank>.json`` (one atomic rename per change), which the harness
(tests/e2e/uninstrumented_cluster.py) turns into its node's fake GPU and RDMA telemetry, as a real
job's state shows on real hardware. "collective" spans ``loss.backward()``, where DDP's gradient
all-reduce runs (the model is tiny: backward is the all-reduce's wait).

A hang: rank ``--stop-rank`` stops at step ``--stop-at-step`` inside the step's collective phase,
before its backward hands the gradient all-reduce to the process group, so the flight recorder
never sees it enter that all-reduce while the others wait in it. ``--stop-how
stuck`` (the default): its main thread never returns (a thread deadlocked on the way into the call);
``sigstop``: the whole process is stopped (SIGSTOP; nothing of it runs, not even a dump).

With the flight recorder on (``TORCH_FR_BUFFER_SIZE``), each rank runs a stall watchdog thread: the
first rank held in its collective phase for ``--dump-after-seconds`` writes torch's own JSON dump
(``torch._C._distributed_c10d._dump_fr_trace_json``) to ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` and sets
a key in the job's store, on which every other live rank's watchdog dumps too: what NCCL's watchdog
does with ``TORCH_NCCL_DUMP_ON_TIMEOUT`` (the first rank to time out signals the others through the
store; Llama 3's practice). gloo has no such watchdog, so the program does it with the same torch
calls, and before the process group's own timeout (``--collective-timeout-seconds``): a gloo
collective that times out is retired as completed in the recorder, and a dump taken after it no
longer shows who waited.

Lookalikes: ``--checkpoint-at-step`` (every rank checkpointing for ``--checkpoint-seconds``: rank 0
saves with torch.save while the others wait in a barrier, the phase says so) and
``--evaluate-at-step`` (forward passes under ``no_grad`` for ``--evaluate-seconds``, no collective).
Bounded by ``--max-seconds``. Rank, world size and the rendezvous come from the environment, as
torchrun sets it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def write_phase(work: Path, rank: int, phase: str, step: int, progress: Progress | None = None) -> None:
    """Atomic (write then rename): the harness never reads half a file."""
    if progress is not None:
        progress.enter(phase)
    path = work / f"phase-{rank}.json"
    tmp = work / f".phase-{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "phase": phase, "step": step, "ts": time.time()}))
    os.replace(tmp, path)


def dump_flight_recorder(rank: int) -> None:
    """torch's own Flight Recorder JSON, where torch would put it (TORCH_FR_DUMP_TEMP_FILE + rank)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if not prefix or not os.environ.get("TORCH_FR_BUFFER_SIZE"):
        return
    trace = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True)  # type: ignore[attr-defined]  # not in torch stubs
    target = Path(f"{prefix}{rank}")
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(trace if isinstance(trace, bytes) else trace.encode())
    os.replace(tmp, target)


DUMP_KEY = "flight_recorder_dump"  # set in the job's store by the first rank whose watchdog fires


class Progress:
    """What the main thread is doing, for the watchdog thread (one writer, one reader)."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.since = time.monotonic()

    def enter(self, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()


def watchdog(store: dist.Store, rank: int, progress: Progress, dump_after_seconds: float) -> None:
    """Dump once: when this rank has been in its collective too long (then ask the others through
    the store), or when another rank asks."""
    while True:
        try:
            if store.check([DUMP_KEY]):
                dump_flight_recorder(rank)
                return
            if progress.phase == "collective" and time.monotonic() - progress.since >= dump_after_seconds:
                dump_flight_recorder(rank)
                store.set(DUMP_KEY, str(rank))
                return
        except RuntimeError:  # the store's server (rank 0) went away: nothing left to dump for
            return
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--compute-seconds", type=float, default=0.25, help="the pace of a step's compute")
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-at-step", type=int, default=0)
    parser.add_argument("--stop-how", choices=("stuck", "sigstop"), default="stuck")
    parser.add_argument("--checkpoint-at-step", type=int, default=0)
    parser.add_argument("--checkpoint-seconds", type=float, default=0.0)
    parser.add_argument("--evaluate-at-step", type=int, default=0)
    parser.add_argument("--evaluate-seconds", type=float, default=0.0)
    parser.add_argument("--collective-timeout-seconds", type=float, default=600.0)
    parser.add_argument("--dump-after-seconds", type=float, default=10.0, help="the stall watchdog's limit")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="bound: exit 0 after this long")
    args = parser.parse_args()
    rank, world, work = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.work

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.collective_timeout_seconds))
    progress = Progress()
    if os.environ.get("TORCH_FR_BUFFER_SIZE"):
        store = dist.distributed_c10d._get_default_store()
        threading.Thread(target=watchdog, args=(store, rank, progress, args.dump_after_seconds), daemon=True).start()
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1234 + rank)
    deadline = time.monotonic() + args.max_seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        write_phase(work, rank, "computing", step, progress)
        started = time.perf_counter()
        x, y = torch.randn(32, 64, generator=data), torch.randn(32, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        time.sleep(max(0.0, args.compute_seconds - (time.perf_counter() - started)))
        write_phase(work, rank, "collective", step, progress)
        if rank == args.stop_rank and step == args.stop_at_step:
            if args.stop_how == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)  # stays here until SIGCONT or SIGKILL
            time.sleep(max(0.0, deadline - time.monotonic()))  # stuck: never hands the all-reduce over
            return 0
        try:
            loss.backward()  # DDP's gradient all-reduce
        except RuntimeError:  # the process group's timeout: the job is dead
            write_phase(work, rank, "timed_out", step, progress)
            time.sleep(max(0.0, deadline - time.monotonic()))
            return 1
        opt.step()
        opt.zero_grad()
        if step == args.checkpoint_at_step:
            write_phase(work, rank, "checkpointing", step, progress)
            until = time.monotonic() + args.checkpoint_seconds
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "step": step}, work / "checkpoint.pt")
            time.sleep(max(0.0, until - time.monotonic()))  # a large model's save, to a slow file system
            dist.barrier()
        if step == args.evaluate_at_step:
            write_phase(work, rank, "evaluating", step, progress)
            until = time.monotonic() + args.evaluate_seconds
            with torch.no_grad():
                while time.monotonic() < until:
                    model.module(torch.randn(256, 64, generator=data))
                    time.sleep(0.01)
    write_phase(work, rank, "done", step, progress)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
