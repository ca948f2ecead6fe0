"""The explicit collector registry: registry key -> builder.

Adding a collector is one module (with its config, metric specs and ``build``) plus one line
here and one config field in ``agent.config.CollectorsConfig``; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vigil.agent.collectors import flight_recorder, gpu, host, node_config, pcie, rdma, training, xid
from vigil.agent.collectors.collector import Collector

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

Builder = Callable[["AgentConfig", "Seams"], Collector]

REGISTRY: dict[str, Builder] = {
    "gpu": gpu.build,
    "host": host.build,
    "rdma": rdma.build,
    "training": training.build,
    "xid": xid.build,
    "flight_recorder": flight_recorder.build,
    "pcie": pcie.build,
    "node_config": node_config.build,
}
