"""The engine: fleet state plus detectors, turning reports into decisions. Synchronous, no I/O.

``ingest`` folds a validated report into the fleet; ``evaluate`` runs every enabled detector on
the fleet view, lets the topology pass merge shared faults, turns findings into ``Decision``s,
drops those already emitted, and submits the rest to the sink. Time is always given (``now``),
so the simulator drives it on a simulated clock and the app on the wall clock.
"""

from __future__ import annotations

from collections import OrderedDict

from agent.wire import Report
from aggregator.config import AggregatorConfig
from aggregator.decision import Decision, Finding
from aggregator.detectors import REGISTRY, Detector
from aggregator.detectors.topology import Episode, TopologyAttributor, episode
from aggregator.fleet import Fleet
from aggregator.sink import DecisionSink


class Engine:
    def __init__(self, config: AggregatorConfig, sink: DecisionSink,
                 detectors: list[Detector] | None = None) -> None:
        self.config = config
        self.sink = sink
        net = config.detectors.network
        judged = [*net.flap_counters, *net.error_counters, *net.congestion_counters] if net.enabled else []
        self.fleet = Fleet(config.fleet, port_counters=judged)
        if detectors is None:
            detectors = [build(getattr(config.detectors, name)) for name, build in REGISTRY.items()
                         if getattr(config.detectors, name).enabled]
        self.detectors = detectors
        topo = config.detectors.topology
        self.topology = TopologyAttributor(topo) if topo.enabled else None
        self._emitted: OrderedDict[str, None] = OrderedDict()
        # An episode that stays active keeps its first decision: a detector whose `since`
        # slides with its window must not emit a new id every evaluation.
        self._active: dict[Episode, str] = {}
        # When each current finding's episode was first found (the topology hold counts from it).
        self._first_seen: dict[Episode, float] = {}
        self.last_findings: list[Finding] = []
        self.admitted_total = 0

    def ingest(self, report: Report, now: float) -> None:
        self.fleet.ingest(report, now)

    def findings(self, now: float) -> list[Finding]:
        view = self.fleet.view()
        found: list[Finding] = []
        for detector in self.detectors:
            found.extend(detector.evaluate(view, now))
        previous = self._first_seen
        self._first_seen = {ep: previous.get(ep, now) for ep in map(episode, found)}
        if self.topology is not None:
            found = self.topology.evaluate(view, now, found, self._first_seen)
        return found

    def evaluate(self, now: float) -> list[Decision]:
        self.fleet.forget_idle_jobs(now)
        found = self.findings(now)
        self.last_findings = found
        fresh: list[Decision] = []
        active: dict[Episode, str] = {}
        for f in found:
            ep = episode(f)
            if ep in active:
                continue
            previous = self._active.get(ep)
            if previous is not None:
                active[ep] = previous
                continue
            decision = Decision.from_finding(f, now, dry_run=self.config.dry_run)
            active[ep] = decision.id
            if decision.id in self._emitted:
                continue
            self._remember(decision.id)
            fresh.append(decision)
        self._active = active
        if not fresh:
            return []
        admitted = self.sink.submit(fresh, now, len(self.fleet.view().nodes))
        self.admitted_total += len(admitted)
        return admitted

    def _remember(self, decision_id: str) -> None:
        self._emitted[decision_id] = None
        while len(self._emitted) > self.config.emitted_memory:
            self._emitted.popitem(last=False)
