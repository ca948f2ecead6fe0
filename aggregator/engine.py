"""The engine: fleet state plus detectors, turning reports into decisions. Synchronous, no I/O.

``ingest`` folds a validated report into the fleet; ``evaluate`` (``prepare``, ``judge``, ``decide``, so the
service can judge off its event loop) runs the enabled detectors and the topology pass on the fleet view and
proposes every current episode, as one ``Decision``, to the ledger each cycle, with each node's policy group
and the findings of the shadow rules (``shadow:<rule>``, recorded by the gate, never acted on). Time is always
given (``now``, one step-free clock); it keeps no record of what was admitted, reading the ledger's gate state
only to hand detectors ``FleetView.removed`` (docs/architecture.md, "11. The acting path"; docs/gate.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import Decision, Finding
from vigil.aggregator.detectors import REGISTRY, Detector
from vigil.aggregator.detectors.topology import Episode, TopologyAttributor, episode, is_onset
from vigil.aggregator.fleet import Fleet, FleetView, Removal
from vigil.aggregator.gate import SHADOW_PREFIX, GateState
from vigil.aggregator.job_recovery import JobRecoveryPlanner
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.outbox import agent_resets_enabled
from vigil.aggregator.policy_groups import DEFAULT_GROUP, GroupResolver, Membership, reported_labels
from vigil.aggregator.synthetic_nodes import is_synthetic
from vigil.contract.wire import Report

# Subjects listed per side of a shadow rule's comparison in GET /v1/gate (the counts are whole).
SHADOW_LISTED = 20


def removals(state: GateState) -> dict[str, Removal]:
    """The nodes the gate records as removed (not those out for inspection: those wait for a
    person), each with the removal that took it out and whether an operator holds it."""
    out: dict[str, Removal] = {}
    for name, rec in state.nodes.items():
        if rec.condition != "removed" or rec.last_removal is None or rec.last_removal_ts is None:
            continue
        entry = next((e for e in reversed(state.history.get(name, ()))
                      if e.action is rec.last_removal and e.ts == rec.last_removal_ts), None)
        out[name] = Removal(rec.last_removal, rec.last_removal_ts, entry.id if entry else "",
                            entry.gpu if entry else None, name in state.holds)
    return out


class Engine:
    def __init__(self, config: AggregatorConfig, ledger: Ledger,
                 detectors: list[Detector] | None = None) -> None:
        self.config = config
        self.ledger = ledger
        net = config.detectors.network
        judged = [*net.flap_counters, *net.error_counters, *net.congestion_counters] if net.enabled else []
        self.fleet = Fleet(config.fleet, port_counters=judged, agent_resets=agent_resets_enabled(config))
        # vigil loadgen's nodes (aggregator/synthetic_nodes.py): ingested as any node's reports are,
        # but held apart, where no detector, breaker count, silence check or listing reads them.
        self.synthetic = Fleet(config.fleet, port_counters=judged, agent_resets=agent_resets_enabled(config))
        if detectors is None:
            detectors = [build(getattr(config.detectors, name)) for name, build in REGISTRY.items()
                         if getattr(config.detectors, name).enabled]
        self.detectors = detectors
        # Second instances of detectors, their findings recorded as shadow decisions (config ``shadow:``).
        self.shadow = [(rule, rule.build(getattr(config.detectors, rule.detector))) for rule in config.shadow]
        # Each shadow rule against its acting detector at the latest judge (GET /v1/gate "shadow").
        self.shadow_comparison: list[dict[str, object]] = []
        gate = config.gate
        self.groups = GroupResolver(gate.groups, gate.node_labels) if gate.groups else None
        topo = config.detectors.topology
        self.topology = TopologyAttributor(topo) if topo.enabled else None
        # Over the findings acted on: restarts a running job without a node that slows it, at the
        # moment it chose (aggregator/job_recovery.py); the spare pool's count (the app's) feeds it.
        self.job_recovery = JobRecoveryPlanner(config.job_recovery) if config.job_recovery.enabled else None
        self.spares_available: Callable[[], int | None] = lambda: None
        # An episode that stays active keeps its decision: a detector whose `since` slides with
        # its window must not emit a new id every evaluation. The float is the fault's latest
        # occurrence when the decision was made (a much later one is a repeat).
        self._active: dict[Episode, tuple[Decision, float | None]] = {}
        self._shadow_active: dict[Episode, tuple[Decision, float | None]] = {}
        # When each current finding's episode was first found: the topology hold counts from it
        # (hold_seconds for a lone node, at most max_hold_seconds while a component is plausible).
        self._first_seen: dict[Episode, float] = {}
        self.last_findings: list[Finding] = []
        self.admitted_total = 0

    def fleet_of(self, node: str) -> Fleet:
        """The fleet that holds ``node``: the synthetic one for a reserved name, else the judged one."""
        return self.synthetic if is_synthetic(node) else self.fleet

    def ingest(self, report: Report, now: float) -> dict[str, int]:
        """``report`` into its fleet; the entries it refused, by reason (Fleet.ingest)."""
        return self.fleet_of(report.node).ingest(report, now)

    def findings(self, now: float) -> list[Finding]:
        return self.judge(self.view(), now)

    def view(self) -> FleetView:
        """The fleet as detectors see it, with the gate's removals copied now (read the gate on
        the thread that owns it; the view then reads only the fleet)."""
        # Only the recovery detector reads what vigil removed (the gate's state, held by the ledger).
        removed = removals(self.ledger.store.state) if self.config.detectors.recovery.enabled else None
        return self.fleet.view(removed)

    def prepare(self, now: float) -> FleetView:
        """The first step of an evaluation, on the thread that owns the fleet: forget idle jobs,
        then the view to judge. Until ``judge`` returns, nothing may ingest into the fleet."""
        self.fleet.forget_idle_jobs(now)
        return self.view()

    def judge(self, view: FleetView, now: float) -> list[Finding]:
        """Every detector and the topology pass over ``view``, then the shadow rules (their findings
        last, named ``shadow:<rule>``): pure with respect to the fleet (reads it, changes only the
        detectors' own memory), so it may run on a worker thread while the fleet's owner holds
        ingest back. One judge at a time."""
        found: list[Finding] = []
        for detector in self.detectors:
            found.extend(detector.evaluate(view, now))
        shadowed = self.judge_shadow(view, now, found)
        previous = self._first_seen
        self._first_seen = {ep: previous.get(ep, now) for ep in map(episode, found)}
        if self.topology is None:
            acted = [f for f in found if not is_onset(f)]  # onsets are the topology pass's evidence only
        else:
            acted = self.topology.evaluate(view, now, found, self._first_seen)
        if self.job_recovery is not None:
            acted += self.job_recovery.evaluate(view, now, acted, self.spares_available())
        return acted + shadowed

    def judge_shadow(self, view: FleetView, now: float, found: list[Finding]) -> list[Finding]:
        """The shadow rules' findings over ``view`` (onsets left out: they never act), each named
        ``shadow:<rule>`` with the rule in its evidence; compared with ``found``, the acting
        detectors' own (before the topology pass), into ``shadow_comparison``."""
        out: list[Finding] = []
        comparison: list[dict[str, object]] = []
        for rule, detector in self.shadow:
            marked = {"rule": rule.name, "detector": rule.detector, "overrides": rule.config}
            mine = [f.model_copy(update={"detector": SHADOW_PREFIX + rule.name,
                                         "evidence": {**f.evidence, "shadow": marked}})
                    for f in detector.evaluate(view, now) if not is_onset(f)]
            out.extend(mine)
            comparison.append({**marked, **_compare(mine, [f for f in found if f.detector == detector.name
                                                           and not is_onset(f)])})
        self.shadow_comparison = comparison
        return out

    def evaluate(self, now: float) -> list[Decision]:
        """Propose every current episode; returns what the ledger admitted now. The three steps in
        one call (the simulator's and the tests' way); the service judges off its event loop."""
        return self.decide(self.judge(self.prepare(now), now), now)

    def decide(self, found: list[Finding], now: float) -> list[Decision]:
        """The last step, on the thread that owns the fleet and the ledger: one decision per
        episode, proposed to the ledger with each node's policy group (shadow rules' included: the
        gate records them and admits none)."""
        acted = [f for f in found if not f.detector.startswith(SHADOW_PREFIX)]
        self.last_findings = acted
        proposals, self._active = self._episodes(acted, self._active, now)
        shadow, self._shadow_active = self._episodes([f for f in found if f.detector.startswith(SHADOW_PREFIX)],
                                                     self._shadow_active, now)
        # What the ledger's gate judges groups by (and GET /v1/gate shows), published before the proposals.
        self.ledger.shadow = self.shadow_comparison
        self.ledger.membership = self.membership(now)
        # The breaker's budget counts the nodes that reported within its window (not every name
        # ever seen: forged or departed nodes must not inflate it).
        window = self.config.gate.breaker_window_seconds
        admitted = self.ledger.submit(proposals + shadow, now, self.fleet.reporting_since(now - window))
        self.admitted_total += len(admitted)
        return admitted

    def membership(self, now: float) -> Membership:
        """Each known node's policy group, and the nodes of each group that reported within the
        breaker window (all the default's when no group is configured)."""
        since = now - self.config.gate.breaker_window_seconds
        if self.groups is None:
            return Membership(members={DEFAULT_GROUP: self.fleet.reporting_since(since)})
        return self.groups.membership((n.name, reported_labels(n), n.last_seen >= since)
                                      for n in self.fleet.view().nodes.values())

    def _episodes(self, found: list[Finding], previous_active: dict[Episode, tuple[Decision, float | None]],
                  now: float) -> tuple[list[Decision], dict[Episode, tuple[Decision, float | None]]]:
        """One decision per episode of ``found``: the one made for it before (``previous_active``)
        unless the fault came again long after; the proposals and the episodes now active."""
        repeat_after = self.config.gate.repeat_after_seconds
        proposals: list[Decision] = []
        active: dict[Episode, tuple[Decision, float | None]] = {}
        for f in found:
            ep = episode(f)
            if ep in active:
                continue
            previous = previous_active.get(ep)
            if previous is not None:
                decision, latest = previous
                if f.latest is not None and latest is not None and f.latest - latest >= repeat_after:
                    # The same fault again, long after the decision: a repeat, decided on its own
                    # (the gate's history climbs the ladder for it).
                    decision, latest = Decision.from_finding(f.model_copy(update={"since": f.latest}), now,
                                                             dry_run=self.config.dry_run), f.latest
            else:
                decision, latest = Decision.from_finding(f, now, dry_run=self.config.dry_run), f.latest
            active[ep] = (decision, latest)
            proposals.append(decision)
        return proposals, active


def _subjects(findings: Iterable[Finding]) -> set[str]:
    return {(f.node or f"job:{f.job}") if f.gpu is None else f"{f.node}/gpu{f.gpu}" for f in findings}


def _compare(shadow: list[Finding], acting: list[Finding]) -> dict[str, object]:
    """A shadow rule's current subjects (node, or node/gpuN) against its acting detector's."""
    mine, theirs = _subjects(shadow), _subjects(acting)
    return {"episodes": len(shadow), "both": len(mine & theirs), "shadow_only_count": len(mine - theirs),
            "acting_only_count": len(theirs - mine), "shadow_only": sorted(mine - theirs)[:SHADOW_LISTED],
            "acting_only": sorted(theirs - mine)[:SHADOW_LISTED]}
