"""The exporter: renders the snapshot as a Prometheus text exposition.

A scrape reads only the cached snapshot (never NVML or sysfs). Every sample is rendered by its
declared ``MetricSpec``; a sample with no declaration is a bug, logged once and dropped, never
guessed at. ``SnapshotExporter`` is a prometheus-client custom collector (the reference, and what
a registry can embed) with a direct text encoder beside it that produces the same bytes: the
library's per-label validation costs ~20 us a series, 30 ms for an 8-GPU node, against a 2 ms
budget, and our label names are already validated once by ``MetricSpec``. It serves nothing itself;
contract/scrape_encoding.py gzips an exposition for a scraper that asks.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from prometheus_client.utils import floatToGoString

from vigil.agent.metric import MetricKind, MetricSpec, Sample

log = logging.getLogger("vigil.agent.exporter")

# Label sets seen in a long-running agent are bounded by hardware; the cap only guards a leak.
_PREFIX_CACHE_MAX = 200_000


def _escape_label_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(v: float) -> str:
    """Go's float formatting as prometheus-client writes it; repr is the same for ordinary values."""
    r = repr(v)
    if r.find(".") > 6 or "n" in r:  # large values switch to exponents sooner in Go; inf and nan
        return floatToGoString(v)
    return r


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


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
        self._headers = {
            name: f"# HELP {name} {_escape_help(spec.help)}\n# TYPE {name} "
                  f"{'counter' if spec.kind is MetricKind.COUNTER else 'gauge'}\n"
            for name, spec in self._specs.items()
        }
        # (name, labels) -> (value, rendered line, line prefix)
        self._lines: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, str, str]] = {}

    @property
    def specs(self) -> dict[str, MetricSpec]:
        return self._specs

    def _grouped(self) -> Iterator[tuple[str, MetricSpec, list[Sample]]]:
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
            yield name, spec, samples

    def render_text(self) -> bytes:
        """The exposition, byte for byte what prometheus-client renders from ``collect``.

        Each series' line is cached with its value: between cycles most values do not change
        (limits, identities, idle counters), so a scrape mostly joins cached strings."""
        out: list[str] = []
        lines = self._lines
        if len(lines) > _PREFIX_CACHE_MAX:
            lines.clear()
        for name, _spec, samples in self._grouped():
            out.append(self._headers[name])
            seen: set[tuple[tuple[str, str], ...]] = set()
            for s in samples:
                labels = s.labels
                if labels in seen:
                    continue
                seen.add(labels)
                key = (name, labels)
                cached = lines.get(key)
                if cached is not None and cached[0] == s.value:
                    out.append(cached[1])
                    continue
                if cached is not None:
                    prefix = cached[2]
                elif labels:
                    inner = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in sorted(labels))
                    prefix = f"{name}{{{inner}}} "
                else:
                    prefix = f"{name} "
                line = prefix + _format_value(s.value) + "\n"
                lines[key] = (s.value, line, prefix)
                out.append(line)
        return "".join(out).encode()

    def collect(self) -> Iterator[Metric]:
        for name, spec, samples in self._grouped():
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


def render(exporter: SnapshotExporter, extra: CollectorRegistry | None = None) -> bytes:
    """vigil's own series, then those of any add-on collectors (e.g. dcgm-exporter compatibility)
    registered in ``extra``."""
    body = exporter.render_text()
    return body + generate_latest(extra) if extra is not None else body
