"""Detectors: one module per judgement, listed in an explicit table.

Each detector class is built from its config section (the model its constructor's ``config``
takes; that model's docstring is the section's description) and exposes ``name`` and a pure
``evaluate(view, now) -> list[Finding]``; the ``detectors:`` config section is derived from this
table, so a detector is its module, one line here and its test. The topology attributor runs
after them over their findings (not in ``REGISTRY``: it judges findings, not the fleet; its
section follows theirs). A shadow rule (``ShadowRule``) is a second instance of a registry entry
built from its section with overrides; the engine records its findings, never acts on them.
"""

from __future__ import annotations

from typing import Any, Protocol, get_type_hints

from pydantic import Field, ValidationError

from vigil.aggregator.decision import Finding
from vigil.aggregator.detectors.amdgpu import AmdgpuDetector
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
from vigil.aggregator.detectors.topology import TopologyAttributor
from vigil.aggregator.detectors.xid import XidDetector
from vigil.aggregator.fleet import FleetView
from vigil.contract.validation import StrictModel, format_validation_error


class Detector(Protocol):
    name: str

    def evaluate(self, view: FleetView, now: float) -> list[Finding]: ...


class DetectorSection(Protocol):
    """What every section under ``detectors:`` has."""

    @property
    def enabled(self) -> bool: ...


class DetectorClass(Protocol):
    def __call__(self, config: Any) -> Detector: ...


# config section name (under `detectors:`) -> detector class taking that section
REGISTRY: dict[str, DetectorClass] = {
    "xid": XidDetector,
    "amdgpu": AmdgpuDetector,
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


# Sections that configure what runs after the detectors, under `detectors:` after theirs.
AFTER_DETECTORS: dict[str, object] = {"topology": TopologyAttributor}


def config_model(cls: object) -> type[StrictModel]:
    """The model of the section the class ``cls`` is built from: the type of its constructor's
    ``config`` (a class without one, or with another type there, is no registry entry: TypeError)."""
    init = getattr(cls, "__init__", None) if isinstance(cls, type) else None
    model = get_type_hints(init).get("config") if init is not None else None
    if not (isinstance(model, type) and issubclass(model, StrictModel)):
        raise TypeError(f"{cls!r} takes no `config: <StrictModel>` argument: it cannot be a registry entry")
    return model


def section_description(model: type[StrictModel]) -> str | None:
    """A section's one-line description: its config model's own docstring, on one line (None without one)."""
    doc = model.__dict__.get("__doc__")
    return " ".join(doc.split()) if doc else None


def config_sections() -> dict[str, tuple[type[StrictModel], str | None]]:
    """Every section under ``detectors:``, in order: key -> (model, its description or None)."""
    return {name: (model, section_description(model))
            for name, model in ((name, config_model(cls)) for name, cls in {**REGISTRY, **AFTER_DETECTORS}.items())}


# Shadow rules are config-defined and few: their name is a metric label.
MAX_SHADOW_RULES = 16


class ShadowRule(StrictModel):
    """A detector run in shadow beside the acting one: its findings are recorded as decisions marked
    shadow (detector ``shadow:<name>``) and compared with the acting rule's, never delivered."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,39}$")
    detector: str  # a section of `detectors:` (a registry entry), e.g. memory
    # Keys of that section that differ from the acting one's (the rest is copied from it); the
    # shadow instance runs whether or not the acting one is enabled.
    config: dict[str, Any] = Field(default_factory=dict)

    def section(self, acting: Any) -> StrictModel:
        """The shadow instance's section: ``acting`` (the detector's own) with this rule's overrides;
        ValueError naming the key when the detector or a key or value is not one the section takes."""
        cls = REGISTRY.get(self.detector)
        if cls is None:
            raise ValueError(f"shadow rule {self.name!r}: unknown detector {self.detector!r} "
                             f"(one of {', '.join(REGISTRY)})")
        model = config_model(cls)
        try:
            return model.model_validate({**acting.model_dump(), **self.config, "enabled": True})
        except ValidationError as exc:
            raise ValueError(f"shadow rule {self.name!r} ({self.detector}): "
                             f"{format_validation_error(exc, model=model)}") from None

    def build(self, acting: Any) -> Detector:
        return REGISTRY[self.detector](self.section(acting))


def check_shadow_rules(rules: list[ShadowRule], sections: Any) -> None:
    """ValueError for rules the engine cannot build (a repeated name, a bad override); ``sections``:
    the ``detectors:`` config (each rule's acting section read from it by name)."""
    seen: set[str] = set()
    for rule in rules:
        if rule.name in seen:
            raise ValueError(f"shadow rule {rule.name!r} is defined twice")
        seen.add(rule.name)
        rule.section(getattr(sections, rule.detector, None) or StrictModel())
