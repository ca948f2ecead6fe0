"""What detectors read of the fleet: each node's state (NodeState), each job's ranks (JobState), the
node-action outcomes and removals, and the read-only FleetView over them.

Fleet.ingest is the only writer of these; a detector reads them through a FleetView and must not
change them. Nothing here reads a report's wire form or judges.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from vigil.aggregator.decision import Action
from vigil.aggregator.fleet.history import GpuHistory, PcieHistory, PortHistory, RankColumns, RankHistory
from vigil.aggregator.xid_catalog import XidOccurrence
from vigil.contract.wire import CollectiveState, Event, NodeActionResult, NodeConfig, Report, kernel_boot_id

if TYPE_CHECKING:
    from vigil.aggregator.detectors.probe_verdict import IsolationOutcome
    from vigil.aggregator.fleet.config import FleetConfig
    from vigil.aggregator.prober import ProbesConfig


@dataclass(slots=True)
class JobState:
    name: str
    ranks: dict[int, RankHistory] = field(default_factory=dict)
    last_seen: float = 0.0
    # Change marker (docs/detectors.md, "change markers"): the fleet revision of the latest change to its membership (a
    # rank joined, left, or moved to another node). Its ranks' summaries change every report.
    members_revision: int = 0
    # Its ranks' newest windows as columns, a slot per rank (the fleet keeps them on ingest), and
    # the change marker ``columns.window_seconds_changes`` (a rank's summary window changed).
    columns: RankColumns = field(default_factory=RankColumns)
    # Change markers of the heartbeat-side detectors (docs/detectors.md, "change markers"): the fleet
    # revision of the latest summary of one of its ranks whose window end changed (app_signals), and
    # of the latest whose pid, state, phase, checkpoint step or non-finite step counts changed or
    # whose step went back (job_runs, hang, app_signals). A rank new to the job or moved moves
    # members_revision instead. A marker tells a change, not a state: a reader checks the state
    # once, then trusts it while the marker stays.
    windows_revision: int = 0
    runs_revision: int = 0

    def nodes(self) -> set[str]:
        return {r.node for r in self.ranks.values()}


class NodeState:
    """One node as the aggregator knows it. ``last_seen`` is arrival time on the aggregator's
    clock (``now`` at ingest), so a node with a skewed clock cannot look alive or dead."""

    def __init__(self, report: Report, now: float, config: FleetConfig) -> None:
        self.name = report.node
        # The node's clock minus the aggregator's, as its latest report showed it (less that
        # report's delay), and the offset that places its event and window times on the
        # aggregator's clock: 0 within ``clock_offset_tolerance_seconds``, replaced only by an
        # offset further than that from it (a step), so one window's end is placed the same in
        # every report that repeats it.
        self.clock_skew_seconds = report.ts - now
        self.clock_offset_seconds = 0.0
        self.first_seen = now
        self.last_seen = now
        # When the state it holds was last reported (a replayed report refreshes last_seen only).
        self.state_seen = now
        self.last_report_ts = report.ts
        self.boot_id = report.boot_id
        self.boot_started = now  # this agent start (a new boot id: counters restarted)
        # The machine's boot (wire.kernel_boot_id): only a change of it is a reboot, the evidence
        # the recovery detector waits for; an agent restart alone changes boot_id, not this.
        self.kernel_boot_id = kernel_boot_id(report.boot_id)
        self.kernel_boot_started = now
        self.kernel_reboots = 0
        self.seq = report.seq
        self.interval_seconds = report.interval_seconds
        self.topology: dict[str, str] = dict(report.topology)
        self.nvml_available = report.nvml_available
        self.nvml_down_since: float | None = None
        self.failed_collectors: list[str] = []
        self.reports = 0
        # Its place in the fleet's order of nodes (set by the fleet when it joins: the order of
        # ``FleetView.nodes``), so that a detector walking only the nodes its journals name
        # (``NodeJournals``) walks them, and finds, in the order a walk of every node would.
        self.position = 0
        self.slot = 0  # its place in the fleet's ReportTimes
        # The fleet revision of the latest change to this node's state, and of the latest change
        # to what names its hardware class (docs/detectors.md, "change markers"): a GPU's model, maximum SM clock or
        # power limit (``_CLASS_FIELDS``), or its GPU histories.
        self.revision = 0
        self.gpu_class_revision = 0
        # The fleet revision of the latest change to which of its ranks are fresh or which GPU one
        # names (a rank joined or left it, a rank's GPU changed, a report or replay left one of its
        # ranks unrefreshed, or the report after such a one): what gpu_peer's jobs of GPUs placed by
        # their ranks are read from. ``ranks_unrefreshed``: its latest report or replay left one.
        self.ranks_revision = 0
        self.ranks_unrefreshed = False
        # What the GPU and port detectors read of it, kept on ingest so that they pass over a quiet
        # node in O(1) (docs/detectors.md, "change markers"): the newest time a judged counter of one of its GPUs or
        # ports increased (CounterBaseline.last_increase_ts, the largest of its GPUs' or ports'),
        # and the revision of the latest report that changed a GPU's memory or NVLink fault state
        # (``_GPU_FAULT_FIELDS``) or a port's link state, rate or flags, or took one of them whole
        # (a new GPU or port, one back in the reports, a whole report, a reboot).
        self.gpu_counters_moved_ts = -math.inf
        self.port_counters_moved_ts = -math.inf
        self.gpu_faults_revision = 0
        self.ports_revision = 0
        # The revision of the latest report with a GPU sample the thermal detector may act on
        # (WATCHED_CLOCK_EVENTS), and how many GPUs its latest report had (of len(gpus)).
        self.gpu_watch_revision = 0
        self.gpus_reported = 0
        # The GPUs whose latest state's health is not "ok" (the silence detector reads only these).
        self.unhealthy_gpus: set[int] = set()
        self.seq_gaps = 0
        self.reboots = 0
        self.gpus: dict[int, GpuHistory] = {}
        self.ports: dict[tuple[str, int], PortHistory] = {}
        # GPU index -> when it went missing from the reports of this boot (fell off the bus).
        self.missing_gpus: dict[int, float] = {}
        self.gpus_this_boot: set[int] = set()
        self.events: deque[tuple[float, Event]] = deque(maxlen=config.event_history)
        # GPU index (None: not attributable to one GPU) -> recent de-duplicated Xids.
        self.xids: dict[int | None, deque[XidOccurrence]] = {}
        self.ranks: dict[tuple[str, int], RankHistory] = {}
        self.host = report.host
        # When the machine booted, on the aggregator's clock: its report time less the uptime its
        # host facts gave, else when its first report of this kernel boot arrived.
        self.booted_at = now
        # Since when its Fabric Manager has been in a state other than active (None: active, or
        # not expected here), as its host facts said.
        self.fabric_manager_down_since: float | None = None
        # GPUs whose NVLink fabric is not registered and healthy (a state other than completed, a
        # registration error, an unhealthy condition) -> since when (this run of reports).
        self.fabric_suspect_gpus: dict[int, float] = {}
        # GPUs whose PCIe link is below its maximum now (GpuHistory.link_below holds the run).
        self.gpu_links_below: set[int] = set()
        # Its configuration facts (wire.NodeConfig; kept when a report leaves them out), since when
        # they are as held, and the fleet revision of their latest change (a change marker).
        self.config: NodeConfig | None = None
        self.config_since = now
        self.config_revision = 0
        # Its PCIe devices by sysfs bus id (the latest ``pcie`` section; kept when left out), the
        # revision of the latest change to a device's link or to which devices it has, and the
        # newest time an AER counter of one of them rose.
        self.pcie: dict[str, PcieHistory] = {}
        self.pcie_revision = 0
        self.pcie_aer_moved_ts = -math.inf
        self.pcie_links_below: set[str] = set()  # bus ids of those whose link is below its maximum
        # The Flight Recorder progress of its ranks (wire.CollectiveState), as its latest report
        # carried it; dump_ts is on the node's clock (clock_offset_seconds places it on ours).
        self.collectives: tuple[CollectiveState, ...] = tuple(report.collectives)
        # Node actions (aggregator/outbox.py): request id -> its expiry, and -> the latest result
        # the agent reported with when the report carrying it arrived (the aggregator's clock).
        self.action_expiry: dict[str, float] = {}
        self.action_results: dict[str, ActionOutcome] = {}
        # Issue 47, the marked nodes (MarkedNodes): the GPUs whose latest recovery_action is other
        # than "none", and the newest time of an Xid and of an amdgpu event (kind amdgpu_*) it reported.
        self.recovery_gpus: set[int] = set()
        self.xid_event_ts = -math.inf
        self.amdgpu_event_ts = -math.inf

    def summary(self) -> dict[str, object]:
        """What is kept of a node once the fleet forgets it (the store's archive)."""
        return {"node": self.name, "first_seen": self.first_seen, "last_seen": self.last_seen,
                "boot_id": self.boot_id, "seq": self.seq, "reports": self.reports, "reboots": self.reboots,
                "topology": self.topology, "gpus": sorted(self.gpus), "ports": [f"{d}/{p}" for d, p in self.ports]}



class MarkedNodes:
    """The few nodes some detectors judge, kept by Fleet.ingest (docs/detectors.md, "change markers"),
    so that those detectors never touch the rest: the nodes with a GPU whose latest recovery_action is
    other than "none" (``NodeState.recovery_gpus``), with any Xid record (``NodeState.xid_event_ts``), with
    any amdgpu event (``NodeState.amdgpu_event_ts``), with Flight Recorder state, with a fabric suspect GPU or Fabric
    Manager down. ``in_order`` gives them in the fleet's order (a detector's findings stay in it)."""

    __slots__ = ("amdgpu_events", "collectives", "fabric", "recovery_actions", "xids")

    def __init__(self) -> None:
        self.recovery_actions: set[NodeState] = set()
        self.xids: set[NodeState] = set()
        self.amdgpu_events: set[NodeState] = set()
        self.collectives: set[NodeState] = set()
        self.fabric: set[NodeState] = set()

    def forget(self, node: NodeState) -> None:
        for marked in (self.recovery_actions, self.xids, self.amdgpu_events, self.collectives, self.fabric):
            marked.discard(node)

    @staticmethod
    def in_order(nodes: set[NodeState]) -> list[NodeState]:
        """``nodes`` in the order the fleet holds them (the order they joined)."""
        return sorted(nodes, key=_POSITION)


_POSITION = attrgetter("position")  # NodeState.position: the fleet's order


class ActionOutcome(NamedTuple):
    """The latest result of one node-action request, and when the report carrying it arrived."""

    result: NodeActionResult
    received: float


class Removal(NamedTuple):
    """A node vigil took out of service and has not given back: the gate's record (the engine
    copies it from the ledger's gate state), read by the recovery detector. ``ts`` is when the
    removal was admitted on the aggregator's clock; ``held``: an operator holds the node."""

    action: Action
    ts: float
    decision: str
    gpu: int | None
    held: bool


class NodeJournal:
    """One change marker's journal (docs/detectors.md, "change markers"): the names of the nodes
    whose marker moved, in the order it moved, appended by the fleet on ingest (one list append
    where the marker moves, nothing where it does not). A detector keeps its own cursor, a position
    in it (``end`` when it last read), and walks the nodes named since instead of testing every
    node; ``start`` is the position of ``names[0]``: the fleet lets go of the oldest entries
    (``trim``), and a reader whose cursor is before ``start`` fell behind and walks everything."""

    __slots__ = ("names", "start")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.start = 0

    @property
    def end(self) -> int:
        return self.start + len(self.names)

    def since(self, cursor: int) -> list[str] | None:
        """The names appended at or after position ``cursor``; None when they are let go."""
        if cursor < self.start:
            return None
        return self.names[cursor - self.start:]

    def trim(self, keep: int) -> None:
        """Keep the newest ``keep`` entries at most."""
        drop = len(self.names) - keep
        if drop > 0:
            del self.names[:drop]
            self.start += drop


class NodeJournals:
    """The fleet's journals of node-side markers (``NodeJournal``), one per marker or group of
    markers that one detector reads together. ``members``: a node joined (a new ``NodeState``:
    all its markers are new) or was forgotten; every reader reads it beside its own."""

    __slots__ = ("gpu_class", "gpu_counters", "gpu_faults", "gpu_health", "gpu_jobs", "gpu_watch", "members",
                 "pcie_links", "port_counters", "ports", "rank_gpus")

    def __init__(self) -> None:
        self.members = NodeJournal()
        # NodeState.gpu_faults_revision and gpu_counters_moved_ts moved.
        self.gpu_faults = NodeJournal()
        self.gpu_counters = NodeJournal()
        # NodeState.gpu_watch_revision moved, or a report left one of its GPUs out or changed how
        # many it had (``gpus_reported``).
        self.gpu_watch = NodeJournal()
        # NodeState.unhealthy_gpus, missing_gpus or nvml_down_since changed.
        self.gpu_health = NodeJournal()
        # NodeState.gpu_class_revision moved; a GPU's job attribution changed or a GPU history
        # began (the node's part of Fleet.gpu_jobs_revision).
        self.gpu_class = NodeJournal()
        self.gpu_jobs = NodeJournal()
        # NodeState.ranks_revision moved (which of its ranks are fresh, or the GPU one names).
        self.rank_gpus = NodeJournal()
        # NodeState.ports_revision and port_counters_moved_ts moved.
        self.ports = NodeJournal()
        self.port_counters = NodeJournal()
        # NodeState.gpu_links_below or pcie_links_below changed, or pcie_aer_moved_ts moved.
        self.pcie_links = NodeJournal()

    def trim(self, nodes: int) -> None:
        """Bound each journal: twice the fleet's nodes (and some room) is more than one round of
        whole reports appends; a reader further behind walks every node, which costs no more."""
        keep = 2 * nodes + 1024
        for name in self.__slots__:
            journal: NodeJournal = getattr(self, name)
            if len(journal.names) > keep:
                journal.trim(keep)


class ReportTimes:
    """Each node's ``state_seen`` (its latest report but a replayed one, so never after its
    ``last_seen``) in one list, by the node's slot (``NodeState.slot``; a slot let go by a
    forgotten node is given to the next that joins, +inf while free), and the node in each slot.
    One store per report on ingest, so that a detector reads every node's report time at C speed:
    the silence detector finds the nodes that may be silent past a delay with a ``min`` over the
    list instead of a test per node, and the thermal detector keeps what the last pass found in
    a copy of it."""

    __slots__ = ("_free", "nodes", "times")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.nodes: list[NodeState | None] = []
        self._free: list[int] = []

    def join(self, node: NodeState) -> None:
        if self._free:
            node.slot = self._free.pop()
            self.times[node.slot], self.nodes[node.slot] = node.state_seen, node
        else:
            node.slot = len(self.times)
            self.times.append(node.state_seen)
            self.nodes.append(node)

    def leave(self, node: NodeState) -> None:
        self.times[node.slot], self.nodes[node.slot] = math.inf, None
        self._free.append(node.slot)


class FleetView:
    """What detectors see: read-only mappings over the fleet (detectors must not mutate state),
    and the nodes vigil removed (empty unless the engine was asked for them)."""

    __slots__ = ("agent_resets", "config_revision", "fleet", "gpu_jobs_revision", "isolations", "jobs",
                 "journals", "learned_probes", "marked", "nodes", "probes", "removed", "report_times", "revision")

    def __init__(self, nodes: dict[str, NodeState], jobs: dict[str, JobState],
                 removed: Mapping[str, Removal] | None = None, *, agent_resets: bool = False,
                 probes: ProbesConfig | None = None,
                 learned_probes: Mapping[tuple[str, str], tuple[float, int]] | None = None,
                 isolations: Sequence[IsolationOutcome] = (), revision: int | None = None,
                 fleet: object | None = None, gpu_jobs_revision: int = 0, config_revision: int = 0,
                 journals: NodeJournals | None = None, report_times: ReportTimes | None = None,
                 marked: MarkedNodes | None = None) -> None:
        self.nodes: Mapping[str, NodeState] = MappingProxyType(nodes)
        # Change markers (docs/detectors.md, "change markers"): the fleet's revision when the view was taken, and the
        # fleet's identity. A view built by hand (tests) has neither: ``revision`` None tells a
        # detector to trust no marker and judge from scratch.
        self.revision = revision
        self.fleet = fleet
        self.gpu_jobs_revision = gpu_jobs_revision  # Fleet.gpu_jobs_revision
        self.config_revision = config_revision  # Fleet.config_revision
        # The fleet's journals of node-side markers (None with ``revision`` None: walk every node).
        self.journals = journals if revision is not None else None
        self.report_times = report_times if revision is not None else None  # Fleet.report_times
        self.marked = marked  # Fleet.marked (None: judge every node)
        self.jobs: Mapping[str, JobState] = MappingProxyType(jobs)
        self.removed: Mapping[str, Removal] = MappingProxyType(dict(removed or {}))
        # An admitted reset_gpu is carried out by the node's agent on a signed request, and its
        # result arrives in the reports (NodeState.action_results).
        self.agent_resets = agent_resets
        # Probing on (aggregator/prober.py): its settings, and the learned figures per (hardware
        # class, probe) -> (median value, passing samples), both owned by the prober.
        self.probes = probes
        self.learned_probes: Mapping[tuple[str, str], tuple[float, int]] = learned_probes or MappingProxyType({})
        # Group-testing isolations (the prober's): the probe verdict detector acts on finished ones.
        self.isolations: tuple[IsolationOutcome, ...] = tuple(isolations)

    def without_markers(self) -> FleetView:
        """The same fleet with no change markers: detectors judge it the long way, from scratch
        (the reference the incremental paths are tested against)."""
        return FleetView(dict(self.nodes), dict(self.jobs), self.removed, agent_resets=self.agent_resets,
                         probes=self.probes, learned_probes=self.learned_probes, isolations=self.isolations)

    def members(self, label: str, value: str) -> list[str]:
        """Nodes whose topology label ``label`` (e.g. leaf_switch) equals ``value``."""
        return [n.name for n in self.nodes.values() if n.topology.get(label) == value]
