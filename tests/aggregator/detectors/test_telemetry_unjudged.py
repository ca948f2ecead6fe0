"""What agents send at telemetry resolution (wire.GPU_TELEMETRY_FIELDS, wire.PORT_TRAFFIC_COUNTERS:
in a compact report at most every 30 s) is judged by nothing: no detector's source reads a GPU
telemetry field (but the detectors built to judge over windows of minutes, far longer than the
30 s resolution: TELEMETRY_JUDGES), and the network detector's config refuses a traffic counter in
any rule."""

from __future__ import annotations

import inspect
import re
import sys

import pytest
from pydantic import ValidationError

from vigil.aggregator.detectors import REGISTRY
from vigil.aggregator.detectors.network import NetworkConfig
from vigil.aggregator.detectors.topology import TopologyAttributor
from vigil.aggregator.fleet import GpuSample
from vigil.contract.wire import GPU_TELEMETRY_FIELDS, PORT_TRAFFIC_COUNTERS

# Detectors whose windows are minutes (telemetry_hang: 60 s alert, 300 s restart, its docstring on
# the resolution): a reading up to 30 s old is inside them.
TELEMETRY_JUDGES = frozenset({"telemetry_hang"})


def test_no_detector_reads_a_gpu_telemetry_field() -> None:
    sources = {cls.__name__: inspect.getsource(sys.modules[cls.__module__])
               for name, cls in [*REGISTRY.items(), ("topology", TopologyAttributor)] if name not in TELEMETRY_JUDGES}
    read = {name: sorted(f for f in GPU_TELEMETRY_FIELDS if re.search(rf"\b{f}\b", source))
            for name, source in sources.items()}
    assert all(not fields for fields in read.values()), read
    assert GPU_TELEMETRY_FIELDS.isdisjoint(GpuSample.__struct_fields__)  # nor the samples they judge over


@pytest.mark.parametrize("rule", ["flap_counters", "error_counters", "congestion_counters"])
def test_the_network_config_refuses_to_judge_a_traffic_counter(rule: str) -> None:
    counters = list(getattr(NetworkConfig(), rule))
    with pytest.raises(ValidationError, match=r"port_rcv_data.*count traffic, not faults"):
        NetworkConfig(**{rule: [*counters, "port_rcv_data"]})
    assert PORT_TRAFFIC_COUNTERS.isdisjoint(counters)  # the defaults judge none
