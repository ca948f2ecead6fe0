"""Topology attribution: one fault shared by many nodes under one switch, rack or row.

It reads the other detectors' findings and the nodes' topology labels. When the same fault
(detector and signal) appears within a window on enough of the nodes under one component, it
replaces their per-node findings with one ``inspect_hardware`` for the component and one alert,
so a dead leaf switch costs one ticket instead of thirty-two drains. It holds per-node findings
of those faults back briefly, so the reports of one event arriving over a few seconds are
judged together rather than draining the first node to report.

On a rail-optimised fabric a rail leaf is cabled to one HCA port of each node, not to the node:
its label is a *port label* (``port_labels`` maps it to the port it covers, ``rail2_leaf`` ->
``mlx5_2``). Only port findings (those whose evidence names a ``device``) on that port count
toward it, and its thresholds count only the nodes whose fault is on that port alone: errors on
several rails of the same nodes are a node- or group-wide cause, not one rail's leaf, and are left
to the other labels (rack, row) or to the nodes themselves. A rail leaf that qualifies takes every
finding on its port; a node's findings on other ports stand on their own.
"""

from __future__ import annotations

import re
import string
from collections import defaultdict
from collections.abc import Iterable, Mapping

from pydantic import Field, model_validator

from vigil.agent.validation import StrictModel
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.fleet import FleetView

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
    # Port labels: a regex matched against a whole label -> the port device its component is
    # cabled to, formatted with the regex's named groups; the first matching entry wins. The default
    # is sim/scenario.py's rail-optimised fabric (label rail<r>_leaf, HCA r is mlx5_<r>, HCA r cables
    # to the rail-r leaf); a site whose HCAs are numbered otherwise (DGX H100's compute HCAs are not
    # mlx5_0..7) lists its labels explicitly, e.g. {"rail1_leaf": "mlx5_3"}. A value may also name
    # the port ("mlx5_3/1"). Labels matching no entry judge whole nodes (leaf_switch, rack, row).
    port_labels: dict[str, str] = Field(default_factory=lambda: {r"rail(?P<rail>\d+)_leaf": "mlx5_{rail}"})

    @model_validator(mode="after")
    def _port_labels_compile(self) -> TopologyConfig:
        for pattern, template in self.port_labels.items():
            try:
                groups = set(re.compile(pattern).groupindex)
            except re.error as e:
                raise ValueError(f"port_labels: {pattern!r} is not a regex: {e}") from e
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
            if not fields <= groups:
                raise ValueError(f"port_labels: {template!r} names {sorted(fields - groups)}, "
                                 f"which {pattern!r} does not capture")
        return self


Episode = tuple[str, str, int | None, str | None, str, str]


def signal_of(f: Finding) -> str:
    """The fault a finding reports, across its node's ports (``symbol_error_rate``)."""
    return str(f.evidence.get("signal", f.key))


def episode(f: Finding) -> Episode:
    """What identifies one finding across evaluations (its ``since`` may slide with a window)."""
    return (f.detector, f.node, f.gpu, f.job, f.action.value, f.key)


class TopologyAttributor:
    name = NAME

    def __init__(self, config: TopologyConfig) -> None:
        self.config = config
        self._eligible = frozenset(config.detectors)
        self._port_patterns = [(re.compile(p), t) for p, t in config.port_labels.items()]
        self._label_ports: dict[str, str | None] = {}

    def port_of(self, label: str) -> str | None:
        """The port a port label's component is cabled to (``mlx5_2``), None for a node label."""
        if label not in self._label_ports:
            self._label_ports[label] = next(
                (t.format(**m.groupdict()) for p, t in self._port_patterns if (m := p.fullmatch(label))), None)
        return self._label_ports[label]

    @staticmethod
    def on_port(f: Finding, port: str) -> bool:
        """Whether ``f`` is a port finding on ``port`` (a device name, or device/port)."""
        device = f.evidence.get("device")
        return device is not None and port in (str(device), f"{device}/{f.evidence.get('port')}")

    def _only_on(self, findings: Iterable[Finding], port: str) -> bool:
        return all(self.on_port(f, port) for f in findings)

    def evaluate(self, view: FleetView, now: float, findings: list[Finding],
                 first_seen: Mapping[Episode, float] | None = None) -> list[Finding]:
        """The findings to act on: ``findings`` with shared faults replaced by component findings
        and new eligible ones held back. ``first_seen`` says when each finding's episode was first
        found (the engine keeps it); without it, a finding counts from its ``since``."""
        cfg = self.config
        first_seen = first_seen or {}
        eligible = [f for f in findings if f.detector in self._eligible and f.action is not Action.OBSERVE]
        # One node's findings of one fault (detector and signal), over all its ports.
        per_node: dict[tuple[str, str, str], list[Finding]] = defaultdict(list)
        for f in eligible:
            per_node[(f.node, f.detector, signal_of(f))].append(f)
        groups: dict[tuple[str, str, str, str], list[Finding]] = defaultdict(list)
        for f in eligible:
            node = view.nodes.get(f.node)
            if node is None:
                continue
            for label in cfg.labels:
                value = node.topology.get(label)
                port = self.port_of(label)
                # A rail's leaf is cabled to one port of each node: only findings on that port are its.
                if value is not None and (port is None or self.on_port(f, port)):
                    groups[(label, value, f.detector, signal_of(f))].append(f)

        def explained(label: str, members: list[Finding]) -> set[str]:
            """The nodes whose fault the component can explain: for a rail's leaf, those whose
            fault is on its port alone (a node erroring on several rails has another cause; once
            the leaf is indicted it still takes that node's findings on its port)."""
            port = self.port_of(label)
            return {f.node for f in members
                    if port is None or self._only_on(per_node[(f.node, f.detector, signal_of(f))], port)}

        def qualifies(label: str, value: str, members: list[Finding]) -> bool:
            population = len(view.members(label, value))
            nodes = explained(label, members)
            return population > 0 and len(nodes) >= cfg.min_nodes and len(nodes) / population >= cfg.min_share

        # Candidates that meet the thresholds, best explanation first: the largest share of the
        # component affected, then the most nodes (a whole rack dark beats each of its leaves),
        # then the most specific label (a leaf that is its whole rack is still the leaf).
        candidates = []
        for (label, value, detector, signal), members in groups.items():
            latest = max(f.since for f in members)
            # One event: findings that began within the window of the latest one.
            members = [f for f in members if f.since >= latest - cfg.window_seconds]
            if not qualifies(label, value, members):
                continue
            affected = {f.node for f in members}
            population = len(view.members(label, value))
            candidates.append((-len(affected) / population, -len(affected), cfg.labels.index(label), value, detector,
                               signal, label, members))
        candidates.sort(key=lambda c: c[:6])
        absorbed: set[int] = set()
        out: list[Finding] = []
        for *_, value, detector, signal, label, members in candidates:
            members = [f for f in members if id(f) not in absorbed]
            if not qualifies(label, value, members):
                continue
            nodes = sorted({f.node for f in members})
            population = len(view.members(label, value))
            since = min(f.since for f in members)
            absorbed.update(id(f) for f in members)
            evidence: dict[str, object] = {"signal": signal, "label": label, "component": value,
                                           "fault_detector": detector, "nodes": nodes,
                                           "nodes_under_component": population}
            reason = f"{len(nodes)} of {population} nodes under {label} {value} show {detector}/{signal}"
            port = self.port_of(label)
            if port is not None:
                evidence["port"] = port
                reason += f" on {port}"
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
