"""The exporter: renders the snapshot as a Prometheus exposition with a custom collector.

A scrape reads only the cached snapshot (never NVML or sysfs). Every sample is rendered by its
declared ``MetricSpec``; a sample with no declaration is a bug, logged once and dropped, never
guessed at. It serves nothing itself: agent.server mounts ``render``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from agent.metric import MetricKind, MetricSpec, Sample

log = logging.getLogger("vigil.agent.exporter")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SnapshotExporter(PromCollector):
    """Yields one family per declared metric that has samples this scrape."""

    def __init__(self, specs: Iterable[MetricSpec], sources: Sequence[Callable[[], Iterable[Sample]]]) -> None:
        self._specs: dict[str, MetricSpec] = {}
        for spec in specs:
            known = self._specs.get(spec.name)
            if known is not None and known != spec:
                raise ValueError(f"metric {spec.name} is declared twice, differently")
            self._specs[spec.name] = spec
        self._sources = sources
        self._undeclared_logged: set[str] = set()

    @property
    def specs(self) -> dict[str, MetricSpec]:
        return self._specs

    def collect(self) -> Iterator[Metric]:
        grouped: dict[str, list[Sample]] = defaultdict(list)
        for source in self._sources:
            for sample in source():
                grouped[sample.name].append(sample)
        for name, samples in grouped.items():
            spec = self._specs.get(name)
            if spec is None:
                if name not in self._undeclared_logged:
                    self._undeclared_logged.add(name)
                    log.error("undeclared metric %s dropped from /metrics", name)
                continue
            family: Metric
            if spec.kind is MetricKind.COUNTER:
                family = CounterMetricFamily(name.removesuffix("_total"), spec.help, labels=spec.labels)
            else:
                family = GaugeMetricFamily(name, spec.help, labels=spec.labels)
            seen: set[tuple[tuple[str, str], ...]] = set()
            for s in samples:
                if s.labels in seen:  # two readers emitting one series: keep the first
                    continue
                seen.add(s.labels)
                family.add_metric([v for _, v in s.labels], s.value)
            yield family


def make_registry(exporter: SnapshotExporter) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
