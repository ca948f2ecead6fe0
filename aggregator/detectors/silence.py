"""Silence detector: nodes whose reports stop, and GPUs that vanish or lose health in a report.

It reads last-seen times (the aggregator's arrival clock), each boot's set of GPUs and their
reported health. It alerts on a quiet node and drains it if the silence lasts; it drains a node
whose GPU fell off the bus and asks for a reset where NVML says one is required. It does not
guess why a node went quiet (the topology pass groups silent nodes under one rack or switch).
"""

from __future__ import annotations

import math
from operator import attrgetter

from pydantic import Field

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.fleet import FleetView
from vigil.contract.validation import StrictModel

NAME = "silence"
_POSITION = attrgetter("position")


class SilenceConfig(StrictModel):
    enabled: bool = True
    # Six missed reports (15 s at the agent's default 2.5 s) before anyone is paged: one or two
    # lost POSTs during an aggregator restart or a network blip are normal.
    alert_after_intervals: float = Field(default=6.0, gt=0)
    alert_after_seconds_min: float = Field(default=15.0, ge=0)
    # Two minutes of silence: the node is dead or cut off, and a job scheduled there would hang.
    drain_after_seconds: float = Field(default=120.0, gt=0)
    # A GPU that left the reports of this boot without a log line (Xid 79's silent cousin):
    # NVIDIA's Xid guide asks for a node reboot after a GPU falls off the bus, so it gets drained.
    gpu_missing_action: Action = Action.DRAIN
    gpu_lost_action: Action = Action.DRAIN
    # NVML's "GPU requires reset" (NVML_ERROR_RESET_REQUIRED); NVSentinel maps it to COMPONENT_RESET.
    gpu_reset_required_action: Action = Action.RESET_GPU
    nvml_unavailable_after_seconds: float = Field(default=30.0, ge=0)


class SilenceDetector:
    name = NAME

    def __init__(self, config: SilenceConfig) -> None:
        self.config = config
        # The nodes to walk (docs/detectors.md, "change markers"): those whose missing or unhealthy
        # GPUs or NVML reachability changed since the last pass (the gpu_health journal), those
        # with something to find when last walked (each pass), and those whose last report may be
        # at least the least delay old (found in the fleet's ReportTimes, a C-level ``min``: a
        # replayed report moves last_seen, not the time kept there, so they are a few more).
        self._walk = ChangedNodes("gpu_health")

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        # Below both the least alert delay and the drain delay, a node with no missing or unhealthy
        # GPU and NVML reachable has nothing to find (the usual node: a view without markers is
        # walked whole, its unhealthy GPUs are not kept).
        calm = min(cfg.alert_after_seconds_min, cfg.drain_after_seconds) if view.revision is not None else -math.inf
        walk = self._walk
        nodes = walk.start(view, now)
        times = view.report_times
        if not walk.every and times is not None:
            # The nodes whose last report may be that old (a millisecond and a thousandth of the
            # delay younger too: rounding may not hide one), with the journals' nodes, in the
            # fleet's order; a healthy fleet has none (the ``min``, ~0.2 ms at 12,500 nodes).
            old = now - calm * 0.999 + 1e-3
            if min(times.times, default=math.inf) <= old:
                walked = {node.name: node for node in nodes}
                slots = times.nodes
                for slot in [i for i, seen in enumerate(times.times) if seen <= old]:
                    node = slots[slot]
                    if node is not None:
                        walked[node.name] = node
                nodes = sorted(walked.values(), key=_POSITION)
        for node in nodes:
            quiet = now - node.last_seen
            if quiet < calm and not node.missing_gpus and not node.unhealthy_gpus and node.nvml_down_since is None:
                continue
            walk.again(node)
            alert_after = max(cfg.alert_after_seconds_min, cfg.alert_after_intervals * node.interval_seconds)
            if quiet >= cfg.drain_after_seconds:
                out.append(Finding(
                    detector=NAME, node=node.name, action=Action.DRAIN, since=node.last_seen, key="silent",
                    reason=f"no report for {quiet:.0f} s (drain after {cfg.drain_after_seconds:.0f} s)",
                    evidence={"signal": "report_silence", "silent_seconds": round(quiet, 1),
                              "last_seen": node.last_seen, "last_seq": node.seq}))
            elif quiet >= alert_after:
                out.append(Finding(
                    detector=NAME, node=node.name, action=Action.ALERT, since=node.last_seen, key="silent",
                    reason=f"no report for {quiet:.0f} s (expected every {node.interval_seconds:g} s)",
                    evidence={"signal": "report_silence", "silent_seconds": round(quiet, 1),
                              "last_seen": node.last_seen, "last_seq": node.seq}))
            if quiet >= alert_after:
                continue  # stale GPU state says nothing about the present
            for index, since in sorted(node.missing_gpus.items()):
                uuid = node.gpus[index].uuid if index in node.gpus else None
                out.append(Finding(
                    detector=NAME, node=node.name, gpu=index, action=cfg.gpu_missing_action, since=since,
                    key="gpu_missing",
                    reason=f"GPU {index} disappeared from the node's reports (fell off the bus?)",
                    evidence={"signal": "gpu_missing", "uuid": uuid, "missing_since": since}))
            # The fleet keeps the GPUs whose health is not "ok" (a view without markers: all of them).
            unhealthy = node.gpus if view.revision is None else node.unhealthy_gpus
            for index in sorted(unhealthy):
                gpu = node.gpus[index]
                if index in node.missing_gpus or gpu.last_seen < node.last_seen:
                    continue
                health = gpu.last.health
                if health in ("lost", "reset_required"):
                    since = gpu.last_seen
                    for sample in reversed(gpu.samples):
                        if sample.health != health:
                            break
                        since = sample.ts
                    action = cfg.gpu_lost_action if health == "lost" else cfg.gpu_reset_required_action
                    out.append(Finding(
                        detector=NAME, node=node.name, gpu=index, action=action, since=since,
                        key=f"gpu_{health}", reason=f"GPU {index} health is {health!r}",
                        evidence={"signal": "gpu_health", "health": health, "uuid": gpu.uuid}))
            if node.nvml_down_since is not None and now - node.nvml_down_since >= cfg.nvml_unavailable_after_seconds:
                out.append(Finding(
                    detector=NAME, node=node.name, action=Action.ALERT, since=node.nvml_down_since,
                    key="nvml_unavailable",
                    reason="the agent cannot reach NVML: no GPU state from this node",
                    evidence={"signal": "nvml_unavailable", "since": node.nvml_down_since}))
        return out
