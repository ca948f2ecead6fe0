#!/usr/bin/env python3
"""The agent process's CPU per second, whole and with one collector at a time switched off.

Starts ``vigil agent`` on loopback once per variant (all collectors; without gpu, host, xid, rdma,
training; none), lets it settle, and reads its CPU from /proc over ``--seconds``: what each
collector costs the node as the process really runs it (hand-offs to worker threads, the Xid
wait thread, the reporter), which the per-cycle benches do not see. Prints one JSON object. It
changes nothing on the node; the real backend needs a GPU, ``--backend fake`` runs anywhere and
uses bench_agent's node (8 H100s over FakeNvml, 8 HCAs copied from the recorded H100 sysfs tree),
the node of ``make bench``'s idle-agent figure.

    PYTHONPATH=$PWD python3 scripts/agent-cpu-breakdown.py --backend nvml --seconds 25
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.bench_agent import AgentProcess, task_cpu_seconds
from vigil.cli.loadgen import free_port

COLLECTORS = ("gpu", "host", "xid", "rdma", "training")
SETTLE_SECONDS = 8.0  # start-up: identities, the first GPM sample, the first report


def measure(backend: str, off: tuple[str, ...], seconds: float, work: Path) -> float:
    """The agent's CPU milliseconds per second with the collectors ``off`` disabled."""
    if backend == "fake":
        agent = AgentProcess(Path(tempfile.mkdtemp(dir=work)), disabled=off)
        try:
            return agent.cpu_ms_per_second(seconds)
        finally:
            agent.stop()
    collectors: dict[str, Any] = {name: {"enabled": False} for name in off}
    if "training" not in off:
        collectors["training"] = {"udp_listen": f"127.0.0.1:{free_port()}"}
    config = work / "agent.yaml"
    config.write_text(yaml.safe_dump({"node": "cpu-breakdown", "listen": f"127.0.0.1:{free_port()}",
                                      "nvml": {"backend": backend}, "collectors": collectors}))
    kmsg = work / "kmsg"
    kmsg.touch()
    proc = subprocess.Popen([sys.executable, "-m", "vigil", "agent", "--config", str(config), "--kmsg", str(kmsg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(SETTLE_SECONDS)
        cpu0, wall0 = task_cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        cpu1, wall1 = task_cpu_seconds(proc.pid), time.monotonic()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 1000.0 * (cpu1 - cpu0) / (wall1 - wall0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("nvml", "fake"), default="fake")
    parser.add_argument("--seconds", type=float, default=25.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vigil-cpu-"))
    variants: list[tuple[str, tuple[str, ...]]] = [("all", ())]
    variants += [(f"without {name}", (name,)) for name in COLLECTORS]
    variants.append(("none", COLLECTORS))
    out: dict[str, Any] = {"backend": args.backend, "seconds": args.seconds,
                           "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_ms_per_second": {}}
    for name, off in variants:
        out["cpu_ms_per_second"][name] = round(measure(args.backend, off, args.seconds, work), 2)
        print(f"{name}: {out['cpu_ms_per_second'][name]} ms/s", file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
