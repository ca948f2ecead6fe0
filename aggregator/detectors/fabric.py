"""Fabric detector: GPUs a multi-GPU job cannot use because their NVLink fabric is not registered.

It reads what the fleet marks on ingest: GPUs whose NVML fabric state is not ``completed``, whose
registration failed or whose fabric health is unhealthy (``NodeState.fabric_suspect_gpus``; a GPU
without NVSwitch fabric is never judged), and how long Fabric Manager has been other than active. Past
the boot grace it makes one decision per node (default drain) naming the GPUs not registered, and one
alert per node for unhealthy conditions or Fabric Manager down alone; it does not judge NVLink error
counters or links down (pcie_nvlink) nor NVSwitch SXids (xid). Thresholds, persistence and lookalikes:
docs/detectors.md, "fabric, pcie_link, config_drift".
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from vigil.aggregator.decision import Action, Finding, NodeAction
from vigil.aggregator.fleet import FleetView, NodeState
from vigil.aggregator.fleet.view import MarkedNodes
from vigil.contract.validation import StrictModel

NAME = "fabric"


class FabricConfig(StrictModel):
    """GPUs whose NVLink fabric is not registered with Fabric Manager past the boot grace (NVSwitch systems), and
    Fabric Manager down (docs/detectors.md)."""
    enabled: bool = True
    # A booting node's GPUs are not_started/in_progress until Fabric Manager has trained the
    # NVLinks and registered them (NVIDIA Fabric Manager User Guide: CUDA work waits for the
    # registration; nvmlDeviceGetGpuFabricInfo). FM starts as a systemd unit after the driver loads
    # and registers an HGX baseboard within a minute or two of boot; 300 s since the node booted
    # (its uptime, else its first report of this boot) is beyond that, so a healthy boot is not judged.
    boot_grace_seconds: float = Field(default=300.0, ge=0)
    # A GPU's fabric must be not registered (or in error) for this long in a row (24 reports at
    # 2.5 s): past the boot grace, a Fabric Manager restart re-registers GPUs within seconds.
    persistence_seconds: float = Field(default=60.0, ge=0)
    # A GPU not registered with the fabric cannot take part in a multi-GPU job (CUDA refuses
    # peer access over NVLink): the node is drained; the gate's ladder escalates repeats.
    action: NodeAction = Action.DRAIN
    # Unhealthy fabric conditions (degraded bandwidth, route recovery...) on a registered GPU, and
    # Fabric Manager down on a node whose GPUs keep their registration (they lose it at the next
    # reset or reboot): a person should look; nothing is removed by default.
    degraded_action: NodeAction = Action.ALERT
    # Fabric Manager not active this long before the alert (the rule VigilFabricManagerDown waits 5m).
    fabric_manager_down_seconds: float = Field(default=300.0, ge=0)


class FabricDetector:
    name = NAME

    def __init__(self, config: FabricConfig) -> None:
        self.config = config

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        # Nodes with nothing suspect are passed over in O(1): the fleet keeps both marks on ingest,
        # and the nodes with either (MarkedNodes.fabric), read alone in the fleet's order (a walk
        # of 12,500 nodes testing both: 8 ms a pass, issue 47).
        marked = view.marked if view.revision is not None else None
        for node in view.nodes.values() if marked is None else MarkedNodes.in_order(marked.fabric):
            if not node.fabric_suspect_gpus and node.fabric_manager_down_since is None:
                continue
            finding = self._judge(node, now)
            if finding is not None:
                out.append(finding)
        return out

    def _judge(self, node: NodeState, now: float) -> Finding | None:
        cfg = self.config
        if not node.nvml_available or now - node.booted_at < cfg.boot_grace_seconds:
            return None
        fm = node.host.fabric_manager_state if node.host is not None else None
        fm_down = node.fabric_manager_down_since
        unusable: list[dict[str, Any]] = []
        degraded: list[dict[str, Any]] = []
        for index in sorted(node.fabric_suspect_gpus):
            since = node.fabric_suspect_gpus[index]
            gpu = node.gpus.get(index)
            if gpu is None or gpu.last_seen < node.last_seen or now - since < cfg.persistence_seconds:
                continue  # gone from the latest report (the silence detector's), or not yet persistent
            s = gpu.last
            entry: dict[str, Any] = {"gpu": index, "uuid": gpu.uuid, "state": s.fabric_state, "since": since}
            if s.fabric_status is not None:
                entry["status"] = s.fabric_status
            if s.fabric_health:
                entry["health"] = list(s.fabric_health)
            if s.fabric_state != "completed" or s.fabric_status is not None:
                unusable.append(entry)
            else:
                degraded.append(entry)
        cause = f"Fabric Manager {fm}" if fm_down is not None and fm is not None else None
        evidence: dict[str, Any] = {"signal": "fabric_state", "fabric_manager_state": fm,
                                    "booted_seconds_ago": round(now - node.booted_at, 1)}
        if unusable:
            # The cause first: a scheduler's reason field is short (Slurm's is cut at 200 characters).
            reason = (f"{cause}: " if cause else "") + f"NVLink fabric not usable on {_describe(unusable)}"
            return Finding(detector=NAME, node=node.name, action=cfg.action, key="fabric_unusable",
                           since=min(e["since"] for e in unusable), reason=reason,
                           evidence={**evidence, "gpus": unusable, "degraded": degraded})
        # Fabric Manager down long enough while the GPUs keep their registration (an NVSwitch node:
        # a GPU has a fabric state).
        fm_since = fm_down if cause is not None else None
        if fm_since is not None and (now - fm_since < cfg.fabric_manager_down_seconds
                                     or all(g.last.fabric_state is None for g in node.gpus.values())):
            fm_since = None
        if not degraded and fm_since is None:
            return None
        parts = [f"NVLink fabric unhealthy on {_describe(degraded)}"] if degraded else []
        starts = [e["since"] for e in degraded]
        if fm_since is not None:
            parts.append(f"{cause} for {now - fm_since:.0f} s (the GPUs lose their fabric registration at their "
                         "next reset)")
            starts.append(fm_since)
        since = min(starts)
        return Finding(detector=NAME, node=node.name, action=cfg.degraded_action, key="fabric_degraded", since=since,
                       reason="; ".join(parts), evidence={**evidence, "signal": "fabric_health", "gpus": degraded})


def _describe(entries: list[dict[str, Any]]) -> str:
    """The GPUs grouped by what is wrong: ``GPU 0,1,2 in_progress; GPU 5 completed, status
    NVML_ERROR_...; GPU 2 route_unhealthy``."""
    groups: dict[str, list[str]] = {}
    for entry in entries:
        words = [entry["state"] or "no state"] if "health" not in entry or entry["state"] != "completed" else []
        if "status" in entry:
            words.append(f"status {entry['status']}")
        if "health" in entry:
            words.extend(entry["health"])
        groups.setdefault(", ".join(words), []).append(str(entry["gpu"]))
    return "; ".join(f"GPU {','.join(gpus)} {what}" for what, gpus in groups.items())
