"""Detectors: one module per judgement, listed in an explicit table.

Each detector is built from its own config section and exposes ``name`` and a pure
``evaluate(view, now) -> list[Finding]``. The topology attributor runs after them over their
findings (it is not in ``REGISTRY``: it judges findings, not the fleet).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from aggregator.decision import Finding
from aggregator.detectors.gpu_peer import GpuPeerDetector
from aggregator.detectors.hang import HangDetector
from aggregator.detectors.memory import MemoryDetector
from aggregator.detectors.network import NetworkDetector
from aggregator.detectors.pcie_nvlink import PcieNvlinkDetector
from aggregator.detectors.recovery import RecoveryDetector
from aggregator.detectors.silence import SilenceDetector
from aggregator.detectors.straggler import StragglerDetector
from aggregator.detectors.thermal import ThermalDetector
from aggregator.detectors.xid import XidDetector
from aggregator.fleet import FleetView


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
    "hang": HangDetector,
    "silence": SilenceDetector,
    "gpu_peer": GpuPeerDetector,
    "recovery": RecoveryDetector,
}
