"""Topology attribution: one fault shared by many nodes under one switch, rack or row.

It reads the other detectors' findings and the nodes' topology labels. When the same fault
(detector and signal) appears within a window on enough of the nodes under one component, it
replaces their per-node findings with one ``inspect_hardware`` for the component and one alert,
so a dead leaf switch costs one ticket instead of thirty-two drains. It holds per-node findings
of those faults back briefly, so the reports of one event arriving over a few seconds are
judged together rather than draining the first node to report.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from pydantic import Field

from agent.collectors.collector import StrictModel
from aggregator.decision import Action, Finding
from aggregator.fleet import FleetView

NAME = "topology"


class TopologyConfig(StrictModel):
    enabled: bool = True
    # Most specific first: a leaf switch explains more precisely than the rack it sits in.
    labels: list[str] = Field(default_factory=lambda: ["leaf_switch", "rack", "row"])
    # Faults a shared component can cause; a GPU's ECC errors are never its switch's fault.
    detectors: list[str] = Field(default_factory=lambda: ["network", "silence", "thermal"])
    window_seconds: float = Field(default=120.0, gt=0)
    # At least 3 nodes and half of those under the component: two bad cables are two bad cables.
    min_nodes: int = Field(default=3, ge=2)
    min_share: float = Field(default=0.5, gt=0, le=1)
    # How long a new per-node finding of an eligible fault waits for its neighbours (counted from
    # when it was first found): two report intervals at the agent's default 2.5 s.
    hold_seconds: float = Field(default=5.0, ge=0)


Episode = tuple[str, str, int | None, str | None, str, str]


def episode(f: Finding) -> Episode:
    """What identifies one finding across evaluations (its ``since`` may slide with a window)."""
    return (f.detector, f.node, f.gpu, f.job, f.action.value, f.key)


class TopologyAttributor:
    name = NAME

    def __init__(self, config: TopologyConfig) -> None:
        self.config = config
        self._eligible = frozenset(config.detectors)

    def evaluate(self, view: FleetView, now: float, findings: list[Finding],
                 first_seen: Mapping[Episode, float] | None = None) -> list[Finding]:
        """The findings to act on: ``findings`` with shared faults replaced by component findings
        and new eligible ones held back. ``first_seen`` says when each finding's episode was first
        found (the engine keeps it); without it, a finding counts from its ``since``."""
        cfg = self.config
        first_seen = first_seen or {}
        eligible = [f for f in findings if f.detector in self._eligible and f.action is not Action.OBSERVE]
        groups: dict[tuple[str, str, str, str], list[Finding]] = defaultdict(list)
        for f in eligible:
            node = view.nodes.get(f.node)
            if node is None:
                continue
            signal = str(f.evidence.get("signal", f.key))
            for label in cfg.labels:
                value = node.topology.get(label)
                if value is not None:
                    groups[(label, value, f.detector, signal)].append(f)
        # Candidates that meet the thresholds, best explanation first: the largest share of the
        # component affected, then the most nodes (a whole rack dark beats each of its leaves),
        # then the most specific label (a leaf that is its whole rack is still the leaf).
        candidates = []
        for (label, value, detector, signal), members in groups.items():
            latest = max(f.since for f in members)
            # One event: findings that began within the window of the latest one.
            members = [f for f in members if f.since >= latest - cfg.window_seconds]
            affected = {f.node for f in members}
            population = len(view.members(label, value))
            if len(affected) < cfg.min_nodes or population == 0 or len(affected) / population < cfg.min_share:
                continue
            candidates.append((-len(affected) / population, -len(affected), cfg.labels.index(label), value, detector,
                               signal, label, members))
        candidates.sort(key=lambda c: c[:6])
        absorbed: set[int] = set()
        out: list[Finding] = []
        for *_, value, detector, signal, label, members in candidates:
            members = [f for f in members if id(f) not in absorbed]
            nodes = sorted({f.node for f in members})
            population = len(view.members(label, value))
            if len(nodes) < cfg.min_nodes or len(nodes) / population < cfg.min_share:
                continue
            since = min(f.since for f in members)
            absorbed.update(id(f) for f in members)
            evidence = {"signal": signal, "label": label, "component": value, "fault_detector": detector,
                        "nodes": nodes, "nodes_under_component": population}
            reason = f"{len(nodes)} of {population} nodes under {label} {value} show {detector}/{signal}"
            for action in (Action.INSPECT_HARDWARE, Action.ALERT):
                out.append(Finding(detector=NAME, node=value, component=value, action=action, since=since,
                                   key=f"{label}:{detector}:{signal}", reason=reason, evidence=evidence))
        for f in findings:
            if id(f) in absorbed:
                continue
            if (f.detector in self._eligible and f.action is not Action.OBSERVE
                    and now - first_seen.get(episode(f), f.since) < cfg.hold_seconds):
                continue  # wait for the neighbours' reports
            out.append(f)
        return out
