"""The agent's configuration: a YAML file validated by strict models.

Unknown keys and wrong types stop start-up with a message naming the key path
(``collectors.gpu.interval_secnds: unknown key``). Each collector's section is defined beside the
collector; this module only assembles them. It reads no environment variables.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError

from agent.collectors.collector import StrictModel
from agent.collectors.gpu import GpuConfig
from agent.collectors.host import HostConfig
from agent.collectors.rdma import RdmaConfig
from agent.collectors.training import TrainingConfig
from agent.collectors.xid import XidConfig
from agent.dcgm_compat import ExporterConfig
from agent.validation import format_validation_error

_M = TypeVar("_M", bound=BaseModel)


class ConfigError(Exception):
    """A configuration that cannot be used; the message names every offending key path."""


class NvmlConfig(StrictModel):
    # `nvml` is the real library; `fake` the embedded FakeNvml driven by `scenario`. Never
    # chosen implicitly: a node without NVML reports no GPU samples, it does not fall back.
    backend: Literal["nvml", "fake"] = "nvml"
    scenario: str | None = None  # fake only: a scenario YAML path or a shipped scenario name
    seed: int = 0


class AggregatorTarget(StrictModel):
    url: str | None = None  # e.g. http://aggregator:9500 ; None: do not push reports
    token_file: str | None = None
    interval_seconds: float = Field(default=2.5, gt=0)
    timeout_seconds: float = Field(default=5.0, gt=0)
    max_backoff_seconds: float = Field(default=60.0, gt=0)
    # Reports kept while the aggregator is down; the oldest periodic ones go first, events never
    # silently: dropped events are counted.
    queue_max_reports: int = Field(default=120, ge=1)


class CollectorsConfig(StrictModel):
    gpu: GpuConfig = GpuConfig()
    host: HostConfig = HostConfig()
    rdma: RdmaConfig = RdmaConfig()
    training: TrainingConfig = TrainingConfig()
    xid: XidConfig = XidConfig()


class AgentConfig(StrictModel):
    node: str = Field(default_factory=socket.gethostname, min_length=1)
    listen: str = "127.0.0.1:9400"
    state_dir: str | None = None
    topology: dict[str, str] = Field(default_factory=dict)  # row, rack, leaf_switch, ...
    nvml: NvmlConfig = NvmlConfig()
    aggregator: AggregatorTarget = AggregatorTarget()
    collectors: CollectorsConfig = CollectorsConfig()
    exporter: ExporterConfig = ExporterConfig()  # dcgm_compat: also serve DCGM_FI_DEV_* series


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping (empty file: {}), or a ConfigError saying why not."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration: the top level must be a mapping, got {type(data).__name__}")
    return data


def validate_config(model: type[_M], data: Any) -> _M:
    """``data`` validated as ``model``; errors name every offending key path (agent and aggregator)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration: the top level must be a mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def parse_config(data: Any) -> AgentConfig:
    return validate_config(AgentConfig, data)


def load_config(path: str | Path | None) -> AgentConfig:
    return parse_config({} if path is None else read_config_file(path))
