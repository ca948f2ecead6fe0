"""Silence detector: nodes whose reports stop, and GPUs that vanish or lose health in a report.

It reads last-seen times (the aggregator's arrival clock), each boot's set of GPUs and their
reported health. It alerts on a quiet node and drains it if the silence lasts; it drains a node
whose GPU fell off the bus and asks for a reset where NVML says one is required. It does not
guess why a node went quiet (the topology pass groups silent nodes under one rack or switch).
"""

from __future__ import annotations

import math
from heapq import heappop, heappush
from operator import attrgetter

from pydantic import Field

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.fleet import FleetView, NodeState
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
        # GPUs or NVML reachability changed since the last pass (the gpu_health journal) and those
        # with something to find when last walked (each pass); and the calm nodes, in cohorts:
        # those found calm in one pass, due again when the oldest report among them may have
        # reached the least delay (heap of (due, count, cohort)), each node in its latest cohort.
        self._walk = ChangedNodes("gpu_health")
        self._cohorts: list[tuple[float, int, list[NodeState]]] = []
        self._cohort_of: dict[str, list[NodeState]] = {}
        self._cohorts_made = 0

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        # Below both the least alert delay and the drain delay, a node with no missing or unhealthy
        # GPU and NVML reachable has nothing to find (the usual node: a view without markers is
        # walked whole, its unhealthy GPUs are not kept).
        calm = min(cfg.alert_after_seconds_min, cfg.drain_after_seconds) if view.revision is not None else -math.inf
        walk = self._walk
        nodes = walk.start(view, now)
        cohorts, cohort_of = self._cohorts, self._cohort_of
        calm_now: list[NodeState] = []  # found calm in this pass: the next cohort
        oldest = math.inf  # the oldest report among them
        if walk.every:
            cohorts.clear()
            cohort_of.clear()
        else:
            for name in walk.gone:
                cohort_of.pop(name, None)
            # A due cohort's nodes still calm (most: they reported since) join the next cohort
            # unwalked; the others are walked with the journals' nodes, in the fleet's order.
            walked = {node.name: node for node in nodes}
            while cohorts and cohorts[0][0] <= now:
                members = heappop(cohorts)[2]
                for node in members:
                    name = node.name
                    if cohort_of.get(name) is not members or name in walked:
                        continue  # in a newer cohort, gone (let go above), or walked anyway
                    seen = node.last_seen
                    if (now - seen < calm and not node.missing_gpus and not node.unhealthy_gpus
                            and node.nvml_down_since is None):
                        calm_now.append(node)
                        if seen < oldest:
                            oldest = seen
                    else:
                        walked[name] = node
            if len(walked) > len(nodes):
                nodes = sorted(walked.values(), key=_POSITION)
        for node in nodes:
            quiet = now - node.last_seen
            if quiet < calm and not node.missing_gpus and not node.unhealthy_gpus and node.nvml_down_since is None:
                calm_now.append(node)
                oldest = min(oldest, node.last_seen)
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
        if calm_now and calm > -math.inf:
            # Due a millisecond and a thousandth of the delay early: one due a little early is found
            # calm again, one due late would miss a pass.
            due = oldest + calm * 0.999 - 1e-3
            self._cohorts_made += 1
            heappush(cohorts, (due, self._cohorts_made, calm_now))
            for node in calm_now:
                cohort_of[node.name] = calm_now
        return out
