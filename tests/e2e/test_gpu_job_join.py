"""An attributed GPU's series join to its Slurm job in PromQL, through a real Prometheus: a
`vigil agent` on the fake NVML backend whose scenario puts pid 4242 on GPU 3, with a process
table (collectors.gpu.proc_root) holding the recorded real cgroup v2 file of Slurm job 1392969
for that pid, scraped by Debian's prometheus with the shipped rules/.

Checked: the raw info series, the shipped recording rule and the documented join
(`vigil_gpu_utilization_ratio * on (node, gpu) group_left (training_job) ...`) name job 1392969 on
GPU 3 and on no other GPU. Every process is ours, on loopback, stopped by pid; bounded by
DEADLINE_SECONDS.
"""

from __future__ import annotations

import shutil
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import Processes, http_json, wait_for, which
from tests.loopback import free_port

pytestmark = pytest.mark.external

ROOT = Path(__file__).resolve().parents[2]
CGROUP = ROOT / "tests" / "fixtures" / "cgroup" / "slurm-v2-fox.cgroup"  # Slurm job 1392969
PROMETHEUS = which("prometheus")
DEADLINE_SECONDS = 60.0
PID, GPU, SLURM_JOB = 4242, 3, "1392969"
JOIN = ("vigil_gpu_utilization_ratio * on (node, gpu) group_left (training_job) "
        "node_gpu_training_job:vigil_gpu_process_info:max")


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (apt-get install prometheus)")
def test_gpu_series_join_to_the_slurm_job_of_their_process(tmp_path: Path, processes: Processes) -> None:
    assert PROMETHEUS is not None
    deadline = time.monotonic() + DEADLINE_SECONDS
    proc = tmp_path / "proc"
    (proc / str(PID)).mkdir(parents=True)
    shutil.copy(CGROUP, proc / str(PID) / "cgroup")
    scenario = tmp_path / "job-on-gpu3.yaml"
    scenario.write_text(yaml.safe_dump({
        "description": "healthy H100 node, one process of Slurm job 1392969 on GPU 3",
        "profile": "h100-sxm-80gb", "gpus": 8, "load": {"utilization": 0.9, "memory_used_ratio": 0.8},
        "processes": [{"gpu": GPU, "pid": PID, "from_seconds": 0}]}))
    config = tmp_path / "agent.yml"
    config.write_text(yaml.safe_dump({"collectors": {
        "gpu": {"interval_seconds": 1.0, "job_attribution_interval_seconds": 1.0, "proc_root": str(proc)},
        "training": {"enabled": False}}}))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    (tmp_path / "sys").mkdir()
    listen = f"127.0.0.1:{free_port()}"
    processes.start("agent", [sys.executable, "-m", "vigil", "agent", "--config", str(config),
                              "--backend", "fake", "--scenario", str(scenario), "--listen", listen,
                              "--node", "vnode1", "--kmsg", str(kmsg), "--sysfs-root", str(tmp_path / "sys"),
                              "--log-level", "WARNING"])
    prom = f"127.0.0.1:{free_port()}"
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(p) for p in sorted((ROOT / "rules").glob("*.rules.yml"))],
        "scrape_configs": [{"job_name": "vigil-agent", "static_configs": [
            {"targets": [listen], "labels": {"node": "vnode1"}}]}],
    }))
    processes.start("prometheus", [PROMETHEUS, f"--config.file={prom_config}",
                                   f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                                   f"--web.listen-address={prom}", "--log.level=warn"])

    def query(expr: str) -> list[dict[str, Any]]:
        processes.check_alive()
        url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return list(http_json(url)["data"]["result"])

    info = wait_for("the process info series", lambda: query("vigil_gpu_process_info"), deadline, processes.logs)
    assert len(info) == 1, info
    labels = info[0]["metric"]
    assert (labels["gpu"], labels["pid"], labels["exported_job"], labels["slurm_job"]) == (
        str(GPU), str(PID), SLURM_JOB, SLURM_JOB)
    assert labels.get("pod_uid", "") == "" and labels["uuid"]
    joined = wait_for("the join", lambda: query(JOIN), deadline, processes.logs)
    assert [(r["metric"]["gpu"], r["metric"]["training_job"], r["metric"]["node"]) for r in joined] == [
        (str(GPU), SLURM_JOB, "vnode1")]
    assert 0.5 < float(joined[0]["value"][1]) <= 1.0  # the GPU's own utilisation, not the info's 1
    # The other seven GPUs are scraped, and have no job to join to.
    assert len(query("vigil_gpu_utilization_ratio")) == 8
