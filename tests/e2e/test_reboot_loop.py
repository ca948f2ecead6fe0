"""Issue 16's closed loop with nothing replaced: an Xid 79 on a fake node, read by a real
`vigil agent`, makes a real `vigil aggregator` reboot the node through a real slurmctld
(`scontrol reboot ASAP nextstate=DOWN`); the cluster's RebootProgram (tests/e2e/reboot_program.py)
"reboots" the fake node (a new boot id, its agent and slurmd started again) and the recovery
detector decides from the new boot's reports whether the node goes back to service.

One run, three nodes rebooted at once, each coming back differently (the scenario its agent is
started again with): vnode1 healthy (resumed, `idle`, with no one touching it), vnode2 with the
same Xid 79 again (`inspect_hardware`, a ticket through the webhook, still out of service), vnode3
with one GPU fewer (not resumed). The three tests read the same recorded run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.aggregator.aggregator_process import (
    REPO,
    SECRET,
    SITE_SECRET,
    AggregatorProcess,
    WebhookReceiver,
    slurm_aggregator_config,
)
from tests.loopback import free_port
from tests.pidfile import stop_children, stop_pidfile, write_pidfile
from tests.slurm_cluster import SlurmCluster, start_cluster
from vigil.aggregator.auth import node_token

pytestmark = pytest.mark.external

REBOOT_PROGRAM = Path(__file__).resolve().parent / "reboot_program.py"
FIXED, SURVIVES, FEWER_GPUS = "vnode1", "vnode2", "vnode3"
NODES = (FIXED, SURVIVES, FEWER_GPUS)
XID_79 = ("[ 2071.315227] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
          "GPU has fallen off the bus.\n")
GPUS = 2  # per fake node: enough to lose one
HEALTHY: dict[str, Any] = {"profile": "h100-sxm-80gb", "gpus": GPUS,
                           "load": {"utilization": 0.5, "noise": 0.05, "memory_used_ratio": 0.5}}
AFTER_REBOOT: dict[str, dict[str, Any]] = {
    FIXED: HEALTHY,
    # The fault survives the reboot: the GPU falls off the bus again a second into the new boot.
    SURVIVES: {**HEALTHY, "faults": [{"at_seconds": 1, "gpu": 0, "kind": "xid", "code": 79}]},
    FEWER_GPUS: {**HEALTHY, "gpus": GPUS - 1},
}
# The recovery detector's proof period, shortened from 60 s so the test takes seconds: 10 reports
# at the agents' 0.5 s interval, still above its min_reports (4).
PERSISTENCE_SECONDS = 5.0
# slurm.conf: how long slurmctld waits for a rebooted node's slurmd to register with a boot time
# after the request before it marks the node DOWN "reboot timed out" (Slurm's default, 60 s); the
# reboot program's "reboot" takes about 3 s.
RESUME_TIMEOUT_SECONDS = 60
RUN_TIMEOUT_SECONDS = 150.0


@pytest.fixture(scope="module")
def reboot_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    root = tmp_path_factory.mktemp("slurm")  # short: munge's socket path must fit in sun_path
    cluster = start_cluster(root, NODES, extra_conf=[
        f'RebootProgram="{sys.executable} {REBOOT_PROGRAM} {root}"',
        f"ResumeTimeout={RESUME_TIMEOUT_SECONDS}",
    ], return_to_service=1)  # 2 would put the rebooted node back in service at its next registration
    try:
        yield cluster
    finally:
        cluster.stop()


def scontrol_states(cluster: SlurmCluster, nodes: tuple[str, ...] = NODES) -> dict[str, tuple[str, str]]:
    """node -> (State, Reason) as `scontrol show node -o` prints them."""
    out: dict[str, tuple[str, str]] = {}
    for line in cluster.run([cluster.scontrol, "show", "node", "-o", ",".join(nodes)]).splitlines():
        name = re.search(r"NodeName=(\S+)", line)
        state = re.search(r" State=(\S+)", line)
        reason = re.search(r" Reason=(.*?)(?: \[[^\]]*\])?\s*$", line)
        if name and state:
            out[name.group(1)] = (state.group(1), reason.group(1) if reason else "")
    return out


@dataclass
class Run:
    """What the loop did, recorded while it ran."""

    xid_ts: float  # time.time() when the Xid lines were written
    # node -> [(seconds after the Xid, Slurm State, Reason)], one entry per change.
    timeline: dict[str, list[tuple[float, str, str]]] = field(default_factory=dict)
    idle_after_seconds: float | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    deliveries: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    tickets: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    boots: dict[str, int] = field(default_factory=dict)
    final: dict[str, tuple[str, str]] = field(default_factory=dict)

    def states(self, node: str) -> list[str]:
        return [state for _, state, _ in self.timeline[node]]

    def actions(self, node: str) -> list[tuple[str, str]]:
        return [(d["action"], d["detector"]) for d in sorted(self.decisions, key=lambda d: d["ts"])
                if d["node"] == node]


class FakeNodes:
    """One agent per node, started as the reboot program expects: ``reboot/<node>/`` holds its
    pidfile, its boot id and ``after-reboot.json`` (how it starts again after the reboot, with the
    scenario ``after_reboot`` names for it). ``agent_extra(node)``: more of each agent's config."""

    def __init__(self, cluster: SlurmCluster, work: Path, aggregator_url: str, *, nodes: tuple[str, ...] = NODES,
                 after_reboot: dict[str, dict[str, Any]] = AFTER_REBOOT,
                 agent_extra: Callable[[str], dict[str, Any]] = lambda _: {}) -> None:
        self.cluster = cluster
        self.procs: list[subprocess.Popen[bytes]] = []
        self.kmsg: dict[str, Path] = {}
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for node in nodes:
            node_dir = cluster.root / "reboot" / node
            node_dir.mkdir(parents=True, exist_ok=True)
            (node_dir / "boot_id").write_text(f"{uuid.uuid4()}\n")
            token = work / f"{node}.token"
            token.write_text(node_token(SITE_SECRET.encode(), node) + "\n")
            listen = f"127.0.0.1:{free_port()}"
            argv = {}
            for boot, scenario in ((0, HEALTHY), (1, after_reboot[node])):
                (work / f"{node}-boot{boot}.scenario.yaml").write_text(yaml.safe_dump(scenario))
                (work / f"{node}-boot{boot}.yaml").write_text(yaml.safe_dump({
                    "node": node, "listen": listen,
                    "nvml": {"backend": "fake", "scenario": str(work / f"{node}-boot{boot}.scenario.yaml")},
                    "aggregator": {"url": aggregator_url, "interval_seconds": 0.5, "token_file": str(token)},
                    "collectors": {"training": {"enabled": False}},
                    **agent_extra(node),
                }))
                kmsg = work / f"{node}-boot{boot}.kmsg"  # each boot has its own kernel log
                kmsg.write_text("[    5.000000] nvidia: module loaded\n")
                argv[boot] = [sys.executable, "-m", "vigil", "agent", "--config", str(work / f"{node}-boot{boot}.yaml"),
                              "--kmsg", str(kmsg), "--boot-id-file", str(node_dir / "boot_id")]
            self.kmsg[node] = work / f"{node}-boot0.kmsg"
            (node_dir / "after-reboot.json").write_text(json.dumps({"argv": argv[1], "cwd": str(REPO), "env": env}))
            with (work / f"{node}-boot0.log").open("wb") as log:
                proc = subprocess.Popen(argv[0], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
            self.procs.append(proc)
            write_pidfile(node_dir / "agent.pid", proc.pid)

    def append(self, node: str, line: str) -> None:
        with self.kmsg[node].open("a") as f:
            f.write(line)

    def stop(self) -> None:
        # The agents the reboot program started again, then the first ones (our children).
        for pidfile in sorted(self.cluster.restarted_dir.glob("*-agent.pid")):
            stop_pidfile(pidfile, 5)
        stop_children(self.procs)


def last_evaluation_ts(agg: AggregatorProcess) -> float:
    with urllib.request.urlopen(agg.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vigil_aggregator_last_evaluation_timestamp_seconds")]
    return max(values, default=0.0)


def _finished(agg: AggregatorProcess, receiver: WebhookReceiver, idle_wall_ts: float | None) -> bool:
    decisions, _ = agg.decisions()
    inspected = {d["node"] for d in decisions if d["action"] == "inspect_hardware"}
    ticketed = {d["node"] for d in receiver.applied.values() if d["action"] == "inspect_hardware"}
    # Done once vnode1 is back, the other two went to inspection (vnode2 with its ticket), and the
    # aggregator has evaluated for one more proof period after vnode1's resume: a wrong resume
    # of the other two (their reboots finished with vnode1's) would have been proposed by then.
    return (idle_wall_ts is not None and SURVIVES in ticketed and FEWER_GPUS in inspected
            and last_evaluation_ts(agg) >= idle_wall_ts + PERSISTENCE_SECONDS)


@pytest.fixture(scope="module")
def run(reboot_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    cluster = reboot_cluster
    work = tmp_path_factory.mktemp("reboot-loop")
    receiver = WebhookReceiver()
    (work / "webhook.secret").write_bytes(SECRET)
    config = slurm_aggregator_config(cluster.scontrol, str(cluster.root / "slurm.conf"))
    config["actuators"]["slurm"]["reboot"] = True  # reboot_node -> scontrol reboot ASAP nextstate=DOWN
    # The ticket system: inspect_hardware decisions only.
    config["actuators"]["webhook"] = {"enabled": True, "url": receiver.url, "secret_file": str(work / "webhook.secret"),
                                      "actions": ["inspect_hardware"], "timeout_seconds": 5}
    config["detectors"] = {"recovery": {"enabled": True, "persistence_seconds": PERSISTENCE_SECONDS}}
    # The gate keeps a removed node out at least 30 min (hysteresis); the test's node proves itself
    # in seconds, so that floor is lifted here. Nothing else of the gate is loosened.
    config["gate"] = {"min_removed_seconds": 0}
    agg = AggregatorProcess(work, config)
    agg.start()
    nodes = FakeNodes(cluster, work, agg.url)
    try:
        deadline = time.monotonic() + 30
        while len(agg.request("GET", "/v1/nodes")["nodes"]) < len(NODES):
            assert time.monotonic() < deadline, "the agents did not all report\n" + agg.log()[-3000:]
            time.sleep(0.2)
        assert all(state == "IDLE" for state, _ in scontrol_states(cluster).values())
        result = Run(xid_ts=time.time())
        for node in NODES:
            nodes.append(node, XID_79)
        idle_wall_ts: float | None = None
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        while True:
            states = scontrol_states(cluster)
            now = time.time()
            for node, (state, reason) in states.items():
                seen = result.timeline.setdefault(node, [])
                if not seen or seen[-1][1] != state:
                    seen.append((round(now - result.xid_ts, 2), state, reason))
            fixed_state = states[FIXED][0]
            if idle_wall_ts is None and len(result.timeline[FIXED]) > 1 and fixed_state == "IDLE":
                idle_wall_ts = now
                result.idle_after_seconds = now - result.xid_ts
            if _finished(agg, receiver, idle_wall_ts):
                break
            if time.monotonic() > deadline:
                break  # the tests below say what did not happen
            time.sleep(0.2)
        result.decisions, result.deliveries = agg.decisions()
        result.tickets = list(receiver.applied.values())
        result.nodes = {n["node"]: n for n in agg.request("GET", "/v1/nodes")["nodes"]}
        result.final = scontrol_states(cluster)
        for node in NODES:
            boots = cluster.root / "reboot" / node / "boots"
            result.boots[node] = int(boots.read_text()) if boots.exists() else 0
        print(f"\nreboot loop timeline (s after the Xid): {json.dumps(result.timeline, indent=1)}")
        print(f"Xid 79 to idle: {result.idle_after_seconds}")
        yield result
    finally:
        nodes.stop()
        agg.stop()
        receiver.close()


def _explain(run: Run, node: str) -> str:
    return f"{node}: timeline {run.timeline.get(node)}; decisions {run.actions(node)}; final {run.final.get(node)}"


def _collapse(states: list[str]) -> list[str]:
    """Slurm states in the order seen, as the loop's steps: drain requested, reboot issued, down
    (reboot complete, waiting for vigil), resuming, idle. ``resuming``: slurmctld answers
    ``State=RESUME`` on a DOWN node with IDLE+NOT_RESPONDING until the node's slurmd answers a ping."""
    steps: list[str] = []
    for state in states:
        flags = set(state.split("+"))
        if "REBOOT_REQUESTED" in flags:
            step = "reboot_requested"
        elif "REBOOT_ISSUED" in flags:
            step = "reboot_issued"
        elif state.startswith("DOWN"):
            step = "down" if "DRAIN" not in flags else "down_drained"
        elif "DRAIN" in flags:
            step = "drained"
        elif flags == {"IDLE", "NOT_RESPONDING"}:
            step = "resuming"
        else:
            step = state.lower()
        if not steps or steps[-1] != step:
            steps.append(step)
    return steps


def test_xid_79_reboots_verifies_and_resumes_the_node_with_no_one_touching_it(run: Run) -> None:
    steps = _collapse(run.states(FIXED))
    # The first state seen may already be the issued reboot: slurmctld issues it within a second.
    assert steps[0] == "idle" and steps[-1] == "idle", _explain(run, FIXED)
    expected = ["reboot_requested", "reboot_issued", "down", "resuming", "idle"]
    # A state shorter than the 0.2 s poll may be missed, but never the reboot and the down state.
    seen = steps[1:]
    assert seen == [s for s in expected if s in seen] and {"reboot_issued", "down"} <= set(seen), _explain(run, FIXED)
    issued = next(s for _, s, _ in run.timeline[FIXED] if "REBOOT_ISSUED" in s)
    assert "DRAIN" in issued and issued.startswith("DOWN"), _explain(run, FIXED)  # out of service at once
    # Slurm kept vigil's reason through the reboot ("... : reboot issued : reboot complete").
    down_reason = next(r for _, s, r in run.timeline[FIXED] if s == "DOWN")
    assert down_reason.startswith("vigil: reboot_node:") and "reboot complete" in down_reason, _explain(run, FIXED)
    assert run.boots[FIXED] == 1
    assert run.nodes[FIXED]["boot_id"] != "" and run.nodes[FIXED]["state"] != "silent"
    assert run.actions(FIXED) == [("reboot_node", "xid"), ("resume", "recovery")], _explain(run, FIXED)
    resume = next(d for d in run.decisions if d["node"] == FIXED and d["action"] == "resume")
    assert resume["evidence"]["new_boot"] is True and resume["evidence"]["gpus"] == GPUS
    delivered = [d for d in run.deliveries.get(resume["id"], []) if d["actuator"] == "slurm"]
    assert delivered and delivered[-1]["state"] == "delivered"
    assert run.final[FIXED][0] == "IDLE"
    assert not [t for t in run.tickets if t["node"] == FIXED]
    assert run.idle_after_seconds is not None
    print(f"Xid 79 -> idle: {run.idle_after_seconds:.1f} s (recovery proof period {PERSISTENCE_SECONDS:.0f} s)")


def test_a_fault_that_survives_the_reboot_goes_to_inspection_with_a_ticket_and_stays_out(run: Run) -> None:
    assert run.boots[SURVIVES] == 1, _explain(run, SURVIVES)
    assert "reboot_issued" in _collapse(run.states(SURVIVES)), _explain(run, SURVIVES)
    actions = run.actions(SURVIVES)
    assert actions[0] == ("reboot_node", "xid") and ("inspect_hardware", "recovery") in actions, \
        _explain(run, SURVIVES)
    assert "resume" not in [a for a, _ in actions], _explain(run, SURVIVES)
    inspect = next(d for d in run.decisions if d["node"] == SURVIVES and d["detector"] == "recovery")
    assert inspect["evidence"]["signal"] == "xid" and "79" in inspect["evidence"]["detail"]
    tickets = [t for t in run.tickets if t["node"] == SURVIVES]
    assert [t["id"] for t in tickets] == [inspect["id"]] and tickets[0]["action"] == "inspect_hardware"
    state, reason = run.final[SURVIVES]
    assert "DRAIN" in state.split("+") and "IDLE" not in state, _explain(run, SURVIVES)
    assert reason.startswith("vigil: inspect_hardware:") and inspect["id"] in reason, _explain(run, SURVIVES)


def test_a_node_whose_gpu_count_drops_after_the_reboot_is_not_resumed(run: Run) -> None:
    assert run.boots[FEWER_GPUS] == 1, _explain(run, FEWER_GPUS)
    actions = run.actions(FEWER_GPUS)
    assert "resume" not in [a for a, _ in actions], _explain(run, FEWER_GPUS)
    # The GPU missing after the reboot sends the node to inspection: the recovery detector's
    # verdict on the returned node, or the silence detector's own gpu_missing finding, whichever
    # is judged first (a missing GPU is no shared component's fault, so the topology pass does not
    # hold it back); either way with the missing GPU as its evidence, and never a resume.
    inspect = next((d for d in run.decisions if d["node"] == FEWER_GPUS and d["action"] == "inspect_hardware"
                    and d["detector"] in ("recovery", "silence")), None)
    assert inspect is not None, _explain(run, FEWER_GPUS)
    assert inspect["evidence"]["signal"] == "gpu_missing", inspect
    assert "IDLE" not in run.final[FEWER_GPUS][0] and "idle" not in _collapse(run.states(FEWER_GPUS))[1:], \
        _explain(run, FEWER_GPUS)
