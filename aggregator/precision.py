"""Precision from outcomes: per detector and rule, a Beta posterior of how often its removals were right.

It reads the decisions the ledger admits (``observe``), each evaluation's look at the fleet
(``observe_fleet``) and operators' ticket verdicts, labels each removal it follows with outcomes.py,
records labels and rule standings in the store, and publishes each rule's posterior; a rule below its
target with high confidence is demoted (its removing proposals become alerts before the gate judges
them, ``demote``) and promoted back on evidence or by an operator. It acts on nothing itself.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from pydantic import Field

from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision, Finding
from vigil.aggregator.fleet import FleetView
from vigil.aggregator.outcomes import (
    CONFIRMED,
    LABELS,
    NOT_CONFIRMED,
    Followed,
    Outcome,
    after_clean_pass,
    after_decision,
    follows,
    from_ticket,
    rule_of,
)
from vigil.aggregator.store import WRITE_ERRORS, Store
from vigil.contract.validation import StrictModel

log = logging.getLogger("vigil.aggregator.precision")

# Removals followed in memory at most (each a few hundred bytes); beyond it the oldest is let go (its
# row stays in the store, unlabelled). (detector, rule) pairs at most: rule names are code constants.
MAX_FOLLOWED = 10_000
MAX_RULES = 256
# A given-back node counts as reporting while its last report is at most this many intervals old.
REPORTING_INTERVALS = 3.0


class PrecisionConfig(StrictModel):
    """Off by default: label removals by what happened next, publish each rule's precision, and
    demote a rule whose precision is below its target with high confidence (docs/precision.md)."""

    enabled: bool = False
    # The precision a rule must keep to act: 0.8 means at most one removal in five was not needed. A
    # false drain costs a node for hours and its job a restart, as a missed fault does (DESIGN.md
    # section 7); a rule wrong more often than that costs more than an alert a person reads.
    target: float = Field(default=0.8, gt=0, lt=1)
    # The target of a detector's rules where it differs (detector section name -> target).
    targets: dict[str, float] = Field(default_factory=dict, max_length=64)
    # How sure the posterior must be: demoted when P(precision < target) >= this, promoted back when
    # P(precision >= target) >= this. 0.95, the usual one-sided test level.
    confidence: float = Field(default=0.95, ge=0.5, lt=1)
    # The central credible interval published (vigil_detector_precision_lower / _upper).
    interval: float = Field(default=0.9, gt=0, lt=1)
    # The Beta prior, a weak optimistic one: Beta(8, 2) has its mean at the default target (a new rule
    # is presumed as good as it must be) and weighs 10 removals, so the first labels cannot swing it.
    # Beta(1, 1) would demote a rule after ONE unconfirmed removal (P(p < 0.8) = 1 - 0.2^2 = 0.96).
    # With Beta(8, 2), target 0.8 and confidence 0.95 a rule whose removals are all unconfirmed is
    # demoted at the 4th (P(p < 0.8) = 0.93 after 3, 0.97 after 4); simulated over 200 removals (400
    # runs), a rule of true precision 0.9 is demoted wrongly in 0.25% of runs, one of 0.85 in 3%, one of
    # 0.3 after a median of 4 unconfirmed removals (docs/precision.md, "Choosing the numbers").
    prior_confirmed: float = Field(default=8.0, gt=0, le=1000)
    prior_unconfirmed: float = Field(default=2.0, gt=0, le=1000)
    # A node given back that ran this long with a job on it, reporting, with no removing finding, was
    # not faulty when removed (a day covers a diurnal load cycle and most intermittent faults' return).
    clean_run_seconds: float = Field(default=86400.0, gt=0)
    # The same rule removing the node again within this long after it was given back confirms the
    # first removal (a week: the gate's history horizon is of the same order).
    recurrence_horizon_seconds: float = Field(default=7 * 86400.0, gt=0)

    def target_of(self, detector: str) -> float:
        return self.targets.get(detector, self.target)


# -- the Beta posterior (pure) ---------------------------------------------------------------------

def _beta_cf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def beta_cdf(x: float, a: float, b: float) -> float:
    """P(X <= x) for X ~ Beta(a, b): the regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def beta_quantile(q: float, a: float, b: float) -> float:
    """The x with P(X <= x) = q (bisection: 60 halvings reach 1e-18)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Posterior:
    """One rule's precision: Beta(prior + confirmed, prior + unconfirmed)."""

    confirmed: int
    unconfirmed: int
    alpha: float
    beta: float

    @classmethod
    def of(cls, confirmed: int, unconfirmed: int, config: PrecisionConfig) -> Posterior:
        return cls(confirmed, unconfirmed, config.prior_confirmed + confirmed, config.prior_unconfirmed + unconfirmed)

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def below(self, target: float) -> float:
        """P(precision < target)."""
        return beta_cdf(target, self.alpha, self.beta)

    def interval(self, mass: float) -> tuple[float, float]:
        tail = (1.0 - mass) / 2
        return beta_quantile(tail, self.alpha, self.beta), beta_quantile(1.0 - tail, self.alpha, self.beta)

    def as_evidence(self, target: float) -> dict[str, Any]:
        return {"confirmed": self.confirmed, "unconfirmed": self.unconfirmed, "mean": round(self.mean, 4),
                "target": target, "p_below_target": round(self.below(target), 4),
                "prior": [self.alpha - self.confirmed, self.beta - self.unconfirmed]}


def standing_change(demoted: bool, posterior: Posterior, target: float, confidence: float) -> bool | None:
    """The rule's new standing if the posterior moves it (True: demote, False: promote), else None."""
    below = posterior.below(target)
    if not demoted and below >= confidence:
        return True
    if demoted and 1.0 - below >= confidence:
        return False
    return None


# -- the owner -----------------------------------------------------------------------------------

class TicketRefused(ValueError):
    """An operator call that cannot be applied: ``reason`` (the 4xx reason) and why."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


class Precision:
    """The one owner of the followed removals, the labels' counts and the rules' standing (read
    back from ``store`` at start). Called on the thread that owns the ledger; the operator calls
    and the metrics take its lock."""

    def __init__(self, config: PrecisionConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self._lock = threading.RLock()
        self.followed: dict[str, Followed] = {}  # decision id -> removal not labelled yet
        self.counts: dict[tuple[str, str], dict[str, int]] = {}
        self.demoted: dict[tuple[str, str], dict[str, Any]] = {}  # (detector, rule) -> why
        self.store_errors = 0
        for decision_id, ts, node, detector, rule, label, body in store.outcomes():
            if label:
                self._count(detector, rule, label)
            else:
                self.followed[decision_id] = Followed(
                    decision_id, node, detector, rule, Action(body["action"]), ts, body.get("resumed"),
                    float(body.get("clean_seconds", 0.0)))
        for key, (demoted, _, why) in store.rule_standings().items():
            self._counts_of(*key)
            if demoted:
                self.demoted[key] = why

    def _counts_of(self, detector: str, rule: str) -> dict[str, int]:
        return self.counts.setdefault((detector, rule), dict.fromkeys(LABELS, 0))

    def _count(self, detector: str, rule: str, label: str) -> None:
        if (detector, rule) in self.counts or len(self.counts) < MAX_RULES:
            self._counts_of(detector, rule)[label] += 1

    def posterior(self, detector: str, rule: str) -> Posterior:
        c = self.counts.get((detector, rule), dict.fromkeys(LABELS, 0))
        return Posterior.of(c[CONFIRMED], c[NOT_CONFIRMED], self.config)

    # -- before the gate ------------------------------------------------------------------------

    def demote(self, decision: Decision) -> Decision:
        """``decision`` as the gate is to judge it: an alert, with the demotion in its evidence, when
        it would remove a node for a demoted rule; else unchanged."""
        if decision.action not in REMOVING_ACTIONS or decision.node is None:
            return decision
        key = (decision.detector, rule_of(decision))
        why = self.demoted.get(key)
        if why is None:
            return decision
        return decision.model_copy(update={
            "action": Action.ALERT, "reason": f"{decision.reason} (demoted to alert: rule {key[0]}/{key[1]})",
            "evidence": {**decision.evidence, "demoted": {
                "proposed_action": decision.action.value, "rule": key[1],
                **self.posterior(*key).as_evidence(self.config.target_of(key[0]))}}})

    # -- evidence -----------------------------------------------------------------------------

    def observe(self, admitted: Sequence[Decision], now: float) -> None:
        """The decisions the ledger just made durable: a removal is followed, any later decision on
        a followed node may label it."""
        with self._lock:
            for d in admitted:
                for f in [f for f in self.followed.values() if f.node == d.node]:
                    g, outcome = after_decision(f, d, now, self.config.recurrence_horizon_seconds)
                    self._update(f, g, outcome, now)
                if follows(d):
                    self._follow(Followed.of(d, now))

    def watching(self) -> bool:
        return any(f.resumed is not None for f in self.followed.values())

    def observe_fleet(self, view: FleetView, findings: Sequence[Finding], now: float) -> None:
        """One evaluation's look at the nodes given back: clean when reporting, under a job and free
        of removing findings."""
        with self._lock:
            given_back = [f for f in self.followed.values() if f.resumed is not None]
            if not given_back:
                return
            loaded = {n for job in view.jobs.values() for n in job.nodes()}
            faulty = {f.node for f in findings if f.action in REMOVING_ACTIONS}
            for f in given_back:
                node = view.nodes.get(f.node)
                clean = (node is not None and now - node.last_seen <= REPORTING_INTERVALS * node.interval_seconds
                         and f.node in loaded and f.node not in faulty)
                g, outcome = after_clean_pass(f, now, clean, self.config.clean_run_seconds)
                self._update(f, g, outcome, now)

    def close_ticket(self, decision_id: str, fault: bool, note: str, now: float) -> Outcome:
        """An operator's verdict on the hardware ticket of one followed removal."""
        with self._lock:
            f = self.followed.get(decision_id)
            if f is None:
                labelled = next((r for r in self.store.outcomes() if r[0] == decision_id), None)
                if labelled is not None:
                    raise TicketRefused(409, "already_labelled", f"decision {decision_id} is labelled {labelled[5]} "
                                        "already (a label is final)")
                raise TicketRefused(404, "unknown_decision", f"no removal {decision_id} is followed")
            outcome = from_ticket(f, now, fault, note)
            self._update(f, f, outcome, now)
            return outcome

    def promote(self, detector: str, rule: str, now: float, note: str) -> dict[str, Any]:
        """An operator gives a demoted rule back its action."""
        with self._lock:
            if (detector, rule) not in self.demoted:
                raise TicketRefused(409, "not_demoted", f"rule {detector}/{rule} is not demoted")
            self._set_standing(detector, rule, False, now, "operator", note)
            return self.rule(detector, rule)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _follow(self, f: Followed) -> None:
        if f.decision_id in self.followed:
            return
        self._write(f, "", {})
        self.followed[f.decision_id] = f
        while len(self.followed) > MAX_FOLLOWED:
            gone = next(iter(self.followed))
            del self.followed[gone]
            log.warning("precision: more than %d removals followed; %s let go unlabelled", MAX_FOLLOWED, gone)

    def _update(self, before: Followed, after: Followed, outcome: Outcome | None, now: float) -> None:
        if outcome is None:
            if after != before:
                self.followed[after.decision_id] = after
                if after.resumed != before.resumed:  # a resume is worth keeping across a restart
                    self._write(after, "", {})
            return
        del self.followed[after.decision_id]
        self._write(after, outcome.label, outcome.as_evidence())
        self._count(after.detector, after.rule, outcome.label)
        log.info("precision: removal %s of %s (%s/%s) %s: %s", after.decision_id, after.node, after.detector,
                 after.rule, outcome.label, outcome.detail)
        key = (after.detector, after.rule)
        change = standing_change(key in self.demoted, self.posterior(*key), self.config.target_of(after.detector),
                                 self.config.confidence)
        if change is not None:
            self._set_standing(*key, change, now, "auto", outcome.detail)

    def _write(self, f: Followed, label: str, evidence: dict[str, Any]) -> None:
        try:
            self.store.write_outcome(f.decision_id, f.ts, f.node, f.detector, f.rule, label,
                                     {**f.as_body(), "outcome": evidence} if label else f.as_body())
        except WRITE_ERRORS as exc:
            self.store_errors += 1
            log.error("precision: could not record the outcome of %s in the store: %s", f.decision_id, exc)

    def _set_standing(self, detector: str, rule: str, demoted: bool, now: float, actor: str, note: str) -> None:
        target = self.config.target_of(detector)
        why = {**self.posterior(detector, rule).as_evidence(target), "actor": actor, "ts": now, "note": note}
        try:
            self.store.write_rule_standing(detector, rule, demoted, now, actor, why)
        except WRITE_ERRORS as exc:  # unrecorded, so not applied: the next label tries again
            self.store_errors += 1
            log.error("precision: could not record rule %s/%s %s: %s", detector, rule,
                      "demoted" if demoted else "promoted", exc)
            return
        if demoted:
            self.demoted[(detector, rule)] = why
            log.error("precision: rule %s/%s DEMOTED to alert (%s): P(precision < %.2f) = %.3f after %d confirmed, "
                      "%d not confirmed", detector, rule, actor, target, why["p_below_target"], why["confirmed"],
                      why["unconfirmed"])
        else:
            self.demoted.pop((detector, rule), None)
            log.warning("precision: rule %s/%s promoted back to act (%s): P(precision < %.2f) = %.3f", detector, rule,
                        actor, target, why["p_below_target"])

    # -- reading --------------------------------------------------------------------------------

    def rule(self, detector: str, rule: str) -> dict[str, Any]:
        p = self.posterior(detector, rule)
        target = self.config.target_of(detector)
        lower, upper = p.interval(self.config.interval)
        return {"detector": detector, "rule": rule, **p.as_evidence(target), "lower": round(lower, 4),
                "upper": round(upper, 4), "demoted": (detector, rule) in self.demoted,
                "followed": sum(1 for f in self.followed.values() if (f.detector, f.rule) == (detector, rule))}

    def rules(self) -> list[dict[str, Any]]:
        with self._lock:
            keys = sorted({*self.counts, *((f.detector, f.rule) for f in self.followed.values())})[:MAX_RULES]
            return [self.rule(*k) for k in keys]

    def collector(self) -> PromCollector:
        return _PrecisionCollector(self)


class _PrecisionCollector(PromCollector):
    def __init__(self, precision: Precision) -> None:
        self.precision = precision

    def collect(self) -> Iterator[Metric]:
        labels = ["detector", "rule"]
        mean = GaugeMetricFamily("vigil_detector_precision", "Posterior mean precision of a rule's removals "
                                 "(confirmed / labelled, with the Beta prior)", labels=labels)
        lower = GaugeMetricFamily("vigil_detector_precision_lower", "Lower end of the rule's central credible "
                                  "interval of precision (precision.interval)", labels=labels)
        upper = GaugeMetricFamily("vigil_detector_precision_upper", "Upper end of the rule's central credible "
                                  "interval of precision", labels=labels)
        target = GaugeMetricFamily("vigil_detector_precision_target", "The precision the rule must keep to act",
                                   labels=labels)
        demoted = GaugeMetricFamily("vigil_detector_demoted", "1 while the rule is demoted from act to alert",
                                    labels=labels)
        followed = GaugeMetricFamily("vigil_detector_removals_followed", "The rule's removals not labelled yet",
                                     labels=labels)
        outcomes = CounterMetricFamily("vigil_detector_outcomes", "The rule's removals labelled, by label",
                                       labels=[*labels, "label"])
        for r in self.precision.rules():
            key = [r["detector"], r["rule"]]
            mean.add_metric(key, r["mean"])
            lower.add_metric(key, r["lower"])
            upper.add_metric(key, r["upper"])
            target.add_metric(key, r["target"])
            demoted.add_metric(key, 1.0 if r["demoted"] else 0.0)
            followed.add_metric(key, r["followed"])
            outcomes.add_metric([*key, CONFIRMED], r["confirmed"])
            outcomes.add_metric([*key, NOT_CONFIRMED], r["unconfirmed"])
        errors = CounterMetricFamily("vigil_precision_store_errors", "Outcomes or rule standings the store "
                                     "could not record")
        errors.add_metric([], self.precision.store_errors)
        yield from (mean, lower, upper, target, demoted, followed, outcomes, errors)

