"""End to end with the real programs: vigil agents on the fake NVML backend -> Debian's prometheus
scraping them with rules/ loaded -> a hardware alert fires -> Debian's prometheus-alertmanager,
routed by deploy/alertmanager/alertmanager.yml, posts it to the aggregator's POST /v1/alertmanager
-> the real `vigil aggregator` process's gate admits it and its Slurm actuator drains the node in a
real slurmctld.

Node vnode1 runs the shipped row-remap-failure scenario (GPU 6 runs out of spare rows), its fault
brought forward from 60 s to 3 s; vnode2 runs the healthy H100 scenario and must raise nothing.
The node names are the Slurm test cluster's (tests/slurm_cluster.py). Every process is ours, on
loopback, stopped by its pid; each test is bounded by DEADLINE_SECONDS.
"""

from __future__ import annotations

import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.aggregator.aggregator_process import ROLE_TOKENS, SITE_SECRET, AggregatorProcess, slurm_aggregator_config
from tests.e2e.conftest import Processes, WebhookReceiver, http_json, wait_for, which
from tests.loopback import free_port
from tests.slurm_cluster import SlurmCluster
from vigil.aggregator.alertmanager_input import WebhookPayload, decisions_from_payload
from vigil.aggregator.auth import node_token
from vigil.aggregator.decision import Action

pytestmark = pytest.mark.external

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_SECONDS = 60.0
FAULT_AT_SECONDS = 3.0
PROMETHEUS = which("prometheus")
ALERTMANAGER = which("prometheus-alertmanager") or which("alertmanager")


def _scenario(tmp: Path, name: str, fault_at: float | None) -> Path:
    """A shipped node scenario, its faults moved to ``fault_at`` seconds so the test stays short."""
    data = yaml.safe_load((ROOT / "scenarios" / "node" / f"{name}.yaml").read_text())
    if fault_at is not None:
        assert data["faults"], name
        for fault in data["faults"]:
            fault["at_seconds"] = fault_at
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start_agent(procs: Processes, tmp: Path, node: str, scenario: Path, aggregator: AggregatorProcess | None) -> str:
    listen = f"127.0.0.1:{free_port()}"
    kmsg = tmp / f"{node}.kmsg"
    kmsg.write_text("")
    sysfs = tmp / f"{node}-sys"
    sysfs.mkdir()
    config = tmp / f"{node}-agent.yml"
    # The training collector's UDP heartbeat port is per host; these two agents share one host.
    agent_config: dict[str, Any] = {"collectors": {"training": {"enabled": False}}}
    if aggregator is not None:  # the agent reports to it with its own node token
        token = tmp / f"{node}.token"
        token.write_text(node_token(SITE_SECRET.encode(), node) + "\n")
        agent_config["aggregator"] = {"url": aggregator.url, "token_file": str(token)}
    config.write_text(yaml.safe_dump(agent_config))
    procs.start(f"agent-{node}", [sys.executable, "-m", "vigil", "agent", "--config", str(config),
                                  "--backend", "fake", "--scenario", str(scenario), "--listen", listen,
                                  "--node", node, "--kmsg", str(kmsg), "--sysfs-root", str(sysfs),
                                  "--log-level", "WARNING"])
    return listen


def _prometheus_config(agents: dict[str, str], alertmanager: str) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(p) for p in sorted((ROOT / "rules").glob("*.rules.yml"))],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "scrape_configs": [{
            "job_name": "vigil-agent",
            # The exposition has no host label; the target's `node` label names the node.
            "static_configs": [{"targets": [addr], "labels": {"node": node}} for node, addr in agents.items()],
        }],
    }


def _alertmanager_config(webhook_url: str, token_file: Path) -> dict[str, Any]:
    """The shipped routing, with the aggregator's URL and credential pointed at this test and
    short waits."""
    config = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    for receiver in config["receivers"]:
        if receiver["name"] == "vigil-aggregator":
            receiver["webhook_configs"][0]["url"] = webhook_url
            http = receiver["webhook_configs"][0]["http_config"]
            assert http["authorization"]["credentials_file"]  # the shipped file sends Alertmanager's token
            http["authorization"]["credentials_file"] = str(token_file)
        else:  # no pager or ticket system here
            receiver.pop("webhook_configs", None)
    config["route"].update(group_wait="1s", group_interval="1s")
    return config


@dataclass
class Pipeline:
    prometheus: str
    alertmanager: str
    processes: Processes

    def query(self, expr: str) -> list[dict[str, Any]]:
        self.processes.check_alive()
        url = f"http://{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return list(http_json(url)["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        self.processes.check_alive()
        return [a for a in http_json(f"http://{self.alertmanager}/api/v2/alerts")
                if a["labels"]["alertname"].startswith("Vigil")]


def start_pipeline(tmp_path: Path, processes: Processes, aggregator_webhook: str,
                   aggregator: AggregatorProcess | None = None) -> Pipeline:
    """vnode1 (faulty) and vnode2 (healthy) agents (reporting to ``aggregator`` if given),
    Alertmanager posting to ``aggregator_webhook`` with its bearer token, and Prometheus scraping
    the agents with rules/ and alerting to that Alertmanager."""
    assert PROMETHEUS is not None and ALERTMANAGER is not None
    faulty = _scenario(tmp_path, "row-remap-failure", FAULT_AT_SECONDS)
    agents = {
        "vnode1": _start_agent(processes, tmp_path, "vnode1", faulty, aggregator),
        "vnode2": _start_agent(processes, tmp_path, "vnode2", _scenario(tmp_path, "healthy-h100", None), aggregator),
    }
    am_addr = f"127.0.0.1:{free_port()}"
    am_config = tmp_path / "alertmanager.yml"
    am_token = tmp_path / "alertmanager.token"
    am_token.write_text(ROLE_TOKENS["alertmanager"] + "\n")
    am_config.write_text(yaml.safe_dump(_alertmanager_config(aggregator_webhook, am_token)))
    processes.start("alertmanager", [ALERTMANAGER, f"--config.file={am_config}",
                                     f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address={am_addr}",
                                     "--cluster.listen-address=", "--log.level=warn"])
    prom_addr = f"127.0.0.1:{free_port()}"
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump(_prometheus_config(agents, am_addr)))
    processes.start("prometheus", [PROMETHEUS, f"--config.file={prom_config}",
                                   f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                                   f"--web.listen-address={prom_addr}", "--log.level=warn"])
    return Pipeline(prom_addr, am_addr, processes)


needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or ALERTMANAGER is None,
    reason="needs Debian's prometheus and prometheus-alertmanager (apt-get install prometheus prometheus-alertmanager)")


@needs_prometheus
def test_hardware_fault_pages_through_prometheus_and_alertmanager(tmp_path: Path, processes: Processes,
                                                                 webhook: WebhookReceiver) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    p = start_pipeline(tmp_path, processes, f"http://127.0.0.1:{webhook.port}/v1/alertmanager")

    # Both agents are scraped, under their node names.
    wait_for("both agents scraped", lambda: {r["metric"]["node"] for r in p.query('up{job="vigil-agent"} == 1')}
             == {"vnode1", "vnode2"}, deadline, processes.logs)

    # The fault reaches Prometheus: vnode1 GPU 6 reports a failed row remap, nothing else does.
    failed = wait_for("vigil_gpu_row_remap_failure == 1", lambda: p.query("vigil_gpu_row_remap_failure == 1"),
                      deadline, processes.logs)
    assert [(r["metric"]["node"], r["metric"]["gpu"]) for r in failed] == [("vnode1", "6")]
    assert "instance" in failed[0]["metric"] and "host" not in failed[0]["metric"]

    # The rule fires, and Alertmanager holds the alert.
    alerts = wait_for("VigilGpuRowRemapFailure in Alertmanager",
                      lambda: [a for a in p.alerts() if a["labels"]["alertname"] == "VigilGpuRowRemapFailure"],
                      deadline, processes.logs)
    labels = alerts[0]["labels"]
    assert (labels["node"], labels["gpu"], labels["severity"], labels["vigil_action"]) == (
        "vnode1", "6", "page", "inspect_hardware")
    assert alerts[0]["annotations"]["summary"] == "Row remap failed on vnode1 GPU 6"

    # Alertmanager delivers it on the aggregator route, and the aggregator's webhook model reads it
    # as one inspect_hardware decision for vnode1. The scenario's Xid 64 pages too, in a group of
    # its own (the route groups by alertname, node and gpu) that may be delivered first: it reads
    # as reset_gpu for the same GPU, the Xid catalog's action for code 64.
    def delivered(alertname: str) -> list[dict[str, Any]]:
        return [b for b in list(webhook.bodies) if b["groupLabels"].get("alertname") == alertname]

    bodies = wait_for("the webhook delivery", lambda: delivered("VigilGpuRowRemapFailure"), deadline, processes.logs)
    assert set(webhook.paths) == {"/v1/alertmanager"}
    assert set(webhook.authorizations) == {f"Bearer {ROLE_TOKENS['alertmanager']}"}
    payload = WebhookPayload.model_validate(bodies[0])
    decisions, skipped, refused = decisions_from_payload(payload, now=time.time(), dry_run=False)
    assert [(d.node, d.action, d.gpu) for d in decisions] == [("vnode1", Action.INSPECT_HARDWARE, 6)], skipped
    assert refused == []
    expected = {"VigilGpuRowRemapFailure": Action.INSPECT_HARDWARE, "VigilGpuXidResetRequired": Action.RESET_GPU}
    for body in list(webhook.bodies):  # whatever else arrived is the same GPU's Xid, nothing of vnode2's
        assert body["groupLabels"]["alertname"] in expected, body["groupLabels"]
        decisions, skipped, refused = decisions_from_payload(WebhookPayload.model_validate(body), now=time.time(),
                                                             dry_run=False)
        assert [(d.node, d.action, d.gpu) for d in decisions] == [
            ("vnode1", expected[body["groupLabels"]["alertname"]], 6)], skipped

    # The healthy node raised nothing, on either tier.
    assert not [a for a in p.alerts() if a["labels"].get("node") == "vnode2"]
    assert not p.query('ALERTS{node="vnode2"}')


@needs_prometheus
def test_hardware_fault_drains_the_node_in_slurm(tmp_path: Path, processes: Processes,
                                                 slurm_cluster: SlurmCluster) -> None:
    slurm_cluster.reset()
    assert {"vnode1", "vnode2"} <= set(slurm_cluster.nodes)
    deadline = time.monotonic() + DEADLINE_SECONDS
    # The real `vigil aggregator` process: gate, SQLite store, dispatcher and the Slurm actuator.
    (tmp_path / "aggregator").mkdir()
    # The agents report to it (a decision may only name a node that reports); its own memory
    # and Xid detectors are off, so the drain comes from the Alertmanager route this test is about.
    aggregator = AggregatorProcess(tmp_path / "aggregator", {
        **slurm_aggregator_config(slurm_cluster.scontrol, str(slurm_cluster.root / "slurm.conf")),
        "detectors": {"memory": {"enabled": False}, "xid": {"enabled": False}}})
    aggregator.start()
    try:
        p = start_pipeline(tmp_path, processes, f"{aggregator.url}/v1/alertmanager", aggregator)

        # The scenario's Xid 64 pages as well (reset_gpu, a drain in Slurm) and may come first; the
        # row-remap page's inspect_hardware drain then writes its own reason over it.
        def drained_for_inspection() -> bool:
            processes.check_alive()
            return ("drain" in slurm_cluster.sinfo_state("vnode1")
                    and slurm_cluster.reason("vnode1").startswith("vigil: inspect_hardware:"))

        wait_for("vnode1 drained in Slurm for inspection", drained_for_inspection, deadline,
                 lambda: processes.logs() + f"\nalerts: {p.alerts()}\nreason: {slurm_cluster.reason('vnode1')}")
        reason = slurm_cluster.reason("vnode1")
        assert slurm_cluster.sinfo_state("vnode2") == "idle"
        # The hardware alert, and only vnode1 alerted. An agent-health alert of vnode1's own (events
        # dropped while a loaded machine slowed its agent) is not what this test is about.
        alerted = {(a["labels"]["alertname"], a["labels"]["node"]) for a in p.alerts()}
        assert ("VigilGpuRowRemapFailure", "vnode1") in alerted and {n for _, n in alerted} == {"vnode1"}, alerted
        decisions, _ = aggregator.decisions()
        assert {(d["node"], d["detector"]) for d in decisions} == {("vnode1", "alertmanager")}, decisions
        inspect = [d for d in decisions if d["action"] == "inspect_hardware"]
        assert len(inspect) == 1 and inspect[0]["id"] in reason, decisions
        assert {d["action"] for d in decisions} <= {"inspect_hardware", "reset_gpu"}, decisions
    finally:
        aggregator.stop()
