"""Issue 46's first Done-when line with nothing replaced but AMD's library: `vigil agent --backend
fake --vendor amd` (the real AmdSmiBackend over FakeAmdSmi, 8 MI300X) serves `/metrics` that
promtool accepts and reports to a real `vigil aggregator`, which takes the node and its AMD GPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.aggregator.aggregator_process import REPO, SITE_SECRET, AggregatorProcess, wait_for
from tests.loopback import free_port
from tests.pidfile import stop_children
from vigil.aggregator.auth import node_token

NODE = "mi300x-node-01"
PROMTOOL = shutil.which("promtool")


@pytest.fixture
def aggregator(tmp_path: Path) -> Iterator[AggregatorProcess]:
    (tmp_path / "aggregator").mkdir()
    agg = AggregatorProcess(tmp_path / "aggregator", {})
    agg.start()
    try:
        yield agg
    finally:
        agg.stop()


def test_fake_amd_agent_serves_clean_metrics_and_reports_to_a_real_aggregator(
        tmp_path: Path, aggregator: AggregatorProcess) -> None:
    token = tmp_path / "node.token"  # the node's own credential (vigil token create)
    token.write_text(node_token(SITE_SECRET.encode(), NODE) + "\n")
    token.chmod(0o600)
    listen = f"127.0.0.1:{free_port()}"
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "node": NODE, "listen": listen,
        "aggregator": {"url": aggregator.url, "interval_seconds": 0.5, "token_file": str(token)},
        "collectors": {"training": {"enabled": False}},
    }))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("[    5.000000] [drm] amdgpu kernel modesetting enabled.\n")
    log = (tmp_path / "agent.log").open("wb")
    agent = subprocess.Popen(
        [sys.executable, "-m", "vigil", "agent", "--config", str(config), "--backend", "fake", "--vendor", "amd",
         "--kmsg", str(kmsg)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    log.close()
    try:
        def agent_log() -> str:
            return (tmp_path / "agent.log").read_text()[-3000:]

        def reported() -> bool:
            assert agent.poll() is None, agent_log()
            status, body = aggregator.status(f"/v1/nodes/{NODE}")
            return status == 200 and len(body["gpus"]) == 8

        wait_for("the AMD node's report with 8 GPUs", reported, 45)
        _, node = aggregator.status(f"/v1/nodes/{NODE}")
        assert {g.get("vendor") for g in node["gpus"]} == {"amd"}, node["gpus"][0]
        assert node["nvml_available"] is True and node["missing_gpus"] == []
        assert "gpu" not in node["failed_collectors"]

        exposition = urllib.request.urlopen(f"http://{listen}/metrics", timeout=5).read().decode()
        info = [line for line in exposition.splitlines() if line.startswith("vigil_gpu_info{")]
        assert len(info) == 8 and all('vendor="amd"' in line for line in info), info[:2]
        assert "MI300X" in info[0]
        if PROMTOOL is None:
            pytest.skip("promtool not installed (Debian package prometheus)")
        checked = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        stop_children([agent])
