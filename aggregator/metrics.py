"""The aggregator's own Prometheus metrics: intake, judgement and the fleet's state at a glance.

Counts reports ingested and rejected (by reason), times ingest and evaluation, counts decisions
by action and detector, and reports how many nodes are in each state. It uses its own registry
(no process-global state), so tests and the simulator can build as many as they like. It
neither judges nor serves; app.py mounts ``render``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Why a report was refused; every rejection is counted under one of these, so the series exist
# (at 0) before the first failure and an alert can rate() them.
REJECT_REASONS = ("unauthorized", "too_large", "invalid_json", "schema")
NODE_STATES = ("ok", "suspect", "failing", "silent")

# Ingest is ~0.1 ms; evaluation of a 12,500-node fleet tens of ms.
_INGEST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
_EVALUATE_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _NodeStates(PromCollector):
    def __init__(self, states: Callable[[], Mapping[str, int]]) -> None:
        self._states = states

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("vigil_aggregator_nodes", "Nodes known to the aggregator, by state.",
                                   labels=["state"])
        counts = self._states()
        for state in NODE_STATES:
            family.add_metric([state], counts.get(state, 0))
        yield family


class AggregatorMetrics:
    def __init__(self, node_states: Callable[[], Mapping[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reports = Counter("vigil_aggregator_reports", "Reports accepted and ingested.", registry=r)
        self.rejections = Counter("vigil_aggregator_report_rejections",
                                  "Reports refused, by reason.", ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason)
        self.ingest_seconds = Histogram("vigil_aggregator_ingest_duration_seconds",
                                        "Time to validate and ingest one report.", buckets=_INGEST_BUCKETS,
                                        registry=r)
        self.evaluate_seconds = Histogram("vigil_aggregator_evaluate_duration_seconds",
                                          "Time to run every detector over the fleet once.",
                                          buckets=_EVALUATE_BUCKETS, registry=r)
        self.decisions = Counter("vigil_aggregator_decisions", "Decisions admitted, by action and detector.",
                                 ["action", "detector"], registry=r)
        r.register(_NodeStates(node_states))

    def render(self) -> bytes:
        return generate_latest(self.registry)
