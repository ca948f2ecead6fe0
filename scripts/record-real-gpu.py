#!/usr/bin/env python3
"""Record what a real NVIDIA GPU and driver answer, for the tests that run without one.

Run on a node with a real GPU, from the repository root, as root (the reset step needs it):

    PYTHONPATH=.:clients/heartbeat python3 scripts/record-real-gpu.py OUT_DIR

It writes into OUT_DIR: every NVML call the backend makes, with its real answer or error and its
duration (``nvml-recording.json``: idle, then under a tensor-core load and a memory-bound load,
both made with PyTorch if it is installed), what the backend made of each (``backend-ops.json``,
the replay test's expectations), per-call costs and the collector's CPU per cycle
(``costs.json``), the GPU-reset path through the agent's node-action runner against the real driver
(``reset.json``), and the output of ``nvidia-smi -q``/``topo -m``/``nvlink --status`` and ``dcgmi
diag -r 1`` where present. It changes nothing on the GPU: without ``--reset`` the reset step stops at
the command line it would run (the checks before it, the busy refusal included, run against the
real driver); with ``--reset`` it resets idle GPU 0 for real, for a site that permits it.

Run as root, it also records the same backend calls made by an unprivileged user (uid 65534, as an
agent in a container without privileges runs): ``nvml-unprivileged.json``, which calls that user is
refused. The real agent runs for ``--agent-seconds`` reporting to a real aggregator on loopback
(dry run), whose fleet view and decisions are kept (``aggregator-node.json``).

``--agent-only`` runs only the agent and aggregator, with a training loop sending heartbeats through
``vigil_heartbeat``'s ``StepTimer`` throughout, and measures the agent's CPU per second and memory
(``agent-cpu-training.json``; files ``*-training.*``).

``--rehearse`` runs every step over FakeNvml (healthy-h100, no loads, the agent on its fake backend)
on a machine without a GPU, so that a device session spends its minutes recording, not debugging.
tests/fixtures/nvml-real/PROVENANCE.md says how the shipped recording was made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.recording import RECORDING_FORMAT, RecordingNvml
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.cli.loadgen import free_port

REPO = Path(__file__).resolve().parents[1]
# The uid/gid an unprivileged agent runs as for the probe (nobody on Debian and Ubuntu).
UNPRIVILEGED_ID = 65534

# Loads run in a child process for this long (s); readings are taken every READ_INTERVAL_SECONDS,
# so each GPM pair spans a real interval of that length, as the collector's does.
LOAD_SECONDS = 14.0
READ_INTERVAL_SECONDS = 2.0
LOADS = {
    # bf16 matrix products: tensor cores busy, DRAM moderately.
    "tensor": "import torch,time\na=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\n"
              "b=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\nprint('ready',flush=True)\n"
              "end=time.time()+{s}\nwhile time.time()<end:\n    c=a@b\n    torch.cuda.synchronize()\n",
    # Device-to-device copies of 4 GiB: DRAM bandwidth near its cap, tensor cores idle.
    "memory": "import torch,time\na=torch.empty(2**30,device='cuda',dtype=torch.float32)\nb=torch.empty_like(a)\n"
              "print('ready',flush=True)\nend=time.time()+{s}\nwhile time.time()<end:\n    b.copy_(a)\n"
              "    torch.cuda.synchronize()\n",
}
# A training loop instrumented as a user would: vigil_heartbeat's StepTimer around each step's bf16
# products (CUDA events), one heartbeat a step to the agent at {addr} (job "recorded", rank 0, GPU 0).
TRAINING_LOAD = (
    "import torch,time\nfrom vigil_heartbeat import Heartbeat\nfrom vigil_heartbeat.pytorch import StepTimer\n"
    "a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\nb=torch.randn_like(a)\n"
    "hb=Heartbeat(job='recorded',rank=0,gpu=0,addr=('127.0.0.1',{port}))\ntimer=StepTimer(hb)\n"
    "print('ready',flush=True)\nend=time.time()+{s}\nstep=0\nwhile time.time()<end:\n    step+=1\n"
    "    with timer.compute():\n        for _ in range(40):\n            c=a@b\n    timer.step(step)\n"
    "    time.sleep(0.05)\n"
)


def sh(out: Path, name: str, argv: list[str], timeout: float = 120) -> str:
    """Run a command, keep its output (or why it failed) in ``out/name``."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        text = f"$ {' '.join(argv)}\n# exit {done.returncode}\n{done.stdout}{done.stderr}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"$ {' '.join(argv)}\n# did not run: {type(exc).__name__}: {exc}\n"
    (out / name).write_text(text)
    return text


def as_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_json(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    return value


def open_nvml(rehearse: bool) -> Any:
    """The real pynvml module, or for a rehearsal a FakeNvml H100 node on the wall clock."""
    return FakeNvml(load_node_scenario("healthy-h100"), time.time) if rehearse else pynvml


class Session:
    """The backend over a recording NVML, with every backend call and its result kept as an op."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = RecordingNvml(nvml)
        # RecordingNvml stands in for the pynvml module (through __getattr__), which
        # PynvmlBackend's annotation (ModuleType | FakeNvml) does not name.
        self.backend = PynvmlBackend(self.nvml)  # type: ignore[arg-type]  # duck-typed pynvml module
        self.ops: list[dict[str, Any]] = []

    def op(self, phase: str, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            result = getattr(self.backend, name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded, as the replay must raise the same
            self.ops.append({"phase": phase, "op": name, "args": list(args), "kwargs": kwargs,
                             "raises": type(exc).__name__})
            return None
        self.ops.append({"phase": phase, "op": name, "args": list(args), "kwargs": kwargs, "result": as_json(result)})
        return result


REHEARSAL = False  # set by main: no GPU loads over FakeNvml


def start_load(kind: str, heartbeat_port: int = 0, seconds: float = LOAD_SECONDS + 4) -> subprocess.Popen[str] | None:
    if REHEARSAL:
        return None
    try:
        import torch  # noqa: F401 - only to know it is there
    except ImportError:
        return None
    code = TRAINING_LOAD.format(s=seconds, port=heartbeat_port) if kind == "training" else LOADS[kind].format(s=seconds)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "clients" / "heartbeat"),
                                                         os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    child.stdout.readline()  # "ready": the tensors are on the GPU
    return child


def record_phase(s: Session, phase: str, count: int, reads: int) -> None:
    for _ in range(reads):
        time.sleep(READ_INTERVAL_SECONDS)
        for i in range(count):
            s.op(phase, "read", i)
    for i in range(count):
        s.op(phase, "running_pids", i)


def collector_cpu(nvml: Any, count: int, cycles: int = 20) -> dict[str, Any]:
    """CPU seconds per collection cycle of the real backend, all GPUs, with and without NVLink."""
    backend = PynvmlBackend(nvml)
    backend.init()
    for i in range(count):
        backend.identity(i)
        backend.read(i)
    out: dict[str, Any] = {}
    for nvlinks in (True, False):
        per_cycle = []
        for _ in range(cycles):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for i in range(count):
                backend.read(i, slow=nvlinks)
            per_cycle.append((time.process_time() - cpu0, time.perf_counter() - wall0))
        key = "with_nvlink" if nvlinks else "without_nvlink"
        out[key] = {"cpu_seconds_median": statistics.median(c for c, _ in per_cycle),
                    "wall_seconds_median": statistics.median(w for _, w in per_cycle),
                    "cycles": cycles, "gpus": count}
    backend.shutdown()
    return out


def gpu_collector_cpu(nvml: Any, cycles: int = 15) -> dict[str, Any]:
    """The agent's GPU collector (process attribution included) over the real backend, under a
    tensor load, 0.5 s apart: CPU and wall per cycle, for cycles that read NVLink and the energy
    counter (slow) and for those that do not (fast, the collector's usual cycle)."""
    from vigil.agent.attribution import ProcessAttribution
    from vigil.agent.collectors.gpu import GpuCollector, GpuConfig

    backend = PynvmlBackend(nvml)
    backend.init()
    child = start_load("tensor")
    out: dict[str, Any] = {"gpus": backend.device_count(), "cycles": cycles, "load": "tensor" if child else "idle"}
    for kind, interval in (("slow_cycle", 1e-6), ("fast_cycle", 1e9)):
        collector = GpuCollector(GpuConfig(xid_events=False, nvlink_interval_seconds=interval), backend, time.time,
                                 ProcessAttribution(backend))
        collector.collect(time.time())  # identities and the first GPM sample
        spent = []
        for _ in range(cycles):
            time.sleep(0.5)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            collector.collect(time.time())
            spent.append((time.process_time() - cpu0, time.perf_counter() - wall0))
        collector.close()
        out[kind] = {"cpu_seconds_median": statistics.median(c for c, _ in spent),
                     "wall_seconds_median": statistics.median(w for _, w in spent)}
    if child is not None:
        child.kill()
        child.wait()
    backend.shutdown()
    return out


def call_costs(calls: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[float]] = defaultdict(list)
    outcome: dict[str, set[str]] = defaultdict(set)
    for c in calls:
        by[c["call"]].append(c["seconds"])
        outcome[c["call"]].add(c.get("error", "ok"))
    return {name: {"calls": len(v), "median_us": round(statistics.median(v) * 1e6, 1),
                   "max_us": round(max(v) * 1e6, 1), "outcomes": sorted(outcome[name])}
            for name, v in sorted(by.items())}


def exercise_reset(nvml: Any, out: Path, do_reset: bool) -> dict[str, Any]:
    """The agent's node-action runner over the real backend: refused while a process holds GPU 0,
    then let through on the idle GPU, where ``nvidia-smi --gpu-reset`` runs only with --reset (else
    the command line is recorded and not run)."""
    from vigil.agent.node_action_runner import NodeActionRunner, NodeActionsConfig
    from vigil.contract.node_actions import node_key, sign
    from vigil.contract.wire import NodeActionRequest, to_builtins

    master = os.urandom(32)
    node = "gpu-recorded"
    key_file = Path(tempfile.mkdtemp()) / "node.key"
    key_file.write_text(node_key(master, node).hex())
    not_run: list[list[str]] = []

    def dry_run(argv: Sequence[str], timeout_seconds: float) -> str:
        not_run.append(list(argv))
        return "(not run: scripts/record-real-gpu.py without --reset)"

    backend = PynvmlBackend(nvml, run=None if do_reset else dry_run)
    backend.init()
    uuid = backend.identity(0).uuid
    runner = NodeActionRunner(NodeActionsConfig(allow=["reset_gpu"], key_file=str(key_file)), node=node,
                              boot_id="recorded-boot", nvml=backend, clock=time.time)

    def request(n: int) -> NodeActionRequest:
        now = time.time()
        return sign(NodeActionRequest(id=f"recorded-{n}", action="reset_gpu", node=node, boot_id="recorded-boot",
                                      gpu=0, gpu_uuid=uuid, issued_at=now, expires_at=now + 300,
                                      reason="scripts/record-real-gpu.py"), node_key(master, node))

    results: dict[str, Any] = {}
    child = start_load("tensor")
    if child is not None:
        results["pids_seen_while_busy"] = backend.running_pids(0)
        results["child_pid"] = child.pid
        started = time.perf_counter()
        results["while_busy"] = to_builtins(runner.handle(request(1)))
        results["while_busy_seconds"] = time.perf_counter() - started
        child.kill()
        child.wait()
    time.sleep(1)
    results["pids_seen_idle"] = backend.running_pids(0)
    started = time.perf_counter()
    results["idle"] = to_builtins(runner.handle(request(2)))
    results["idle_seconds"] = time.perf_counter() - started
    results["commands_not_run"] = not_run
    after = backend.read(0)
    results["health_after"] = after.health
    backend.shutdown()
    (out / "reset.json").write_text(json.dumps(results, indent=1, default=str))
    return results


def _get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as answer:
        return bytes(answer.read())


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    try:
        log, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    return log or ""


def _wait_http(url: str, proc: subprocess.Popen[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            _get(url)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {seconds} s (exit {proc.poll()})")


def _process_cost(pid: int, warmup_seconds: float, seconds: float) -> dict[str, Any]:
    """A process's CPU (user + system, from /proc) and resident memory over ``seconds``, after
    ``warmup_seconds``."""
    from vigil.cli.loadgen import read_proc

    time.sleep(warmup_seconds)
    before, wall0 = read_proc(pid), time.monotonic()
    time.sleep(seconds)
    after, wall1 = read_proc(pid), time.monotonic()
    cpu = after.cpu_seconds - before.cpu_seconds
    return {"seconds": wall1 - wall0, "cpu_seconds": cpu, "cpu_ms_per_second": 1000 * cpu / (wall1 - wall0),
            "rss_bytes_start": before.rss_bytes, "rss_bytes_end": after.rss_bytes}


def run_agent(out: Path, seconds: float, rehearse: bool, training: bool = False) -> None:
    """The real agent on the real backend for ``seconds``, reporting every 2 s to a real aggregator
    on loopback (dry run: nothing is acted on), scraped at its end with a load running; the
    aggregator's view of the node and its decisions are kept beside the agent's own state. With
    ``training`` the load is a heartbeat-instrumented training loop and the files end in
    ``-training``."""
    import yaml

    suffix = "-training" if training else ""
    work = Path(tempfile.mkdtemp(prefix="vigil-record-"))
    agg_port, agent_port, heartbeat_port = free_port(), free_port(), free_port()
    agg_url = f"http://127.0.0.1:{agg_port}"
    (work / "aggregator.yaml").write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{agg_port}", "store_path": str(work / "decisions.sqlite"), "dry_run": True,
        "gate": {"breaker_max_share": 1.0, "breaker_startup_grace_seconds": 0}}))
    (work / "agent.yaml").write_text(yaml.safe_dump({
        "node": "gpu-recorded", "listen": f"127.0.0.1:{agent_port}",
        "nvml": {"backend": "fake" if rehearse else "nvml"},
        "aggregator": {"url": agg_url, "interval_seconds": 2.0},
        # The recorded load runs outside any scheduler: its UDP heartbeats are taken as unverified
        # (keyed unverified/recorded), which the agent refuses unless told (docs/training.md).
        "collectors": {"training": {"udp_listen": f"127.0.0.1:{heartbeat_port}", "accept_unverified": True}}}))
    # The services run in the work folder: the repository goes on their path by its absolute name.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    aggregator = subprocess.Popen([sys.executable, "-m", "vigil", "aggregator", "--config",
                                   str(work / "aggregator.yaml")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work, env=env)
    agent = None
    child = None
    try:
        _wait_http(f"{agg_url}/healthz", aggregator, 30)
        agent = subprocess.Popen([sys.executable, "-m", "vigil", "agent", "--config", str(work / "agent.yaml")],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work, env=env)
        if training:  # the loop runs throughout; the agent's CPU is measured past its first 20 s
            child = start_load("training", heartbeat_port, seconds + 4)
            (out / "agent-cpu-training.json").write_text(json.dumps(_process_cost(agent.pid, 20.0, seconds - 20.0)))
        else:
            time.sleep(max(seconds - LOAD_SECONDS, 5))
            child = start_load("tensor", heartbeat_port)
            time.sleep(min(LOAD_SECONDS, seconds))
        for url, name in ((f"http://127.0.0.1:{agent_port}/metrics", f"agent-metrics{suffix}.prom"),
                          (f"http://127.0.0.1:{agent_port}/v1/state", f"agent-state{suffix}.json")):
            try:
                (out / name).write_bytes(_get(url))
            except OSError as exc:
                (out / name).write_text(f"# could not scrape {url}: {exc}\n")
        seen: dict[str, Any] = {}
        for key, path in (("nodes", "/v1/nodes"), ("node", "/v1/nodes/gpu-recorded"), ("decisions", "/v1/decisions"),
                          ("metrics", "/metrics")):
            try:
                body = _get(agg_url + path)
                seen[key] = json.loads(body) if key != "metrics" else [
                    line for line in body.decode().splitlines()
                    if line.startswith(("vigil_aggregator_reports_total", "vigil_aggregator_report_rejections_total",
                                        "vigil_aggregator_ingest_failures_total", "vigil_aggregator_events_received"))]
            except (OSError, ValueError) as exc:
                seen[key] = f"could not read {path}: {exc}"
        (out / f"aggregator-node{suffix}.json").write_text(json.dumps(seen, indent=1))
    finally:
        if child is not None:
            child.kill()
            child.wait()
        if agent is not None:
            (out / f"agent{suffix}.log").write_text(_stop(agent))
        (out / f"aggregator{suffix}.log").write_text(_stop(aggregator))


def probe(rehearse: bool) -> dict[str, Any]:
    """The backend's calls as this (unprivileged) process may make them: start-up, identity, two
    reads 2 s apart, the Xid event registration, the process list. Returned as a recording."""
    s = Session(open_nvml(rehearse))
    s.op("init", "init")
    count = s.op("init", "device_count") or 0
    for i in range(count):
        s.op("identity", "identity", i)
        s.op("identity", "config_facts", i)
    for _ in range(2):
        for i in range(count):
            s.op("idle", "read", i)
        time.sleep(READ_INTERVAL_SECONDS)
    for i in range(count):
        s.op("idle", "running_pids", i)
    registered = s.op("events", "open_events", list(range(count)))
    s.op("events", "wait_xid", 100)
    s.op("events", "close_events")
    s.op("shutdown", "shutdown")
    return {"format": RECORDING_FORMAT, "uid": os.geteuid(), "gid": os.getegid(),
            "events_registered": registered, "calls": s.nvml.calls, "ops": s.ops}


def probe_unprivileged(out: Path, rehearse: bool) -> bool:
    """Runs ``probe`` as uid/gid 65534 from a world-readable copy of the code (the checkout may sit
    in root's home), and keeps what it recorded in ``nvml-unprivileged.json``."""
    if os.geteuid() != 0:
        (out / "nvml-unprivileged.json").write_text(json.dumps({"skipped": "not run as root"}))
        return True
    code = Path(tempfile.mkdtemp(prefix="vigil-code-"))
    os.chmod(code, 0o755)
    # Everything `vigil` imports from the checkout: its linked packages and the heartbeat client.
    for name in ("agent", "aggregator", "sim", "contract", "scenarios", "vigil", "scripts", "clients"):
        shutil.copytree(REPO / name, code / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in [code, *code.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    paths = [str(code), str(code / "clients" / "heartbeat"),
             *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p.startswith("/tmp"))]
    argv = [sys.executable, str(code / "scripts" / "record-real-gpu.py"), "--probe", "-"]
    # A rehearsal runs the copy as this user: the interpreter of a development checkout (a virtual
    # environment under root's home) is often out of uid 65534's reach, and the copy and its imports
    # are what a rehearsal must prove before a device session.
    as_user: dict[str, Any] = {} if rehearse else {"user": UNPRIVILEGED_ID, "group": UNPRIVILEGED_ID,
                                                   "extra_groups": []}
    if rehearse:
        argv.append("--rehearse")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, cwd="/", **as_user,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HOME": "/"})
        result = json.loads(done.stdout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        result = {"failed": f"{type(exc).__name__}: {exc}"}
    except ValueError:
        result = {"failed": done.returncode, "stdout": done.stdout[-4000:], "stderr": done.stderr[-4000:]}
    (out / "nvml-unprivileged.json").write_text(json.dumps(result, separators=(",", ":")))
    shutil.rmtree(code, ignore_errors=True)
    if "failed" in result:
        print(f"the unprivileged probe failed: {json.dumps(result)[:2000]}", file=sys.stderr)
    return "failed" not in result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--reset", action="store_true",
                        help="really reset idle GPU 0 through the node-action runner (default: stop at the command)")
    parser.add_argument("--agent-seconds", type=float, default=45.0)
    parser.add_argument("--rehearse", action="store_true",
                        help="every step over FakeNvml, without a GPU (to check the script before a device session)")
    parser.add_argument("--agent-only", action="store_true",
                        help="only the agent run, with a heartbeat-instrumented training loop (files *-training.*)")
    parser.add_argument("--unprivileged-only", action="store_true",
                        help="only the unprivileged user's calls (nvml-unprivileged.json)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the unprivileged child
    args = parser.parse_args()
    global REHEARSAL
    REHEARSAL = args.rehearse
    if args.probe:
        recorded = probe(args.rehearse)
        # The copy must hold all of vigil's own code: a module found elsewhere (an installed
        # checkout) hides one the copy left out, which a GPU node without that install refuses.
        outside = sorted(name for name, module in sys.modules.items()
                         if name.partition(".")[0] in ("vigil", "vigil_heartbeat")
                         and (module_file := getattr(module, "__file__", None))
                         and not Path(module_file).resolve().is_relative_to(REPO))
        if outside:
            print(f"imported from outside the copy {REPO}: {', '.join(outside)}", file=sys.stderr)
            return 1
        print(json.dumps(recorded, separators=(",", ":"), default=str))
        return 0
    nvml = open_nvml(args.rehearse)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.agent_only:
        run_agent(out, args.agent_seconds, args.rehearse, training=True)
        return 0
    if args.unprivileged_only:
        return 0 if probe_unprivileged(out, args.rehearse) else 1
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    sh(out, "nvidia-smi-version.txt", ["nvidia-smi", "--version"])
    sh(out, "nvidia-smi-q.txt", ["nvidia-smi", "-q"])
    sh(out, "nvidia-smi-q-d.txt", ["nvidia-smi", "-q", "-d",
                                  "PERFORMANCE,CLOCK,ECC,ROW_REMAPPER,TEMPERATURE,POWER,MEMORY,UTILIZATION,PAGE_RETIREMENT"])
    sh(out, "nvidia-smi-topo-m.txt", ["nvidia-smi", "topo", "-m"])
    sh(out, "nvidia-smi-nvlink-status.txt", ["nvidia-smi", "nvlink", "--status"])
    sh(out, "nvidia-smi-nvlink-errors.txt", ["nvidia-smi", "nvlink", "-e"])
    # NVLink payload counters per link (KiB), to hold against the backend's all-links sum
    # (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, scopeId UINT_MAX) in nvml-recording.json.
    sh(out, "nvidia-smi-nvlink-throughput.txt", ["nvidia-smi", "nvlink", "-gt", "d"])
    # MIG: the devices (`-L` names each "MIG 1g.10gb Device 0: (UUID: MIG-...)") and the GPU instances
    # with their ids, to hold against the backend's MIG layout (nvmlDeviceGetMigMode and, in MIG
    # mode, the MIG device calls, which the recording below captures like every other call).
    sh(out, "nvidia-smi-L.txt", ["nvidia-smi", "-L"])
    sh(out, "nvidia-smi-mig-lgi.txt", ["nvidia-smi", "mig", "-lgi"])
    if shutil.which("dcgmi"):
        sh(out, "dcgmi-diag-r1.txt", ["dcgmi", "diag", "-r", "1"], timeout=180)

    s = Session(nvml)
    s.op("init", "init")
    count = s.op("init", "device_count")
    for i in range(count):
        s.op("identity", "identity", i)
        # Issue 44: the configuration facts (VBIOS, image, ECC, persistence, MIG, power limit,
        # application clocks). Each read below also records the fabric, the PCIe link (idle and
        # loaded: does the link downclock at idle on this board?) and the recovery action.
        s.op("identity", "config_facts", i)
    for i in range(count):
        s.op("idle", "read", i)  # the first GPM sample of each GPU: no GPM values yet
    record_phase(s, "idle", count, 2)
    registered = s.op("events", "open_events", list(range(count)))
    s.op("events", "wait_xid", 100)
    s.op("events", "close_events")
    for kind in LOADS:
        child = start_load(kind)
        if child is None:
            continue
        record_phase(s, kind, count, int(LOAD_SECONDS // READ_INTERVAL_SECONDS) - 1)
        child.kill()
        child.wait()
    s.op("shutdown", "shutdown")
    recording = {"format": RECORDING_FORMAT, "recorded_at": stamp, "gpu0": s.ops[2].get("result", {}),
                 "events_registered": registered, "calls": s.nvml.calls}
    (out / "nvml-recording.json").write_text(json.dumps(recording, indent=None, separators=(",", ":")))
    (out / "backend-ops.json").write_text(json.dumps({"recorded_at": stamp, "ops": s.ops}, indent=1))

    costs = {"recorded_at": stamp, "nvml_calls": call_costs(s.nvml.calls), "collector": collector_cpu(nvml, count),
             "gpu_collector": gpu_collector_cpu(nvml)}
    (out / "costs.json").write_text(json.dumps(costs, indent=1))
    unprivileged = probe_unprivileged(out, args.rehearse)
    run_agent(out, args.agent_seconds, args.rehearse)
    exercise_reset(nvml, out, args.reset)
    print(json.dumps({k: costs[k] for k in ("collector", "gpu_collector")}))
    return 0 if unprivileged else 1


if __name__ == "__main__":
    sys.exit(main())
