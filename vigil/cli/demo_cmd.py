"""``vigil demo``: the whole stack on fake GPUs, in real time, on loopback.

Starts one aggregator and a handful of agent processes (fake 8x H100 nodes), runs a small
synchronous training job that sends heartbeats to every agent, injects one fault of a few kinds
(a fatal Xid in a kernel log, a GPU-level fault from a FakeNvml scenario, a slow node), and shows
nodes, GPUs and decisions as they happen. The aggregator runs in dry run: the demo says so at the
start, on its view and on every decision, and nothing is acted on. Every process it starts is
stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# node name -> (FakeNvml scenario, fault shown in the view). Scenario names are shipped under
# scenarios/node/; `None` is the embedded healthy default.
NODES: list[tuple[str, str | None, str]] = [
    ("gpu-node-01", None, "healthy"),
    ("gpu-node-02", None, "fatal Xid 79 in the kernel log at ~15 s"),
    ("gpu-node-03", "demo-ecc-storm", "uncorrectable ECC + row-remap failure on GPU 2 at ~10 s"),
    ("gpu-node-04", None, "slow node: its ranks compute 25% slower from ~5 s"),
    ("gpu-node-05", "demo-gpu-lost", "GPU 5 falls off the bus at ~25 s"),
]
XID_NODE = "gpu-node-02"
TABLE_NODE = "gpu-node-03"  # the node whose GPUs the view lists one by one
SLOW_NODE = "gpu-node-04"
DEMO_SLURM_JOB = 1001  # the demo job's Slurm id in the fake nodes' process tables
XID_AT_SECONDS = 15.0
SLOW_FROM_SECONDS = 5.0
XID_LINE = ("NVRM: Xid (PCI:0000:19:00): 79, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus.\n")


DRY_RUN_BANNER = ("vigil demo: DRY RUN. The aggregator decides and records, and nothing is acted on: "
                  "no node is drained, reset or rebooted, no scheduler or alert receiver is called.")
WRAP_COLUMNS = 100  # a decision's reason wraps at this width; it is never cut off
REASON_INDENT = " " * 6
DECISIONS_HEADER = "decisions (dry run: recorded, not acted on):"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the stack on fake GPUs with injected faults",
                       description="Run an aggregator and a few fake GPU nodes on loopback for about a minute.")
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    p.add_argument("--workdir", help="where logs, the store and the summary go (default: a temp dir)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str, timeout: float = 1.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # loopback only
        return json.loads(resp.read())


def _wait_http(url: str, proc: subprocess.Popen[bytes], deadline_seconds: float) -> None:
    end = time.monotonic() + deadline_seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=0.5).read()  # loopback only
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {deadline_seconds}s")


@dataclass
class Node:
    name: str
    scenario: str | None
    fault: str
    port: int
    udp_port: int
    kmsg: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def heartbeat_socket(self) -> Path:
        return self.kmsg.with_suffix(".sock")

    @property
    def proc_root(self) -> Path:
        return self.kmsg.with_suffix(".proc")
    ranks: list[int] = field(default_factory=list)


class TrainingJob(threading.Thread):
    """A tiny synchronous job: 8 ranks per node, one heartbeat per rank per step, through the
    real client. The slow node's ranks compute longer and wait less, as a real straggler does."""

    def __init__(self, nodes: list[Node], start: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        from vigil.agent.heartbeat import Heartbeat

        self.stop = stop
        self.start_ts = start
        self.step = 0
        self.clients: list[tuple[Node, Any]] = []
        for ni, node in enumerate(nodes):
            for local in range(8):
                rank = ni * 8 + local
                self.clients.append((node, Heartbeat(job="demo-llm", rank=rank, gpu=local,
                                                     addr=str(node.heartbeat_socket))))
        self.rng = random.Random(7)

    def run(self) -> None:
        base_compute = 0.30
        while not self.stop.is_set():
            self.step += 1
            elapsed = time.time() - self.start_ts
            computes = []
            for node, _ in self.clients:
                slow = node.name == SLOW_NODE and elapsed >= SLOW_FROM_SECONDS
                computes.append(base_compute * (1.25 if slow else 1.0) * self.rng.uniform(0.98, 1.02))
            step_seconds = max(computes) + 0.05
            for (_, hb), compute in zip(self.clients, computes, strict=True):
                hb.step(self.step, step_seconds, compute_seconds=compute, comm_seconds=step_seconds - compute,
                        data_seconds=0.005)
            self.stop.wait(0.5)


def _gpu_table(node: Node) -> list[str]:
    """One row per GPU of one node, from the agent's own /v1/state (its last report)."""
    try:
        state = _get_json(f"http://127.0.0.1:{node.port}/v1/state")
        gpus = (state.get("last_report") or {}).get("gpus", [])
    except (urllib.error.URLError, OSError, ValueError):
        gpus = []
    out = [f"{node.name} GPUs:",
           f"  {'gpu':>3} {'name':<24} {'health':<8} {'util':>5} {'SM MHz':>7} {'temp C':>6} {'HBM C':>6} "
           f"{'power W':>8} {'ECC corr':>8} {'ECC unc':>7} {'remap':<8} throttle"]
    for g in gpus:
        def num(key: str, scale: float = 1.0, fmt: str = "{:.0f}", g: dict[str, Any] = g) -> str:
            v = g.get(key)
            return fmt.format(v * scale) if v is not None else "-"
        remap = "FAILED" if g.get("remap_failure") else ("pending" if g.get("remap_pending") else "ok")
        out.append(f"  {g['index']:>3} {str(g.get('name', ''))[:24]:<24} {g.get('health', '?'):<8} "
                   f"{num('utilization_gpu_ratio', 100, '{:.0f}%'):>5} {num('sm_clock_hertz', 1e-6):>7} "
                   f"{num('temperature_celsius'):>6} {num('memory_temperature_celsius'):>6} "
                   f"{num('power_watts'):>8} {num('ecc_corrected_volatile'):>8} {num('ecc_uncorrected_volatile'):>7} "
                   f"{remap:<8} {','.join(g.get('clock_event_reasons') or []) or '-'}")
    if not gpus:
        out.append("  (no report yet)")
    return out


def _render(nodes: list[Node], agg: str, started: float, decisions: list[dict[str, Any]]) -> str:
    lines = [f"vigil demo (DRY RUN: nothing is acted on)  t={time.time() - started:5.1f}s   aggregator {agg}", ""]
    fault_chars = max(len(n.fault) for n in nodes)  # the whole description: never cut off
    lines.append(f"{'node':<13} {'fault':<{fault_chars}} {'GPUs ok':>7} {'hot':>4} {'max C':>6} {'state':<10}")
    try:
        agg_nodes = {n["node"]: n for n in _get_json(f"{agg}/v1/nodes").get("nodes", [])}
    except (urllib.error.URLError, OSError, ValueError):
        agg_nodes = {}
    for node in nodes:
        gpus: list[dict[str, Any]] = []
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
            state = _get_json(f"http://127.0.0.1:{node.port}/v1/state")
            gpus = (state.get("last_report") or {}).get("gpus", [])
        ok = sum(1 for g in gpus if g.get("health", "ok") == "ok")
        temps = [g["temperature_celsius"] for g in gpus if g.get("temperature_celsius") is not None]
        throttled = sum(1 for g in gpus if g.get("clock_event_reasons"))
        agg_state = str(agg_nodes.get(node.name, {}).get("state", "?"))
        lines.append(f"{node.name:<13} {node.fault:<{fault_chars}} {ok:>4}/{len(gpus):<2} {throttled:>4} "
                     f"{(max(temps) if temps else 0):>6.0f} {agg_state:<10}")
    lines += ["", *_gpu_table(next(n for n in nodes if n.name == TABLE_NODE)), "",
              DECISIONS_HEADER, *decision_lines(decisions[-12:])]
    return "\n".join(lines)


def decision_lines(decisions: list[dict[str, Any]]) -> list[str]:
    """Each decision on a line of its own, marked dry run (or ACTED ON, were it not), and its reason
    in full below it, wrapped at WRAP_COLUMNS."""
    if not decisions:
        return ["  (none yet)"]
    out = []
    for d in decisions:
        where = (d.get("node") or f"job {d.get('job')}") + (f" gpu {d['gpu']}" if d.get("gpu") is not None else "")
        acted = "dry run, not acted on" if d.get("dry_run", True) else "ACTED ON"
        out.append(f"  {time.strftime('%H:%M:%S', time.localtime(d['ts']))}  {d['action']:<16} {where:<20} "
                   f"[{d['detector']}] ({acted})")
        out += textwrap.wrap(str(d["reason"]), WRAP_COLUMNS, initial_indent=REASON_INDENT,
                             subsequent_indent=REASON_INDENT, break_long_words=False, break_on_hyphens=False)
    return out


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vigil-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "vigil"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    tty = sys.stdout.isatty()
    agg_port = _free_port()
    agg = f"http://127.0.0.1:{agg_port}"
    nodes = [Node(n, s, f, _free_port(), _free_port(), workdir / f"{n}.kmsg") for n, s, f in NODES]
    decisions: list[dict[str, Any]] = []
    print(DRY_RUN_BANNER, flush=True)
    try:
        agg_log = open(workdir / "aggregator.log", "wb")  # noqa: SIM115 - closed with the process
        # Dry run (nothing is acted on), and a breaker that lets the demo's 4 faulty nodes of 5
        # through: on a real fleet that share of removals is exactly what the breaker stops. The
        # demo's fleet starts with its aggregator, so no start-up grace.
        (workdir / "aggregator.yaml").write_text(yaml.safe_dump({
            "listen": f"127.0.0.1:{agg_port}", "store_path": str(workdir / "decisions.sqlite"),
            "dry_run": True, "gate": {"breaker_max_share": 1.0, "breaker_startup_grace_seconds": 0},
        }))
        agg_proc = subprocess.Popen([*exe, "aggregator", "--config", str(workdir / "aggregator.yaml")],
                                    stdout=agg_log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        procs.append(agg_proc)
        _wait_http(f"{agg}/healthz", agg_proc, 30)
        for node in nodes:
            node.kmsg.write_text("")
            config = {
                "node": node.name, "listen": f"127.0.0.1:{node.port}",
                "topology": {"rack": "rack-1", "leaf_switch": "leaf-1"},
                "nvml": {"backend": "fake", **({"scenario": node.scenario} if node.scenario else {})},
                "aggregator": {"url": agg, "interval_seconds": 1.0},
                # The job's ranks are this process; heartbeats are keyed by their sender's Slurm job
                # (docs/training.md "Job identity"), so each fake node's process table puts it in one.
                "collectors": {"training": {"udp_listen": f"127.0.0.1:{node.udp_port}",
                                            "unix_socket": str(node.heartbeat_socket),
                                            "proc_root": str(node.proc_root)}},
            }
            own = node.proc_root / str(os.getpid())
            own.mkdir(parents=True, exist_ok=True)
            (own / "stat").write_bytes(Path("/proc/self/stat").read_bytes())
            (own / "cgroup").write_text(f"0::/system.slice/slurmstepd.scope/job_{DEMO_SLURM_JOB}/step_0\n")
            cfg_path = workdir / f"{node.name}.yaml"
            cfg_path.write_text(yaml.safe_dump(config))
            log = open(workdir / f"{node.name}.log", "wb")  # noqa: SIM115 - closed with the process
            node.proc = subprocess.Popen([*exe, "agent", "--config", str(cfg_path), "--kmsg", str(node.kmsg)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
            procs.append(node.proc)
        for node in nodes:
            assert node.proc is not None
            _wait_http(f"http://127.0.0.1:{node.port}/healthz", node.proc, 30)
        started = time.time()
        TrainingJob(nodes, started, stop).start()
        xid_done = False
        last_printed = ""
        while time.time() - started < args.seconds:
            if not xid_done and time.time() - started >= XID_AT_SECONDS:
                with open(next(n.kmsg for n in nodes if n.name == XID_NODE), "a") as f:
                    f.write(XID_LINE)
                xid_done = True
            with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
                decisions = _get_json(f"{agg}/v1/decisions").get("decisions", [])
            view = _render(nodes, agg, started, decisions)
            if tty:
                sys.stdout.write("\x1b[2J\x1b[H" + view + "\n")
                sys.stdout.flush()
            elif view.split(DECISIONS_HEADER)[1] != last_printed:
                print(view, flush=True)
                last_printed = view.split(DECISIONS_HEADER)[1]
            time.sleep(1.0)
    except (RuntimeError, OSError) as exc:
        print(f"vigil demo: {exc} (logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
    summary = {"decisions": decisions, "nodes": [{"node": n.name, "fault": n.fault} for n in nodes]}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\nsummary (dry run: none of these decisions was acted on):")
    by_node: dict[str, list[str]] = {}
    for d in decisions:
        by_node.setdefault(d["node"], []).append(f"{d['action']} ({d['detector']})")
    fault_chars = max(len(n.fault) for n in nodes)
    for n in nodes:
        taken = ", ".join(by_node.get(n.name, [])) or "no decision"
        print(f"  {n.name:<13} fault: {n.fault:<{fault_chars}} -> {taken}")
    print(f"\nlogs, the decision store and summary.json (each decision's reason in full) are in {workdir}")
    return 0
