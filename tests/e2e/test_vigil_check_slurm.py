"""``vigil check`` as a real slurmd's ``HealthCheckProgram`` (issue 39, Done when): the node whose
check fails is drained with a "vigil check:" reason, the healthy one stays idle, the failing node
returns once its check passes, and an operator's drain is never overwritten nor lifted.

slurmd runs the program as slurm.conf(5) says: every HealthCheckInterval, with an empty
environment but SLURMD_NODENAME; the wrapper is the one docs/slurm.md shows. Each node's fake
NVML (one H100) is the same; what differs is the baselines file the node is judged against: a
gpu_compute floor of 1e9 TFLOP/s, which nothing reaches, makes a node fail. Which run judged a
node is read from its report's ``baselines_sha256``, so no wait races a check already under way.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.aggregator.aggregator_process import REPO
from tests.slurm_cluster import SEARCH_PATH, SlurmCluster, start_cluster

pytestmark = pytest.mark.external

NODES = ("vnode1", "vnode2")
H100 = "NVIDIA H100 80GB HBM3"
# Short, so a test sees several runs; slurmd starts one per interval (slurm.conf(5)), overlapping
# runs held off by the wrapper's lock.
HEALTH_CHECK_INTERVAL_SECONDS = 3
# One run is a Python start and a quick probe; waits allow many of them on a loaded machine.
WAIT_SECONDS = 120.0
UNREACHABLE_FLOOR = {"classes": {H100: {"gpu_compute": {"min_value": 1e9}}}}

WRAPPER = """\
#!/bin/sh
# slurmd runs its HealthCheckProgram as root with an empty environment but SLURMD_NODENAME.
export PATH={path} SLURM_CONF={slurm_conf} PYTHONPATH={pythonpath}
node="$SLURMD_NODENAME"
# slurmd starts a run every interval even while the last one goes on (deploy/slurm/vigil-healthcheck.sh):
# one at a time per node, a run that finds another exits 0 at once.
exec flock -n {work}/"$node".lock \\
    {python} -m vigil check --drain --quick --probes gpu_compute --timeout 40 --node "$node" \\
    --config {work}/"$node".yaml --baselines {work}/"$node"-baselines.yaml \\
    --json {work}/"$node"-report.json >>{work}/"$node"-check.log 2>&1
"""


class CheckedCluster:
    def __init__(self, cluster: SlurmCluster, work: Path) -> None:
        self.cluster, self.work = cluster, work
        self.generation = 0

    def judge_with(self, node: str, baselines: dict[str, Any]) -> str:
        """Write the node's baselines (a new version each time); the SHA-256 its reports will name."""
        self.generation += 1
        text = f"# generation {self.generation}\n" + yaml.safe_dump(baselines)
        (self.work / f"{node}-baselines.yaml").write_text(text)
        return hashlib.sha256(text.encode()).hexdigest()

    def report(self, node: str) -> dict[str, Any] | None:
        try:
            loaded: dict[str, Any] = json.loads((self.work / f"{node}-report.json").read_text())
        except (OSError, ValueError):
            return None
        return loaded

    def wait_judged(self, node: str, digest: str, done: Callable[[dict[str, Any]], bool] = lambda r: True
                    ) -> dict[str, Any]:
        """The first report of ``node`` judged by baselines ``digest`` for which ``done`` holds."""
        found: list[dict[str, Any]] = []

        def check() -> bool:
            report = self.report(node)
            if report is not None and report["baselines_sha256"] == digest and done(report):
                found.append(report)
                return True
            return False

        try:
            self.cluster.wait_for(f"a check of {node} under baselines {digest[:8]}", check, WAIT_SECONDS)
        except AssertionError:
            log = self.work / f"{node}-check.log"
            raise AssertionError(f"{node}: last report {self.report(node)}; log tail: "
                                 f"{log.read_text()[-1500:] if log.exists() else '(none)'}") from None
        return found[0]

    def state(self, node: str) -> tuple[str, str]:
        return self.cluster.sinfo_state(node), self.cluster.reason(node)

    def all_healthy(self) -> None:
        """Every node judged by permissive baselines and back in service, whatever a test left."""
        digests = {node: self.judge_with(node, {}) for node in NODES}
        for node, digest in digests.items():
            self.wait_judged(node, digest)
        self.cluster.reset()
        self.cluster.wait_for("every node idle", lambda: all(self.state(n)[0] == "idle" for n in NODES),
                              WAIT_SECONDS)


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckedCluster]:
    root = tmp_path_factory.mktemp("hc")
    work = root / "check"
    work.mkdir()
    scenario = work / "one-h100.yaml"
    scenario.write_text(yaml.safe_dump({"description": "one idle H100", "gpus": 1}))
    for node in NODES:
        (work / f"{node}.yaml").write_text(yaml.safe_dump({
            "node": node, "nvml": {"backend": "fake", "scenario": str(scenario)}}))
        (work / f"{node}-baselines.yaml").write_text("{}\n")
    wrapper = work / "vigil-healthcheck.sh"
    pythonpath = os.pathsep.join(p for p in (str(REPO), str(REPO / "clients" / "heartbeat"),
                                             os.environ.get("PYTHONPATH", "")) if p)
    wrapper.write_text(WRAPPER.format(path=SEARCH_PATH, slurm_conf=root / "slurm.conf", pythonpath=pythonpath,
                                      python=sys.executable, work=work))
    wrapper.chmod(0o755)
    cluster = start_cluster(root, NODES, extra_conf=[
        f"HealthCheckProgram={wrapper}", f"HealthCheckInterval={HEALTH_CHECK_INTERVAL_SECONDS}",
        "HealthCheckNodeState=ANY"])
    try:
        yield CheckedCluster(cluster, work)
    finally:
        cluster.stop()


def test_a_failing_check_drains_its_node_with_the_reason_and_a_passing_one_returns_it(
        checked: CheckedCluster) -> None:
    checked.all_healthy()
    failing = checked.judge_with("vnode1", UNREACHABLE_FLOOR)
    passing = checked.judge_with("vnode2", {})

    report = checked.wait_judged("vnode1", failing, lambda r: r["drain"]["action"] == "drained")
    assert report["outcome"] == "unhealthy" and report["exit_code"] == 1
    assert report["hardware_class"] == H100 and report["node"] == "vnode1"
    checked.cluster.wait_for("vnode1 drained", lambda: checked.state("vnode1")[0] in ("drained", "draining"))
    reason = checked.state("vnode1")[1]
    assert reason.startswith("vigil check: gpu_compute")
    # The reason is the report's first failure: below the floor once the compute probe measures,
    # unverified while it cannot (no engine): either way the node did not show 1e9 TFLOP/s.
    assert reason == report["drain"]["detail"][: len(reason)]

    healthy = checked.wait_judged("vnode2", passing)
    assert (healthy["outcome"], healthy["exit_code"], healthy["drain"]["action"]) == ("healthy", 0, "none")
    assert checked.state("vnode2") == ("idle", "none")

    fixed = checked.judge_with("vnode1", {})
    report = checked.wait_judged("vnode1", fixed, lambda r: r["drain"]["action"] == "undrained")
    assert report["outcome"] == "healthy"
    checked.cluster.wait_for("vnode1 back in service", lambda: checked.state("vnode1") == ("idle", "none"))


def test_an_operators_drain_is_neither_overwritten_by_a_failure_nor_lifted_by_a_pass(
        checked: CheckedCluster) -> None:
    checked.all_healthy()
    operator = "hbm replacement ticket 4711"
    checked.cluster.run([checked.cluster.scontrol, "update", "NodeName=vnode2", "State=DRAIN",
                         f"Reason={operator}"])
    failing = checked.judge_with("vnode2", UNREACHABLE_FLOOR)
    report = checked.wait_judged("vnode2", failing)
    assert report["outcome"] == "unhealthy" and report["drain"]["action"] == "left_alone"
    assert checked.state("vnode2") == ("drained", operator)

    passing = checked.judge_with("vnode2", {})
    report = checked.wait_judged("vnode2", passing)
    assert report["outcome"] == "healthy" and report["drain"]["action"] == "none"
    assert checked.state("vnode2") == ("drained", operator)
    assert checked.state("vnode1") == ("idle", "none")  # judged all along by permissive baselines
    checked.all_healthy()
