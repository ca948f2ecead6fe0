"""The job dashboard's GPM panels through a real Prometheus: two `vigil agent` processes on the
fake NVML backend, each with one rank of Slurm job 4242 (heartbeats on each agent's Unix socket, from
this process, which each agent's process table puts in that job), scraped by Debian's
prometheus with the shipped rules/; the panels' own PromQL (dashboards/vigil-job.json) is run
against it.

vnode1 runs the shipped memory-bound H100 scenario: its DRAM bandwidth panel must sit near the
scenario's cap and its tensor activity low, and the "capped vs memory-bound" panel must count its
8 GPUs memory-bound. vnode2 is an A100 node: NVML GPM is Hopper-only, so its GPM series must be
absent (not 0) while its other GPU series are there. Every process is ours, on loopback, stopped
by pid; the test is bounded by DEADLINE_SECONDS.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.agent.proc_table import in_slurm_job
from tests.dashboards.test_dashboards import substitute
from tests.e2e.conftest import Processes, http_json, wait_for, which
from tests.loopback import free_port

pytestmark = pytest.mark.external

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = which("prometheus")
DEADLINE_SECONDS = 60.0
JOB = "4242"  # the Slurm job of the heartbeats' sender: the key the dashboards' training_job shows
MEMORY_BOUND_DRAM_RATIO = 0.93  # agent/nvml/fake.py's memory-bound DRAM ratio (the scenario's cap)


def _panel_exprs(title: str) -> list[str]:
    board = json.loads((ROOT / "dashboards" / "vigil-job.json").read_text())
    for panel in board["panels"]:
        if panel.get("title") == title:
            return [substitute(t["expr"]).replace('training_job="llm"', f'training_job="{JOB}"')
                    for t in panel["targets"]]
    raise AssertionError(f"no panel {title!r} in the job dashboard")


def _start_agent(procs: Processes, tmp: Path, node: str, scenario: str) -> tuple[str, str]:
    listen = f"127.0.0.1:{free_port()}"
    heartbeat = str(tmp / f"{node}.sock")
    in_slurm_job(tmp / f"{node}-proc", os.getpid(), int(JOB))
    kmsg = tmp / f"{node}.kmsg"
    kmsg.write_text("")
    sysfs = tmp / f"{node}-sys"
    sysfs.mkdir()
    config = tmp / f"{node}-agent.yml"
    config.write_text(yaml.safe_dump({"collectors": {
        "gpu": {"interval_seconds": 1.0},
        "training": {"udp_listen": f"127.0.0.1:{free_port()}", "http": False, "unix_socket": heartbeat,
                     "proc_root": str(tmp / f"{node}-proc"), "interval_seconds": 0.5, "window_seconds": 1.0},
    }}))
    procs.start(f"agent-{node}", [sys.executable, "-m", "vigil", "agent", "--config", str(config),
                                  "--backend", "fake", "--scenario", scenario, "--listen", listen,
                                  "--node", node, "--kmsg", str(kmsg), "--sysfs-root", str(sysfs),
                                  "--log-level", "WARNING"])
    return listen, heartbeat


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (apt-get install prometheus)")
def test_memory_bound_h100_job_shows_on_the_job_dashboard_and_a100_has_no_gpm(tmp_path: Path,
                                                                              processes: Processes) -> None:
    assert PROMETHEUS is not None
    deadline = time.monotonic() + DEADLINE_SECONDS
    agents = {"vnode1": _start_agent(processes, tmp_path, "vnode1", "memory-bound-h100"),
              "vnode2": _start_agent(processes, tmp_path, "vnode2", "healthy-a100")}
    prom = f"127.0.0.1:{free_port()}"
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(p) for p in sorted((ROOT / "rules").glob("*.rules.yml"))],
        "scrape_configs": [{"job_name": "vigil-agent", "static_configs": [
            {"targets": [listen], "labels": {"node": node}} for node, (listen, _) in agents.items()]}],
    }))
    processes.start("prometheus", [PROMETHEUS, f"--config.file={prom_config}",
                                   f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                                   f"--web.listen-address={prom}", "--log.level=warn"])

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    step = [0]

    def beat() -> None:  # one step of rank 0 (vnode1) and rank 1 (vnode2) of the job
        step[0] += 1
        for rank, (_, heartbeat) in enumerate(agents.values()):
            body = {"job": "llm", "rank": rank, "step": step[0], "step_seconds": 0.25, "pid": os.getpid()}
            with contextlib.suppress(OSError):  # an agent still starting has no socket yet
                sock.sendto(json.dumps(body).encode(), heartbeat)

    def query(expr: str) -> list[dict[str, Any]]:
        beat()
        processes.check_alive()
        url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return list(http_json(url)["data"]["result"])

    try:
        dram_expr, = _panel_exprs("DRAM bandwidth used per GPU")
        tensor_expr, = _panel_exprs("Tensor core activity per GPU")
        memory_bound_expr, capped_expr = _panel_exprs("Capped vs memory-bound GPUs")

        # Both nodes scraped (the A100's ordinary GPU series are there) and vnode1's GPM pair taken.
        wait_for("vnode2 scraped", lambda: len(query('vigil_gpu_utilization_ratio{node="vnode2"}')) == 8,
                 deadline, processes.logs)
        dram = wait_for("the job's DRAM bandwidth for 8 GPUs", lambda: r if len(r := query(dram_expr)) == 8 else None,
                        deadline, processes.logs)
        assert {r["metric"]["node"] for r in dram} == {"vnode1"}  # the A100 node has no GPM series
        for r in dram:
            assert float(r["value"][1]) == pytest.approx(MEMORY_BOUND_DRAM_RATIO, abs=0.02), r
        tensor = query(tensor_expr)
        assert len(tensor) == 8 and {r["metric"]["node"] for r in tensor} == {"vnode1"}
        assert all(float(r["value"][1]) < 0.1 for r in tensor), tensor
        memory_bound = query(memory_bound_expr)
        assert [(r["metric"]["node"], float(r["value"][1])) for r in memory_bound] == [("vnode1", 8.0)]
        assert query(capped_expr) == []  # busy at full clocks: nothing capped

        # The A100 is scraped and busy, but has no GPM series at all: absent, never 0.
        assert len(query('vigil_gpu_utilization_ratio{node="vnode2"}')) == 8
        for name in ("vigil_gpu_dram_active_ratio", "vigil_gpu_tensor_active_ratio", "vigil_gpu_sm_active_ratio",
                     "vigil_gpu_nvlink_tx_bytes_per_second"):
            assert query(f'{name}{{node="vnode2"}}') == [], name
            assert len(query(f'{name}{{node="vnode1"}}')) == 8, name
    finally:
        sock.close()
