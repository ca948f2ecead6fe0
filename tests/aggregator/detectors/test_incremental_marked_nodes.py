"""The detectors that read only the nodes the fleet marks on ingest (MarkedNodes: xid, amdgpu,
collective_culprit, fabric), the nodes config_drift lists again only when a configuration changed,
and telemetry_straggler's jobs with no ranks found from the fleet's job listing (JobNodes) find
exactly what the long way finds, every evaluation, over a randomized evolving fleet: recovery
actions appearing and clearing (in compact entries and whole ones), Xids with and without a GPU,
a job-wide application Xid, amdgpu events leaving the window, Flight Recorder dumps with a culprit,
GPUs whose fabric is not registered, Fabric Manager down, a mixed and a drifted configuration, a
node short of the manifest, jobs that lose or never had ranks, a reboot, replayed and lost reports,
and a node that leaves and comes back.

The long way: a twin of each detector judging ``view.without_markers()`` (every node, every GPU)."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from tests.aggregator.conftest import FakeNode, rank_summary
from tests.aggregator.detectors.test_incremental_gpu_side import compact
from vigil.aggregator.detectors.amdgpu import AmdgpuConfig, AmdgpuDetector
from vigil.aggregator.detectors.collective_culprit import CollectiveCulpritConfig, CollectiveCulpritDetector
from vigil.aggregator.detectors.config_drift import ConfigDriftConfig, ConfigDriftDetector, ManifestClass
from vigil.aggregator.detectors.fabric import FabricConfig, FabricDetector
from vigil.aggregator.detectors.telemetry_straggler import TelemetryStragglerConfig, TelemetryStragglerDetector
from vigil.aggregator.detectors.xid import XidConfig, XidDetector
from vigil.aggregator.fleet import Fleet, FleetConfig
from vigil.contract.wire import CollectiveState, Event, Report

NODES = 12
RECOVERY = (None, "none", "none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")
XIDS = (13, 31, 43, 48, 63, 79, 94, 13, 13)
AMDGPU = ("ras_uncorrectable", "ras_fatal", "poison_consumed", "ring_timeout", "ring_timeout", "ras_correctable",
          "gpu_reset_succeeded")


def detectors() -> list[Any]:
    return [
        XidDetector(XidConfig(window_seconds=300.0)),
        AmdgpuDetector(AmdgpuConfig(window_seconds=200.0)),
        CollectiveCulpritDetector(CollectiveCulpritConfig()),
        FabricDetector(FabricConfig(boot_grace_seconds=0.0, persistence_seconds=10.0,
                                    fabric_manager_down_seconds=20.0)),
        ConfigDriftDetector(ConfigDriftConfig(persistence_seconds=10.0, manifest_persistence_seconds=0.0)),
        ConfigDriftDetector(ConfigDriftConfig(persistence_seconds=10.0, manifest={
            "NVIDIA H100": ManifestClass(gpu_count=8, gpu_pcie_generation=5)})),
        TelemetryStragglerDetector(TelemetryStragglerConfig(persistence_seconds=30.0, min_samples=3)),
    ]


def fleet_nodes() -> list[FakeNode]:
    nodes = [FakeNode(f"n{i}", ports=1) for i in range(NODES)]
    for node in nodes:
        node.config = {"driver_version": "550.54", "kernel": "5.15", "gpu_model": "NVIDIA H100", "gpu_count": 8}
        node.host = {"uptime_seconds": 1000.0, "fabric_manager_state": "active"}
        for g in node.gpus.values():
            g["fabric_state"] = "completed"
    return nodes


def state_at(rng: random.Random, nodes: list[FakeNode], t: float, plan: dict[str, float]) -> None:
    """The fleet's state at ``t``: each node's GPUs' jobs and readings, and the faults from their start."""
    for i, node in enumerate(nodes):
        for g in node.gpus.values():
            # Job a (nodes 0-3) sends heartbeats until plan["ranks_stop"]; c (4-7) never does; u
            # (8-11) is attributed from plan["u"] on.
            g["job"] = "a" if i < 4 else "c" if i < 8 else "u" if t >= plan["u"] else None
            g["utilization_gpu_ratio"] = 0.95 + rng.uniform(-0.01, 0.01)
        node.ranks = [rank_summary("a", i * 8 + local, ts=t, gpu=local, step=int(t), comm=0.3, compute=1.0)
                      for local in range(8)] if i < 4 and t < plan["ranks_stop"] else []
    if t >= plan["slow"]:  # one node of u starved: its GPUs idle while its peers wait
        for g in nodes[11].gpus.values():
            g["utilization_gpu_ratio"] = 0.55
    # The driver asking for recovery actions, appearing and clearing at random.
    if rng.random() < 0.15:
        gpu = nodes[rng.randrange(NODES)].gpus[rng.randrange(8)]
        gpu["recovery_action"] = rng.choice(RECOVERY)
    # Fabric: a GPU not registered for a while, one whose fabric is unhealthy, Fabric Manager down.
    nodes[5].gpus[3]["fabric_state"] = "in_progress" if plan["fabric"] <= t < plan["fabric"] + 100 else "completed"
    nodes[9].gpus[1]["fabric_health"] = ["route_unhealthy"] if t >= plan["fabric_health"] else []
    nodes[6].host = {"uptime_seconds": 1000.0 + t,
                     "fabric_manager_state": "failed" if t >= plan["fm"] else "active"}
    # Configuration: a node drifted, a node whose devices differ (then fixed), one short of the manifest.
    nodes[1].config = {**nodes[1].config, "driver_version": "535.1" if t >= plan["drift"] else "550.54"}
    nodes[9].config = {**nodes[9].config, "mixed": ["vbios_version"] if plan["mixed"] <= t < plan["mixed"] + 150
                       else []}
    nodes[10].config = {**nodes[10].config, "gpu_count": 7 if t >= plan["short"] else 8}
    # A GPU whose link maximum reads below the manifest's for a while (a compact entry carries only it).
    nodes[3].gpus[2]["pcie_link_generation_max"] = 4 if plan["link"] <= t < plan["link"] + 100 else 5


def events_at(rng: random.Random, node: FakeNode, i: int, t: float, plan: dict[str, float]) -> list[Event]:
    events: list[Event] = []
    if rng.random() < 0.03:
        gpu = rng.choice([*range(8), None])
        bus = node.gpus[rng.randrange(8)]["pci_bus_id"] if gpu is None and rng.random() < 0.5 else None
        events.append(Event(kind="xid", ts=t, code=rng.choice(XIDS), gpu=gpu, pci_bus_id=bus, source="kmsg"))
    if i < 4 and any(abs(t - plan["app_xid"] - k) < 1.3 for k in (0, 90, 180)):
        # A job-wide crash, three times: Xid 13 on every GPU of job a at once (the job's, not a GPU's).
        events += [Event(kind="xid", ts=t, code=13, gpu=g, source="kmsg") for g in range(8)]
    if i in (2, 7) and rng.random() < 0.03:
        gpu = rng.choice([*range(8), None])
        bus = node.gpus[rng.randrange(8)]["pci_bus_id"] if gpu is None and rng.random() < 0.5 else None
        events.append(Event(kind="amdgpu_" + rng.choice(AMDGPU), ts=t, code=rng.choice([0, 2, None]), gpu=gpu,
                            pci_bus_id=bus))
    if rng.random() < 0.02:
        events.append(Event(kind="link_down", ts=t, device="mlx5_0", port=1))
    return events


def collectives_at(i: int, t: float, plan: dict[str, float]) -> list[CollectiveState]:
    """Job a's Flight Recorder dumps while it hangs: node 2's ranks never entered collective 10."""
    if i >= 4 or not plan["hang"] <= t < plan["hang"] + 60:
        return []
    entered = 9 if i == 2 else 10
    return [CollectiveState(job="a", rank=i * 8 + local, group="0", group_size=32, last_entered_seq=entered,
                            last_completed_seq=9, op="allreduce", dump_ts=plan["hang"]) for local in range(8)]


def summary(findings: list[Any]) -> set[str]:
    return {f"{f.detector}:{f.key.split(':')[0]}:{f.action.value}" for f in findings}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_marked_nodes_find_what_every_node_finds_every_pass(seed: int) -> None:
    rng = random.Random(seed)
    nodes = fleet_nodes()
    plan = {name: rng.uniform(40, 400) for name in
            ("u", "slow", "ranks_stop", "fabric", "fabric_health", "fm", "drift", "mixed", "short", "app_xid",
             "hang", "link")}
    plan["slow"] = max(plan["slow"], plan["u"])
    plan["ranks_stop"] = max(plan["ranks_stop"], plan["drift"] + 60, plan["app_xid"] + 200, plan["hang"] + 60)
    fleet = Fleet(FleetConfig(job_forget_seconds=60.0))
    short, long = detectors(), detectors()
    found: set[str] = set()
    sent: dict[str, list[Report]] = {}
    held: dict[str, Report] = {}
    gone_at = rng.uniform(200, 500)
    t = 0.0
    while t < 800:
        state_at(rng, nodes, t, plan)
        for i, node in enumerate(nodes):
            if node.name == "n0" and gone_at <= t < gone_at + 40:
                continue  # silent: forgotten below, then a new node of the same name
            if rng.random() < 0.04:
                continue  # a lost report
            if node.name == "n6" and abs(t - 450) < 1.0:
                node.reboot()
            report = msgspec.structs.replace(node.report(t, events=events_at(rng, node, i, t, plan)),
                                             collectives=collectives_at(i, t, plan))
            arrival = t + rng.uniform(0, 0.5)
            taken = report
            if rng.random() < 0.8:  # compact as the agent sends it, with its events (``whole`` leaves them out)
                taken = msgspec.structs.replace(compact(fleet, held.get(node.name), report, arrival),
                                                events=report.events)
            fleet.ingest(taken, arrival)
            held[node.name] = report
            sent.setdefault(node.name, []).append(report)
            if rng.random() < 0.02 and len(sent[node.name]) > 3:
                fleet.ingest(sent[node.name][-3], t + 0.6)  # replayed: moves last_seen alone (its events dedup)
        fleet.forget_departed(t + 1.0, lambda n: 20.0)
        fleet.forget_idle_jobs(t + 1.0)
        t += 2.5
        if rng.random() < 0.2:
            continue  # no pass this time
        now = t - 2.5 + rng.choice([0.7, 1.0, 2.0])
        view = fleet.view()
        long_view = view.without_markers()
        for a, b in zip(short, long, strict=True):
            got = a.evaluate(view, now)
            assert got == b.evaluate(long_view, now), (a.name, t)
            found |= summary(got)
    missing = {"xid:recovery:reset_gpu", "xid:recovery:reboot_node", "xid:recovery:drain", "xid:xid:reset_gpu",
            "xid:xid:alert", "amdgpu:amdgpu:reset_gpu", "collective_culprit:hang:drain", "fabric:fabric_unusable:drain",
            "fabric:fabric_degraded:alert", "config_drift:config_drift:alert", "config_drift:config_mixed:alert",
            "config_drift:manifest:drain", "telemetry_straggler:telemetry_straggler:alert"} - found
    assert not missing, (missing, sorted(found))


def test_a_recovery_action_cleared_in_a_compact_entry_unmarks_its_node() -> None:
    """The marks follow each GPU's latest state: set whole, cleared compact, a node forgotten."""
    fleet, node = Fleet(), FakeNode("n1", ports=0)
    base = node.report(0.0)
    fleet.ingest(base, 0.0)
    node.gpus[3]["recovery_action"] = "gpu_reset"
    node.gpus[5]["recovery_action"] = "drain_p2p"
    sent = node.report(2.5)
    fleet.ingest(compact(fleet, base, sent, 2.5), 2.5)
    state = fleet.view().nodes["n1"]
    assert state.recovery_gpus == {3, 5} and fleet.marked.recovery_actions == {state}
    node.gpus[3]["recovery_action"] = "none"
    node.gpus[5]["recovery_action"] = None
    again = node.report(5.0)
    fleet.ingest(compact(fleet, sent, again, 5.0), 5.0)
    assert not state.recovery_gpus and not fleet.marked.recovery_actions
    fleet.ingest(node.report(7.5, events=[Event(kind="xid", ts=7.5, code=79, gpu=1),
                                          Event(kind="amdgpu_ras_fatal", ts=7.0)]), 7.5)
    assert fleet.marked.xids == fleet.marked.amdgpu_events == {state}
    assert (state.xid_event_ts, state.amdgpu_event_ts) == (7.5, 7.0)
    fleet.forget_departed(100.0, lambda n: 10.0)
    assert not fleet.marked.xids and not fleet.marked.amdgpu_events
