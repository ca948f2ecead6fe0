"""The agent's metric catalog: every MetricSpec the agent can put on /metrics, gathered from each
collector module's declarations and the runner's, reporter's and server's self-metrics.

Rules, dashboards and the dcgm-exporter compatibility layer are checked against it, so a renamed
metric breaks a test instead of silently emptying a panel. It reads declarations only; it builds
no collector and touches no hardware.
"""

from __future__ import annotations

from vigil.agent.collectors import COLLECTORS
from vigil.agent.credential_exposure import ExposedFiles
from vigil.agent.metric import MetricSpec
from vigil.agent.reporter import REPORTER_SPECS
from vigil.agent.runner import RUNNER_SPECS
from vigil.agent.server import SERVER_SPECS

# Each registered collector's declared metrics, derived from agent.collectors.COLLECTORS.
COLLECTOR_SPECS: dict[str, tuple[MetricSpec, ...]] = {name: tuple(module.SPECS) for name, module in COLLECTORS.items()}


def agent_specs() -> list[MetricSpec]:
    """Every metric the agent may emit, each once, in declaration order.

    Two modules declaring one name differently is a bug the exporter would also refuse, so it
    raises here too rather than pick one.
    """
    out: dict[str, MetricSpec] = {}
    for specs in (*COLLECTOR_SPECS.values(), RUNNER_SPECS, REPORTER_SPECS, SERVER_SPECS, ExposedFiles.specs):
        for spec in specs:
            known = out.get(spec.name)
            if known is not None and known != spec:
                raise ValueError(f"metric {spec.name} is declared twice, differently")
            out[spec.name] = spec
    return list(out.values())
