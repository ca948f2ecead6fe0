"""A real vigil agent for one fake node whose GPUs a test drives at run time, for the
uninstrumented-hang tests (tests/e2e/uninstrumented_cluster.py).

It builds the agent as ``vigil agent`` does (agent.daemon.Agent over a ``Seams``: the real runner,
collectors, reporter and exporter), with the fake NVML backend built here so that the node's GPUs
can be switched at run time through the fake's own seam (``FakeNvml.set_busy_spin``), and with its
own process table (``Seams.proc_root``). Every ``POLL_SECONDS`` it reads ``--mode-file`` (one word,
written by the test's telemetry driver) and makes every GPU busy-spin while it says ``busy_spin``;
any other mode leaves the GPUs on the scenario's load. It exits on SIGTERM.

argv: --config, --scenario, --sysfs-root, --proc-root, --kmsg, --mode-file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from pathlib import Path

from vigil.agent.config import load_config
from vigil.agent.daemon import Agent
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.cli.log_format import configure_logging
from vigil.contract.seams import Seams

POLL_SECONDS = 0.2


async def follow_mode(fake: FakeNvml, mode_file: Path, stop: asyncio.Event) -> None:
    spinning = False
    gpus = list(range(fake.scenario.gpus))
    while not stop.is_set():
        try:
            mode = mode_file.read_text().strip()
        except OSError:
            mode = ""
        if (mode == "busy_spin") != spinning:
            spinning = not spinning
            fake.set_busy_spin(gpus, spinning)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_SECONDS)


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--config", "--scenario", "--sysfs-root", "--proc-root", "--kmsg", "--mode-file"):
        parser.add_argument(flag, type=Path, required=True)
    args = parser.parse_args()
    configure_logging("INFO", "text")
    config = load_config(args.config)
    fake = FakeNvml(load_node_scenario(args.scenario), time.time)
    backend = PynvmlBackend(fake)
    backend.init()
    agent = Agent(config, Seams(nvml=backend, sysfs_root=args.sysfs_root, proc_root=args.proc_root,
                                kmsg=str(args.kmsg), clock=time.time))

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow_mode(fake, args.mode_file, stop))
            tg.create_task(agent.run(stop, on_ready=lambda address: print(f"listening on {address}", flush=True)))

    asyncio.run(run())


if __name__ == "__main__":
    main()
