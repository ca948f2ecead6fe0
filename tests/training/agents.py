"""Real `vigil agent` processes on the fake NVML backend for the training tests: one per fake
node, each with its own heartbeat Unix socket, reporting to an aggregator every second; stopped by
pid. Heartbeats are keyed by their sender's Slurm job: the test cannot create Slurm jobs, so each
agent reads cgroups from its own process table, where ``admit`` places a real process (its real pid,
as the kernel reports it to the agent) in a job."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.agent.proc_table import in_slurm_job
from tests.aggregator.aggregator_process import SITE_SECRET, AggregatorProcess, wait_for
from tests.loopback import free_port
from vigil.aggregator.auth import node_token

REPO = Path(__file__).resolve().parents[2]


class Agent:
    def __init__(self, root: Path, node: str, aggregator: str, scenario: str | None = None,
                 training: dict[str, Any] | None = None, interval_seconds: float = 1.0) -> None:
        """``training``: more of the training collector's settings (e.g. its ``hang_seconds``);
        ``interval_seconds``: how often it reports and its collector runs."""
        self.node = node
        self.udp_port = free_port()
        self.port = free_port()
        self.socket_path = str(root / f"{node}.sock")
        self.proc_root = root / f"{node}-proc"
        self.proc_root.mkdir()
        cfg = root / f"{node}.yaml"
        token = root / f"{node}.token"  # the node's own credential (README "Security")
        token.write_text(node_token(SITE_SECRET.encode(), node) + "\n")
        cfg.write_text(yaml.safe_dump({
            "node": node,
            "aggregator": {"url": aggregator, "interval_seconds": interval_seconds, "token_file": str(token)},
            # Short summary window: the test's job lives for tens of seconds, not hours.
            "collectors": {"training": {"udp_listen": f"127.0.0.1:{self.udp_port}", "window_seconds": 6.0,
                                        "interval_seconds": interval_seconds, "unix_socket": self.socket_path,
                                        "proc_root": str(self.proc_root), **(training or {})}},
        }))
        self.log = (root / f"{node}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vigil", "agent", "--config", str(cfg), "--backend", "fake",
             "--listen", f"127.0.0.1:{self.port}", *(["--scenario", scenario] if scenario else [])],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def admit(self, pid: int, slurm_job: int) -> None:
        """Process ``pid`` runs in Slurm job ``slurm_job`` on this node, as far as this agent can tell."""
        in_slurm_job(self.proc_root, pid, slurm_job)

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"agent {self.node} exited {self.proc.returncode}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=0.5).read()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@contextmanager
def cluster(root: Path, nodes: list[str], aggregator_config: dict[str, Any],
            scenario: Callable[[str], str | None] = lambda node: None,
            ) -> Iterator[tuple[AggregatorProcess, dict[str, Agent]]]:
    """A real aggregator and one real agent per node (``scenario(node)``: its fake NVML scenario),
    every agent healthy before it yields; all stopped by pid afterwards."""
    aggregator = AggregatorProcess(root, aggregator_config)
    aggregator.start()
    agents: dict[str, Agent] = {}
    try:
        for node in nodes:
            agents[node] = Agent(root, node, aggregator.url, scenario(node))
        for agent in agents.values():
            wait_for(f"agent {agent.node}", agent.healthy, 30.0)
        yield aggregator, agents
    finally:
        for agent in agents.values():
            agent.stop()
        aggregator.stop()
