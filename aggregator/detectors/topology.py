"""Topology attribution: one fault shared by many nodes under one switch, rack, PDU or row.

It reads the other detectors' findings of this evaluation (network, silence, thermal and its onsets,
straggler, gpu_straggler, gpu_peer), the nodes' topology labels and its own indictments. A component
under which a binomial test finds too many erring nodes takes their findings as one
``inspect_hardware`` and an alert, and while one is plausible its nodes' removals wait a bounded hold;
it decides no node's fault itself. Fault classes, thresholds, hold times, rail leaves and the designed
false-indictment rate: docs/detectors.md, "topology".
"""

from __future__ import annotations

import math
import re
import string
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import Field, model_validator

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.fleet import FleetView
from vigil.contract.validation import StrictModel

NAME = "topology"
# Evidence flag of a precursor: an ``observe`` finding of a fault under way that has not met its
# detector's persistence yet (thermal's onset). The topology pass counts it and never passes it on.
ONSET = "onset"
# The consequence class: a node slowed by a failing component is slow because of it, so an
# indicted component takes its erring nodes' slow findings too (never their other faults).
SLOW = "slow"


class TopologyConfig(StrictModel):
    enabled: bool = True
    # Most specific first: a leaf switch explains more precisely than the rack it sits in (the
    # order breaks ties between components of equal evidence). A label no node carries costs nothing.
    labels: list[str] = Field(default_factory=lambda: ["leaf_switch", "rack", "pdu", "row"])
    # The fault class of a finding, by "detector/signal" or else by detector: the faults a shared
    # component can cause. A GPU's ECC errors, Xids or a lost GPU are never its switch's fault.
    classes: dict[str, str] = Field(default_factory=lambda: {
        "network": "network", "silence/report_silence": "silence",
        "thermal/clock_event_reasons": "thermal", "thermal/memory_temperature_celsius": "thermal",
        "straggler": SLOW, "gpu_straggler": SLOW, "gpu_peer": SLOW})
    # The classes each label's component can cause. A leaf: port errors, flaps and downs, and
    # nodes cut off (silence). A rack, PDU or row (its cooling, its power): heat, slowness (a
    # throttled GPU slows its ranks) and nodes going dark; never symbol errors on a port. A label
    # not listed explains every class; a port label (rail leaf) explains its port's network faults.
    explains: dict[str, list[str]] = Field(default_factory=lambda: {
        "leaf_switch": ["network", "silence"], "rack": ["thermal", SLOW, "silence"],
        "pdu": ["thermal", SLOW, "silence"], "row": ["thermal", SLOW, "silence"]})
    # One event: findings that began within this long of the latest one under the component. An
    # indicted component stays indicted this long after its last erring node (it takes the
    # findings of nodes that turn bad later, e.g. a rack's last node to throttle).
    window_seconds: float = Field(default=120.0, gt=0)
    # At least 3 erring nodes: two bad cables are two bad cables.
    min_nodes: int = Field(default=3, ge=2)
    # Indictment: the binomial tail P(X >= k), X ~ Bin(n, base rate), of k erring nodes among the
    # n under the component, below this. 1e-3 per component: see the module docstring.
    alpha: float = Field(default=1e-3, gt=0, lt=1)
    # The base rate is the share of the other nodes carrying the label that err in the same class,
    # never below this floor: a node erring in any 2-minute window with 1% probability is ~1,000x
    # the field's rate (a few node faults per 1,000 node-days), so chance clusters stay far rarer
    # than alpha on a healthy fleet, and a small fleet cannot indict on one or two nodes.
    base_rate_floor: float = Field(default=0.01, gt=0, lt=1)
    # Plausible: at least 2 erring nodes under the component with a tail below this. While a
    # component over a node is plausible, the node's findings of a class it explains wait for it.
    plausible_alpha: float = Field(default=0.1, gt=0, lt=1)
    # How long a new per-node finding of an eligible fault waits for its neighbours (counted from
    # when it was first found): two report intervals at the agent's default 2.5 s. A lone node's
    # finding waits this long and no longer.
    hold_seconds: float = Field(default=5.0, ge=0)
    # The most any node's finding waits while a component over it is plausible: the straggler's
    # 3 windows (15-20 s) plus the 5 s thermal onset of a rack-mate turning bad 10 s later. A node
    # whose rack-mate errs by coincidence is drained this much later, never more.
    max_hold_seconds: float = Field(default=30.0, ge=0)
    # Port labels: a regex matched against a whole label -> the port device its component is
    # cabled to, formatted with the regex's named groups; the first matching entry wins. The default
    # is sim/scenario.py's rail-optimised fabric (label rail<r>_leaf, HCA r is mlx5_<r>, HCA r cables
    # to the rail-r leaf); a site whose HCAs are numbered otherwise (DGX H100's compute HCAs are not
    # mlx5_0..7) lists its labels explicitly, e.g. {"rail1_leaf": "mlx5_3"}. A value may also name
    # the port ("mlx5_3/1"). Labels matching no entry judge whole nodes (leaf_switch, rack, row).
    port_labels: dict[str, str] = Field(default_factory=lambda: {r"rail(?P<rail>\d+)_leaf": "mlx5_{rail}"})

    @model_validator(mode="after")
    def _consistent(self) -> TopologyConfig:
        for pattern, template in self.port_labels.items():
            try:
                groups = set(re.compile(pattern).groupindex)
            except re.error as e:
                raise ValueError(f"port_labels: {pattern!r} is not a regex: {e}") from e
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
            if not fields <= groups:
                raise ValueError(f"port_labels: {template!r} names {sorted(fields - groups)}, "
                                 f"which {pattern!r} does not capture")
        known = set(self.classes.values())
        for label, classes in self.explains.items():
            if not set(classes) <= known:
                raise ValueError(f"explains.{label}: {sorted(set(classes) - known)} is no class of `classes`")
        if self.max_hold_seconds < self.hold_seconds:
            raise ValueError("max_hold_seconds must be at least hold_seconds")
        if self.plausible_alpha < self.alpha:
            raise ValueError("plausible_alpha must be at least alpha (plausible comes before indicted)")
        return self


Episode = tuple[str, str, int | None, str | None, str, str]


def signal_of(f: Finding) -> str:
    """The fault a finding reports, across its node's ports (``symbol_error_rate``)."""
    return str(f.evidence.get("signal", f.key))


def episode(f: Finding) -> Episode:
    """What identifies one finding across evaluations (its ``since`` may slide with a window)."""
    return (f.detector, f.node, f.gpu, f.job, f.action.value, f.key)


def is_onset(f: Finding) -> bool:
    """A precursor for the topology pass only (never acted on)."""
    return f.action is Action.OBSERVE and f.evidence.get(ONSET) is True


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (n may be a row of thousands)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq, ln = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms = [ln - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


@dataclass(slots=True)
class _Component:
    """One label value's share of this evaluation's erring nodes."""

    label: str
    value: str
    port: str | None
    population: int
    members: list[Finding]  # its classes' findings on its nodes (on its port, for a rail leaf)
    nodes: set[str]  # the erring nodes it explains (for a rail leaf: erring on its port alone)
    fleet_nodes: int = 0  # nodes carrying the label
    fleet_erring: int = 0  # of those, erring in the label's classes
    base_rate: float = 0.0
    p_value: float = 1.0


@dataclass(slots=True)
class _Indictment:
    since: float
    until: float  # stays indicted until then (refreshed while its nodes err)


class TopologyAttributor:
    name = NAME

    def __init__(self, config: TopologyConfig) -> None:
        self.config = config
        self._classes = dict(config.classes)
        self._all_classes = frozenset(config.classes.values())
        self._port_patterns = [(re.compile(p), t) for p, t in config.port_labels.items()]
        self._label_ports: dict[str, str | None] = {}
        # (label, value) -> its indictment, for as long as it lasts (the only memory kept).
        self._indicted: dict[tuple[str, str], _Indictment] = {}

    def port_of(self, label: str) -> str | None:
        """The port a port label's component is cabled to (``mlx5_2``), None for a node label."""
        if label not in self._label_ports:
            self._label_ports[label] = next(
                (t.format(**m.groupdict()) for p, t in self._port_patterns if (m := p.fullmatch(label))), None)
        return self._label_ports[label]

    def class_of(self, f: Finding) -> str | None:
        """The fault class of ``f`` (network, silence, thermal, slow), None when no component can cause it."""
        return self._classes.get(f"{f.detector}/{signal_of(f)}", self._classes.get(f.detector))

    def explains(self, label: str) -> frozenset[str]:
        if self.port_of(label) is not None:
            return frozenset({"network"})
        given = self.config.explains.get(label)
        return self._all_classes if given is None else frozenset(given)

    @staticmethod
    def on_port(f: Finding, port: str) -> bool:
        """Whether ``f`` is a port finding on ``port`` (a device name, or device/port)."""
        device = f.evidence.get("device")
        return device is not None and port in (str(device), f"{device}/{f.evidence.get('port')}")

    def _only_on(self, findings: Iterable[Finding], port: str) -> bool:
        return all(self.on_port(f, port) for f in findings)

    def evaluate(self, view: FleetView, now: float, findings: list[Finding],
                 first_seen: Mapping[Episode, float] | None = None) -> list[Finding]:
        """The findings to act on: ``findings`` with shared faults replaced by component findings,
        eligible ones held back while a component over their node is plausible, onsets dropped.
        ``first_seen`` says when each finding's episode was first found (the engine keeps it);
        without it, a finding counts from its ``since``."""
        cfg = self.config
        first_seen = first_seen or {}
        self._indicted = {k: v for k, v in self._indicted.items() if v.until >= now}
        classed: dict[int, str] = {}
        by_node: dict[str, list[Finding]] = defaultdict(list)
        for f in findings:
            cls = self.class_of(f)
            if cls is not None and (f.action is not Action.OBSERVE or is_onset(f)):
                classed[id(f)] = cls
                by_node[f.node].append(f)
        if not classed:
            return [f for f in findings if not is_onset(f)]
        components = self._components(view, by_node, classed)

        # Indict, the strongest evidence first: the smallest tail, then the most nodes, then the
        # most specific label. A component keeps its indictment while its nodes still err.
        order = sorted(components.values(), key=lambda c: (c.p_value, -len(c.nodes), cfg.labels.index(c.label),
                                                           c.value))
        absorbed: set[int] = set()
        out: list[Finding] = []
        for comp in order:
            members = [f for f in comp.members if id(f) not in absorbed]
            nodes = comp.nodes & {f.node for f in members}
            if not nodes:
                continue
            key = (comp.label, comp.value)
            p_value = self._tail(len(nodes), comp)
            if key not in self._indicted and (len(nodes) < cfg.min_nodes or p_value > cfg.alpha):
                continue
            taken = members + [f for n in nodes for f in by_node[n] if classed[id(f)] == SLOW]
            absorbed.update(id(f) for f in taken)
            held = self._indicted.get(key)
            since = held.since if held is not None else min(f.since for f in members)
            self._indicted[key] = _Indictment(since, now + cfg.window_seconds)
            # Its evidence names every node it takes findings from (a rail leaf also takes the
            # port's findings of a node that errs on other rails too; that node's other ports stand).
            out.extend(self._component_findings(comp, members, sorted({f.node for f in taken}), p_value, since,
                                                classed))

        # Plausible components hold their nodes' findings of the classes they explain (and the
        # slowness those cause); a lone node's finding waits hold_seconds only.
        plausible: dict[str, set[str]] = defaultdict(set)
        for comp in components.values():
            if len(comp.nodes) >= 2 and comp.p_value <= cfg.plausible_alpha:
                for n in comp.nodes:
                    plausible[n].update(self.explains(comp.label) | {SLOW})
        for f in findings:
            if id(f) in absorbed or is_onset(f):
                continue
            if id(f) in classed:
                waited = now - first_seen.get(episode(f), f.since)
                if waited < cfg.hold_seconds:
                    continue  # wait for the neighbours' reports
                if waited < cfg.max_hold_seconds and classed[id(f)] in plausible.get(f.node, ()):
                    continue  # a component over the node may explain it: wait, within the bound
            out.append(f)
        return out

    def _components(self, view: FleetView, by_node: Mapping[str, list[Finding]],
                    classed: Mapping[int, str]) -> dict[tuple[str, str], _Component]:
        """Each label value with an erring node under it, with its binomial tail."""
        cfg = self.config
        population: dict[tuple[str, str], int] = defaultdict(int)
        carrying: dict[str, int] = defaultdict(int)
        for node in view.nodes.values():
            for label in cfg.labels:
                value = node.topology.get(label)
                if value is not None:
                    population[(label, value)] += 1
                    carrying[label] += 1
        out: dict[tuple[str, str], _Component] = {}
        for label in cfg.labels:
            port = self.port_of(label)
            allowed = self.explains(label)
            comps: dict[str, _Component] = {}
            for name, found in by_node.items():
                state = view.nodes.get(name)
                value = state.topology.get(label) if state is not None else None
                if value is None:
                    continue
                relevant = [f for f in found if classed[id(f)] in allowed and (port is None or self.on_port(f, port))]
                if not relevant:
                    continue
                comp = comps.get(value)
                if comp is None:
                    comp = comps[value] = _Component(label, value, port, population[(label, value)], [], set())
                comp.members.extend(relevant)
                # A rail's leaf explains a node whose fault (detector and signal) is on its port alone.
                if port is None or any(self._only_on((g for g in found if g.detector == f.detector
                                                      and signal_of(g) == signal_of(f)), port) for f in relevant):
                    comp.nodes.add(name)
            erring: set[str] = set()
            for comp in comps.values():
                latest = max(f.since for f in comp.members)
                # One event: findings that began within the window of the latest one.
                comp.members = [f for f in comp.members if f.since >= latest - cfg.window_seconds]
                comp.nodes &= {f.node for f in comp.members}
                erring |= comp.nodes
            for value, comp in comps.items():
                comp.fleet_nodes, comp.fleet_erring = carrying[label], len(erring)
                comp.p_value = self._tail(len(comp.nodes), comp)
                out[(label, value)] = comp
        return out

    def _tail(self, k: int, comp: _Component) -> float:
        """The binomial tail of ``k`` erring nodes under ``comp`` against the rest of the fleet's rate."""
        rest = comp.fleet_nodes - comp.population
        rate = (comp.fleet_erring - k) / rest if rest > 0 else 0.0
        comp.base_rate = max(self.config.base_rate_floor, rate)
        return binomial_tail(k, comp.population, comp.base_rate)

    def _component_findings(self, comp: _Component, members: list[Finding], nodes: list[str], p_value: float,
                            since: float, classed: Mapping[int, str]) -> list[Finding]:
        classes = sorted({classed[id(f)] for f in members})
        evidence: dict[str, object] = {
            "label": comp.label, "component": comp.value, "classes": classes,
            "detectors": sorted({f.detector for f in members}), "signals": sorted({signal_of(f) for f in members}),
            "nodes": nodes, "nodes_under_component": comp.population, "fleet_nodes": comp.fleet_nodes,
            "fleet_erring_nodes": comp.fleet_erring, "base_rate": round(comp.base_rate, 6),
            "p_value": float(f"{p_value:.3g}")}
        reason = (f"{len(nodes)} of {comp.population} nodes under {comp.label} {comp.value} err "
                  f"({', '.join(classes)}): binomial tail {p_value:.2g} against the fleet's rate "
                  f"{comp.base_rate:.1%}")
        if comp.port is not None:
            evidence["port"] = comp.port
            reason += f", on {comp.port}"
        return [Finding(detector=NAME, node=comp.value, component=comp.value, action=action, since=since,
                        key=comp.label, reason=reason, evidence=evidence)
                for action in (Action.INSPECT_HARDWARE, Action.ALERT)]
