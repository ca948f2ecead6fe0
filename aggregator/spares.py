"""The spare pool: healthy idle nodes a job restarted without a bad node can land on, so it keeps its size.

It reads the pool's members from the scheduler through a reader the app supplies (the Slurm or Kubernetes
actuator's ``spare_nodes``) and sizes the pool by a stated binomial rule on the fleet's observed removal rate,
exporting the count, the recommendation and the draws and answering ``wants_spare`` for a verified node. It
removes no node and decides no restart (docs/goodput.md, "The spare pool").
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from pydantic import Field

from vigil.contract.validation import StrictModel

# Why a read of the pool failed (vigil_aggregator_spares_read_errors_total).
READ_ERRORS = ("timeout", "error")


class SparesConfig(StrictModel):
    enabled: bool = False
    # Slurm: an idle node (no DRAIN, DOWN, ... flag) with this active feature is a spare.
    slurm_feature: str = Field(default="vigil_spare", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # Kubernetes: a Ready, schedulable node with this label (key=value) is a spare.
    kubernetes_label: str = Field(default="vigil.io/spare=true",
                                  pattern=r"^[A-Za-z0-9_./-]{1,253}=[A-Za-z0-9_.-]{0,63}$")
    # The sizing rule's risk: P(more nodes fail within refill_seconds than the pool holds).
    risk: float = Field(default=0.01, gt=0, lt=1)
    # How long a removed node takes to come back verified (repair, reboot, probes): the pool must
    # cover the failures within it. A day: a hardware ticket's usual turnaround.
    refill_seconds: float = Field(default=86400.0, gt=0)
    # The failure rate before there is history: Llama 3 (Meta, 2024), 419 unexpected interruptions
    # in 54 days on 16,384 GPUs (2,048 nodes of 8) = 1.6e-4 per node-hour, weighted as this many
    # node-hours of observation (a gamma prior): ~1,000 nodes observed for 10 h outweigh it.
    prior_rate_per_node_hour: float = Field(default=1.6e-4, ge=0)
    prior_node_hours: float = Field(default=10_000.0, gt=0)
    # Removals counted over at most this much of the gate's history (it keeps 7 days).
    history_seconds: float = Field(default=7 * 86400.0, gt=0)
    # How often the pool is read, and the total deadline of one read.
    refresh_seconds: float = Field(default=60.0, gt=0)
    timeout_seconds: float = Field(default=20.0, gt=0)
    # Add the feature to a node vigil resumed after verification while the pool is short (Slurm).
    refill: bool = True


def failure_rate(removals: int, node_hours: float, config: SparesConfig) -> float:
    """Removals per node-hour: the gamma posterior mean with the configured prior."""
    return (removals + config.prior_rate_per_node_hour * config.prior_node_hours) / (
        max(node_hours, 0.0) + config.prior_node_hours)


def recommended_spares(nodes: int, rate_per_node_hour: float, refill_seconds: float, risk: float) -> int:
    """The smallest S with P(X > S) <= ``risk``, X ~ Binomial(``nodes``, p), p the chance that one
    node fails within ``refill_seconds`` at ``rate_per_node_hour`` (1 - exp(-rate t))."""
    if nodes <= 0 or rate_per_node_hour <= 0:
        return 0
    p = -math.expm1(-rate_per_node_hour * refill_seconds / 3600.0)
    if p >= 1.0:
        return nodes
    # pmf(k + 1) = pmf(k) (n - k) / (k + 1) p / (1 - p), in logs so large fleets do not underflow.
    log_pmf = nodes * math.log1p(-p)
    ratio = math.log(p) - math.log1p(-p)
    cdf = 0.0
    for k in range(nodes + 1):
        cdf += math.exp(log_pmf)
        if 1.0 - cdf <= risk:
            return k
        log_pmf += math.log(nodes - k) - math.log(k + 1) + ratio if k < nodes else 0.0
    return nodes


class SparePool:
    """The pool as last read. ``available`` is None until a read succeeded."""

    def __init__(self, config: SparesConfig) -> None:
        self.config = config
        self.members: frozenset[str] = frozenset()
        self.available: int | None = None
        self.recommended = 0
        self.rate_per_node_hour = config.prior_rate_per_node_hour
        self.draws = 0
        self.read_errors: Counter[str] = Counter(dict.fromkeys(READ_ERRORS, 0))
        # Verified nodes the Slurm actuator added to the pool, and failed to (the app wires it).
        self.refills: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def observe(self, members: Iterable[str]) -> None:
        """A successful read: the pool's members now. A member gone since the last read was
        drawn (the scheduler gave it work, a restart landed on it, or it left service)."""
        now = frozenset(members)
        if self.available is not None:
            self.draws += len(self.members - now)
        self.members = now
        self.available = len(now)

    def failed(self, reason: str) -> None:
        self.read_errors[reason if reason in READ_ERRORS else "error"] += 1

    def size(self, nodes: int, removals: int, node_hours: float) -> int:
        """The recommendation for ``nodes`` nodes, from ``removals`` seen over ``node_hours``."""
        self.rate_per_node_hour = failure_rate(removals, node_hours, self.config)
        self.recommended = recommended_spares(nodes, self.rate_per_node_hour, self.config.refill_seconds,
                                              self.config.risk)
        return self.recommended

    def wants_spare(self) -> bool:
        """Whether a verified node should join the pool: it is known and short of the recommendation."""
        return self.config.refill and self.available is not None and self.available < self.recommended

    def collector(self) -> PromCollector:
        return _PoolMetrics(self)


class _PoolMetrics(PromCollector):
    def __init__(self, pool: SparePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        p = self._pool
        if p.available is not None:
            yield GaugeMetricFamily("vigil_aggregator_spares_available",
                "Spare nodes in the pool at the last read (Slurm: "
                "idle with spares.slurm_feature; Kubernetes: Ready, schedulable, labelled "
                "spares.kubernetes_label).", value=p.available)
        yield GaugeMetricFamily("vigil_aggregator_spares_recommended",
            "The pool size the sizing rule asks for: the smallest S "
            "with P(more than S nodes fail within spares.refill_seconds) <= spares.risk.",
            value=p.recommended)
        yield GaugeMetricFamily("vigil_aggregator_spares_failure_rate_per_node_hour",
            "The fleet's removal rate the sizing "
            "rule uses (observed removals with the configured prior).",
            value=p.rate_per_node_hour)
        yield CounterMetricFamily("vigil_aggregator_spare_draws",
            "Spare nodes that left the pool between two reads (a job, "
            "a restart's landing, or out of service).", value=p.draws)
        added, failed = p.refills()
        refills = CounterMetricFamily("vigil_aggregator_spares_refills",
            "Nodes resumed after verification while the pool "
            "was short, by outcome (added: given the pool's feature; failed: the "
            "update was refused, the resume stands).", labels=["outcome"])
        refills.add_metric(["added"], added)
        refills.add_metric(["failed"], failed)
        yield refills
        errors = CounterMetricFamily("vigil_aggregator_spares_read_errors", "Reads of the pool that failed, by reason "
                                     "(timeout: past spares.timeout_seconds; error: the scheduler refused or "
                                     "answered what could not be read).", labels=["reason"])
        for reason in READ_ERRORS:
            errors.add_metric([reason], p.read_errors[reason])
        yield errors
