"""Fleet scenarios: the YAML that describes a simulated fleet, its jobs, its faults and the answers.

A scenario names the fleet (nodes, GPUs, device profile, topology), the training jobs running on
it, faults injected at scripted simulated times, and the decisions the aggregator is expected to
take. This module validates and resolves that description (node names, ranges, components); it
runs nothing and knows nothing about the agent or the aggregator.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agent.validation import format_validation_error

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"

# The node-level FakeNvml fault kinds (agent/nvml scenario contract); the simulator passes these
# through to each node's FakeNvml unchanged.
NVML_FAULT_KINDS = (
    "reset_required",
    "ecc_corrected_growth",
    "ecc_uncorrectable",
    "row_remap_pending",
    "row_remap_failure",
    "thermal_throttle",
    "power_brake",
    "xid",
    "gpu_lost",
    "nvlink_errors",
    "nvlink_down",
    "nvml_unavailable",
)


class ScenarioError(Exception):
    """A scenario that cannot be used; the message names every offending key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Topology(_Strict):
    """Consecutive nodes share a rack, consecutive racks a row; leaf switches span consecutive
    nodes (a rail-optimised fabric has several per rack; a leaf of 32 nodes is a common size)."""

    nodes_per_rack: int = Field(default=4, ge=1)
    racks_per_row: int = Field(default=8, ge=1)
    nodes_per_leaf: int = Field(default=32, ge=1)


class Fleet(_Strict):
    nodes: int = Field(ge=1, le=100_000)
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    hcas_per_node: int = Field(default=1, ge=0, le=16)
    profile: str = "h100-sxm-80gb"
    load: float = Field(default=0.9, ge=0, le=1)  # GPU utilization of the healthy fleet
    name_format: str = "node-{:04d}"
    topology: Topology = Topology()

    @model_validator(mode="after")
    def _name_format_works(self) -> Fleet:
        from agent.nvml.profiles import PROFILES

        if self.profile not in PROFILES:
            raise ValueError(f"profile {self.profile!r} is not one of {sorted(PROFILES)}")
        try:
            first = self.name_format.format(0)
        except (IndexError, KeyError, ValueError) as exc:
            raise ValueError(f"name_format {self.name_format!r} cannot format an index: {exc}") from None
        if first == self.name_format.format(1):
            raise ValueError(f"name_format {self.name_format!r} gives every node the same name")
        return self


class Phases(_Strict):
    """Share of a healthy step spent in each phase (they must sum to 1)."""

    compute: float = Field(default=0.75, ge=0, le=1)
    comm: float = Field(default=0.2, ge=0, le=1)
    data: float = Field(default=0.05, ge=0, le=1)

    @model_validator(mode="after")
    def _sums_to_one(self) -> Phases:
        total = self.compute + self.comm + self.data
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"compute + comm + data must be 1, got {total:g}")
        return self


class Noise(_Strict):
    """Per-step jitter of each rank's compute time: multiplicative lognormal (heavy right tail,
    what step-time histograms of real jobs look like) or additive gaussian (relative sigma)."""

    kind: Literal["lognormal", "gaussian"] = "lognormal"
    sigma: float = Field(default=0.02, ge=0, le=1)


NodeSet = str | list[str]  # "all", "node-0000..node-0099", or a list of names


class Job(_Strict):
    name: str = Field(min_length=1, max_length=128)
    nodes: NodeSet = "all"
    ranks_per_node: int = Field(default=8, ge=1, le=16)
    step_seconds: float = Field(gt=0)
    noise: Noise = Noise()
    phases: Phases = Phases()
    start_seconds: float = Field(default=0.0, ge=0)


class _FaultBase(_Strict):
    at_seconds: float = Field(ge=0)
    # Target: one node, several (names or a "a..b" range), or every node under a component
    # (a topology label value, e.g. a leaf switch name).
    node: str | None = None
    nodes: NodeSet | None = None
    component: str | None = None

    @model_validator(mode="after")
    def _one_target(self) -> _FaultBase:
        given = [k for k in ("node", "nodes", "component") if getattr(self, k) is not None]
        if len(given) != 1 and not self._target_optional():
            raise ValueError(f"give exactly one of node, nodes, component (got {given or 'none'})")
        return self

    @classmethod
    def _target_optional(cls) -> bool:
        return False


class NvmlFault(_FaultBase):
    """A fault of the node's FakeNvml (agent/nvml/scenario.py); the kind's own fields (``code``,
    ``rate_per_second``, ``link``, ...) are given beside it and validated by that model."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal[
        "ecc_corrected_growth", "ecc_uncorrectable", "row_remap_pending", "row_remap_failure",
        "thermal_throttle", "power_brake", "xid", "gpu_lost", "reset_required", "nvlink_errors",
        "nvlink_down", "nvml_unavailable",
    ]
    gpu: int | None = Field(default=None, ge=0)

    def node_fault(self, at_seconds: float | None = None) -> dict[str, Any]:
        """The fault as the node scenario declares it (times relative to the node's start)."""
        out: dict[str, Any] = {"kind": self.kind, "at_seconds": self.at_seconds if at_seconds is None
                               else at_seconds, **(self.model_extra or {})}
        if self.kind != "nvml_unavailable":
            out["gpu"] = self.gpu if self.gpu is not None else 0
        return out


class KernelXid(_FaultBase):
    """An NVRM Xid line written to the node's kernel log (what the xid collector tails)."""

    kind: Literal["kernel_xid"]
    gpu: int = Field(default=0, ge=0)
    code: int = Field(ge=1)
    text: str = ""  # the driver's trailing message; a default per well-known code otherwise


class PortDown(_FaultBase):
    """The HCA port's link goes down (state DOWN, phys_state Disabled/Polling), for good or for
    ``duration_seconds``."""

    kind: Literal["port_down"]
    hca: int = Field(default=0, ge=0)
    duration_seconds: float | None = Field(default=None, gt=0)


class PortFlap(_FaultBase):
    """The link goes down and comes back ``count`` times, ``period_seconds`` apart."""

    kind: Literal["port_flap"]
    hca: int = Field(default=0, ge=0)
    count: int = Field(default=3, ge=1)
    period_seconds: float = Field(default=20.0, gt=0)


class PortErrors(_FaultBase):
    """Link-integrity errors: ``counter`` grows by ``per_second`` from ``at_seconds`` on."""

    kind: Literal["port_errors"]
    hca: int = Field(default=0, ge=0)
    counter: str = "symbol_error"
    per_second: float = Field(default=50.0, gt=0)
    until_seconds: float | None = None


class SlowNode(_FaultBase):
    """Every rank on the node computes ``factor`` times slower (a throttled or degraded GPU that
    reports nothing wrong: only the step times show it)."""

    kind: Literal["slow_node"]
    factor: float = Field(default=1.1, gt=1.0, le=100.0)
    until_seconds: float | None = None


class DataStall(_FaultBase):
    """The whole job waits on its data loader (shared filesystem): every rank slower alike."""

    kind: Literal["data_stall"]
    job: str
    extra_seconds: float = Field(gt=0)
    until_seconds: float | None = None

    @classmethod
    def _target_optional(cls) -> bool:
        return True


class Hang(_FaultBase):
    """The ranks on the target node stop stepping (process alive). The job's other ranks go on
    with the work that does not need them (gradient-accumulation micro-steps, pipeline stages)
    for ``others_continue_seconds``, then block in the next collective that includes them;
    0 stops the whole job at once."""

    kind: Literal["hang"]
    job: str
    others_continue_seconds: float = Field(default=60.0, ge=0)
    until_seconds: float | None = None  # the job is restarted then and steps again

    @classmethod
    def _target_optional(cls) -> bool:
        return True  # no target: every rank of the job stops at once (a software bug)


class Silence(_FaultBase):
    """The node stops reporting (power loss, kernel panic, network partition)."""

    kind: Literal["silence"]
    until_seconds: float | None = None


Fault = Annotated[
    NvmlFault | KernelXid | PortDown | PortFlap | PortErrors | SlowNode | DataStall | Hang | Silence,
    Field(discriminator="kind"),
]


class Expectation(_Strict):
    """A decision the aggregator must take: on ``node`` (or ``component``, or ``job``), one of
    ``action``, within ``within_seconds`` of ``after_seconds`` (default: the first fault on that
    subject)."""

    node: str | None = None
    component: str | None = None
    job: str | None = None
    action: str | list[str]
    within_seconds: float = Field(gt=0)
    after_seconds: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_subject(self) -> Expectation:
        if sum(x is not None for x in (self.node, self.component, self.job)) != 1:
            raise ValueError("give exactly one of node, component, job")
        return self

    @property
    def actions(self) -> tuple[str, ...]:
        return (self.action,) if isinstance(self.action, str) else tuple(self.action)

    @property
    def subject(self) -> str:
        return next(str(x) for x in (self.node, self.component, self.job) if x is not None)


class Scenario(_Strict):
    name: str = ""
    description: str = ""
    seed: int = 0
    duration_seconds: float = Field(gt=0, le=30 * 86400)
    report_interval_seconds: float = Field(default=10.0, gt=0)
    # Heartbeats fed per rank and report: every step when a window holds fewer, else an even
    # sample ending at the last step (1,000 nodes x 8 ranks at one step a second would otherwise
    # cost more than everything else together); the summary's step count stays exact.
    heartbeats_per_rank: int = Field(default=4, ge=1)
    # On a node whose source of a collector has no fault injected (no NVML fault for `gpu`, no
    # port fault for `rdma`, no kernel-log line for `xid`), run that collector this often
    # instead of every report; its last result rides every report meanwhile, as with a real
    # agent whose collector interval is longer than its report interval. Costly collectors on
    # quiet nodes are what bounds a 1,000-node run; the faulty nodes always run every report.
    quiet_collector_intervals: dict[str, float] = Field(default_factory=dict)
    fleet: Fleet
    jobs: list[Job] = Field(default_factory=list)
    faults: list[Fault] = Field(default_factory=list)
    expect: list[Expectation] = Field(default_factory=list)
    # "tripped": the scenario passes only if the gate's cluster circuit breaker trips.
    expect_breaker: Literal["tripped", "closed", "any"] = "any"
    # Passed through to the real configurations: the agent's (for every simulated node), the
    # aggregator's (detector thresholds, fleet windows) and the gate's (always in dry run here).
    agent: dict[str, Any] = Field(default_factory=dict)
    aggregator: dict[str, Any] = Field(default_factory=dict)
    gate: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _references_resolve(self) -> Scenario:
        names = set(self.node_names())
        components = set(self.components())
        jobs = {j.name for j in self.jobs}
        if len(jobs) != len(self.jobs):
            raise ValueError("jobs: two jobs share a name")
        for i, job in enumerate(self.jobs):
            _check_nodeset(job.nodes, names, self.fleet.name_format, f"jobs.{i}.nodes")
        for i, fault in enumerate(self.faults):
            where = f"faults.{i}"
            if fault.node is not None and fault.node not in names:
                raise ValueError(f"{where}.node: unknown node {fault.node!r}")
            if fault.nodes is not None:
                _check_nodeset(fault.nodes, names, self.fleet.name_format, f"{where}.nodes")
            if fault.component is not None and fault.component not in components:
                raise ValueError(f"{where}.component: unknown component {fault.component!r}")
            if isinstance(fault, NvmlFault):
                _check_node_fault(fault, self.fleet, where)
            if isinstance(fault, DataStall | Hang) and fault.job not in jobs:
                raise ValueError(f"{where}.job: unknown job {fault.job!r}")
            if isinstance(fault, NvmlFault | KernelXid) and fault.gpu is not None \
                    and fault.gpu >= self.fleet.gpus_per_node:
                raise ValueError(f"{where}.gpu: {fault.gpu} >= gpus_per_node {self.fleet.gpus_per_node}")
            if isinstance(fault, PortDown | PortFlap | PortErrors) and fault.hca >= self.fleet.hcas_per_node:
                raise ValueError(f"{where}.hca: {fault.hca} >= hcas_per_node {self.fleet.hcas_per_node}")
            if fault.at_seconds > self.duration_seconds:
                raise ValueError(f"{where}.at_seconds: {fault.at_seconds:g} is after duration_seconds")
        for i, exp in enumerate(self.expect):
            if exp.node is not None and exp.node not in names:
                raise ValueError(f"expect.{i}.node: unknown node {exp.node!r}")
            if exp.component is not None and exp.component not in components:
                raise ValueError(f"expect.{i}.component: unknown component {exp.component!r}")
            if exp.job is not None and exp.job not in jobs:
                raise ValueError(f"expect.{i}.job: unknown job {exp.job!r}")
        return self

    # -- resolution -----------------------------------------------------------------------------

    def node_names(self) -> list[str]:
        return [self.fleet.name_format.format(i) for i in range(self.fleet.nodes)]

    def topology_of(self, index: int) -> dict[str, str]:
        t = self.fleet.topology
        rack = index // t.nodes_per_rack
        return {
            "row": f"row-{rack // t.racks_per_row:02d}",
            "rack": f"rack-{rack:03d}",
            "leaf_switch": f"leaf-{index // t.nodes_per_leaf:03d}",
        }

    def components(self) -> dict[str, list[str]]:
        """Every topology label value -> the nodes under it."""
        out: dict[str, list[str]] = {}
        for i, name in enumerate(self.node_names()):
            for value in self.topology_of(i).values():
                out.setdefault(value, []).append(name)
        return out

    def resolve_nodes(self, nodeset: NodeSet) -> list[str]:
        return _resolve_nodeset(nodeset, self.node_names(), self.fleet.name_format)

    def fault_nodes(self, fault: Any) -> list[str]:
        """The nodes a fault acts on (a job-wide fault without a target: the job's nodes)."""
        if fault.node is not None:
            return [fault.node]
        if fault.nodes is not None:
            return self.resolve_nodes(fault.nodes)
        if fault.component is not None:
            return list(self.components()[fault.component])
        job = next(j for j in self.jobs if j.name == fault.job)
        return self.resolve_nodes(job.nodes)

    def subject_fault_time(self, exp: Expectation) -> float | None:
        """When the fault an expectation answers began: ``after_seconds`` or the first fault on
        its node (or component, or any node under it)."""
        if exp.after_seconds is not None:
            return exp.after_seconds
        times = []
        for fault in self.faults:
            if exp.component is not None:
                hit = fault.component == exp.component
            elif exp.job is not None:
                hit = getattr(fault, "job", None) == exp.job and fault.node is None and fault.nodes is None
            else:
                targeted = fault.node is not None or fault.nodes is not None or fault.component is not None
                hit = targeted and exp.node in self.fault_nodes(fault)
            if hit:
                times.append(fault.at_seconds)
        if not times and exp.component is not None:
            # No fault of the component itself: the first fault of a node under it.
            times = [f.at_seconds for f in self.faults if exp.component in self._fault_components(f)]
        return min(times) if times else None

    def _fault_components(self, fault: Any) -> set[str]:
        index = {n: i for i, n in enumerate(self.node_names())}
        out: set[str] = set()
        for n in self.fault_nodes(fault):
            out.update(self.topology_of(index[n]).values())
        return out


def _check_node_fault(fault: NvmlFault, fleet: Fleet, where: str) -> None:
    # The node-level model is the one definition of each kind's fields: validate against it.
    from agent.nvml.scenario import ScenarioError as NodeScenarioError
    from agent.nvml.scenario import parse_node_scenario

    try:
        parse_node_scenario({"profile": fleet.profile, "gpus": fleet.gpus_per_node,
                             "faults": [fault.node_fault()]})
    except NodeScenarioError as exc:
        detail = str(exc).split("\n", 1)[-1].strip().replace("faults.0.", f"{where}.")
        raise ValueError(detail) from None


_RANGE_RE = re.compile(r"^\s*(\S+)\s*\.\.\s*(\S+)\s*$")


def _resolve_nodeset(nodeset: NodeSet, names: Sequence[str], name_format: str) -> list[str]:
    if isinstance(nodeset, list):
        return list(nodeset)
    if nodeset == "all":
        return list(names)
    m = _RANGE_RE.match(nodeset)
    if m is None:
        return [nodeset]
    index = {n: i for i, n in enumerate(names)}
    first, last = index[m.group(1)], index[m.group(2)]
    return list(names[first:last + 1])


def _check_nodeset(nodeset: NodeSet, names: set[str], name_format: str, where: str) -> None:
    if isinstance(nodeset, list):
        unknown = [n for n in nodeset if n not in names]
        if unknown:
            raise ValueError(f"{where}: unknown node(s) {unknown[:3]}")
        if not nodeset:
            raise ValueError(f"{where}: empty")
        return
    if nodeset == "all":
        return
    m = _RANGE_RE.match(nodeset)
    ends = [m.group(1), m.group(2)] if m else [nodeset]
    for end in ends:
        if end not in names:
            raise ValueError(f"{where}: unknown node {end!r} (give 'all', a name, 'first..last' or a list)")
    if m and sorted(ends) != ends:
        raise ValueError(f"{where}: range {nodeset!r} runs backwards")


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"invalid scenario {source}: the top level must be a mapping, "
                            f"got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(format_validation_error(exc, f"invalid scenario {source}")) from None


def load_scenario(path_or_name: str | Path) -> Scenario:
    """Load a scenario file, or a shipped one by name (``slow-node-1024``)."""
    path = Path(path_or_name)
    if not path.exists() and not path.suffix:
        path = SCENARIO_DIR / f"{path_or_name}.yaml"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"scenario {path} is not valid YAML: {exc}") from None
    scenario = parse_scenario(data, str(path))
    if not scenario.name:
        scenario = scenario.model_copy(update={"name": path.stem})
    return scenario


def shipped_scenarios() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.yaml"))


def shortened(scenario: Scenario, duration_seconds: float) -> Scenario:
    """The first ``duration_seconds`` of a scenario: faults after it are dropped, and so are the
    expectations that could not be judged within it (their deadline falls after the end)."""
    if duration_seconds >= scenario.duration_seconds:
        return scenario
    faults = [f for f in scenario.faults if f.at_seconds <= duration_seconds]
    kept = scenario.model_copy(update={"faults": faults, "duration_seconds": duration_seconds})
    expect = []
    for exp in scenario.expect:
        start = scenario.subject_fault_time(exp) or 0.0
        if start + exp.within_seconds <= duration_seconds:
            expect.append(exp)
    data = kept.model_dump(exclude_defaults=False)
    data["expect"] = [e.model_dump(exclude_none=True) for e in expect]
    data["faults"] = [_fault_dump(f) for f in faults]
    return Scenario.model_validate(data)


def _fault_dump(fault: Any) -> dict[str, Any]:
    data = fault.model_dump(exclude_none=True)
    data.update(fault.model_extra or {})
    return dict(data)
