"""Issue 16's GPU-reset path with nothing replaced but the GPU: an Xid 46 in a fake node's kernel
log, read by a real `vigil agent` (fake NVML), judged by a real `vigil aggregator` that drains the
node in a real slurmctld, then asks the agent, in a signed node-bound request, to reset the GPU.
The agent refuses while a compute process holds the GPU and says so; once the process ends it
resets the GPU, the aggregator verifies the node and gives it back: `idle` with no one touching it.
A node whose agent is not allowed to reset stays drained."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.aggregator.aggregator_process import (
    REPO,
    ROLE_TOKENS,
    SITE_SECRET,
    AggregatorProcess,
    slurm_aggregator_config,
    wait_for,
)
from tests.loopback import free_port
from tests.pidfile import stop_children
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.auth import node_token
from vigil.contract.node_actions import node_key

MASTER_KEY = bytes(range(32))
# GPU 2 of the fake H100 profile sits at PCI 0000:4c:00 (agent/nvml/profiles.py).
XID_46_GPU_2 = ("[ 2071.315227] NVRM: Xid (PCI:0000:4c:00): 46, pid=4242, name=python, "
                "Ch 00000010, engmask 00000101\n")
BUSY_UNTIL_SECONDS = 25.0  # the job's process holds GPU 2 this long after the agent starts


def _agent(root: Path, node: str, aggregator_url: str, allow: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    kmsg = root / f"{node}.kmsg"
    kmsg.write_text("[    5.000000] nvidia: module loaded\n")
    scenario = root / f"{node}.scenario.yaml"
    scenario.write_text(yaml.safe_dump({
        "profile": "h100-sxm-80gb", "gpus": 8, "load": {"utilization": 0.9, "memory_used_ratio": 0.8},
        "processes": [{"gpu": 2, "pid": 4242, "until_seconds": BUSY_UNTIL_SECONDS}],
    }))
    token = root / f"{node}.token"
    token.write_text(node_token(SITE_SECRET.encode(), node) + "\n")
    key = root / f"{node}.node-key"
    key.write_text(node_key(MASTER_KEY, node).hex() + "\n")
    key.chmod(0o600)
    cfg = root / f"{node}.yaml"
    cfg.write_text(yaml.safe_dump({
        "node": node, "listen": f"127.0.0.1:{free_port()}", "nvml": {"backend": "fake", "scenario": str(scenario)},
        "aggregator": {"url": aggregator_url, "interval_seconds": 0.5, "token_file": str(token)},
        "collectors": {"training": {"enabled": False}},
        "node_actions": {"key_file": str(key), "allow": allow} if allow else {},
    }))
    with (root / f"{node}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vigil", "agent", "--config", str(cfg), "--kmsg", str(kmsg)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, kmsg


@pytest.fixture
def aggregator(tmp_path: Path, slurm_cluster: SlurmCluster) -> Iterator[AggregatorProcess]:  # noqa: F811
    slurm_cluster.reset()
    master = tmp_path / "node-actions.key"
    master.write_text(MASTER_KEY.hex() + "\n")
    master.chmod(0o600)
    config = slurm_aggregator_config(slurm_cluster.scontrol, str(slurm_cluster.root / "slurm.conf"))
    config["actuators"]["slurm"]["reset_gpu"] = True
    config["node_actions"] = {"key_file": str(master), "retry_seconds": 1.0}  # offer again every second
    # Verification shortened for a test (defaults: 60 s of clean reports, 30 min before a resume).
    config["detectors"] = {"recovery": {"enabled": True, "persistence_seconds": 3.0, "min_reports": 3}}
    config["gate"] = {"min_removed_seconds": 0.0}
    agg = AggregatorProcess(tmp_path, config)
    try:
        yield agg
    finally:
        agg.stop()
        slurm_cluster.reset()


def _metrics(aggregator: AggregatorProcess) -> str:
    req = urllib.request.Request(aggregator.url + "/metrics",
                                 headers={"Authorization": f"Bearer {ROLE_TOKENS['read']}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def _counter(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.external
def test_xid_46_drains_waits_for_the_job_resets_the_gpu_verifies_and_resumes(
    tmp_path: Path, aggregator: AggregatorProcess, slurm_cluster: SlurmCluster  # noqa: F811
) -> None:
    aggregator.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        agent, kmsg = _agent(tmp_path, "vnode1", aggregator.url, allow=["reset_gpu"])
        procs.append(agent)
        bystander, bystander_kmsg = _agent(tmp_path, "vnode2", aggregator.url, allow=[])
        procs.append(bystander)
        wait_for("both nodes report", lambda: len(aggregator.request("GET", "/v1/nodes")["nodes"]) == 2, 30)
        started = time.monotonic()
        with kmsg.open("a") as f:
            f.write(XID_46_GPU_2)
        with bystander_kmsg.open("a") as f:
            f.write(XID_46_GPU_2)
        wait_for("vnode1 drained", lambda: "drain" in slurm_cluster.sinfo_state("vnode1"), 20)
        assert "reset_gpu" in slurm_cluster.reason("vnode1") and "46" in slurm_cluster.reason("vnode1")

        # The job's process still holds GPU 2: the agent refuses, and the refusal reaches the aggregator.
        wait_for("a busy refusal", lambda: _counter(_metrics(aggregator), "vigil_aggregator_node_action_results_total",
                                                     action="reset_gpu", outcome="refused", reason="busy") >= 1, 20)
        assert "drain" in slurm_cluster.sinfo_state("vnode1")

        # Once it ends the GPU is reset, the node verified and given back.
        wait_for("vnode1 idle again", lambda: slurm_cluster.sinfo_state("vnode1") == "idle", 60)
        back_after = time.monotonic() - started
        metrics = _metrics(aggregator)
        assert _counter(metrics, "vigil_aggregator_node_action_results_total", action="reset_gpu",
                        outcome="done") == 1
        decisions, _ = aggregator.decisions()
        actions = [(d["node"], d["action"]) for d in decisions]
        assert ("vnode1", "reset_gpu") in actions and ("vnode1", "resume") in actions
        print(f"Xid 46 to idle: {back_after:.1f} s (the GPU was busy for the first ~{BUSY_UNTIL_SECONDS:.0f} s "
              "of the agent's life)")

        # vnode2's agent may not reset: it refuses (not_allowed), and the node stays drained.
        assert "drain" in slurm_cluster.sinfo_state("vnode2")
        results = "vigil_aggregator_node_action_results_total"
        wait_for("vnode2's refusal", lambda: _counter(_metrics(aggregator), results, action="reset_gpu",
                                                      reason="not_allowed") >= 1, 20)
        assert ("vnode2", "resume") not in [(d["node"], d["action"]) for d in aggregator.decisions()[0]]
        assert "drain" in slurm_cluster.sinfo_state("vnode2")
    finally:
        stop_children(procs)
