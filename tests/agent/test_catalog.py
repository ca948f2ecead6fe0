"""agent.catalog: one declaration per metric, covering every registered collector."""

from __future__ import annotations

from vigil.agent.catalog import COLLECTOR_SPECS, agent_specs
from vigil.agent.collectors import REGISTRY
from vigil.agent.metric import MetricKind


def test_catalog_covers_every_registered_collector() -> None:
    assert set(COLLECTOR_SPECS) == set(REGISTRY)


def test_names_are_unique_and_include_self_metrics() -> None:
    names = [s.name for s in agent_specs()]
    assert len(names) == len(set(names))
    for expected in ("vigil_gpu_temperature_celsius", "vigil_gpu_xid_errors_total", "vigil_rdma_port_state",
                     "vigil_training_step_seconds", "vigil_collector_success", "vigil_agent_reports_total"):
        assert expected in names


def test_gpu_series_carry_gpu_and_uuid() -> None:
    for spec in agent_specs():
        if spec.name.startswith("vigil_gpu_") and spec.name not in ("vigil_gpu_nvml_available",
                                                                   "vigil_gpu_nvml_errors_total"):
            assert spec.labels[:2] == ("gpu", "uuid"), spec.name
        if spec.kind is MetricKind.INFO:
            assert spec.name.endswith("_info")
