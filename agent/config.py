"""The agent's configuration: a YAML file validated by strict models.

Unknown keys and wrong types stop start-up with a message naming the key path
(``collectors.gpu.interval_secnds: unknown key``). Each collector's section is defined beside the
collector, and ``collectors:`` is derived from the collector registry; this module only assembles
the sections. It reads no environment variables.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from vigil.agent.collectors import config_sections
from vigil.agent.collectors.collector import CollectorConfig
from vigil.agent.dcgm_compat import ExporterConfig
from vigil.agent.launcher_health import LauncherHealthConfig
from vigil.agent.node_action_runner import NodeActionsConfig
from vigil.agent.probes import PROBES
from vigil.agent.probes.context import ProbesConfig
from vigil.contract.limits import PENDING_EVENTS_MAX_BYTES, REPORT_MAX_BYTES
from vigil.contract.validation import (
    HostPort,
    Sections,
    StrictModel,
    read_config_file,
    sections_model,
    validate_config,
)
from vigil.contract.wire import check_real_node_name

if TYPE_CHECKING:
    from vigil.agent.collectors.gpu import GpuConfig
    from vigil.agent.collectors.training import TrainingConfig


class NvmlConfig(StrictModel):
    # The GPU library (agent/gpu_backend.py): `nvml` (NVIDIA), `amdsmi` (AMD's, from ROCm), `auto`
    # (NVML if it initialises, else amdsmi: docs/amd.md) or `fake`, the embedded FakeNvml (or
    # FakeAmdSmi with vendor: amd) driven by `scenario`. Never chosen implicitly: a node where the
    # library does not initialise reports no GPU samples, it never falls back to a fake.
    backend: Literal["nvml", "amdsmi", "auto", "fake"] = "nvml"
    scenario: str | None = None  # fake only: a scenario YAML path or a shipped scenario name
    seed: int = 0
    # fake only: whose library the fake imitates (amd: FakeAmdSmi, 8x MI300X by default); a scenario
    # names its board, whose vendor must be this one.
    vendor: Literal["nvidia", "amd"] = "nvidia"


class AggregatorTarget(StrictModel):
    # e.g. https://aggregator:9500 ; None: do not push reports. https verifies the aggregator's
    # certificate (the system's CAs, or only ca_file's) and its hostname, always.
    url: str | None = None
    # Instead of url: every replica of an HA aggregator pair (docs/ha.md). Each gets every report,
    # through a reporter and an event backlog of its own, so the standby's fleet view stays warm.
    urls: list[str] = Field(default_factory=list, max_length=4)
    token_file: str | None = None  # this node's token, sent as "Authorization: Bearer"
    ca_file: str | None = None  # PEM CA bundle that signed the aggregator's certificate
    cert_file: str | None = None  # client certificate (PEM) where the site uses mTLS ...
    key_file: str | None = None  # ... and its key
    interval_seconds: float = Field(default=2.5, gt=0)
    # How often a compact (version 2 or 3) report carries the telemetry that moved (wire.py's
    # GPU_TELEMETRY_FIELDS and PORT_TRAFFIC_COUNTERS: utilization of memory, profiling ratios,
    # throughputs, traffic counters; nothing a detector judges); 0: every report. 30 s keeps the
    # aggregator's copy as fresh as a 30 s scrape while most reports leave out over half their
    # bytes; dashboards read it from this agent's /metrics at scrape resolution anyway.
    telemetry_seconds: float = Field(default=30.0, ge=0, le=3600)
    timeout_seconds: float = Field(default=5.0, gt=0)
    max_backoff_seconds: float = Field(default=60.0, gt=0)
    # Every report is built at or under this (contract/limits.py: the aggregator's max_body_bytes
    # default); a 413 from an aggregator configured lower makes the agent split further.
    max_report_bytes: int = Field(default=REPORT_MAX_BYTES, ge=16 * 1024)
    # Events kept (serialized) while the aggregator cannot take them; past it the oldest are
    # dropped, counted in vigil_agent_events_dropped_total{reason="backlog_full"} and logged.
    max_pending_event_bytes: int = Field(default=PENDING_EVENTS_MAX_BYTES, ge=16 * 1024)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return url

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r}: must be an http:// or https:// URL")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError("the same aggregator twice")
        return urls

    @property
    def targets(self) -> list[str]:
        """Every aggregator this agent reports to (url, or urls)."""
        return list(self.urls) if self.urls else [self.url] if self.url else []

    @model_validator(mode="after")
    def _tls_needs_https(self) -> AggregatorTarget:
        if self.url and self.urls:
            raise ValueError("aggregator.url and aggregator.urls: set one (urls lists every replica)")
        tls = [k for k in ("ca_file", "cert_file", "key_file") if getattr(self, k)]
        if tls and not all(u.startswith("https://") for u in self.targets or [""]):
            raise ValueError(f"aggregator.{tls[0]}: only used with https:// aggregator URLs")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("aggregator.cert_file and aggregator.key_file go together (mTLS client certificate)")
        return self


# `collectors:` has one section per entry of agent.collectors.COLLECTORS, each the model its module
# declares (CONFIG) with its DESCRIPTION. mypy sees the typed view below: the sections read by
# attribute (the GPU collector's build, the daemon's heartbeat intake) with their models, any other
# as its CollectorConfig base (a module reads its own with ``section``); a test holds the view to
# the derived model.
if TYPE_CHECKING:
    class CollectorsConfig(Sections):
        gpu: GpuConfig = GpuConfig()
        training: TrainingConfig = TrainingConfig()

        def __getattr__(self, name: str) -> CollectorConfig: ...
else:
    CollectorsConfig = sections_model("CollectorsConfig", __name__, config_sections())


class AgentConfig(StrictModel):
    # What the aggregator knows this node as: a hostname (contract/wire.py's one rule), so that a
    # typo'd name fails here, at start-up, instead of in every report; never loadgen-* (reserved
    # for vigil loadgen's synthetic nodes, which the aggregator does not judge).
    node: Annotated[str, AfterValidator(check_real_node_name)] = Field(default_factory=socket.gethostname,
                                                                  validate_default=True)
    # /metrics, /healthz and /v1/state. It may be any address (0.0.0.0 for Prometheus): heartbeats
    # have their own node-local listener (collectors.training.udp_listen, unix_socket).
    # 19400: 9400 is dcgm-exporter's and 9100 node_exporter's, and the Prometheus default-port list
    # (9100-9999) is fully allocated; 19400 is outside it, below the ephemeral range, and reads as
    # "dcgm-exporter's port + 10000" so both can run side by side during a migration.
    listen: HostPort = "127.0.0.1:19400"
    # Open connections to that listener beyond this are closed at accept and counted
    # (vigil_agent_connections_refused_total): a node has one or two scrapers, and a flood must
    # not use up the file descriptors the reporter needs.
    listen_max_connections: int = Field(default=64, ge=1, le=4096)
    state_dir: str | None = None
    topology: dict[str, str] = Field(default_factory=dict)  # row, rack, leaf_switch, ...
    nvml: NvmlConfig = NvmlConfig()
    aggregator: AggregatorTarget = AggregatorTarget()
    collectors: CollectorsConfig = CollectorsConfig()
    exporter: ExporterConfig = ExporterConfig()  # dcgm_compat: also serve DCGM_FI_DEV_* series
    # What the aggregator may ask this agent to do on its node (agent/node_action_runner.py,
    # docs/security-agent.md "Node actions"): nothing unless `allow` lists it.
    node_actions: NodeActionsConfig = NodeActionsConfig()
    # How long and how hard the probes work when the aggregator asks for them (node_actions.allow
    # lists run_probes) or `vigil check` runs them (agent/probes/, docs/probes.md).
    probes: ProbesConfig = ProbesConfig()
    # The node health check NVIDIA's ft_launcher asks before a rendezvous, answered from vigil's
    # standing of this node (agent/launcher_health.py, docs/goodput.md); needs the resiliency extra.
    launcher_health: LauncherHealthConfig = LauncherHealthConfig()

    @model_validator(mode="after")
    def _only_non_intrusive_beside_a_job(self) -> AgentConfig:
        intrusive = [p for p in self.probes.allow_with_job if PROBES[p].intrusive]
        if intrusive:
            verb = "is" if len(intrusive) == 1 else "are"
            raise ValueError(f"probes.allow_with_job: {', '.join(intrusive)} {verb} intrusive and never run while "
                             "a job holds a GPU")
        return self


def parse_config(data: Any) -> AgentConfig:
    return validate_config(AgentConfig, data)


def load_config(path: str | Path | None) -> AgentConfig:
    return parse_config({} if path is None else read_config_file(path))
