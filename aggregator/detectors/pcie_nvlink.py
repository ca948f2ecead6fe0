"""PCIe and NVLink detector: replay and link-error rates on a GPU's buses, and NVLinks down.

It reads each GPU's PCIe replay counter and NVLink CRC, replay and recovery counters (as deltas
between reports of one boot) and the list of NVLinks reported down. Sustained error rates above
DCGM's thresholds drain the node; a link down asks for a reboot. A healthy H100 accumulates tens
of PCIe replays between resets, so only rates are judged, never totals. AMD's XGMI links arrive in
the NVLink fields: decisions and keys are the same, reasons say XGMI for an AMD GPU.
"""

from __future__ import annotations

from pydantic import Field

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.fleet import FleetView, GpuHistory, NodeState
from vigil.contract.validation import StrictModel

NAME = "pcie_nvlink"


class PcieNvlinkConfig(StrictModel):
    enabled: bool = True
    window_seconds: float = Field(default=300.0, gt=0)
    # DCGM health watch (DCGM_FR_PCI_REPLAY_RATE): more than 8 PCIe replays per minute.
    # NVSentinel maps it to CONTACT_SUPPORT; we drain and let the gate escalate repeats.
    pcie_replays_per_minute: float = Field(default=8.0, gt=0)
    pcie_action: Action = Action.DRAIN
    # DCGM's NVLink health watch flags CRC flit errors above 100 per second on a link
    # (DCGM_FR_NVLINK_CRC_ERROR_THRESHOLD); replays and recoveries are rarer and judged per minute.
    nvlink_crc_per_second: float = Field(default=100.0, gt=0)
    nvlink_replays_per_minute: float = Field(default=10.0, gt=0)
    nvlink_recoveries_per_minute: float = Field(default=1.0, gt=0)
    nvlink_action: Action = Action.DRAIN
    # DCGM_FR_NVLINK_DOWN -> RESTART_VM (NVSentinel dcgmerrorsmapping.csv).
    link_down_action: Action = Action.REBOOT_NODE
    # The rate must hold over at least this much history before it counts.
    min_coverage_seconds: float = Field(default=30.0, gt=0)


class PcieNvlinkDetector:
    name = NAME

    def __init__(self, config: PcieNvlinkConfig) -> None:
        self.config = config
        cfg = config
        # counter, limit per second, action, label ({link}: the GPU's link, by vendor), display scale and unit
        self._checks = (
            ("pcie_replay_total", cfg.pcie_replays_per_minute / 60.0, cfg.pcie_action, "PCIe replays", 60.0, "min"),
            ("nvlink_crc_errors_total", cfg.nvlink_crc_per_second, cfg.nvlink_action, "{link} CRC errors", 1.0, "s"),
            ("nvlink_replay_errors_total", cfg.nvlink_replays_per_minute / 60.0, cfg.nvlink_action,
             "{link} replays", 60.0, "min"),
            ("nvlink_recovery_errors_total", cfg.nvlink_recoveries_per_minute / 60.0, cfg.nvlink_action,
             "{link} recoveries", 60.0, "min"),
        )
        # The nodes to walk (docs/detectors.md, "change markers"): those whose GPUs' NVLinks down
        # changed (gpu_faults_revision) or whose GPU counters moved since the last pass, and those
        # with a counter moved within the window or a link down when last walked.
        self._walk = ChangedNodes("gpu_faults", "gpu_counters")

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        t0 = now - self.config.window_seconds
        # A node none of whose GPUs had anything to judge when last walked is not visited until
        # its NVLinks down change or a counter moves (the journals); a view without them is walked whole.
        walk = self._walk
        for node in walk.start(view, now):
            flagged = False
            for gpu in node.gpus.values():
                # No counter moved in the window and no link down: nothing to judge (most GPUs).
                if gpu.counters.last_increase_ts >= t0 or gpu.last.nvlink_links_down:
                    flagged = True
                    if gpu.last_seen >= node.last_seen:
                        out.extend(self._judge(node, gpu, now))
            if flagged:
                walk.again(node)
        return out

    def _judge(self, node: NodeState, gpu: GpuHistory, now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        t0 = now - cfg.window_seconds
        link = link_name(gpu)
        # No counter moved in the window: nothing to rate.
        for counter, limit_per_second, action, label, scale, per in (
                self._checks if gpu.counters.last_increase_ts >= t0 else ()):
            covered = gpu.counters.covered_seconds(counter, t0)
            if covered < cfg.min_coverage_seconds:
                continue
            increases = gpu.counters.increases_since(counter, t0)
            errors = sum(d for _, d in increases)
            rate = errors / covered
            if rate <= limit_per_second:
                continue
            out.append(Finding(
                detector=NAME, node=node.name, gpu=gpu.index, action=action, since=increases[0][0], key=counter,
                reason=(f"GPU {gpu.index}: {label.format(link=link)} at {rate * scale:.1f}/{per} "
                        f"(limit {limit_per_second * scale:g}/{per})"),
                evidence={"signal": counter, "uuid": gpu.uuid,
                          **({"link": link} if counter.startswith("nvlink_") else {}),
                          "rate_per_second": round(rate, 4),
                          "limit_per_second": limit_per_second, "errors": errors,
                          "window_seconds": round(covered, 1)}))
        down = gpu.last.nvlink_links_down
        if down:
            since = gpu.last_seen
            for sample in reversed(gpu.samples):
                if not sample.nvlink_links_down:
                    break
                since = sample.ts
            out.append(Finding(
                detector=NAME, node=node.name, gpu=gpu.index, action=cfg.link_down_action, since=since,
                key="nvlink_down", reason=f"GPU {gpu.index}: {link}(s) {', '.join(map(str, down))} down",
                evidence={"signal": "nvlink_links_down", "link": link, "uuid": gpu.uuid, "links_down": list(down),
                          "links_active": gpu.last.nvlink_links_active}))
        return out


# What a GPU's links are called: AMD's XGMI links are reported in the NVLink fields (docs/amd.md), so
# the counters and keys are shared and only the words follow the vendor.
LINK_NAMES = {"nvidia": "NVLink", "amd": "XGMI"}


def link_name(gpu: GpuHistory) -> str:
    """"XGMI" for an AMD GPU, "NVLink" otherwise (an agent from before issue 46 reports no vendor)."""
    return LINK_NAMES.get(gpu.last.vendor or "nvidia", "NVLink")
