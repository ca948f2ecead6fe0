"""The aggregator's configuration: a YAML file validated by strict models.

Safe defaults run it with no file at all: loopback only, the decision store under the working
directory, dry run. Unknown keys and wrong types stop start-up with the key path named
(``detectors.straggler.z_treshold: unknown key``). Each detector's section is defined beside
the detector; this module only assembles them. It reads no environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from agent.collectors.collector import StrictModel
from agent.config import ConfigError, read_config_file, validate_config
from aggregator.actuators import ActuatorsConfig
from aggregator.detectors.hang import HangConfig
from aggregator.detectors.memory import MemoryConfig
from aggregator.detectors.network import NetworkConfig
from aggregator.detectors.pcie_nvlink import PcieNvlinkConfig
from aggregator.detectors.silence import SilenceConfig
from aggregator.detectors.straggler import StragglerConfig
from aggregator.detectors.thermal import ThermalConfig
from aggregator.detectors.topology import TopologyConfig
from aggregator.detectors.xid import XidConfig
from aggregator.fleet import FleetConfig
from aggregator.gate import GateConfig

__all__ = ["AggregatorConfig", "ConfigError", "DetectorsConfig", "load_config", "parse_config"]


class DetectorsConfig(StrictModel):
    xid: XidConfig = XidConfig()
    memory: MemoryConfig = MemoryConfig()
    thermal: ThermalConfig = ThermalConfig()
    pcie_nvlink: PcieNvlinkConfig = PcieNvlinkConfig()
    network: NetworkConfig = NetworkConfig()
    straggler: StragglerConfig = StragglerConfig()
    hang: HangConfig = HangConfig()
    silence: SilenceConfig = SilenceConfig()
    topology: TopologyConfig = TopologyConfig()


class AggregatorConfig(StrictModel):
    listen: str = "127.0.0.1:9500"
    # Bearer token agents must present; None accepts unauthenticated reports (loopback default).
    token_file: str | None = None
    store_path: str = "vigil-aggregator.sqlite"
    # Decisions are recorded and served but no actuator changes anything until this is false.
    dry_run: bool = True
    # An 8-GPU report is ~10 KB of JSON; 1 MiB leaves room for a node with a flood of events.
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    evaluate_interval_seconds: float = Field(default=2.5, gt=0)
    # Decision ids already emitted are remembered this many at most (bounded memory).
    emitted_memory: int = Field(default=100_000, ge=100)
    fleet: FleetConfig = FleetConfig()
    detectors: DetectorsConfig = DetectorsConfig()
    gate: GateConfig = GateConfig()
    actuators: ActuatorsConfig = ActuatorsConfig()

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected HOST:PORT")
        return value

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def parse_config(data: Any) -> AggregatorConfig:
    return validate_config(AggregatorConfig, data)


def load_config(path: str | Path | None) -> AggregatorConfig:
    return parse_config({} if path is None else read_config_file(path))
