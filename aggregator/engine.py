"""The engine: fleet state plus detectors, turning reports into decisions. Synchronous, no I/O.

``ingest`` folds a validated report into the fleet; ``evaluate`` (``prepare``, ``judge``, ``decide``, so the
service can judge off its event loop) runs the enabled detectors and the topology pass on the fleet view and
proposes every current episode, as one ``Decision``, to the ledger each cycle. Time is always given (``now``,
one step-free clock); it keeps no record of what was admitted, reading the ledger's gate state only to hand
detectors ``FleetView.removed`` (docs/architecture.md, "11. The acting path").
"""

from __future__ import annotations

from collections.abc import Callable

from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import Decision, Finding
from vigil.aggregator.detectors import REGISTRY, Detector
from vigil.aggregator.detectors.topology import Episode, TopologyAttributor, episode, is_onset
from vigil.aggregator.fleet import Fleet, FleetView, Removal
from vigil.aggregator.gate import GateState
from vigil.aggregator.job_recovery import JobRecoveryPlanner
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.outbox import agent_resets_enabled
from vigil.aggregator.synthetic_nodes import is_synthetic
from vigil.contract.wire import Report


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
        """Every detector and the topology pass over ``view``: pure with respect to the fleet
        (reads it, changes only the detectors' own memory), so it may run on a worker thread
        while the fleet's owner holds ingest back. One judge at a time."""
        found: list[Finding] = []
        for detector in self.detectors:
            found.extend(detector.evaluate(view, now))
        previous = self._first_seen
        self._first_seen = {ep: previous.get(ep, now) for ep in map(episode, found)}
        if self.topology is None:
            acted = [f for f in found if not is_onset(f)]  # onsets are the topology pass's evidence only
        else:
            acted = self.topology.evaluate(view, now, found, self._first_seen)
        if self.job_recovery is not None:
            acted += self.job_recovery.evaluate(view, now, acted, self.spares_available())
        return acted

    def evaluate(self, now: float) -> list[Decision]:
        """Propose every current episode; returns what the ledger admitted now. The three steps in
        one call (the simulator's and the tests' way); the service judges off its event loop."""
        return self.decide(self.judge(self.prepare(now), now), now)

    def decide(self, found: list[Finding], now: float) -> list[Decision]:
        """The last step, on the thread that owns the fleet and the ledger: one decision per
        episode, proposed to the ledger."""
        self.last_findings = found
        repeat_after = self.config.gate.repeat_after_seconds
        proposals: list[Decision] = []
        active: dict[Episode, tuple[Decision, float | None]] = {}
        for f in found:
            ep = episode(f)
            if ep in active:
                continue
            previous = self._active.get(ep)
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
        self._active = active
        # The breaker's budget counts the nodes that reported within its window (not every name
        # ever seen: forged or departed nodes must not inflate it).
        window = self.config.gate.breaker_window_seconds
        admitted = self.ledger.submit(proposals, now, self.fleet.reporting_since(now - window))
        self.admitted_total += len(admitted)
        return admitted
