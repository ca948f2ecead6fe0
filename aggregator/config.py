"""The aggregator's configuration: a YAML file validated by strict models.

Safe defaults run it with no file at all: loopback only, the decision store under the working
directory, dry run. Unknown keys and wrong types stop start-up with the key path named
(``detectors.straggler.z_treshold: unknown key``). Each detector's section is defined beside
the detector, and ``detectors:`` is derived from the detector registry; this module only assembles
the sections. It reads no environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from vigil.aggregator.actuators import ActuatorsConfig
from vigil.aggregator.auth import AuthConfig, TlsConfig
from vigil.aggregator.detectors import (
    MAX_SHADOW_RULES,
    DetectorSection,
    ShadowRule,
    check_shadow_rules,
    config_sections,
)
from vigil.aggregator.fleet import FleetConfig
from vigil.aggregator.gate import GateConfig
from vigil.aggregator.job_recovery import JobRecoveryConfig
from vigil.aggregator.leadership import HaConfig
from vigil.aggregator.listener import ServerConfig
from vigil.aggregator.outbox import NodeActionsConfig, switched_on
from vigil.aggregator.precision import PrecisionConfig
from vigil.aggregator.prober import ProbesConfig
from vigil.aggregator.spares import SparesConfig
from vigil.aggregator.store import StoreConfig
from vigil.aggregator.trace import TraceConfig
from vigil.contract.limits import REPORT_MAX_BYTES
from vigil.contract.validation import (
    ConfigError,
    HostPort,
    Sections,
    StrictModel,
    read_config_file,
    sections_model,
    split_host_port,
    validate_config,
)

if TYPE_CHECKING:
    from vigil.aggregator.detectors.network import NetworkConfig
    from vigil.aggregator.detectors.probe_verdict import ProbeVerdictConfig
    from vigil.aggregator.detectors.recovery import RecoveryConfig
    from vigil.aggregator.detectors.silence import SilenceConfig
    from vigil.aggregator.detectors.topology import TopologyConfig

__all__ = ["AggregatorConfig", "ConfigError", "DetectorsConfig", "load_config", "parse_config"]


# `detectors:` has one section per entry of aggregator.detectors.REGISTRY, then the topology
# attributor's, each the model its class's constructor takes, with that model's docstring as its description. mypy sees
# the typed view below: the sections read outside their own detector with their models, any other
# as a DetectorSection (``enabled``); a test holds the view to the derived model.
if TYPE_CHECKING:
    class DetectorsConfig(Sections):
        network: NetworkConfig = NetworkConfig()
        probe_verdict: ProbeVerdictConfig = ProbeVerdictConfig()
        recovery: RecoveryConfig = RecoveryConfig()
        silence: SilenceConfig = SilenceConfig()
        topology: TopologyConfig = TopologyConfig()

        def __getattr__(self, name: str) -> DetectorSection: ...
else:
    DetectorsConfig = sections_model("DetectorsConfig", __name__, config_sections())


class AggregatorConfig(StrictModel):
    listen: HostPort = "127.0.0.1:9500"
    # Credentials per role (README "Security"). None configured: only a loopback listener in
    # dry run accepts anything; with dry_run false the aggregator refuses to start.
    auth: AuthConfig = AuthConfig()
    tls: TlsConfig = TlsConfig()
    server: ServerConfig = ServerConfig()
    store_path: str = "vigil-aggregator.sqlite"
    # Decisions are recorded and served but no actuator changes anything until this is false.
    dry_run: bool = True
    # The one size number both services derive from (contract/limits.py): the agent builds every
    # report at or under it, splitting a backlog of events over several reports.
    max_body_bytes: int = Field(default=REPORT_MAX_BYTES, ge=1024)
    evaluate_interval_seconds: float = Field(default=2.5, gt=0)
    fleet: FleetConfig = FleetConfig()
    detectors: DetectorsConfig = DetectorsConfig()
    gate: GateConfig = GateConfig()
    store: StoreConfig = StoreConfig()
    # Replicas sharing a PostgreSQL store: which one acts (store.backend postgresql; docs/ha.md).
    ha: HaConfig = HaConfig()
    actuators: ActuatorsConfig = ActuatorsConfig()
    # Signed requests to the agents (aggregator/outbox.py); used by actuators.slurm.reset_gpu,
    # actuators.kubernetes.reset_gpu and actuators.kubernetes.reboot.
    node_actions: NodeActionsConfig = NodeActionsConfig()
    # Active validation: probe runs the aggregator asks the agents for (aggregator/prober.py,
    # docs/probes.md); the recovery detector then resumes only after the probes pass.
    probes: ProbesConfig = ProbesConfig()
    # Off by default: restart a running job without a node that slows or threatens it, at the
    # moment that loses the least GPU time (aggregator/job_recovery.py, docs/goodput.md).
    job_recovery: JobRecoveryConfig = JobRecoveryConfig()
    # Off by default: the pool of healthy idle nodes a restart draws on (aggregator/spares.py).
    spares: SparesConfig = SparesConfig()
    # Off by default: a bounded trace of the accepted traffic for ``vigil replay`` (aggregator/trace.py,
    # docs/replay.md; it holds node names, job ids and host facts, no credential).
    trace: TraceConfig = TraceConfig()
    # Off by default: each rule's precision from what happened after its removals, and a rule below
    # its target demoted from act to alert (aggregator/precision.py, docs/precision.md).
    precision: PrecisionConfig = PrecisionConfig()
    # Detectors run in shadow beside the acting ones (a new rule, another threshold): their findings
    # are recorded and compared, never acted on (docs/gate.md, "Shadow rules").
    shadow: list[ShadowRule] = Field(default_factory=list, max_length=MAX_SHADOW_RULES)

    @model_validator(mode="after")
    def _shadow(self) -> AggregatorConfig:
        check_shadow_rules(self.shadow, self.detectors)
        return self

    @model_validator(mode="after")
    def _node_action_key(self) -> AggregatorConfig:
        on = switched_on(self)  # outbox.FOLLOW_UPS: each switch that makes a request to an agent
        if on and not self.node_actions.key_file:
            raise ValueError(f"{' and '.join(on)} {'needs' if len(on) == 1 else 'need'} node_actions.key_file "
                             "(the master key the requests to the agents are signed with: vigil token "
                             "master-key --out FILE)")
        return self

    @model_validator(mode="after")
    def _probes(self) -> AggregatorConfig:
        if self.probes.enabled and not self.node_actions.key_file:
            raise ValueError("probes.enabled needs node_actions.key_file (each probe run is a request signed with "
                             "that master key, each result signed under the node's key: vigil token master-key "
                             "--out FILE)")
        if self.detectors.probe_verdict.enabled and not self.probes.enabled:
            raise ValueError("detectors.probe_verdict.enabled needs probes.enabled (it judges the probe runs the "
                             "prober requests)")
        return self

    @model_validator(mode="after")
    def _postgres(self) -> AggregatorConfig:
        if self.store.backend != "postgresql":
            return self
        if not self.store.dsn_file:
            raise ValueError("store.backend postgresql needs store.dsn_file (a file holding the libpq connection "
                             "string; never on the command line or in this file)")
        silence = self.detectors.silence
        if silence.enabled and self.ha.warm_after_seconds < silence.alert_after_seconds_min:
            raise ValueError(f"ha.warm_after_seconds ({self.ha.warm_after_seconds:g}) must cover "
                             f"detectors.silence.alert_after_seconds_min ({silence.alert_after_seconds_min:g}): "
                             "a replica taking over earlier would find nodes silent it merely has not heard yet")
        return self

    @property
    def host(self) -> str:
        return split_host_port(self.listen)[0]

    @property
    def port(self) -> int:
        return split_host_port(self.listen)[1]


def parse_config(data: Any) -> AggregatorConfig:
    return validate_config(AggregatorConfig, data)


def load_config(path: str | Path | None) -> AggregatorConfig:
    return parse_config({} if path is None else read_config_file(path))
