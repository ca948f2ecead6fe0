"""A 4-node cluster running a real, uninstrumented torch (gloo) DDP job, for the uninstrumented-hang
tests (tests/e2e/test_uninstrumented_hang.py): a real aggregator process, one real ``vigil agent``
per node (fake NVML backend, its own sysfs root with one InfiniBand port, its own process table),
and one rank of tests/e2e/uninstrumented_job.py per node, admitted to one Slurm job in its node's
process table and holding its node's fake GPUs (the fake's process list names the rank's real pid).

No vigil code runs in the job. The job's real state drives each node's telemetry through a seam
(``TelemetryDriver``, a thread of this process), the documented equivalent of real hardware: every
``TICK_SECONDS`` it reads each rank's phase file (written by the job) and its process state
(/proc/<pid>/stat: a stopped rank is 'T') and derives the node's mode:

- ``training``: computing, or in a collective for less than ``BLOCKED_AFTER_SECONDS`` (an all-reduce
  of this model takes milliseconds): GPUs busy training, RDMA data counters growing;
- ``busy_spin``: in its collective phase for longer (or stopped there, or past the collective's
  timeout): the collective's kernels are resident and spin waiting for a peer (SM clock high, power
  low, no DRAM or PCIe traffic), RDMA counters flat. A rank stopped inside its collective phase is
  modelled so too, as NCCL's kernels are once launched: they keep polling on the GPU while the
  host thread that would feed them is stopped;
- ``idle``: the rank is stopped (SIGSTOP: it launches nothing) or stuck in its own code (computing
  for longer than ``STUCK_AFTER_SECONDS``: its GPU ran out of queued work), done, or checkpointing
  (the GPUs wait on the host writing the save: low power; the compute fabric carries nothing);
- ``evaluating``: forward passes, no collective: GPUs busy with DRAM traffic, RDMA counters flat.

The RDMA counters (``port_xmit_data``/``port_rcv_data`` in 4-byte words, and the packet counts) are
rewritten in place at offset 0 (the agent keeps them open and re-reads them; a counter only grows,
so its text never shrinks and a reader never sees a truncated file). The GPUs follow the mode
through the fake NVML's run-time seam (``FakeNvml.set_busy_spin``), which each node's agent
(tests/e2e/fake_node_agent.py) applies from the mode file the driver writes. Every process is bounded in time and
stopped by pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.agent.proc_table import in_slurm_job
from tests.aggregator.aggregator_process import SITE_SECRET, AggregatorProcess, wait_for
from tests.loopback import free_port
from tests.training.agents import Agent
from vigil.aggregator.auth import node_token

REPO = Path(__file__).resolve().parents[2]
JOB_PROGRAM = Path(__file__).with_name("uninstrumented_job.py")
NODE_AGENT = Path(__file__).with_name("fake_node_agent.py")
# A real ConnectX-7 InfiniBand port's sysfs tree (tests/fixtures/sysfs/PROVENANCE.md).
HCA = REPO / "tests" / "fixtures" / "sysfs" / "h100" / "class" / "infiniband" / "mlx5_0"
NODES = ("node-a", "node-b", "node-c", "node-d")
SLURM_JOB = "7431"
GPUS_PER_NODE = 1  # one rank per node, one GPU each
TICK_SECONDS = 0.25
# A healthy gradient all-reduce of this model over loopback takes milliseconds; a rank still in it
# after a second is waiting for a peer.
BLOCKED_AFTER_SECONDS = 1.0
# A step's compute takes 0.25 s; a rank still computing after 2 s is stuck in its own code: its GPU
# ran out of queued work and idles.
STUCK_AFTER_SECONDS = 2.0
# What one port carries while the job trains: ~12.5 GB/s each way (a quarter of NDR 400G), in the
# counters' 4-byte words; two packets of 4 KiB MTU per 8 KiB.
TRAINING_BYTES_PER_SECOND = 12.5e9
POLL_SECONDS = 0.25

MODES = ("training", "busy_spin", "idle", "evaluating")


def node_mode(phase: str | None, in_phase_seconds: float, stopped: bool) -> str:
    """The telemetry a node shows for its rank's state (the seam's one rule; see the module doc)."""
    if phase == "collective" and (stopped or in_phase_seconds >= BLOCKED_AFTER_SECONDS):
        return "busy_spin"
    if stopped or phase in (None, "done", "checkpointing"):
        return "idle"
    if phase == "evaluating":
        return "evaluating"
    if phase == "computing" and in_phase_seconds >= STUCK_AFTER_SECONDS:
        return "idle"
    if phase == "timed_out":
        return "busy_spin"
    return "training"


class RdmaPort:
    """One node's InfiniBand port under its own sysfs root; ``advance`` moves its data counters."""

    COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
                "unicast_xmit_packets", "unicast_rcv_packets")

    def __init__(self, sysfs_root: Path) -> None:
        device = sysfs_root / "class" / "infiniband" / HCA.name
        shutil.copytree(HCA, device)
        self.counters = device / "ports" / "1" / "counters"
        self.values = {name: int((self.counters / name).read_text().strip() or 0) for name in self.COUNTERS}

    def advance(self, seconds: float) -> None:
        data_words = int(TRAINING_BYTES_PER_SECOND * seconds / 4)
        packets = int(TRAINING_BYTES_PER_SECOND * seconds / 4096)
        for name in self.COUNTERS:
            self.values[name] += data_words if name.endswith("_data") else packets
            fd = os.open(self.counters / name, os.O_WRONLY)
            try:
                os.pwrite(fd, str(self.values[name]).encode(), 0)  # in place: never shorter, never torn
            finally:
                os.close(fd)


@dataclass
class NodeState:
    node: str
    rank: int
    pid: int
    sysfs_root: Path
    port: RdmaPort
    mode_file: Path
    mode: str = "training"
    modes: list[tuple[float, str]] = field(default_factory=list)  # (wall clock, mode) at each change


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


class TelemetryDriver(threading.Thread):
    """The seam: each rank's real state -> its node's fake GPU mode and RDMA counters."""

    def __init__(self, work: Path, nodes: list[NodeState]) -> None:
        super().__init__(name="telemetry-driver", daemon=True)
        self.work = work
        self.nodes = nodes
        self.stop_event = threading.Event()
        self._since: dict[int, tuple[str | None, int, float]] = {}  # rank -> (phase, step, first seen)

    def _phase(self, rank: int) -> tuple[str | None, float]:
        try:
            doc = json.loads((self.work / f"phase-{rank}.json").read_text())
            phase, step = str(doc["phase"]), int(doc["step"])
        except (OSError, ValueError, KeyError):
            phase, step = None, -1
        now = time.time()
        last = self._since.get(rank)
        if last is None or last[:2] != (phase, step):
            self._since[rank] = (phase, step, now)
            return phase, 0.0
        return phase, now - last[2]

    def tick(self, seconds: float) -> None:
        for state in self.nodes:
            phase, held = self._phase(state.rank)
            mode = node_mode(phase, held, _stopped(state.pid))
            if mode != state.mode or not state.modes:
                state.mode = mode
                state.modes.append((time.time(), mode))
                tmp = state.mode_file.with_name(f".{state.mode_file.name}.tmp")
                tmp.write_text(mode)
                os.replace(tmp, state.mode_file)  # the node's agent follows it (fake_node_agent.py)
            if mode == "training":
                state.port.advance(seconds)

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop_event.wait(TICK_SECONDS):
            now = time.monotonic()
            self.tick(now - last)
            last = now


class NodeAgent(Agent):
    """A real vigil agent for one fake node (tests/e2e/fake_node_agent.py): fake NVML (``scenario``)
    whose GPUs follow ``mode_file``, its own sysfs root and process table, reporting to the
    aggregator every ``interval_seconds`` with its GPU readings at that resolution too. Started
    here, not by the training tests' Agent (no heartbeat listeners: the job sends none); checked
    and stopped as that one is."""

    def __init__(self, root: Path, node: str, aggregator: str, scenario: Path, sysfs_root: Path,
                 proc_root: Path, mode_file: Path, interval_seconds: float, collectors: dict[str, Any]) -> None:
        self.node = node
        self.port = free_port()
        self.proc_root = proc_root
        token = root / f"{node}.token"
        token.write_text(node_token(SITE_SECRET.encode(), node) + "\n")
        kmsg = root / f"{node}.kmsg"
        kmsg.write_text("")
        cfg = root / f"{node}.yaml"
        cfg.write_text(yaml.safe_dump({
            "node": node,
            "listen": f"127.0.0.1:{self.port}",
            "nvml": {"backend": "fake", "scenario": str(scenario)},
            "aggregator": {"url": aggregator, "interval_seconds": interval_seconds, "token_file": str(token),
                           "telemetry_seconds": interval_seconds},
            "collectors": {
                "gpu": {"interval_seconds": interval_seconds, "job_attribution_interval_seconds": interval_seconds,
                        "proc_root": str(proc_root)},
                "rdma": {"interval_seconds": interval_seconds, "ethtool": False},
                "training": {"enabled": False},  # no heartbeats: the job is not instrumented
                **collectors},
        }))
        self.log = (root / f"{node}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(NODE_AGENT), "--config", str(cfg), "--scenario", str(scenario),
             "--sysfs-root", str(sysfs_root), "--proc-root", str(proc_root), "--kmsg", str(kmsg),
             "--mode-file", str(mode_file)],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)


@dataclass
class JobRun:
    """What the aggregator decided and when: decision id -> (wall clock first seen, decision)."""

    nodes: list[NodeState]
    seen: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    dumps: dict[int, float] = field(default_factory=dict)  # rank -> wall clock its FR dump appeared

    def decisions(self, detector: str | None = None) -> list[tuple[float, dict[str, Any]]]:
        return sorted((t, d) for t, d in self.seen.values() if detector is None or d["detector"] == detector)

    def node_of(self, rank: int) -> str:
        return next(s.node for s in self.nodes if s.rank == rank)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def job_args(**options: float | int) -> list[str]:
    """``stop_rank=2`` -> ["--stop-rank", "2"]: the job program's flags."""
    return [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", repr(v))]


def run(root: Path, *, aggregator: dict[str, Any], job: dict[str, float | int], watch_seconds: float,
        until: Callable[[JobRun], bool], scenario: Callable[[int], dict[str, Any]], flight_recorder: bool = False,
        interval_seconds: float = 1.0) -> JobRun:
    """Start everything, let the job run, poll the aggregator's decisions until ``until`` holds or
    ``watch_seconds`` pass (after the job's first step); stop everything by pid.
    ``scenario(pid)``: a node's fake NVML scenario whose GPUs hold process ``pid``;
    ``flight_recorder``: the ranks record and dump (TORCH_FR_BUFFER_SIZE, TORCH_FR_DUMP_TEMP_FILE
    under <root>/fr/<node>/) and each node's agent reads its own ranks' dumps there."""
    work = root / "work"
    work.mkdir()
    fr_dir = root / "fr"
    fr_dir.mkdir()
    with ExitStack() as teardown:  # in reverse: the driver, the agents, the ranks, the aggregator
        agg = AggregatorProcess(root, aggregator)
        agg.start()
        teardown.callback(agg.stop)
        ranks: list[subprocess.Popen[bytes]] = []
        master = free_port()
        for rank, node in enumerate(NODES):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "RANK": str(rank),
                   "WORLD_SIZE": str(len(NODES)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
            if flight_recorder:  # each rank dumps where its node's agent reads
                (fr_dir / node).mkdir()
                env |= {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": str(fr_dir / node / "trace_rank_")}
            log = (root / f"rank{rank}.log").open("wb")
            ranks.append(subprocess.Popen(
                [sys.executable, str(JOB_PROGRAM), "--work", str(work), "--max-seconds", repr(watch_seconds + 30.0),
                 *job_args(**job)], env=env, stdout=log, stderr=subprocess.STDOUT))
            teardown.callback(_kill, ranks[-1])
            log.close()
        states: list[NodeState] = []
        agents: list[NodeAgent] = []
        for rank, (node, proc) in enumerate(zip(NODES, ranks, strict=True)):
            sysfs, proc_root = root / f"{node}-sys", root / f"{node}-proc"
            sysfs.mkdir()
            in_slurm_job(proc_root, proc.pid, int(SLURM_JOB))
            # Its owner and environment too: the flight recorder collector binds a dump to the job
            # of its owner's uid, for a rank that job's processes on this node declare (RANK).
            for name in ("status", "environ"):
                (proc_root / str(proc.pid) / name).write_bytes(Path(f"/proc/{proc.pid}/{name}").read_bytes())
            path = root / f"{node}-scenario.yaml"
            path.write_text(yaml.safe_dump(scenario(proc.pid)))
            state = NodeState(node, rank, proc.pid, sysfs, RdmaPort(sysfs), root / f"{node}.mode")
            state.mode_file.write_text(state.mode)
            states.append(state)
            reader = {"flight_recorder": {"enabled": True, "interval_seconds": interval_seconds,
                                          "dump_glob": str(fr_dir / node / "trace_rank_*")}} if flight_recorder else {}
            agents.append(NodeAgent(root, node, agg.url, path, sysfs, proc_root, state.mode_file, interval_seconds,
                                    reader))
            teardown.callback(agents[-1].stop)
        for agent in agents:
            wait_for(f"agent {agent.node}", agent.healthy, 30.0)
        driver = TelemetryDriver(work, states)
        driver.start()
        teardown.callback(driver.join, 5)
        teardown.callback(driver.stop_event.set)
        wait_for("the job's first step", lambda: all((work / f"phase-{r}.json").exists() for r in range(len(NODES))),
                 60.0)
        result = JobRun(states)
        deadline = time.monotonic() + watch_seconds
        while time.monotonic() < deadline and not until(result):
            for proc in ranks:
                assert proc.poll() in (None, 0, 1), f"a rank exited {proc.returncode}: see {root}/rank*.log"
            decisions, _ = agg.decisions()
            for d in decisions:
                result.seen.setdefault(d["id"], (time.time(), d))
            for rank in range(len(NODES)):
                if rank not in result.dumps and (fr_dir / NODES[rank] / f"trace_rank_{rank}").exists():
                    result.dumps[rank] = time.time()
            time.sleep(POLL_SECONDS)
        return result
