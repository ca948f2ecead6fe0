"""The ``vigil_build_info`` series: which release (and Python) a process runs, for version-skew alerts.

The agent and the aggregator each register it in their own prometheus-client registry; its value
is always 1 and the labels carry the facts. It reads ``vigil.contract.version`` and emits nothing else.
"""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Gauge

from vigil.contract.version import __version__


def register_build_info(registry: CollectorRegistry, component: str) -> None:
    Gauge("vigil_build_info", "The vigil release this process runs (value 1; the labels carry the facts).",
          ["component", "version", "python"], registry=registry,
          ).labels(component, __version__, platform.python_version()).set(1)
