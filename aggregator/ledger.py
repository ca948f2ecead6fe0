"""Admission: proposed decisions judged by the gate and made durable in the store, or kept until they can be.

``Ledger``, the engine's ``DecisionSink``, reads each proposal not already admitted, asks the ``Gate`` for a
verdict against the store's gate state, and commits a batch's verdicts with their pending deliveries in one
transaction, keeping the batch in memory and retrying while the store cannot be written (``problem()`` makes
/healthz 503). It holds no gate state of its own and delivers nothing (README.md, "Delivery guarantee";
docs/architecture.md, "11. The acting path").
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

from vigil.aggregator.actuators.actuator import Actuator
from vigil.aggregator.decision import Decision
from vigil.aggregator.gate import Gate, GateConfig, GateState, Verdict
from vigil.aggregator.leadership import Leadership, SoleLeader
from vigil.aggregator.policy_groups import DEFAULT_GROUP, Membership
from vigil.aggregator.precision import Precision
from vigil.aggregator.store import WRITE_ERRORS, Store, StoreConfig

log = logging.getLogger("vigil.aggregator.ledger")

# Proposals kept in memory while the store cannot be written; beyond this the oldest go (the
# detectors propose a persisting fault again, so only a one-off finding can be lost, counted).
MAX_UNSTORED = 100_000
# Settled ids (admitted, or refused for good) remembered so a re-proposed episode skips the store.
SETTLED_CACHE = 100_000
RETENTION_EVERY_SECONDS = 3600.0
# Refusals that settle a proposal for good: what it asks is already done (or nothing is left to
# undo). Every other refusal (breaker, maintenance, opt-out, hold, cooldown, start-up grace, the
# restart budget) is judged again each time the detectors propose the persisting fault.
SETTLED_REFUSALS = frozenset({"duplicate", "already_removed", "awaiting_inspection", "not_removed"})
# Verdicts of one reason logged one by one per batch; the rest of a storm is one counted line.
LOG_PER_REASON = 20


class Ledger:
    """Implements ``aggregator.sink.DecisionSink``: ``submit`` returns the admitted decisions
    (as admitted: escalated action, dry_run set) plus any alert the gate raised."""

    def __init__(
        self,
        gate: Gate,
        store: Store,
        actuators: Mapping[str, Actuator],
        wake: Callable[[], None] | None = None,
        config: StoreConfig | None = None,
        leadership: Leadership | SoleLeader | None = None,
    ) -> None:
        self.gate = gate
        self.store = store
        # Only the leader of an HA pair proposes to the gate, once it has read the gate's state back
        # (``take_over``); a lone aggregator always does.
        self.leadership = leadership or SoleLeader()
        self._taken_over = not self.leadership.ha
        self.actuators = dict(actuators)
        self.wake = wake
        self.config = config or StoreConfig()
        # Held while a batch is judged and written; re-entrant, so the app's evaluator can take its
        # turn without waiting (``turn``) and then submit. ``_queue_lock`` guards only the queue.
        self._lock = threading.RLock()
        self._queue_lock = threading.Lock()
        # verdict reason -> decisions judged so (every judgement, re-proposals included)
        self.verdicts: Counter[str] = Counter()
        # (action, detector, verdict) -> verdicts recorded in the store (each change once)
        self.recorded: Counter[tuple[str, str, str]] = Counter()
        # (group, mode, verdict) -> verdicts recorded in the store, by policy group (vigil_gate_decisions_total)
        self.recorded_groups: Counter[tuple[str, str, str]] = Counter()
        # Published by the engine each evaluation: each node's policy group (what the gate judges every
        # proposal by, Alertmanager's and operators' too) and its shadow rules' comparison (GET /v1/gate).
        self.membership = Membership()
        self.shadow: list[dict[str, object]] = []
        # kind -> store failures (write, file, dropped: a proposal the memory queue could not keep)
        self.store_errors: Counter[str] = Counter()
        self._unstored: OrderedDict[str, Decision] = OrderedDict()
        self._settled: OrderedDict[str, None] = OrderedDict()
        self._problem: str | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._retention_at = 0.0
        # Precision from outcomes (aggregator/precision.py; None: off): demotes a proposal before the
        # gate judges it, and follows what the gate admitted.
        self.precision: Precision | None = None

    @classmethod
    def in_memory(cls, gate: GateConfig | None = None, *, started: float | None = None) -> Ledger:
        """The gate over a store in memory, no actuator: what the simulator, tests and benchmarks
        propose to (the same admission as the service's, nothing kept on disk). ``started``: when
        the aggregator started (the breaker's start-up grace counts from it; None: no grace)."""
        return cls(Gate(gate or GateConfig(), started=started), Store(":memory:"), actuators={})

    # -- health -------------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why decisions cannot be made durable right now, or None."""
        return self._problem

    @property
    def unstored(self) -> int:
        return len(self._unstored)

    def _failed(self, kind: str, why: str, now: float) -> None:
        self._failures += 1
        delay = min(self.config.retry_max_seconds, self.config.retry_base_seconds * 2 ** (self._failures - 1))
        self._retry_at = now + delay
        self._problem = why
        self.store_errors[kind] += 1
        log.error("decision store %s: %s; %d decision(s) wait in memory, retry in %.1fs",
                  self.store.path, why, len(self._unstored), delay)

    def _recovered(self) -> None:
        if self._problem is not None:
            log.warning("decision store %s works again after %d failure(s)", self.store.path, self._failures)
        self._problem, self._failures, self._retry_at = None, 0, 0.0

    @contextlib.contextmanager
    def turn(self) -> Iterator[bool]:
        """Whether the ledger is free now (and, if so, keep it for this thread meanwhile): the event
        loop evaluates only when no batch is being written in a worker thread, instead of waiting."""
        got = self._lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    # -- the sink -----------------------------------------------------------------------------

    def routes(self, decision: Decision) -> dict[str, bool]:
        return {name: a.notify_in_dry_run for name, a in self.actuators.items() if a.handles(decision)}

    def submit(self, decisions: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        """Judge and record ``decisions`` (and any left from a failed write); ``fleet_nodes`` is
        how many nodes reported within the breaker window. Called every evaluation cycle.
        A standby proposes nothing: it drops what it was given (the leader's detectors propose
        the same episodes, with the same ids)."""
        if not self.leads():
            with self._queue_lock:
                self._unstored.clear()
            return []
        with self._queue_lock:
            for d in decisions:
                if d.id not in self._settled:
                    self._unstored[d.id] = d
            while len(self._unstored) > MAX_UNSTORED:
                _, lost = self._unstored.popitem(last=False)
                self.store_errors["dropped"] += 1
                log.error("decision store %s failing too long: proposal %s (%s %s) dropped from memory",
                          self.store.path, lost.id, lost.action.value, lost.subject)
        with self._lock:
            if self._problem is not None and now < self._retry_at:
                return []
            file_problem = self.store.check_file()
            if file_problem is not None:
                why, writable = file_problem
                self.store_errors["file"] += 1
                if not writable:  # never write to a file nobody will find again
                    self._failed("file", why, now)
                    return []
            with self._queue_lock:
                queue = list(self._unstored.values())
            if not queue:
                self._recovered()
                return []
            try:
                admitted = self._decide(queue, now, fleet_nodes)
                if now >= self._retention_at:
                    self._retention_at = now + RETENTION_EVERY_SECONDS
                    gone = self.store.apply_retention(now, self.config)
                    if gone:
                        log.info("decision store retention: %d finished decision(s) deleted", gone)
            except WRITE_ERRORS as exc:
                self._failed("write", f"write failed: {' '.join(str(exc).split()) or type(exc).__name__}", now)
                return []
            with self._queue_lock:
                for d in queue:  # proposals queued meanwhile by another thread stay for the next turn
                    self._unstored.pop(d.id, None)
            self._recovered()
        if admitted and self.wake is not None:
            self.wake()
        return admitted

    def leads(self) -> bool:
        """Whether this replica acts now: it holds the leadership and has taken over."""
        return self._taken_over and self.leadership.leader

    def stand_by(self) -> None:
        """Leadership lost: propose nothing until ``take_over`` again."""
        self._taken_over = not self.leadership.ha

    def take_over(self) -> None:
        """This replica just became the leader: the gate's state is read back from the database
        (the previous leader changed it) and what this one remembered as settled is forgotten, so
        every proposal is checked against the store's verdicts again."""
        with self._lock:
            self.store.reload()
            with self._queue_lock:
                self._unstored.clear()
            self._settled.clear()
            self._recovered()
            self._taken_over = True

    def _decide(self, queue: Sequence[Decision], now: float, fleet_nodes: int) -> list[Decision]:
        state = self.store.state
        shadow: GateState | None = None
        writes: list[tuple[Verdict, Mapping[str, bool]]] = []
        written: set[str] = set()
        admitted: list[Decision] = []
        todo = [d for d in queue if d.id not in self._settled]
        priors = self.store.verdicts_of([d.id for d in todo])
        for decision in todo:
            prior = priors.get(decision.id)
            if prior is not None and (prior[0] or prior[1] in SETTLED_REFUSALS):
                self.verdicts["duplicate" if prior[0] else prior[1]] += 1
                self._remember(decision.id)
                continue
            if self.precision is not None:
                decision = self.precision.demote(decision)
            verdict = self.gate.judge(decision, now, fleet_nodes, shadow or state, self.membership)
            self.verdicts[verdict.reason] += 1
            alerts = [a for a in verdict.alerts if a.id not in written and a.id not in self._settled
                      and self.store.verdict_of(a.id) is None]
            if prior is not None and not verdict.admitted and prior[1] == verdict.reason and not alerts:
                continue  # the same refusal again: already on record, do not rewrite it each cycle
            if shadow is None:
                shadow = state.copy()
            shadow.apply(verdict, now)
            writes.append((verdict, self.routes(verdict.decision)))
            written.add(decision.id)
            if verdict.admitted:
                admitted.append(verdict.decision)
            for alert in alerts:
                raised = Verdict(True, "gate_alert", alert.reason, alert, alert.action)
                shadow.apply(raised, now)
                writes.append((raised, self.routes(alert)))
                written.add(alert.id)
                admitted.append(alert)
        if shadow is not None:
            self.store.commit(writes, now, shadow)  # the decisions are made here, or not at all
            if self.precision is not None:
                self.precision.observe([v.decision for v, _ in writes if v.admitted], now)
            logged: Counter[str] = Counter()
            for verdict, _ in writes:
                d = verdict.decision
                logged[verdict.reason] += 1
                if logged[verdict.reason] <= LOG_PER_REASON:
                    self._log(verdict)
                self.recorded[(d.action.value, d.detector, verdict.reason)] += 1
                self.recorded_groups[(verdict.group, verdict.mode, verdict.reason)] += 1
                if verdict.admitted:
                    self._remember(d.id)
            for reason, n in logged.items():
                if n > LOG_PER_REASON:  # a storm is a few lines and a count, not thousands of lines
                    log.warning("%d more decisions recorded %s in this batch (see `vigil aggregator decisions`)",
                                n - LOG_PER_REASON, reason)
        self.store.prune(now, self.gate.config)
        return admitted

    def _remember(self, decision_id: str) -> None:
        self._settled[decision_id] = None
        while len(self._settled) > SETTLED_CACHE:
            self._settled.popitem(last=False)

    @staticmethod
    def _log(verdict: Verdict) -> None:
        d = verdict.decision
        what = f"{d.id}: {d.action.value} {d.subject}{f' gpu {d.gpu}' if d.gpu is not None else ''} ({d.detector})"
        if verdict.trip:
            log.error("circuit breaker TRIPPED: %s (refused %s); automation stopped until "
                      "`vigil aggregator breaker reset`", verdict.detail, what)
        elif not verdict.admitted:
            log.warning("decision %s refused, %s: %s", what, verdict.reason, verdict.detail)
        elif verdict.reason == "gate_alert":
            log.warning("gate alert %s: %s", d.id, d.reason)
        else:
            log.info("decision %s %s: %s", what, verdict.reason, d.reason)

    # -- reading and operator actions ---------------------------------------------------------

    def recent(self, limit: int = 100) -> list[Decision]:
        return [r.decision for r in self.store.decisions(limit=limit, admitted_only=True)]

    def delivery_states(self, decision_id: str) -> list[dict[str, object]]:
        """Each actuator's delivery of one decision, as ``GET /v1/decisions`` shows it."""
        return [
            {"actuator": x.actuator, "state": x.state, "attempts": x.attempts, "last_error": x.last_error,
             "detail": x.detail}
            for x in self.store.deliveries(decision_id)
        ]

    def reset_breaker(self) -> bool:
        """The manual reset; returns whether the breaker was tripped. Refused proposals are
        judged again at the next cycle (the detectors still propose a persisting fault)."""
        with self._lock:
            before = self.store.reset_breaker()
        if before.tripped:
            log.warning("circuit breaker reset by an operator (it tripped at %s: %s)", before.tripped_ts, before.reason)
        return before.tripped

    def hold(self, node: str, held: bool, now: float, note: str = "") -> bool:
        """Set or release an operator's hold on ``node``; returns whether it was held before."""
        with self._lock:
            before = self.store.set_hold(node, held, now, note)
        log.warning("node %s %s by an operator%s", node, "held" if held else "released", f": {note}" if note else "")
        return before

    def breaker_budget(self, now: float, fleet_nodes: int) -> dict[str, object]:
        """The breaker as ``GET /v1/breaker`` shows it."""
        cfg = self.gate.config
        state = self.store.state
        removed = state.removed_nodes_since(now - cfg.breaker_window_seconds)
        grace = self.gate.in_grace(now)
        b = state.breaker
        return {
            "tripped": b.tripped, "tripped_ts": b.tripped_ts, "reason": b.reason,
            "removed_nodes": sorted(removed), "removals_in_window": len(removed),
            "budget": cfg.breaker_budget(fleet_nodes, in_grace=grace), "reporting_nodes": fleet_nodes,
            "window_seconds": cfg.breaker_window_seconds, "floor_nodes": cfg.breaker_floor_nodes,
            "max_share": cfg.breaker_max_share, "startup_grace": grace,
            "restarts_in_window": len([ts for ts, _ in state.restarts if ts >= now - cfg.breaker_window_seconds]),
            "restart_budget": cfg.restart_job_budget,
        }

    def gate_state(self, now: float, fleet_nodes: int) -> dict[str, object]:
        """Everything the gate decides from, as ``GET /v1/gate`` shows it."""
        state = self.store.state
        return {
            "breaker": self.breaker_budget(now, fleet_nodes),
            "nodes": {name: {"condition": r.condition, "last_removal": r.last_removal.value if r.last_removal else None,
                             "last_removal_ts": r.last_removal_ts,
                             "remediations": [[ts, a.value] for ts, a in r.remediations]}
                      for name, r in sorted(state.nodes.items())},
            "holds": {n: {"ts": ts, "note": note} for n, (ts, note) in sorted(state.holds.items())},
            "history": {n: [e.as_evidence() for e in entries] for n, entries in sorted(state.history.items())},
            "store": {"path": str(self.store.path), "schema_version": self.store.schema_version,
                      "problem": self._problem, "unstored": len(self._unstored)},
            "policy": {"default_mode": self.gate.config.default_mode, "groups": self.groups(now)},
            "shadow": self.shadow,
        }

    def groups(self, now: float) -> list[dict[str, object]]:
        """Each policy group (config order, the default last): its mode, selector, reporting members
        and its own breaker budget (the removals within the window of nodes now in the group)."""
        cfg, members, group_of = self.gate.config, self.membership.members, self.membership.group_of
        removed = self.store.state.removed_nodes_since(now - cfg.breaker_window_seconds)
        out: list[dict[str, object]] = []
        for g in cfg.groups:
            ours = sorted(n for n in removed if group_of.get(n) == g.name)
            budget = g.budget(members.get(g.name, 0))
            out.append({"name": g.name, "mode": g.mode, "select": g.select.model_dump(exclude_defaults=True),
                        "trust_reported_labels": g.trust_reported_labels, "members": members.get(g.name, 0),
                        "breaker": {"budget": budget, "removed_nodes": ours, "removals_in_window": len(ours),
                                    "exhausted": budget is not None and len(ours) >= budget}})
        ours = sorted(n for n in removed if not group_of.get(n))
        out.append({"name": DEFAULT_GROUP, "mode": cfg.default_mode, "select": None, "trust_reported_labels": False,
                    "members": members.get(DEFAULT_GROUP, 0),
                    "breaker": {"budget": None, "removed_nodes": ours, "removals_in_window": len(ours),
                                "exhausted": False}})
        return out
