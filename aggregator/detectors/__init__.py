"""Detectors: one module per judgement, listed in an explicit table.

Each detector is built from its own config section and exposes ``name`` and a pure
``evaluate(view, now) -> list[Finding]``. The topology attributor runs after them over their
findings (it is not in ``REGISTRY``: it judges findings, not the fleet).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from vigil.aggregator.decision import Finding
from vigil.aggregator.detectors.app_signals import AppSignalsDetector
from vigil.aggregator.detectors.collective_culprit import CollectiveCulpritDetector
from vigil.aggregator.detectors.config_drift import ConfigDriftDetector
from vigil.aggregator.detectors.crash_loop import CrashLoopDetector
from vigil.aggregator.detectors.fabric import FabricDetector
from vigil.aggregator.detectors.gpu_peer import GpuPeerDetector
from vigil.aggregator.detectors.gpu_straggler import GpuStragglerDetector
from vigil.aggregator.detectors.hang import HangDetector
from vigil.aggregator.detectors.memory import MemoryDetector
from vigil.aggregator.detectors.network import NetworkDetector
from vigil.aggregator.detectors.pcie_link import PcieLinkDetector
from vigil.aggregator.detectors.pcie_nvlink import PcieNvlinkDetector
from vigil.aggregator.detectors.probe_verdict import ProbeVerdictDetector
from vigil.aggregator.detectors.recovery import RecoveryDetector
from vigil.aggregator.detectors.silence import SilenceDetector
from vigil.aggregator.detectors.straggler import StragglerDetector
from vigil.aggregator.detectors.telemetry_hang import TelemetryHangDetector
from vigil.aggregator.detectors.telemetry_straggler import TelemetryStragglerDetector
from vigil.aggregator.detectors.thermal import ThermalDetector
from vigil.aggregator.detectors.xid import XidDetector
from vigil.aggregator.fleet import FleetView


class Detector(Protocol):
    name: str

    def evaluate(self, view: FleetView, now: float) -> list[Finding]: ...


# config section name (under `detectors:`) -> detector class taking that section
REGISTRY: dict[str, Callable[[Any], Detector]] = {
    "xid": XidDetector,
    "memory": MemoryDetector,
    "thermal": ThermalDetector,
    "pcie_nvlink": PcieNvlinkDetector,
    "network": NetworkDetector,
    "straggler": StragglerDetector,
    "gpu_straggler": GpuStragglerDetector,
    "hang": HangDetector,
    "silence": SilenceDetector,
    "gpu_peer": GpuPeerDetector,
    "recovery": RecoveryDetector,
    "probe_verdict": ProbeVerdictDetector,
    "crash_loop": CrashLoopDetector,
    "app_signals": AppSignalsDetector,
    "telemetry_hang": TelemetryHangDetector,
    "telemetry_straggler": TelemetryStragglerDetector,
    "collective_culprit": CollectiveCulpritDetector,
    "fabric": FabricDetector,
    "pcie_link": PcieLinkDetector,
    "config_drift": ConfigDriftDetector,
}
