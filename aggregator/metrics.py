"""The aggregator's own Prometheus metrics: intake, judgement and the fleet's state at a glance.

It holds the counters, histograms and gauges of intake, judging, decisions and deliveries, the breaker, the
store, leadership, the actuators' workers, the event loop, the garbage collector, the clocks and the fleet's
caps, in a registry of its own (no process-global state, so tests and the simulator build as many as they
like). It neither judges nor serves: app.py mounts ``render`` and supplies the readings.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import prometheus_client.metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from prometheus_client.utils import INF, floatToGoString

from vigil.aggregator.admission import SHED_REASONS
from vigil.aggregator.auth import Refusals
from vigil.aggregator.clock import ClockReading
from vigil.aggregator.fleet import EVICTION_KINDS
from vigil.contract.build_info import register_build_info

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Why a report was refused; every rejection is counted under one of these, so the series exist
# (at 0) before the first failure and an alert can rate() them.
REJECT_REASONS = ("unauthorized", "too_large", "invalid_json", "schema")
NODE_STATES = ("ok", "suspect", "failing", "silent")
DELIVERY_OUTCOMES = ("delivered", "failed", "dead")
# Where an actuator's total deadline was passed: a delivery, or the start-up reach check.
DEADLINE_PHASES = ("delivery", "check")
STORE_ERROR_KINDS = ("write", "file", "delivery_update", "dropped")
# Event kinds the agent sends (contract/wire.py's Event); any other kind is counted as "other", so a
# node cannot create series at will.
EVENT_KINDS = ("xid", "sxid", "gpu_lost", "mlx5_error", "link_down", "link_up", "link_flap", "counter_reset",
               "hang", "rank_exit", "nvml_unavailable")
OTHER_EVENT_KIND = "other"
# CPython's collector generations (gc.get_threshold() has one threshold each).
GC_GENERATIONS = ("0", "1", "2")

# Ingest is ~0.1 ms; evaluation of a 12,500-node fleet tens of ms.
_INGEST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
_EVALUATE_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Issue #20 holds intake p99 under 100 ms: the buckets around it are the ones that matter.
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _created_series() -> bool:
    """Whether counters and histograms expose ``_created`` (prometheus_client's switch, read as it reads it)."""
    return bool(getattr(prometheus_client.metrics, "_use_created", True))


class TallyCounter(PromCollector):
    """A counter without labels, exposed exactly as prometheus_client's ``Counter`` (``_total`` and
    ``_created``) and counted by ``value += n`` on the event loop's thread: the per-report counters
    cost 0.1 us each where ``Counter.inc`` (a lock and a value object) took 2.0 us, and the intake
    counts two or three a report (issue 47). tests/aggregator/test_metrics_tally.py holds the
    exposition to prometheus_client's."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.value = 0
        self.created = time.time()
        registry.register(self)

    def inc(self, n: int = 1) -> None:
        self.value += n

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        metric.add_sample(self.name + "_total", {}, float(self.value))
        if _created_series():
            metric.add_sample(self.name + "_created", {}, self.created)
        yield metric


class TallyHistogram(PromCollector):
    """A histogram without labels, exposed exactly as prometheus_client's ``Histogram`` (cumulative
    buckets, ``_count``, ``_sum``, ``_created``); ``observe`` puts a value in its bucket by bisection
    on the event loop's thread: 0.4 us where ``Histogram.observe`` (a locked value per bucket, a
    Python loop over the bounds) took 4.5 us for each report's ingest time (issue 47)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        bounds = [float(b) for b in buckets]
        if bounds[-1] != INF:
            bounds.append(INF)
        self.bounds = tuple(bounds)
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        # The first bucket whose bound is >= amount, as Histogram's ``amount <= bound`` scan finds it.
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        acc = 0.0
        for bound, n in zip(self.bounds, list(self.counts), strict=True):
            acc += n
            metric.add_sample(self.name + "_bucket", {"le": floatToGoString(bound)}, acc)
        metric.add_sample(self.name + "_count", {}, acc)
        if self.bounds[0] >= 0:
            metric.add_sample(self.name + "_sum", {}, self.sum)
        if _created_series():
            metric.add_sample(self.name + "_created", {}, self.created)
        yield metric


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


@dataclass
class ActingReadings:
    """The acting side at one scrape; app.py assembles it from the ledger, store and dispatcher."""

    decisions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # (action, detector, verdict)
    deliveries: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (actuator, outcome) attempts
    open_deliveries: Mapping[tuple[str, str], int] | None = None  # (actuator, store state), None: unreadable
    actuators: tuple[str, ...] = ()
    breaker_tripped: bool = False
    breaker_removals: int = 0
    breaker_budget: int = 0
    store_errors: Mapping[str, int] = field(default_factory=dict)
    store_ok: bool = True
    unstored: int = 0
    # Kubernetes Events the API server did not take (the actions themselves were unaffected);
    # None without the Kubernetes actuator.
    kubernetes_events_not_recorded: int | None = None
    # Policy groups (config-defined, so bounded; "default": nodes in no group), as GET /v1/gate shows
    # them: (group, mode, verdict) -> verdicts recorded, and each group's rows of Ledger.groups.
    group_decisions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    groups: Sequence[Mapping[str, object]] = ()
    # Each shadow rule's comparison with its acting detector (Engine.shadow_comparison).
    shadow: Sequence[Mapping[str, object]] = ()
    # (actuator, reason) -> deliveries an actuator refused as unverified before changing anything
    # (a job that is not the scheduler's id, or does not run on the decision's node, ...).
    actuator_refusals: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # Leadership of an HA pair (aggregator/leadership.py); a lone aggregator is always the leader.
    leader: bool = True
    leader_transitions: int = 0
    leadership_errors: int = 0
    leadership_fenced: int = 0  # stalled leaders this replica fenced
    leadership_relinquished: int = 0  # times this leader gave the lock up: its acting loop stalled
    # Each actuator's own workers (aggregator/dispatch.py) and the deadlines it passed, by phase.
    workers: Mapping[str, WorkersReading] = field(default_factory=dict)
    deadline_exceeded: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (actuator, phase)
    deliveries_not_acting: int = 0  # claimed, then not sent: this replica stopped acting meanwhile
    # Seconds since the acting loop (the dispatcher) completed a round; None: it does not run.
    round_age_seconds: float | None = None


@dataclass(frozen=True)
class WorkersReading:
    """One actuator's worker pool at a scrape."""

    size: int
    busy: int
    oldest_seconds: float  # how long the longest-running delivery or check has held its worker
    stalled: bool  # the last exchange cut off at the deadline, or every worker busy past it


CLOCK_STEP_SOURCES = ("aggregator", "fleet")


@dataclass
class FleetReadings:
    """The clocks and the fleet's bounds at one scrape; app.py assembles it from its clock, the
    fleet clock watch and the fleet."""

    clocks: ClockReading = field(default_factory=ClockReading)
    offset_seconds: float = 0.0  # the aggregator's wall clock minus its step-free clock
    steps: Mapping[str, int] = field(default_factory=dict)  # CLOCK_STEP_SOURCES -> steps seen
    evictions: Mapping[str, int] = field(default_factory=dict)  # EVICTION_KINDS -> entries evicted


class _Fleet(PromCollector):
    def __init__(self, readings: Callable[[], FleetReadings]) -> None:
        self._readings = readings

    def collect(self) -> Iterator[Metric]:
        r = self._readings()
        yield GaugeMetricFamily("vigil_aggregator_clock_offset_seconds",
                                "The aggregator's wall clock minus the step-free clock it judges on (0 until "
                                "the system clock is stepped; persisted times are off by this until a restart).",
                                value=r.offset_seconds)
        steps = CounterMetricFamily("vigil_aggregator_clock_steps", "Clock steps seen, by clock: aggregator (its "
                                    "own wall clock moved against its monotonic one) or fleet (most nodes' clocks "
                                    "moved by about the same offset at once). Neither changes any judgement.",
                                    labels=["clock"])
        for source in CLOCK_STEP_SOURCES:
            steps.add_metric([source], r.steps.get(source, 0))
        yield steps
        yield GaugeMetricFamily("vigil_aggregator_fleet_clock_offset_seconds",
                                "The median of the nodes' clocks minus the aggregator's (nodes heard from within "
                                "5 minutes): far from 0, the aggregator's clock is the odd one.",
                                value=r.clocks.median_offset_seconds)
        yield GaugeMetricFamily("vigil_aggregator_nodes_clock_skewed",
                                "Nodes whose clock is further than fleet.max_clock_skew_seconds from the "
                                "aggregator's (their reports are still used, their times placed on its clock).",
                                value=r.clocks.skewed)
        named = GaugeMetricFamily("vigil_aggregator_node_clock_skew_seconds",
                                  "A skewed node's clock minus the aggregator's (the 20 furthest).", labels=["node"])
        for node, offset in r.clocks.furthest:
            named.add_metric([node], offset)
        yield named
        evictions = CounterMetricFamily("vigil_aggregator_fleet_evictions", "Entries the fleet dropped to keep a "
                                        "node within its caps (fleet.max_*_per_node), by kind: the oldest a node's "
                                        "latest report no longer named.", labels=["kind"])
        for kind in EVICTION_KINDS:
            evictions.add_metric([kind], r.evictions.get(kind, 0))
        yield evictions


class _Acting(PromCollector):
    def __init__(self, readings: Callable[[], ActingReadings]) -> None:
        self._readings = readings

    def collect(self) -> Iterator[Metric]:
        r = self._readings()
        yield _counted("vigil_aggregator_decisions", "Verdicts recorded, by action (as admitted), detector "
                       "(alertmanager for proposals from Alertmanager) and verdict.", ["action", "detector", "verdict"],
                       r.decisions)
        deliveries = CounterMetricFamily("vigil_aggregator_deliveries", "Delivery attempts, by actuator and "
                                         "outcome (delivered, failed: will retry, dead: dead-lettered).",
                                         labels=["actuator", "outcome"])
        for actuator in r.actuators:
            for outcome in DELIVERY_OUTCOMES:
                deliveries.add_metric([actuator, outcome], r.deliveries.get((actuator, outcome), 0))
        yield deliveries
        pending = GaugeMetricFamily("vigil_aggregator_deliveries_pending",
                                    "Deliveries not yet done (pending, or failed and awaiting a retry).",
                                    labels=["actuator"])
        dead = GaugeMetricFamily("vigil_aggregator_deliveries_dead",
                                 "Dead-lettered deliveries kept in the store (retention removes them).",
                                 labels=["actuator"])
        got = r.open_deliveries
        if got is not None:  # None: the store cannot be read now (store_up says so)
            for actuator in sorted(set(r.actuators) | {a for a, _ in got}):
                pending.add_metric([actuator], got.get((actuator, "pending"), 0) + got.get((actuator, "failed"), 0))
                dead.add_metric([actuator], got.get((actuator, "dead"), 0))
        yield pending
        yield dead
        yield GaugeMetricFamily("vigil_aggregator_breaker_tripped",
                                "1 while the circuit breaker is open (automation stopped).",
                                value=int(r.breaker_tripped))
        yield GaugeMetricFamily("vigil_aggregator_breaker_removals",
                                "Distinct nodes removed within the breaker window.", value=r.breaker_removals)
        yield GaugeMetricFamily("vigil_aggregator_breaker_budget_nodes",
                                "Nodes the breaker lets the gate remove within its window.", value=r.breaker_budget)
        errors = CounterMetricFamily("vigil_aggregator_store_errors", "Decision store failures, by kind (write: "
                                     "a decision write; file: the file deleted or replaced; delivery_update; dropped: "
                                     "a proposal lost from the memory queue).",
                                     labels=["kind"])
        for kind in STORE_ERROR_KINDS:
            errors.add_metric([kind], r.store_errors.get(kind, 0))
        yield errors
        yield GaugeMetricFamily("vigil_aggregator_store_up", "1 when decisions can be made durable, 0 while the "
                                "store fails (/healthz answers 503).", value=int(r.store_ok))
        yield GaugeMetricFamily("vigil_aggregator_store_unstored_decisions",
                                "Proposals waiting in memory for the store to work again.", value=r.unstored)
        yield GaugeMetricFamily("vigil_aggregator_leader", "1 while this replica acts (holds the leadership lock, "
                                "or is a lone aggregator), 0 while it stands by.", value=int(r.leader))
        yield CounterMetricFamily("vigil_aggregator_leader_transitions", "Times this replica became the leader or "
                                  "stopped being it.", value=r.leader_transitions)
        yield CounterMetricFamily("vigil_aggregator_leadership_check_errors", "Leadership checks that failed on the "
                                  "database (connection lost, timeout); a leader stops acting at the first.",
                                  value=r.leadership_errors)
        refusals = CounterMetricFamily("vigil_aggregator_actuator_refusals", "Deliveries an actuator refused "
                                       "before changing anything, by actuator and reason (job_not_numeric, "
                                       "job_not_a_pod, job_not_found, job_not_on_node, node_not_found, "
                                       "not_drained_by_vigil, out_for_someone_else); each is also dead-lettered.",
                                       labels=["actuator", "reason"])
        for (actuator, reason), n in sorted(r.actuator_refusals.items()):
            refusals.add_metric([actuator, reason], n)
        yield refusals
        yield CounterMetricFamily("vigil_aggregator_leadership_fenced", "Stalled leaders this replica fenced: their "
                                  "recorded progress was older than ha.progress_timeout_seconds, so their lock session "
                                  "was terminated and the lock taken.", value=r.leadership_fenced)
        yield CounterMetricFamily("vigil_aggregator_leadership_relinquished", "Times this leader gave the lock up "
                                  "because its own acting loop completed no round within "
                                  "ha.progress_timeout_seconds.", value=r.leadership_relinquished)
        if r.round_age_seconds is not None:
            yield GaugeMetricFamily("vigil_aggregator_acting_round_age_seconds", "Seconds since the delivery loop "
                                    "last completed a round (it does every poll when idle; HA leadership follows "
                                    "it).", value=r.round_age_seconds)
        yield CounterMetricFamily("vigil_aggregator_deliveries_not_acting", "Deliveries claimed and then not sent: "
                                  "this replica stopped acting (leadership or its lease lost) before the send.",
                                  value=r.deliveries_not_acting)
        size = GaugeMetricFamily("vigil_aggregator_actuator_workers", "Worker threads of the actuator's own pool "
                                 "(actuators.delivery.workers).", labels=["actuator"])
        busy = GaugeMetricFamily("vigil_aggregator_actuator_busy_workers", "The actuator's workers busy with a "
                                 "delivery or a check now (one past its deadline stays busy until the actuator "
                                 "returns).", labels=["actuator"])
        oldest = GaugeMetricFamily("vigil_aggregator_actuator_oldest_in_flight_seconds", "How long the actuator's "
                                   "longest-running delivery or check has held its worker (0: none).",
                                   labels=["actuator"])
        stalled = GaugeMetricFamily("vigil_aggregator_actuator_stalled", "1 while the actuator's target answers "
                                    "nothing within its deadline (its last exchange was cut off there) or every "
                                    "worker is busy past it; other actuators go on.",
                                    labels=["actuator"])
        exceeded = CounterMetricFamily("vigil_aggregator_actuator_deadline_exceeded", "Deliveries and start-up "
                                       "checks cut off at the actuator's total deadline (timeout_seconds), by "
                                       "actuator and phase (delivery, check).", labels=["actuator", "phase"])
        for actuator in sorted(r.workers):
            w = r.workers[actuator]
            size.add_metric([actuator], w.size)
            busy.add_metric([actuator], w.busy)
            oldest.add_metric([actuator], w.oldest_seconds)
            stalled.add_metric([actuator], int(w.stalled))
            for phase in DEADLINE_PHASES:
                exceeded.add_metric([actuator, phase], r.deadline_exceeded.get((actuator, phase), 0))
        yield from (size, busy, oldest, stalled, exceeded)
        yield from _policy(r)
        if r.kubernetes_events_not_recorded is not None:
            yield CounterMetricFamily("vigil_aggregator_kubernetes_events_not_recorded",
                                      "Kubernetes Events on Nodes the API server refused or did not answer "
                                      "(the node actions themselves went on).",
                                      value=r.kubernetes_events_not_recorded)


def _counted(name: str, doc: str, labels: list[str], counts: Mapping[tuple[str, str, str], int]) -> Metric:
    """A counter family with one series per key of ``counts`` (its label values, in ``labels``' order)."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, n in sorted(counts.items()):
        family.add_metric(list(values), n)
    return family


def _policy(r: ActingReadings) -> Iterator[Metric]:
    """Policy groups and shadow rules (docs/gate.md): both config-defined, so their labels stay bounded."""
    nodes = GaugeMetricFamily("vigil_gate_group_nodes", "A policy group's nodes that reported within the breaker "
                              "window (group default: nodes in no group).", labels=["group", "mode"])
    removed = GaugeMetricFamily("vigil_gate_group_removals", "Distinct nodes of the group removed within the "
                                "breaker window.", labels=["group"])
    budget = GaugeMetricFamily("vigil_gate_group_budget_nodes", "The group's own breaker budget (absent: only the "
                               "global breaker counts).", labels=["group"])
    for g in r.groups:
        name = str(g["name"])
        breaker = g["breaker"]
        assert isinstance(breaker, Mapping)
        nodes.add_metric([name, str(g["mode"])], float(g["members"]))  # type: ignore[arg-type]
        removed.add_metric([name], float(breaker["removals_in_window"]))
        if breaker["budget"] is not None:
            budget.add_metric([name], float(breaker["budget"]))
    yield from (nodes, removed, budget)
    yield _counted("vigil_gate_decisions", "Verdicts recorded, by the policy group of the node, its mode (act, "
                   "alert, dry_run) and the verdict (group_alert, group_dry_run, group_budget, shadow, admitted...).",
                   ["group", "mode", "verdict"], r.group_decisions)
    shadow = GaugeMetricFamily("vigil_gate_shadow_subjects", "A shadow rule's current subjects (node, or node and "
                               "GPU) against its acting detector's, by agreement (both, shadow_only, acting_only).",
                               labels=["rule", "agreement"])
    for c in r.shadow:
        for agreement, key in (("both", "both"), ("shadow_only", "shadow_only_count"),
                               ("acting_only", "acting_only_count")):
            shadow.add_metric([str(c["rule"]), agreement], float(c[key]))  # type: ignore[arg-type]
    yield shadow


class AggregatorMetrics:
    def __init__(self, node_states: Callable[[], Mapping[str, int]],
                 acting: Callable[[], ActingReadings] | None = None,
                 fleet: Callable[[], FleetReadings] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Counted on each report taken: tallies (exposed as prometheus_client's, a tenth of the cost).
        self.reports = TallyCounter("vigil_aggregator_reports", "Reports accepted and ingested.", r)
        self.rejections = Counter("vigil_aggregator_report_rejections",
                                  "Reports refused, by reason.", ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason)
        self.events_received = Counter("vigil_aggregator_events_received",
                                       "Events carried by accepted reports, by kind (other: a kind the agent "
                                       "does not send); a replayed report's events count again (dedup absorbs "
                                       "them).", ["kind"], registry=r)
        for kind in (*EVENT_KINDS, OTHER_EVENT_KIND):
            self.events_received.labels(kind)
        self.ingest_seconds = TallyHistogram("vigil_aggregator_ingest_duration_seconds",
                                             "Time to validate and ingest one report.", _INGEST_BUCKETS, r)
        self.evaluate_seconds = Histogram("vigil_aggregator_evaluate_duration_seconds",
                                          "Time to run every detector over the fleet once.",
                                          buckets=_EVALUATE_BUCKETS, registry=r)
        self.last_evaluation = Gauge("vigil_aggregator_last_evaluation_timestamp_seconds",
                                     "When the last evaluation of the fleet finished (Unix time).", registry=r)
        self.loop_lag = Gauge("vigil_aggregator_event_loop_lag_seconds",
                              "How late the event loop ran a 0.25 s timer, at the last measurement.", registry=r)
        self.loop_lag_observed = Histogram("vigil_aggregator_event_loop_lag_observed_seconds",
                                           "How late the event loop ran each 0.25 s timer: every measurement "
                                           "(intake waits this long behind whatever held the loop).",
                                           buckets=_LAG_BUCKETS, registry=r)
        self.judge_seconds = Histogram("vigil_aggregator_judge_duration_seconds",
                                       "Time the detectors took over the fleet once, on the judging thread "
                                       "(reports are held, not refused, meanwhile).",
                                       buckets=_EVALUATE_BUCKETS, registry=r)
        self.gc_pause_seconds = Histogram("vigil_aggregator_gc_pause_seconds",
                                          "How long each cyclic garbage collection stopped the whole process "
                                          "(intake and judging), by generation (2: a full collection, its "
                                          "length grows with the objects the fleet keeps tracked).",
                                          ["generation"], buckets=_LAG_BUCKETS, registry=r)
        for generation in GC_GENERATIONS:
            self.gc_pause_seconds.labels(generation)
        self.held_reports = TallyCounter("vigil_aggregator_reports_held",
                                         "Accepted reports held back while the detectors read the fleet, ingested "
                                         "right after.", r)
        self.held_now = Gauge("vigil_aggregator_reports_held_now",
                              "Accepted reports waiting to enter the fleet now (held while the detectors "
                              "read it, then ingested in batches; server.admission.max_held_reports).", registry=r)
        self.shed = Counter("vigil_aggregator_reports_shed", "Reports not taken because the aggregator was behind on "
                            "its work (answered 503, or 429 over server.admission.max_reports_per_second, with "
                            "Retry-After), by reason: held_full, loop_lag, rate. The agent keeps "
                            "the report's events and resends later.", ["reason"], registry=r)
        for reason in SHED_REASONS:
            self.shed.labels(reason)
        self.ingest_failures = Counter("vigil_aggregator_ingest_failures",
                                       "Reports that passed every check and still failed to enter the fleet (a "
                                       "defect: the log has its traceback); the others are ingested regardless.",
                                       registry=r)
        self.actuator_up = Gauge("vigil_aggregator_actuator_up", "1 when the actuator's start-up check reached "
                                 "its target, 0 when it did not.", ["actuator"], registry=r)
        r.register(_NodeStates(node_states))
        self.refusals = Refusals(r)  # every door's refusals (aggregator/auth.py declares it)
        r.register(_Acting(acting or ActingReadings))
        r.register(_Fleet(fleet or FleetReadings))
        register_build_info(r, "aggregator")

    def count_events(self, kinds: Iterable[str]) -> None:
        """Count an accepted report's events under their kinds (unknown kinds as "other")."""
        for kind, n in collections.Counter(k if k in EVENT_KINDS else OTHER_EVENT_KIND for k in kinds).items():
            self.events_received.labels(kind).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
