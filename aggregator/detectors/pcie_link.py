"""PCIe link detector: links trained below their maximum, and AER errors, on GPUs and HCAs.

It reads each GPU's NVML link against its maximum with the GPU's utilization (``GpuHistory.link_below``)
and each PCIe device of the node's ``pcie`` section (an HCA's sysfs link, GPU and HCA AER counters). A
link held below its maximum (a GPU's only while it is loaded, since NVIDIA GPUs downtrain at idle) or an
uncorrectable AER increase drains, a correctable AER rate over DCGM's replay threshold alerts; it does
not judge PCIe replays (pcie_nvlink) or Xids (xid). Thresholds, persistence and lookalikes:
docs/detectors.md, "fabric, pcie_link, config_drift".
"""

from __future__ import annotations

from pydantic import Field

from vigil.aggregator.decision import Action, Finding, NodeAction
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.fleet import FleetView, GpuHistory, NodeState, PcieHistory, normal_bus_id
from vigil.contract.validation import StrictModel

NAME = "pcie_link"


class PcieLinkConfig(StrictModel):
    """PCIe links trained below their maximum (a GPU's judged only under load) and AER errors on GPUs and HCAs
    (docs/detectors.md)."""
    enabled: bool = True
    # A GPU's link is judged only while every report of the persistence window has the GPU at or
    # above this utilization: at idle the driver drops the link to Gen1 to save power and raises
    # it under load (nvidia-smi -q: "PCIe Generation Current ... may be lower than Max when the
    # GPU is idle"); a training job keeps its GPUs at 0.9 and above, a loaded GPU far above 0.5.
    load_min_ratio: float = Field(default=0.5, gt=0, le=1)
    # A GPU link below its maximum under load this long in a row (48 reports at 2.5 s): a retrain
    # after a correctable-error burst recovers within a report or two (a flicker does not act).
    gpu_persistence_seconds: float = Field(default=120.0, gt=0)
    # Gen5 x8 halves the GPU's host bandwidth (checkpoint and data loading, NCCL's PCIe paths):
    # the node is drained (a link that trained down stays down until the slot is reseated).
    gpu_action: NodeAction = Action.DRAIN
    # An HCA's link below its maximum: no load signal to tell power saving from a fault, but
    # ConnectX links stay trained at idle (no link-speed power saving in mlx5), so only a longer
    # persistence guards against a retrain in progress.
    hca_persistence_seconds: float = Field(default=300.0, gt=0)
    hca_action: NodeAction = Action.DRAIN
    # Uncorrectable (nonfatal or fatal) AER errors on a GPU or HCA within this window: the link
    # lost a transaction (data may be lost; Linux's AER recovery resets the device).
    window_seconds: float = Field(default=600.0, gt=0)
    uncorrectable_action: NodeAction = Action.DRAIN
    # Correctable AER errors above this rate: DCGM's PCIe replay threshold (DCGM_FR_PCI_REPLAY_RATE,
    # 8 per minute), the same physical event seen from the OS (each replay follows a correctable
    # LCRC error). Alert: the link still delivers everything.
    correctable_per_minute: float = Field(default=8.0, gt=0)
    correctable_action: NodeAction = Action.ALERT
    # The correctable rate must hold over at least this much baseline before it counts.
    min_coverage_seconds: float = Field(default=60.0, gt=0)


def describe_link(generation: int | None, generation_max: int | None, width: int | None,
                  width_max: int | None) -> str:
    """``PCIe Gen5 x8 of x16``, ``PCIe Gen3 of Gen5 x16``, ``PCIe Gen3 x8 of Gen5 x16``."""
    if generation == generation_max:
        return f"PCIe Gen{generation} x{width} of x{width_max}"
    if width == width_max:
        return f"PCIe Gen{generation} of Gen{generation_max} x{width_max}"
    return f"PCIe Gen{generation} x{width} of Gen{generation_max} x{width_max}"


class PcieLinkDetector:
    name = NAME

    def __init__(self, config: PcieLinkConfig) -> None:
        self.config = config
        # The nodes to walk (docs/detectors.md, "change markers"): those whose links below their
        # maximum changed or whose AER counters rose since the last pass (the pcie_links journal),
        # and those with a link below or an AER rise within the window when last walked.
        self._walk = ChangedNodes("pcie_links")

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        t0 = now - self.config.window_seconds
        # A node with every link at its maximum and no AER counter moved within the window has
        # nothing to judge (the fleet's marks, kept on ingest): not visited until they change.
        walk = self._walk
        for node in walk.start(view, now):
            if node.gpu_links_below or node.pcie_links_below or node.pcie_aer_moved_ts >= t0:
                out.extend(self._judge(node, now))
                walk.again(node)
        return out

    def _judge(self, node: NodeState, now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        for index in sorted(node.gpu_links_below):
            gpu = node.gpus.get(index)
            if gpu is not None and gpu.link_below is not None and gpu.last_seen >= node.last_seen:
                finding = self._gpu_link(node, gpu, now)
                if finding is not None:
                    out.append(finding)
        for bus_id in sorted(node.pcie_links_below):
            device = node.pcie.get(bus_id)
            if device is None or device.link_below_since is None or device.last.kind != "hca" \
                    or now - device.link_below_since < cfg.hca_persistence_seconds:
                continue
            d = device.last
            link = describe_link(d.link_generation, d.link_generation_max, d.link_width, d.link_width_max)
            out.append(Finding(
                detector=NAME, node=node.name, action=cfg.hca_action, since=device.link_below_since,
                key=f"link:{bus_id}", reason=f"HCA {_name(device)}: {link}",
                evidence={"signal": "pcie_link", "pci_bus_id": bus_id, "kind": d.kind, "device": d.name,
                          "generation": d.link_generation, "generation_max": d.link_generation_max,
                          "width": d.link_width, "width_max": d.link_width_max,
                          "below_seconds": round(now - device.link_below_since, 1)}))
        t0 = now - cfg.window_seconds
        if node.pcie_aer_moved_ts < t0:
            return out  # the usual node: no AER counter rose within the window
        gpus_by_bus = {normal_bus_id(g.last.pci_bus_id): g for g in node.gpus.values() if g.last.pci_bus_id}
        for bus_id in sorted(node.pcie):
            device = node.pcie[bus_id]
            if device.counters.last_increase_ts >= t0:
                gpu = gpus_by_bus.get(bus_id) if device.last.kind == "gpu" else None
                out.extend(self._aer(node, device, gpu, now))
        return out

    def _gpu_link(self, node: NodeState, gpu: GpuHistory, now: float) -> Finding | None:
        cfg = self.config
        run = gpu.link_below
        loaded = run.loaded_since(cfg.load_min_ratio) if run is not None else None
        if loaded is None or now - loaded < cfg.gpu_persistence_seconds:
            return None  # idle (power saving) or not yet persistent under load
        s = gpu.last
        link = describe_link(s.pcie_link_generation, s.pcie_link_generation_max, s.pcie_link_width,
                             s.pcie_link_width_max)
        return Finding(
            detector=NAME, node=node.name, gpu=gpu.index, action=cfg.gpu_action, since=loaded, key="gpu_link",
            reason=f"GPU {gpu.index} {link} under load for {now - loaded:.0f} s",
            evidence={"signal": "pcie_link", "uuid": gpu.uuid, "pci_bus_id": s.pci_bus_id,
                      "generation": s.pcie_link_generation, "generation_max": s.pcie_link_generation_max,
                      "width": s.pcie_link_width, "width_max": s.pcie_link_width_max,
                      "loaded_seconds": round(now - loaded, 1), "load_min_ratio": cfg.load_min_ratio})

    def _aer(self, node: NodeState, device: PcieHistory, gpu: GpuHistory | None, now: float) -> list[Finding]:
        cfg = self.config
        t0 = now - cfg.window_seconds
        counters = device.counters
        subject = f"GPU {gpu.index}" if gpu is not None else f"{device.last.kind.upper()} {_name(device)}"
        out: list[Finding] = []
        base = {"pci_bus_id": device.bus_id, "kind": device.last.kind, "device": device.last.name}
        if gpu is not None:
            base["uuid"] = gpu.uuid
        rises = sorted(counters.increases_since("aer_nonfatal_total", t0) + counters.increases_since(
            "aer_fatal_total", t0))
        if rises:
            fatal = counters.sum_since("aer_fatal_total", t0)
            nonfatal = counters.sum_since("aer_nonfatal_total", t0)
            out.append(Finding(
                detector=NAME, node=node.name, gpu=gpu.index if gpu is not None else None,
                action=cfg.uncorrectable_action, since=rises[0][0], latest=rises[-1][0],
                key=f"aer_uncorrectable:{device.bus_id}",
                reason=f"{subject}: {nonfatal:.0f} nonfatal, {fatal:.0f} fatal uncorrectable PCIe (AER) errors",
                evidence={**base, "signal": "aer_uncorrectable", "nonfatal": nonfatal, "fatal": fatal,
                          "window_seconds": cfg.window_seconds}))
        start = counters.baseline_since("aer_correctable_total")
        covered = now - max(t0, start) if start is not None else 0.0
        correctable = counters.increases_since("aer_correctable_total", t0)
        if correctable and covered >= cfg.min_coverage_seconds:
            errors = sum(d for _, d in correctable)
            limit = cfg.correctable_per_minute / 60.0
            if errors / covered > limit:
                out.append(Finding(
                    detector=NAME, node=node.name, gpu=gpu.index if gpu is not None else None,
                    action=cfg.correctable_action, since=correctable[0][0], key=f"aer_correctable:{device.bus_id}",
                    reason=(f"{subject}: correctable PCIe (AER) errors at {errors / covered * 60:.1f}/min "
                            f"(limit {cfg.correctable_per_minute:g}/min)"),
                    evidence={**base, "signal": "aer_correctable", "errors": errors,
                              "rate_per_second": round(errors / covered, 4), "window_seconds": round(covered, 1)}))
        return out


def _name(device: PcieHistory) -> str:
    return f"{device.last.name} ({device.bus_id})" if device.last.name else device.bus_id
