"""The explicit collector registry: registry key -> collector module.

A collector module declares its config section's model (``CONFIG``, optionally a one-line
``DESCRIPTION``), its metric specs (``SPECS``) and ``build``. The ``collectors:`` config section
and the metric catalog are derived from this table, so adding a collector is its module, one
line here and its test; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from vigil.agent.collectors import flight_recorder, gpu, host, node_config, pcie, rdma, training, xid
from vigil.agent.collectors.collector import Collector, CollectorConfig
from vigil.agent.metric import MetricSpec

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

Builder = Callable[["AgentConfig", "Seams"], Collector]


class CollectorModule(Protocol):
    """What a collector module declares."""

    @property
    def CONFIG(self) -> type[CollectorConfig]: ...

    @property
    def SPECS(self) -> Sequence[MetricSpec]: ...

    def build(self, config: AgentConfig, seams: Seams) -> Collector: ...


# config section name (under `collectors:`) -> the collector's module
COLLECTORS: dict[str, CollectorModule] = {
    "gpu": gpu,
    "host": host,
    "rdma": rdma,
    "training": training,
    "xid": xid,
    "flight_recorder": flight_recorder,
    "pcie": pcie,
    "node_config": node_config,
}

REGISTRY: dict[str, Builder] = {name: module.build for name, module in COLLECTORS.items()}


def config_sections() -> dict[str, tuple[type[CollectorConfig], str | None]]:
    """Every section under ``collectors:``, in order: key -> (model, one-line description or None)."""
    return {name: (module.CONFIG, getattr(module, "DESCRIPTION", None)) for name, module in COLLECTORS.items()}
