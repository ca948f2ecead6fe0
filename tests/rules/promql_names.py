"""Metric names used by a PromQL expression, and the catalog they must come from.

A small lexer, not a parser: promtool checks syntax; this only has to find every series selector's
name. String literals, label matchers, durations, grouping clauses and function names are removed;
what is left that looks like an identifier is a metric name.
"""

from __future__ import annotations

import re

from vigil.agent.catalog import agent_specs

# Series Prometheus makes itself (target health, alert state) rather than scraping them.
PROMETHEUS_BUILTINS = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped", "ALERTS",
                                  "ALERTS_FOR_STATE"})

_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                       "offset", "bool", "atan2", "inf", "nan", "Inf", "NaN", "start", "end"})
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS_RE = re.compile(r"\{[^{}]*\}")
_RANGE_RE = re.compile(r"\[[^\]]*\]")
_GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT_RE = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (function names and keywords excluded)."""
    text = _STRING_RE.sub('""', expr)
    text = _MATCHERS_RE.sub("", text)
    text = _RANGE_RE.sub("", text)
    # `sum by (x) (...)` -> `sum (...)`, so the aggregation reads as a call like any function.
    text = _GROUPING_RE.sub(lambda m: "" if m.group(1) in ("by", "without") else m.group(1), text)
    text = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?[smhdwy]?\b", " ", text)  # numbers and durations
    names: set[str] = set()
    for m in _IDENT_RE.finditer(text):
        name, call = m.group(1), m.group(2)
        if call or name in _KEYWORDS:
            continue
        names.add(name)
    return names


def aggregator_names() -> set[str]:
    """Series names the aggregator's /metrics carries (aggregator/metrics.py builds prometheus-client
    metrics, not MetricSpecs, so they are listed from a throw-away instance's registry)."""
    try:
        from vigil.aggregator.fleet import Fleet
        from vigil.aggregator.metrics import AggregatorMetrics
        from vigil.aggregator.outbox import Outbox
        from vigil.aggregator.precision import Precision, PrecisionConfig
        from vigil.aggregator.prober import Prober, ProbesConfig
        from vigil.aggregator.spares import SparePool, SparesConfig
        from vigil.aggregator.store import Store
        from vigil.aggregator.tokenreview import review_families
    except ImportError:  # not landed yet: no aggregator metric can be used
        return set()
    names: set[str] = set()
    # The TokenReview client's series are registered beside them when auth.kubernetes is on; the
    # node-action outbox's and the prober's always (aggregator/app.py).
    outbox = Outbox(None)
    # The spare pool's and the job-recovery planner's when enabled; the pool's count once read.
    pool = SparePool(SparesConfig(enabled=True))
    pool.observe([])
    for family in [*AggregatorMetrics(lambda: {}).registry.collect(), *review_families({}, 0, 0),
                   *outbox.collector().collect(), *Prober(ProbesConfig(), outbox, Fleet()).collector().collect(),
                   *pool.collector().collect(), *Precision(PrecisionConfig(), Store(":memory:")).collector().collect()]:
        # A labelled metric with no children yet has no samples, so names come from the type.
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count", "")}.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
    return names


def catalog_names() -> set[str]:
    names: set[str] = set(PROMETHEUS_BUILTINS)
    names.update(spec.name for spec in agent_specs())
    return names | aggregator_names()
