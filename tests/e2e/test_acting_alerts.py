"""A failing actuator is seen three ways: the real aggregator with a Slurm actuator whose controller
is gone (Debian's scontrol against a slurm.conf with no slurmctld) logs each failed delivery,
counts it in /metrics, and Debian's prometheus, scraping it with the shipped rules/, fires the alert."""

from __future__ import annotations

import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.aggregator.aggregator_process import AggregatorProcess
from tests.aggregator.conftest import FakeNode
from tests.e2e.conftest import Processes, http_json, wait_for, which
from tests.loopback import free_port
from vigil.contract.wire import Event

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = which("prometheus")
SCONTROL = which("scontrol")


@pytest.mark.skipif(PROMETHEUS is None or SCONTROL is None,
                    reason="needs Debian's prometheus and slurm-client (apt-get install prometheus slurm-client)")
def test_a_slurm_actuator_without_a_controller_logs_counts_and_fires_the_alert(tmp_path: Path,
                                                                              processes: Processes) -> None:
    assert PROMETHEUS is not None and SCONTROL is not None
    conf = tmp_path / "slurm.conf"
    conf.write_text(  # a controller that is not running: every scontrol call fails to connect
        f"ClusterName=vigiltest\nSlurmctldHost=localhost\nSlurmctldPort={free_port()}\n"
        f"AuthType=auth/munge\nAuthInfo=socket={tmp_path}/munge.sock\nCredType=cred/munge\n"
        "NodeName=gpu-a1 CPUs=1 State=UNKNOWN\nPartitionName=p Nodes=gpu-a1 Default=YES\n")
    agg = AggregatorProcess(tmp_path, {
        "dry_run": False, "evaluate_interval_seconds": 0.5,
        "actuators": {"slurm": {"enabled": True, "scontrol": SCONTROL, "slurm_conf": str(conf),
                                "timeout_seconds": 5},
                      "delivery": {"base_backoff_seconds": 0.2, "max_backoff_seconds": 0.5, "poll_seconds": 0.2,
                                   "max_attempts": 1000}},
    })
    try:
        agg.start()
        node = FakeNode("gpu-a1")
        now = time.time()
        agg.post_report(node.report(now, events=[Event(kind="xid", ts=now, code=79, gpu=0, urgent=True,
                                                       message="GPU has fallen off the bus.")], urgent=True))
        # The log line: the start-up check (run once the listener is open) and each failed attempt.
        wait_for("the start-up check logged", lambda: re.search(
            r"actuator slurm cannot reach its target: \S*scontrol ping", agg.log()) is not None, time.monotonic() + 20)
        wait_for("a failed delivery logged", lambda: "to slurm failed, attempt" in agg.log(), time.monotonic() + 20)
        # The metric.
        with urllib.request.urlopen(agg.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert 'vigil_aggregator_actuator_up{actuator="slurm"} 0.0' in text
        assert 'vigil_aggregator_deliveries_total{actuator="slurm",outcome="failed"}' in text
        assert 'vigil_aggregator_deliveries_total{actuator="slurm",outcome="delivered"} 0.0' in text

        # The alert, in a real Prometheus with the shipped rules.
        prom = f"127.0.0.1:{free_port()}"
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(p) for p in sorted((ROOT / "rules").glob("*.rules.yml"))],
            "scrape_configs": [{"job_name": "vigil-aggregator",
                                "static_configs": [{"targets": [agg.url.removeprefix("http://")]}]}],
        }))
        processes.start("prometheus", [PROMETHEUS, f"--config.file={prom_config}",
                                       f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                                       f"--web.listen-address={prom}", "--log.level=warn"])

        def alerts(state: str) -> set[str]:
            processes.check_alive()
            query = urllib.parse.urlencode({"query": f'ALERTS{{alertstate="{state}", actuator="slurm"}}'})
            result = http_json(f"http://{prom}/api/v1/query?{query}")["data"]["result"]
            return {r["metric"]["alertname"] for r in result}

        deadline = time.monotonic() + 60
        wait_for("VigilActuatorUnreachable firing", lambda: "VigilActuatorUnreachable" in alerts("firing"),
                 deadline, processes.logs)
        # Every attempt fails: the delivery alert's condition holds (it fires after its 2 minutes).
        wait_for("VigilActuatorFailing pending", lambda: "VigilActuatorFailing" in alerts("pending"),
                 deadline, processes.logs)
    finally:
        agg.stop()
