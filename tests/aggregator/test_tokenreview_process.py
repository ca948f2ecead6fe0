"""A real aggregator with Kubernetes node credentials and a real agent sending its projected token:
the agent's reports are accepted for its own node, the agent re-reads the token file when kubelet
replaces it, and the same token naming another node is refused (docs/kubernetes.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from tests.aggregator.aggregator_process import REPO, AggregatorProcess, wait_for
from tests.aggregator.fake_kubernetes import FakeKubernetes
from tests.loopback import free_port
from vigil.contract.wire import Report, encode

NODE = "k8s-gpu-1"


def write_projected(path: Path, token: str) -> None:
    """As kubelet's atomic writer does: a new file swapped in under the same name."""
    new = path.with_suffix(".new")
    new.write_text(token)
    new.chmod(0o600)
    os.replace(new, path)


def agent_metric(port: int, name: str) -> str:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return "\n".join(line for line in text.splitlines() if line.startswith(name))


def test_a_real_agent_reports_with_its_projected_token_and_follows_its_rotation(tmp_path: Path) -> None:
    kube = FakeKubernetes()
    own = tmp_path / "aggregator-sa.token"
    own.write_text(kube.aggregator_token + "\n")
    aggregator = AggregatorProcess(tmp_path, {"auth": {
        "site_secret_file": str(tmp_path / "site.secret"), "read_token_file": str(tmp_path / "read.token"),
        "kubernetes": {"enabled": True, "api_url": kube.url, "token_file": str(own), "ca_file": None,
                       "timeout_seconds": 2.0}}})
    projected = tmp_path / "projected-token"
    first = kube.mint(NODE)
    projected.write_text(first)
    projected.chmod(0o644)  # the agent warns about it (and exports it) but runs
    port = free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "node": NODE, "aggregator": {"url": aggregator.url, "interval_seconds": 0.5, "token_file": str(projected)},
        "collectors": {"training": {"udp_listen": f"127.0.0.1:{free_port()}"}}}))
    log = (tmp_path / "agent.log").open("wb")
    agent = None
    try:
        aggregator.start()
        agent = subprocess.Popen([sys.executable, "-m", "vigil", "agent", "--config", str(config), "--backend",
                                  "fake", "--listen", f"127.0.0.1:{port}"], cwd=REPO, stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})

        def node_known() -> bool:
            assert agent is not None and agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
            status, body = aggregator.status("/v1/nodes")
            return status == 200 and NODE in {n["node"] for n in body["nodes"]}

        wait_for("the agent's report accepted with its projected token", node_known, 30)
        assert kube.reviews == [first]
        exposed = agent_metric(port, "vigil_agent_credential_file_exposed")
        assert 'key="aggregator.token_file"} 1.0' in exposed
        assert "anyone on this node who reads it can report as this node" in (tmp_path / "agent.log").read_text()

        second = kube.mint(NODE)  # kubelet's refreshed token (0600 from here on)
        write_projected(projected, second)
        wait_for("the agent to send the rotated token", lambda: second in kube.reviews, 30)
        assert 'key="aggregator.token_file"} 0.0' in agent_metric(port, "vigil_agent_credential_file_exposed")

        # The same token, naming another node: refused, counted, whatever the body says.
        body = encode(Report(node="k8s-gpu-2", boot_id="b", seq=1, ts=time.time(),
                             interval_seconds=2.5))
        answer = aggregator.request("POST", "/v1/reports", body, expect=403, token=second)
        assert answer["error"] == "node_mismatch"
        metrics = urllib.request.urlopen(f"{aggregator.url}/metrics", timeout=5).read().decode()
        assert 'vigil_aggregator_refusals_total{door="reports",reason="node_mismatch"} 1.0' in metrics
        assert 'vigil_aggregator_token_reviews_total{outcome="accepted"} 2.0' in metrics
        # Not one of the agent's reports was refused for its credential, rotation included.
        assert agent_metric(port, 'vigil_agent_report_errors_total{reason="unauthorized"}').endswith(" 0.0")
    finally:
        if agent is not None:
            agent.terminate()
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(5)
        log.close()
        aggregator.stop()
        kube.close()
