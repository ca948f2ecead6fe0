"""dcgm-exporter's official Grafana dashboard against vigil's dcgm-compat mode through a real
Prometheus: a `vigil agent` process on the fake NVML backend (H100 node, so the GPM-backed Tensor
Core panel has data) with `exporter.dcgm_compat` on, scraped by Debian's prometheus; every panel's
query from tests/fixtures/dcgm-exporter/dcgm-exporter-dashboard.json, with the template variables
`$instance` and `$gpu` set to `.*` (Grafana's "All"), must return data. Every process is ours, on
loopback, stopped by pid; the test is bounded by DEADLINE_SECONDS.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import Processes, http_json, wait_for, which
from tests.loopback import free_port

pytestmark = pytest.mark.external

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "tests" / "fixtures" / "dcgm-exporter" / "dcgm-exporter-dashboard.json"
PROMETHEUS = which("prometheus")
DEADLINE_SECONDS = 60.0
VARIABLES = {"$instance": ".*", "$gpu": ".*"}  # Grafana's "All" for both template variables


def panel_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for var, value in VARIABLES.items():
                    expr = expr.replace(var, value)
                assert "$" not in expr, expr
                out.append((panel["title"], expr))
            walk(panel.get("panels", []))

    walk(board["panels"])
    return out


def test_the_fixture_has_the_dashboards_panels() -> None:
    titles = {title for title, _ in panel_queries()}
    assert len(panel_queries()) == 8 and "Tensor Core Utilization" in titles


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (apt-get install prometheus)")
def test_every_panel_of_the_official_dashboard_has_data(tmp_path: Path, processes: Processes) -> None:
    assert PROMETHEUS is not None
    deadline = time.monotonic() + DEADLINE_SECONDS
    listen = f"127.0.0.1:{free_port()}"
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    config = tmp_path / "agent.yml"
    off = {"enabled": False}
    config.write_text(yaml.safe_dump({"exporter": {"dcgm_compat": True}, "collectors": {
        "gpu": {"interval_seconds": 1.0}, "training": off, "rdma": off}}))
    processes.start("agent", [sys.executable, "-m", "vigil", "agent", "--config", str(config), "--backend", "fake",
                              "--scenario", "healthy-h100", "--listen", listen, "--node", "vnode1",
                              "--kmsg", str(kmsg), "--sysfs-root", str(sysfs), "--log-level", "WARNING"])
    prom = f"127.0.0.1:{free_port()}"
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "scrape_configs": [{"job_name": "vigil-agent", "static_configs": [{"targets": [listen]}]}],
    }))
    processes.start("prometheus", [PROMETHEUS, f"--config.file={prom_config}",
                                   f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                                   f"--web.listen-address={prom}", "--log.level=warn"])

    def query(expr: str) -> list[dict[str, Any]]:
        processes.check_alive()
        url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return list(http_json(url)["data"]["result"])

    def has_data(expr: str) -> bool:
        return bool(query(expr))

    # The template variables' own queries (label_values(DCGM_FI_DEV_GPU_TEMP, instance|gpu)).
    wait_for("8 GPUs' DCGM_FI_DEV_GPU_TEMP", lambda: len(query("DCGM_FI_DEV_GPU_TEMP")) == 8, deadline,
             processes.logs)
    empty: list[str] = []
    for title, expr in panel_queries():
        try:
            wait_for(f"panel {title!r}", partial(has_data, expr), deadline, processes.logs)
        except AssertionError:
            empty.append(title)
    assert not empty, f"panels without data: {empty}"
    tensor = query('DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~".*", gpu=~".*"}')
    assert len(tensor) == 8 and all(0 < float(r["value"][1]) <= 1 for r in tensor), tensor
    (temp,) = query("DCGM_FI_DEV_GPU_TEMP")[:1]
    assert temp["metric"]["hostname"] == "vnode1" and "Hostname" not in temp["metric"]
