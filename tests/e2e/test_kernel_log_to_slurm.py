"""Issue 7's path with nothing replaced: an Xid 79 line in a fake node's kernel log, read by a real
`vigil agent`, pushed to a real `vigil aggregator` (gate, store, Slurm actuator, not dry run),
ends with that node drained in a real slurmctld, and a restarted aggregator drains nothing twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.aggregator.aggregator_process import REPO, SITE_SECRET, AggregatorProcess, slurm_aggregator_config, wait_for
from tests.loopback import free_port
from tests.pidfile import stop_children
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.auth import node_token

XID_79 = ("[ 2071.315227] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
          "GPU has fallen off the bus.\n")


class Agents:
    def __init__(self, root: Path, nodes: list[str], aggregator_url: str) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.kmsg = {n: root / f"{n}.kmsg" for n in nodes}
        for node in nodes:
            self.kmsg[node].write_text("[    5.000000] nvidia: module loaded\n")
            cfg = root / f"{node}.yaml"
            token = root / f"{node}.token"  # the node's own credential (vigil token create)
            token.write_text(node_token(SITE_SECRET.encode(), node) + "\n")
            cfg.write_text(yaml.safe_dump({
                "node": node, "listen": f"127.0.0.1:{free_port()}", "nvml": {"backend": "fake"},
                "aggregator": {"url": aggregator_url, "interval_seconds": 0.5, "token_file": str(token)},
                "collectors": {"training": {"enabled": False}},
            }))
            log = (root / f"{node}.log").open("wb")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "vigil", "agent", "--config", str(cfg), "--kmsg", str(self.kmsg[node])],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)}))
            log.close()

    def append(self, node: str, line: str) -> None:
        with self.kmsg[node].open("a") as f:
            f.write(line)

    def stop(self) -> None:
        stop_children(self.procs)


@pytest.fixture
def aggregator(tmp_path: Path, slurm_cluster: SlurmCluster) -> Iterator[AggregatorProcess]:  # noqa: F811
    slurm_cluster.reset()
    agg = AggregatorProcess(tmp_path, slurm_aggregator_config(slurm_cluster.scontrol,
                                                              str(slurm_cluster.root / "slurm.conf")))
    try:
        yield agg
    finally:
        agg.stop()
        slurm_cluster.reset()


@pytest.mark.external
def test_xid_79_in_a_kernel_log_drains_that_node_in_slurm_once(
    tmp_path: Path, aggregator: AggregatorProcess, slurm_cluster: SlurmCluster  # noqa: F811
) -> None:
    aggregator.start()
    agents = Agents(tmp_path, list(slurm_cluster.nodes), aggregator.url)
    try:
        wait_for("every node to report", lambda: len(aggregator.request("GET", "/v1/nodes")["nodes"])
                 == len(slurm_cluster.nodes), 30)
        agents.append("vnode1", XID_79)
        wait_for("vnode1 drained", lambda: "drain" in slurm_cluster.sinfo_state("vnode1"), 20)
        decisions, _ = aggregator.decisions()
        drained = [d for d in decisions if d["node"] == "vnode1"]
        assert drained and all(d["node"] == "vnode1" for d in decisions)
        reason = slurm_cluster.reason("vnode1")
        assert reason.startswith("vigil:") and any(d["id"] in reason for d in drained) and "79" in reason
        before = slurm_cluster.run([slurm_cluster.sinfo, "-h", "-N", "-n", "vnode1", "-o", "%E|%H"]).strip()

        # The aggregator restarts and the node logs the same fatal Xid again: nothing is drained twice.
        assert aggregator.stop() == 0
        time.sleep(1.1)  # a second drain would show a later reason time (%H has seconds)
        aggregator.start()
        agents.append("vnode1", XID_79)
        time.sleep(3.0)  # several report intervals, evaluations and dispatcher polls
        _, deliveries = aggregator.decisions()
        slurm_deliveries = [d for ds in deliveries.values() for d in ds
                            if d["actuator"] == "slurm" and d["state"] == "delivered"]
        assert len(slurm_deliveries) == 1
        after = slurm_cluster.run([slurm_cluster.sinfo, "-h", "-N", "-n", "vnode1", "-o", "%E|%H"]).strip()
        assert after == before
        assert [slurm_cluster.sinfo_state(n) for n in ("vnode2", "vnode3")] == ["idle", "idle"]
    finally:
        agents.stop()
