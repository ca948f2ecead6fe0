"""Issue 39's closed loop with nothing replaced: an Xid 79 on a fake node, read by a real `vigil agent`,
makes a real `vigil aggregator` reboot the node through a real slurmctld; the node comes back, passes
the recovery detector's passive checks, and is probed (a signed run_probes request in the answer to
its report; the real agent runs the real compute and memory probes through torch on the CPU, coupled
to the fake NVML's under-load fault) before anything gives it back.

Two nodes rebooted at once: vnode1 comes back healthy and is resumed only after its probes passed;
vnode2 comes back with a fault that shows only under load (its GPUs read healthy idle, and sag
with a thermal slowdown while a probe burns them): it passes the passive checks, fails its probes,
is not resumed and goes to hardware inspection with the failed probes as evidence. The tests read
the same recorded run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.aggregator.aggregator_process import AggregatorProcess, slurm_aggregator_config
from tests.e2e.test_reboot_loop import HEALTHY, XID_79, FakeNodes, reboot_cluster, scontrol_states
from tests.slurm_cluster import SlurmCluster
from vigil.contract.node_actions import node_key

pytestmark = pytest.mark.external
torch = pytest.importorskip("torch")  # the agent's compute engine (the probes run on the CPU)

FIXED, UNDER_LOAD = "vnode1", "vnode2"  # of reboot_cluster's nodes (its vnode3 stays out of this test)
NODES = (FIXED, UNDER_LOAD)
MASTER_KEY = bytes(range(64, 96))
AFTER_REBOOT: dict[str, dict[str, Any]] = {
    FIXED: HEALTHY,
    # Idle (and under its scenario's own load) it reads healthy; under a probe's load GPU 1's SM clock
    # sags to 60% with HW thermal slowdown.
    UNDER_LOAD: {**HEALTHY, "faults": [{"kind": "under_load", "at_seconds": 0, "gpu": 1, "sm_clock_factor": 0.6,
                                        "throttle": "thermal", "compute_factor": 0.6}]},
}
PERSISTENCE_SECONDS = 5.0  # the recovery detector's passive proof period, shortened (10 reports at 0.5 s)
# The probes kept small: two short burn passes and small buffers per GPU on a shared CPU (the fake
# GPUs report their modelled figures; the CPU's own pass-to-pass spread is never a failure).
AGENT_PROBES = {"burn_pass_seconds": 0.5, "burn_passes": 2, "memory_bytes": 1 << 22, "run_timeout_seconds": 120}
RUN_TIMEOUT_SECONDS = 240.0
__all__ = ["reboot_cluster"]  # the fixture, imported: a cluster of its own for this module


@dataclass
class Run:
    decisions: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, tuple[str, str]] = field(default_factory=dict)
    log: str = ""
    xid_ts: float = 0.0  # time.time() when the Xid lines were written

    def actions(self, node: str) -> list[tuple[str, str, str]]:
        return [(d["action"], d["detector"], d["evidence"].get("signal", ""))
                for d in sorted(self.decisions, key=lambda d: d["ts"]) if d["node"] == node]


def _agent_extra(work: Path) -> Callable[[str], dict[str, Any]]:
    def extra(node: str) -> dict[str, Any]:
        """Each agent may run probes, with its node key and the test's small probes."""
        key = work / f"{node}.node-key"
        key.write_text(node_key(MASTER_KEY, node).hex() + "\n")
        key.chmod(0o600)
        return {"node_actions": {"key_file": str(key), "allow": ["run_probes"]}, "probes": AGENT_PROBES}
    return extra


@pytest.fixture(scope="module")
def run(reboot_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    cluster = reboot_cluster
    work = tmp_path_factory.mktemp("reboot-probes")
    master = work / "node-actions.key"
    master.write_text(MASTER_KEY.hex() + "\n")
    master.chmod(0o600)
    config = slurm_aggregator_config(cluster.scontrol, str(cluster.root / "slurm.conf"))
    config["actuators"]["slurm"]["reboot"] = True
    config["node_actions"] = {"key_file": str(master), "retry_seconds": 5.0}
    config["detectors"] = {"recovery": {"enabled": True, "persistence_seconds": PERSISTENCE_SECONDS}}
    config["gate"] = {"min_removed_seconds": 0}
    # Both nodes may probe at once (2 nodes: the default 2% share is one node at a time).
    config["probes"] = {"enabled": True, "max_fleet_share": 1.0, "run_timeout_seconds": 150}
    agg = AggregatorProcess(work, config)
    agg.start()
    nodes = FakeNodes(cluster, work, agg.url, nodes=NODES, after_reboot=AFTER_REBOOT, agent_extra=_agent_extra(work))
    try:
        deadline = time.monotonic() + 30
        while len(agg.request("GET", "/v1/nodes")["nodes"]) < len(NODES):
            assert time.monotonic() < deadline, "the agents did not all report\n" + agg.log()[-3000:]
            time.sleep(0.2)
        result = Run(xid_ts=time.time())
        for node in NODES:
            nodes.append(node, XID_79)
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            decisions, _ = agg.decisions()
            done = {d["node"] for d in decisions if d["detector"] == "recovery" and d["action"] != "observe"}
            if set(NODES) <= done and scontrol_states(cluster, NODES).get(FIXED, ("",))[0] == "IDLE":
                break
            time.sleep(0.5)
        result.decisions, _ = agg.decisions()
        result.final = scontrol_states(cluster, NODES)
        result.log = agg.log()[-4000:]
        yield result
    finally:
        nodes.stop()
        agg.stop()


def _explain(run: Run, node: str) -> str:
    return f"{node}: decisions {run.actions(node)}; final {run.final.get(node)}\n{run.log[-2000:]}"


def test_a_rebooted_node_is_resumed_only_after_its_probes_pass(run: Run) -> None:
    actions = run.actions(FIXED)
    assert [a for a, _, _ in actions] == ["reboot_node", "observe", "resume"], _explain(run, FIXED)
    probing = next(d for d in run.decisions if d["node"] == FIXED and d["action"] == "observe")
    assert probing["evidence"]["signal"] == "probing" and "probing" in probing["reason"]
    resume = next(d for d in run.decisions if d["node"] == FIXED and d["action"] == "resume")
    judged = resume["evidence"]["probes"]
    assert {p["probe"] for p in judged if p["status"] == "pass"} >= {"gpu_compute", "gpu_memory"}, judged
    assert resume["evidence"]["new_boot"] is True
    assert run.final[FIXED][0] == "IDLE", _explain(run, FIXED)
    print(f"\nXid 79 -> resume after passing probes: {resume['ts'] - run.xid_ts:.1f} s "
          f"(passive proof {PERSISTENCE_SECONDS:.0f} s, probes {probing['ts'] - run.xid_ts:.1f} s after the Xid)")


def test_a_fault_only_load_shows_passes_the_passive_checks_fails_its_probe_and_is_escalated(run: Run) -> None:
    actions = run.actions(UNDER_LOAD)
    assert [a for a, _, _ in actions][:2] == ["reboot_node", "observe"], _explain(run, UNDER_LOAD)
    assert ("inspect_hardware", "recovery", "probe_failed") in actions, _explain(run, UNDER_LOAD)
    assert "resume" not in [a for a, _, _ in actions], _explain(run, UNDER_LOAD)
    inspect = next(d for d in run.decisions if d["node"] == UNDER_LOAD and d["action"] == "inspect_hardware")
    failed = inspect["evidence"]["failed"]
    assert failed and all(f["probe"] == "gpu_compute" for f in failed if f["reason"] == "throttled"), failed
    assert any(f["reason"] == "throttled" for f in failed), failed
    state, reason = run.final[UNDER_LOAD]
    assert "IDLE" not in state and reason.startswith("vigil: inspect_hardware:"), _explain(run, UNDER_LOAD)
