"""Fleet state: the aggregator's bounded, windowed memory of every node, GPU, port and job.

Fleet (fleet/ingest.py) reads validated reports and is the only writer; per-entry histories
(fleet/history.py), the completion of compact entries (fleet/completion.py) and what detectors
read (fleet/view.py: NodeState, FleetView) are its parts, and their public names are imported
from here. It judges nothing.
"""

from vigil.aggregator.fleet.config import FleetConfig
from vigil.aggregator.fleet.history import (
    AER_COUNTERS,
    GPU_COUNTERS,
    PORT_COUNTERS_ROSE,
    PORT_LINK_CHANGED,
    CounterBaseline,
    GpuHistory,
    GpuSample,
    LoadedRun,
    PcieHistory,
    PortHistory,
    PortSample,
    RankHistory,
    Series,
    link_below_max,
    normal_bus_id,
    port_is_active,
)
from vigil.aggregator.fleet.ingest import (
    EVICTION_KINDS,
    HBM_DEFAULT_LIMIT_CELSIUS,
    HBM_WATCH_BELOW_LIMIT_CELSIUS,
    MAX_NODE_ACTIONS_KEPT,
    WATCHED_CLOCK_EVENTS,
    Fleet,
)
from vigil.aggregator.fleet.view import ActionOutcome, FleetView, JobState, NodeState, Removal

__all__ = [
    "AER_COUNTERS", "EVICTION_KINDS", "GPU_COUNTERS", "HBM_DEFAULT_LIMIT_CELSIUS", "HBM_WATCH_BELOW_LIMIT_CELSIUS",
    "MAX_NODE_ACTIONS_KEPT", "PORT_COUNTERS_ROSE", "PORT_LINK_CHANGED", "WATCHED_CLOCK_EVENTS", "ActionOutcome",
    "CounterBaseline", "Fleet", "FleetConfig", "FleetView", "GpuHistory", "GpuSample", "JobState", "LoadedRun",
    "NodeState", "PcieHistory", "PortHistory", "PortSample", "RankHistory", "Removal", "Series", "link_below_max",
    "normal_bus_id", "port_is_active",
]
