"""The Fleet: the aggregator's bounded, windowed memory of every node, GPU, port and job, and its one writer.

It reads validated Reports (``refusal`` says whether one may be taken; ``ingest`` folds it in,
completing a compact report's entries from its base, computing counter increases per boot,
de-duplicating Xids and keeping job membership from the rank summaries) and the node-action
requests and results the outbox hands it. It judges nothing; detectors read it through ``view()``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

import msgspec

from vigil.aggregator.fleet.completion import (
    complete_cleared,
    complete_port,
    complete_rank,
    copy_struct,
    marking_completer,
    with_cleared,
)
from vigil.aggregator.fleet.config import FleetConfig
from vigil.aggregator.fleet.history import (
    PORT_COUNTERS_ROSE,
    PORT_LINK_CHANGED,
    GpuHistory,
    LoadedRun,
    PcieHistory,
    PortHistory,
    RankHistory,
    link_below_max,
    normal_bus_id,
)
from vigil.aggregator.fleet.view import (
    ActionOutcome,
    FleetView,
    JobState,
    MarkedNodes,
    NodeJournals,
    NodeState,
    Removal,
    ReportTimes,
)
from vigil.aggregator.xid_catalog import XidOccurrence
from vigil.contract.wire import (
    REPORT_VERSION,
    REPORT_VERSIONS,
    Event,
    GpuState,
    HostFacts,
    NodeActionRequest,
    NodeActionResult,
    PcieDevice,
    PortState,
    Report,
    kernel_boot_id,
)

if TYPE_CHECKING:
    from vigil.aggregator.detectors.probe_verdict import IsolationOutcome
    from vigil.aggregator.prober import ProbesConfig

_V = TypeVar("_V")

# removal it follows): far above one request per GPU in flight; the oldest go first.
MAX_NODE_ACTIONS_KEPT = 64

# The GPU fields a node's hardware class is read from (detectors/peer_class.py): a change to one
# moves NodeState.gpu_class_revision.
_CLASS_FIELDS = frozenset({"name", "sm_clock_max_hertz", "power_limit_watts"})
# What a compact GPU entry that carries one of these fields moves (a fault flag: gpu_faults_revision;
# the class: gpu_class_revision; its job: the fleet's gpu_jobs_revision; its recovery action: the
# marked nodes, MarkedNodes.recovery_actions), told by its completion.
_GPU_FAULTS, _GPU_CLASS, _GPU_JOB, _GPU_RECOVERY = 1, 2, 4, 8
complete_gpu_marked = marking_completer(GpuState, {
    **dict.fromkeys(("remap_pending", "remap_failure", "retired_pages_pending", "retired_pages_sbe",
                     "retired_pages_dbe",
                     # the link's maxima: config_drift's manifest check (its cache is on this marker)
                     "pcie_link_generation_max", "pcie_link_width_max"), _GPU_FAULTS),
    **dict.fromkeys(_CLASS_FIELDS, _GPU_CLASS), "job": _GPU_JOB, "recovery_action": _GPU_RECOVERY},
    matched=("index", "uuid"))

# A GPU's recovery_action that asks for nothing (wire.RecoveryAction; None: not read).
_NO_RECOVERY = frozenset({None, "none"})

# A GPU sample the thermal detector may act on is marked on ingest (NodeState.gpu_watch_revision),
# so that it passes over a node none of whose samples it could act on in O(1). Watched: a clock-event
# reason by which the hardware protects itself (NVML nvmlClocksEventReasons, agent/nvml/backend.py:
# HW slowdown, SW and HW thermal slowdown, HW power brake; not SwPowerCap, the usual state of a GPU at
# full load, nor idle, clock settings or sync boost), or HBM within HBM_WATCH_BELOW_LIMIT_CELSIUS of
# its limit (memory_max_temperature, else the 95 C of an H100 SXM's "Memory Max Operating Temp"). The
# thermal detector trusts the marker only where its configuration acts within these
# (ThermalDetector._watched).
WATCHED_CLOCK_EVENTS = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                  "hw_power_brake_slowdown"})
HBM_DEFAULT_LIMIT_CELSIUS = 95.0
HBM_WATCH_BELOW_LIMIT_CELSIUS = 10.0


_NODE_LAST_SEEN = attrgetter("last_seen")  # NodeState.last_seen
# A fleet trims its journals at each view (once a judging pass) and here every so many reports,
# so that one that ingests without judging (judging off, a pass that never comes) stays bounded:
# at most this many reports' appends (a few names each) past 2 x nodes + 1,024 a journal.
JOURNAL_TRIM_REPORTS = 4096


class Fleet:
    """Mutable fleet state. ``ingest`` is the only writer; detectors get ``view()``."""

    def __init__(self, config: FleetConfig | None = None, *, port_counters: Collection[str] | None = None,
                 agent_resets: bool = False) -> None:
        """``port_counters``: the RDMA counters detectors judge (None: keep deltas of all);
        ``agent_resets``: reset_gpu decisions become requests to the agents (FleetView says so)."""
        self.config = config or FleetConfig()
        self.agent_resets = agent_resets
        self._port_counters = frozenset(port_counters) if port_counters is not None else None
        self._nodes: dict[str, NodeState] = {}
        self._jobs: dict[str, JobState] = {}
        # Change markers (docs/detectors.md, "change markers"): counts every change to the state detectors read; each
        # node, job and rank records the revision of its own latest change. ``identity`` tells
        # one fleet from another (a detector's cache holds for the fleet it was built over).
        self.revision = 0
        self.identity = object()
        # The revision of the latest change to which GPUs the fleet holds (a node joined or was
        # forgotten, a GPU history began) or to any GPU's job attribution (GpuState.job).
        self.gpu_jobs_revision = 0
        # The revision of the latest change to any node's configuration facts, or to which nodes
        # the fleet holds (config_drift's fleet-wide value counts).
        self.config_revision = 0
        # The journals of node-side markers (view.NodeJournals): the names of the nodes whose
        # marker moved, appended where it moves; and the next node's place in the fleet's order.
        self.journals = NodeJournals()
        self._reports_since_trim = 0  # the journals are also trimmed every JOURNAL_TRIM_REPORTS reports
        self._positions = 0
        # Each node's state_seen in one list (view.ReportTimes: the silence and thermal detectors').
        self.report_times = ReportTimes()
        # The few nodes some detectors judge (xid, amdgpu, collective_culprit, fabric), so that they
        # never touch the rest (issue 47: a walk of 12,500 nodes costs them 5-10 ms a pass).
        self.marked = MarkedNodes()
        # Entries dropped to keep a node within its caps, by kind (ports, ranks, jobs): the oldest
        # of those its latest report no longer named (vigil_aggregator_fleet_evictions_total).
        self.evicted: dict[str, int] = dict.fromkeys(EVICTION_KINDS, 0)
        # Active validation (aggregator/prober.py owns both and sets them; the view hands them to the
        # detectors): the ``probes`` settings when probing is on (the recovery detector then resumes
        # only after a probe run passes), and the fleet's learned probe figures per (hardware class,
        # probe), replaced whole by the prober (never changed in place: a judge reading it sees one).
        self.probes: ProbesConfig | None = None
        self.learned_probes: Mapping[tuple[str, str], tuple[float, int]] = MappingProxyType({})
        # Group-testing isolations, running and the latest finished (replaced whole by the prober).
        self.isolations: tuple[IsolationOutcome, ...] = ()

    def refusal(self, report: Report, now: float, pending: tuple[str, int] | None = None) -> tuple[str, str] | None:
        """Why ``report`` must be refused against the node's last report, as (reason, detail);
        None: it may be ingested. Reads state, changes nothing, so a refused report leaves the
        fleet exactly as it was. ``pending``: the (boot id, seq) of this node's latest accepted
        report not ingested yet (held while the detectors read). The report's own time is never
        a reason: a node's clock may be off (it is measured at ingest, and reported), and ``now``
        is the aggregator's step-free clock (aggregator/clock.py), so the seq bound below is a
        difference of two of its readings."""
        if report.version != REPORT_VERSION:
            return "unsupported_report_version", (
                f"report version {report.version} is not taken: this aggregator takes version {REPORT_VERSION} "
                f"only (report_versions {list(REPORT_VERSIONS)}; a report without base_seq is whole): upgrade the "
                "agent")
        cfg = self.config
        node = self._nodes.get(report.node)
        if report.base_seq is not None:
            last = pending if pending is not None else (node.boot_id, node.seq) if node is not None else None
            if last is None or last != (report.boot_id, report.base_seq):
                held = "nothing of this node" if last is None else f"boot {last[0]!r} seq {last[1]}"
                return "delta_base", (f"the report is relative to seq {report.base_seq} of boot {report.boot_id!r}, "
                                      f"but the aggregator's last accepted report is {held}: send it whole")
        if node is not None and report.boot_id == node.boot_id:
            allowed = node.seq + cfg.max_seq_jump + int(max(0.0, now - node.last_seen) * cfg.max_reports_per_second)
            if report.seq > allowed:
                return "seq_jump", f"seq {report.seq} jumps past {allowed} (last accepted {node.seq})"
        return None

    def reporting_since(self, ts: float) -> int:
        """Nodes whose last accepted report arrived at or after ``ts`` (the breaker's budget base).
        Counted in C (a pass asks twice: a generator over 12,500 nodes cost ~2-4 ms each time)."""
        return sum(map(float(ts).__le__, map(_NODE_LAST_SEEN, self._nodes.values())))

    def clock_offsets(self, since: float) -> dict[str, float]:
        """Each node heard from at or after ``since``: its clock minus the aggregator's, as held
        (0 within ``clock_offset_tolerance_seconds``)."""
        return {n.name: n.clock_offset_seconds for n in self._nodes.values() if n.last_seen >= since}

    def clock_offset(self, name: str) -> float:
        """Node ``name``'s clock minus the aggregator's, as held (0 for a node not in the fleet)."""
        node = self._nodes.get(name)
        return node.clock_offset_seconds if node is not None else 0.0

    def is_skewed(self, node: NodeState) -> bool:
        return abs(node.clock_offset_seconds) > self.config.max_clock_skew_seconds

    def is_member(self, name: str, now: float) -> bool:
        """Whether decisions may name ``name``: it reported within ``forget_after_seconds``."""
        node = self._nodes.get(name)
        return node is not None and now - node.last_seen < self.config.forget_after_seconds

    def forget_departed(self, now: float,
                        after_seconds: Callable[[NodeState], float] | None = None) -> list[NodeState]:
        """Drop the nodes silent longer than ``forget_after_seconds`` (or ``after_seconds(node)``)
        and return them (for the archive); their ranks leave their jobs."""
        after = after_seconds or (lambda _: self.config.forget_after_seconds)
        gone = [n for n in self._nodes.values() if n.last_seen < now - after(n)]
        if gone:
            self.revision += 1
            self.gpu_jobs_revision = self.config_revision = self.revision
        members = self.journals.members.names
        for node in gone:
            del self._nodes[node.name]
            members.append(node.name)
            self.report_times.leave(node)
            self.marked.forget(node)
            for job_name, rank in node.ranks:
                job = self._jobs.get(job_name)
                if job is not None and job.ranks.get(rank) is not None and job.ranks[rank].node == node.name:
                    job.columns.release(job.ranks.pop(rank))
                    job.members_revision = self.revision
        self.journals.trim(len(self._nodes))
        return gone

    def ingest(self, report: Report, now: float) -> dict[str, int]:
        """Fold ``report``, received at ``now`` (the aggregator's step-free clock), into the fleet.
        Returns the entries refused to keep the node within its caps or off another node's ranks,
        by reason (empty: none); the report itself is always taken, its events whatever its entries."""
        cfg = self.config
        node = self._nodes.get(report.node)
        refused: dict[str, int] = {}
        # A compact report's entries complete the state its base report left (refusal checked
        # the base; an entry with none, which no agent sends, is taken as it came).
        base_seen = node.state_seen if report.base_seq is not None and node is not None \
            and node.boot_id == report.boot_id else None
        # The node's previous report (not a replay): a whole entry of a GPU that was in it moves
        # the GPU markers only where what they follow changed, as a compact entry does.
        prev_seen = node.state_seen if node is not None else None
        fresh = node is None
        journals = self.journals
        self._reports_since_trim += 1
        if self._reports_since_trim >= JOURNAL_TRIM_REPORTS:  # bounded where nobody takes a view
            self._reports_since_trim = 0
            journals.trim(len(self._nodes))
        if node is None:
            node = self._nodes[report.node] = NodeState(report, now, cfg)
            node.position = self._positions
            self._positions += 1
            self.report_times.join(node)
            journals.members.names.append(node.name)  # all its markers are new
        elif report.boot_id == node.boot_id and report.seq <= node.seq:
            # A replayed or reordered report of this boot (the seq alone says so: the node's clock
            # may have stepped back): its counters are older than what we hold, so applying them
            # would fake a reset. Keep its events, which dedup absorbs; its clock says nothing new.
            self._ingest_events(node, report, now, refused)
            node.last_seen = max(node.last_seen, now)
            self.revision += 1
            node.revision = self.revision
            if node.ranks:  # its ranks' freshness is reckoned from last_seen
                self._ranks_moved(node, self.revision)
                node.ranks_unrefreshed = True
            return refused
        self.revision += 1
        revision = node.revision = self.revision
        if fresh:
            self.gpu_jobs_revision = self.config_revision = revision
        self._measure_clock(node, report, now)
        if fresh:
            pass
        elif report.boot_id != node.boot_id:
            node.reboots += 1
            node.boot_id = report.boot_id
            node.boot_started = now
            if kernel_boot_id(report.boot_id) != node.kernel_boot_id:
                node.kernel_boot_id = kernel_boot_id(report.boot_id)
                node.kernel_boot_started = node.booted_at = now
                node.kernel_reboots += 1
            # The GPUs of the last boot are still expected: one that does not come back after
            # a reboot is missing (a new episode, counted from this boot), not forgotten.
            node.gpus_this_boot.update(node.gpus)
            node.missing_gpus.clear()
            for gpu in node.gpus.values():
                gpu.counters.forget_baseline()
            for port in node.ports.values():
                port.counters.forget_baseline()
                port.max_rate_bits_per_second = None
                port.active_this_boot = False
            node.ports_revision = revision
            journals.ports.names.append(node.name)
            for device in node.pcie.values():
                device.counters.forget_baseline()
        elif report.seq != node.seq + 1:
            node.seq_gaps += 1
        node.seq = report.seq
        node.last_seen = node.state_seen = self.report_times.times[node.slot] = now
        node.last_report_ts = report.ts
        node.interval_seconds = report.interval_seconds
        node.reports += 1
        if report.topology:
            node.topology = dict(report.topology)
        if not report.nvml_available and node.nvml_down_since is None:
            node.nvml_down_since = now
            journals.gpu_health.names.append(node.name)
        elif report.nvml_available and node.nvml_down_since is not None:
            node.nvml_down_since = None
            journals.gpu_health.names.append(node.name)
        node.nvml_available = report.nvml_available
        node.failed_collectors = list(report.failed_collectors)
        if report.host is not None:
            self._ingest_host(node, report.host, now)
        if report.config is not None and report.config != node.config:
            node.config = report.config
            node.config_since = now
            node.config_revision = self.config_revision = revision
        if report.pcie is not None:
            self._ingest_pcie(node, report.pcie, now, revision, refused)
        # Whole in every report while the dumps are fresh (not a section): each report replaces it.
        node.collectives = tuple(report.collectives)
        if node.collectives:
            self.marked.collectives.add(node)
        elif node in self.marked.collectives:
            self.marked.collectives.discard(node)
        ts = now
        maxlen = cfg.history_reports
        # A compact report: (section, entry) -> the fields back at their defaults (rare: usually empty).
        cleared: dict[tuple[str, int], list[str]] = {}
        for section, i, name in report.cleared:
            cleared.setdefault((section, i), []).append(name)
        state_maxlen = cfg.state_history_reports
        # An entry completes its history's last state when that state is the base's (its history
        # was observed when the base report was ingested, base_seen; never when base_seen is None).
        gpus = node.gpus
        seen: set[int] = set()
        braking, hbm_limit, hbm_watch = WATCHED_CLOCK_EVENTS, HBM_DEFAULT_LIMIT_CELSIUS, HBM_WATCH_BELOW_LIMIT_CELSIUS
        suspect, links_below = node.fabric_suspect_gpus, node.gpu_links_below
        for i, state in enumerate(report.gpus):
            index = state.index
            held = False  # whether ``state`` is the very one the GPU's history took last (whole entries)
            hist = gpus.get(index)
            if hist is None and len(gpus) >= cfg.max_gpus_per_node:
                _count(refused, "too_many_gpus")  # never evicted: a GPU gone from the reports is evidence
                continue
            seen.add(index)
            if hist is not None and hist.last_seen == base_seen and hist.uuid == state.uuid:
                # A compact entry carries a field that changed (or lists it as cleared): the
                # completer says which of the marked ones it carried.
                base = hist.last
                if base is not hist.owned:  # the fleet's own copy, made once (``owned``)
                    base = hist.owned = copy_struct(base)
                links_sent = state.nvlink_links_down != base.nvlink_links_down  # read before completing in place
                marked = complete_gpu_marked(base, state)
                if cleared:
                    names = cleared.get(("gpus", i), ())
                    if names:
                        marked |= _GPU_FAULTS | (_GPU_CLASS if not _CLASS_FIELDS.isdisjoint(names) else 0) \
                            | (_GPU_JOB if "job" in names else 0) | (_GPU_RECOVERY if "recovery_action" in names else 0)
                    base = with_cleared(base, names)
                state = base
                if marked or links_sent:
                    if (marked & _GPU_FAULTS or links_sent) and node.gpu_faults_revision != revision:
                        node.gpu_faults_revision = revision
                        journals.gpu_faults.names.append(node.name)
                    if marked & _GPU_CLASS and node.gpu_class_revision != revision:
                        node.gpu_class_revision = revision
                        journals.gpu_class.names.append(node.name)
                    if marked & _GPU_JOB:
                        self.gpu_jobs_revision = revision
                        journals.gpu_jobs.names.append(node.name)
                    if marked & _GPU_RECOVERY:
                        self._mark_recovery(node, index, state.recovery_action)
            elif hist is None or hist.uuid != state.uuid:
                hist = gpus[index] = GpuHistory(state, ts, maxlen, state_maxlen)
                if node.gpu_faults_revision != revision:
                    journals.gpu_faults.names.append(node.name)
                if node.gpu_class_revision != revision:
                    journals.gpu_class.names.append(node.name)
                journals.gpu_jobs.names.append(node.name)
                node.gpu_class_revision = node.gpu_faults_revision = self.gpu_jobs_revision = revision
                if state.recovery_action not in _NO_RECOVERY or node.recovery_gpus:
                    self._mark_recovery(node, index, state.recovery_action)
            else:
                last = hist.last
                # The state held itself (the simulator hands the service its agents' objects, the same
                # ones until a GPU is read again; wire states are values) changed nothing it marks.
                held = state is last
                # Taken whole: a GPU back in the reports, or one whose fault fields (the marking
                # completer's _GPU_FAULTS, and the NVLinks down) changed. Tested field by field: an
                # attrgetter of the eight, twice, cost ~4k instructions a GPU (bench_ingest_instructions),
                # the chain ~1.5k.
                if node.gpu_faults_revision != revision and (hist.last_seen != prev_seen or (not held and (
                        state.remap_pending != last.remap_pending or state.remap_failure != last.remap_failure
                        or state.retired_pages_pending != last.retired_pages_pending
                        or state.retired_pages_sbe != last.retired_pages_sbe
                        or state.retired_pages_dbe != last.retired_pages_dbe
                        or state.nvlink_links_down != last.nvlink_links_down
                        or state.pcie_link_generation_max != last.pcie_link_generation_max
                        or state.pcie_link_width_max != last.pcie_link_width_max))):
                    node.gpu_faults_revision = revision
                    journals.gpu_faults.names.append(node.name)
                if not held:  # else its class, job and recovery action were taken with it (idempotent)
                    if (state.name != last.name or state.sm_clock_max_hertz != last.sm_clock_max_hertz
                            or state.power_limit_watts != last.power_limit_watts) \
                            and node.gpu_class_revision != revision:
                        node.gpu_class_revision = revision
                        journals.gpu_class.names.append(node.name)
                    if state.job != last.job:
                        self.gpu_jobs_revision = revision
                        journals.gpu_jobs.names.append(node.name)
                    if state.recovery_action not in _NO_RECOVERY or node.recovery_gpus:
                        self._mark_recovery(node, index, state.recovery_action)
            if hist.observe(state, ts, held) and node.gpu_counters_moved_ts != ts:
                node.gpu_counters_moved_ts = ts
                journals.gpu_counters.names.append(node.name)
            reasons, hbm = state.clock_event_reasons, state.memory_temperature_celsius
            if ((reasons and not braking.isdisjoint(reasons)) or (hbm is not None and hbm >= (
                    state.memory_max_temperature_celsius or hbm_limit) - hbm_watch)) \
                    and node.gpu_watch_revision != revision:
                node.gpu_watch_revision = revision
                journals.gpu_watch.names.append(node.name)
            if state.health != "ok":
                if index not in node.unhealthy_gpus:
                    node.unhealthy_gpus.add(index)
                    journals.gpu_health.names.append(node.name)
            elif node.unhealthy_gpus and index in node.unhealthy_gpus:
                node.unhealthy_gpus.discard(index)
                journals.gpu_health.names.append(node.name)
            # The fabric and PCIe link markers: a few reads per GPU (none without an NVSwitch
            # fabric or a link reading). The slow path only for a GPU whose fabric is not registered
            # and healthy (a state other than completed, a registration error, an unhealthy
            # condition) or whose link is below its maximum, or while the node has any such GPU (an
            # empty dict or set is false: one test).
            fabric = state.fabric_state
            if fabric is not None or suspect:
                if (fabric is not None and fabric != "completed") or state.fabric_status is not None \
                        or state.fabric_health:
                    suspect.setdefault(index, ts)
                elif suspect:
                    suspect.pop(index, None)
            if state.pcie_link_generation != state.pcie_link_generation_max \
                    or state.pcie_link_width != state.pcie_link_width_max or links_below:
                self._observe_gpu_link(node, hist, state, ts)
        reported = len(seen)
        if reported != node.gpus_reported or reported != len(gpus):  # a GPU left out, or their count changed
            journals.gpu_watch.names.append(node.name)
        node.gpus_reported = reported
        if suspect or node.fabric_manager_down_since is not None:
            self.marked.fabric.add(node)
        elif node in self.marked.fabric:
            self.marked.fabric.discard(node)
        # A GPU that was in this boot's reports and is now absent fell off the bus, unless the
        # reader itself failed (then the report says so and "no data" is not "no GPU").
        gpu_reader_ok = report.nvml_available and "gpu" not in report.failed_collectors
        if gpu_reader_ok:
            known = node.gpus_this_boot
            missing = node.missing_gpus
            if not known <= seen:
                for index in known - seen:
                    if index not in missing:
                        missing[index] = ts
                        journals.gpu_health.names.append(node.name)
            if missing:
                for index in seen:
                    if missing.pop(index, None) is not None:
                        journals.gpu_health.names.append(node.name)
            if not seen <= known:
                known |= seen
        ports = node.ports
        max_counters = cfg.max_counters_per_port
        idle_ports: list[PortHistory] | None = None  # those this report does not name, oldest last
        for i, pstate in enumerate(report.ports):
            key = (pstate.device, pstate.port)
            phist = ports.get(key)
            psent = None
            if phist is None:
                if len(ports) >= cfg.max_ports_per_node:
                    if idle_ports is None:
                        named = {(p.device, p.port) for p in report.ports}
                        idle_ports = sorted((p for k, p in ports.items() if k not in named),
                                            key=attrgetter("last_seen"), reverse=True)
                    if not idle_ports:
                        _count(refused, "too_many_ports")
                        continue
                    oldest = idle_ports.pop()
                    del ports[(oldest.device, oldest.port)]
                    self.evicted["ports"] += 1
                    if node.ports_revision != revision:
                        node.ports_revision = revision
                        journals.ports.names.append(node.name)
                if len(pstate.counters) > max_counters:
                    pstate = _within(pstate, {}, max_counters, refused)
                phist = ports[key] = PortHistory(pstate, ts, maxlen, state_maxlen, self._port_counters)
            elif phist.last_seen == base_seen:
                psent = pstate
                # The moved counters merge into the base's own dict.
                pbase = phist.last
                if pbase is not phist.owned:
                    pbase = phist.owned = copy_struct(pbase, counters=dict(pbase.counters))
                if len(pbase.counters) + len(pstate.counters) > max_counters:
                    pstate = psent = _within(pstate, pbase.counters, max_counters, refused)
                if not cleared:
                    changed = phist.observe_moved(pstate, ts)  # the usual entry: only counters moved
                    if changed is not None:
                        if changed & PORT_COUNTERS_ROSE and node.port_counters_moved_ts != ts:
                            node.port_counters_moved_ts = ts
                            journals.port_counters.names.append(node.name)
                        continue
                pstate = complete_cleared(complete_port, pbase, pstate, cleared.get(("ports", i), ())) \
                    if cleared else complete_port(pbase, pstate)
            back = phist.last_seen != prev_seen  # not in the node's previous report: taken as changed
            # A whole entry that is the state held (the simulator's quiet ports: as a GPU's, above).
            changed = phist.observe(pstate, ts, psent, psent is None and pstate is phist.last) \
                | (PORT_LINK_CHANGED if back else 0)
            if changed:
                if changed & PORT_LINK_CHANGED and node.ports_revision != revision:
                    node.ports_revision = revision
                    journals.ports.names.append(node.name)
                if changed & PORT_COUNTERS_ROSE and node.port_counters_moved_ts != ts:
                    node.port_counters_moved_ts = ts
                    journals.port_counters.names.append(node.name)
        jobs = self._jobs
        job: JobState | None = None
        room: _RankRoom | None = None  # built at the first rank new to this node
        offset = node.clock_offset_seconds
        # NodeState.ranks_revision's inputs: the ranks this report refreshed (each counted once: a
        # rank already seen at ``ts`` is not), and whether one joined the node or named another GPU.
        refreshed = 0
        ranks_moved = False
        for i, summary in enumerate(report.ranks):
            if job is None or job.name != summary.job:
                job = jobs.get(summary.job)
            rhist = job.ranks.get(summary.rank) if job is not None else None
            if rhist is None or rhist.node != node.name:
                # New to this node: another node's live rank stays its own, and the node's caps hold.
                if rhist is not None:
                    if summary.state == "exited":
                        continue  # the tail of a rank that moved away: it claims nothing
                    if (rhist.last.state != "exited" and now - rhist.last_seen < cfg.rank_hold_seconds
                            and rhist.node in self._nodes):
                        _count(refused, "rank_owner_conflict")
                        continue
                if room is None:
                    room = _RankRoom(node, report)
                why = self._make_room(node, room, summary.job)
                if why is not None:
                    _count(refused, why)
                    continue
                if job is None:
                    job = jobs[summary.job] = JobState(summary.job)
                if rhist is None:
                    rhist = job.ranks[summary.rank] = RankHistory(summary, node.name, ts, cfg.rank_history_reports)
                    job.columns.take(rhist)
                    refreshed += 1  # seen at ``ts`` already: not counted below
                else:
                    old = self._nodes.get(rhist.node)
                    if old is not None and old.ranks.pop((summary.job, summary.rank), None) is not None:
                        old.revision = revision  # a rank forgotten off it is a change to it
                        self._ranks_moved(old, revision)
                job.members_revision = revision
                node.ranks[(summary.job, summary.rank)] = rhist
                ranks_moved = True
                room.jobs[summary.job] = room.jobs.get(summary.job, 0) + 1
            elif rhist.last_seen == base_seen:
                rbase = rhist.last
                if rbase is not rhist.owned:
                    rbase = rhist.owned = copy_struct(rbase)
                # -- the heartbeat-side detectors' markers (JobState.windows_revision, runs_revision): a
                # compact entry carries only what changed (or what is away from its default).
                if summary.window_end_ts is not None or cleared:
                    job.windows_revision = revision  # type: ignore[union-attr]
                if (summary.pid is not None or summary.state != "running" or summary.phase is not None
                        or summary.checkpoint_step is not None or summary.nonfinite_steps
                        or summary.nonfinite_loss_steps or summary.last_step < rbase.last_step or cleared):
                    job.runs_revision = revision  # type: ignore[union-attr]
                # -- end of the markers' block
                summary = complete_cleared(complete_rank, rbase, summary, cleared.get(("ranks", i), ())) \
                    if cleared else complete_rank(rbase, summary)
            else:
                # -- the heartbeat-side detectors' markers: a whole summary against the rank's last.
                rlast = rhist.last
                if summary.window_end_ts is None or summary.window_end_ts != rlast.window_end_ts:
                    job.windows_revision = revision  # type: ignore[union-attr]
                if (summary.pid != rlast.pid or summary.state != rlast.state or summary.phase != rlast.phase
                        or summary.checkpoint_step != rlast.checkpoint_step or summary.nonfinite_steps
                        or summary.nonfinite_loss_steps or summary.last_step < rlast.last_step):
                    job.runs_revision = revision  # type: ignore[union-attr]
                # -- end of the markers' block
            job.last_seen = ts  # type: ignore[union-attr]  # rhist is one of its ranks
            if rhist.last_seen != ts:
                refreshed += 1
            if summary.gpu != rhist.gpu:
                ranks_moved = True
            rhist.observe(summary, node.name, ts, report.ts, offset)
        # A rank this report left out may have gone stale (gpu_peer reads a rank as fresh within
        # _RANK_FRESH_INTERVALS of the node's last report), and the report after such a one may
        # have refreshed it: both move the marker, as does a rank that joined or named another GPU.
        unrefreshed = refreshed != len(node.ranks)
        if ranks_moved or unrefreshed or node.ranks_unrefreshed:
            self._ranks_moved(node, revision)
        node.ranks_unrefreshed = unrefreshed
        self._ingest_events(node, report, now, refused)
        return refused

    def _ranks_moved(self, node: NodeState, revision: int) -> None:
        """Which of ``node``'s ranks are fresh, or which GPU one names, may have changed."""
        if node.ranks_revision != revision:
            node.ranks_revision = revision
            self.journals.rank_gpus.names.append(node.name)

    @staticmethod
    def _ingest_host(node: NodeState, host: HostFacts, now: float) -> None:
        node.host = host
        if host.uptime_seconds is not None:  # the earliest reading: a held (stale) uptime cannot move it later
            node.booted_at = min(node.booted_at, now - host.uptime_seconds)
        fm = host.fabric_manager_state
        # "unknown": the agent could not ask systemd (no D-Bus in its container, a timeout): not down.
        if fm is None or fm in ("active", "unknown"):
            node.fabric_manager_down_since = None
        elif node.fabric_manager_down_since is None:
            node.fabric_manager_down_since = now

    def _observe_gpu_link(self, node: NodeState, hist: GpuHistory, state: GpuState, ts: float) -> None:
        """A GPU whose link may be below its maximum: extend its run, or end it."""
        if link_below_max(state.pcie_link_generation, state.pcie_link_generation_max, state.pcie_link_width,
                          state.pcie_link_width_max):
            if hist.link_below is None:
                hist.link_below = LoadedRun(ts)
                node.gpu_links_below.add(hist.index)
                self.journals.pcie_links.names.append(node.name)
            hist.link_below.observe(ts, state.utilization_gpu_ratio)
        else:
            hist.link_below = None
            if hist.index in node.gpu_links_below:
                node.gpu_links_below.discard(hist.index)
                self.journals.pcie_links.names.append(node.name)

    def _ingest_pcie(self, node: NodeState, section: list[PcieDevice], now: float, revision: int,
                     refused: dict[str, int]) -> None:
        """A node's whole ``pcie`` section: devices it no longer lists are let go.

        A whole report carries the section every time (the agent reads sysfs every 10 s; a healthy
        node's links and AER counters never move): one entry by entry equal to the devices held, in
        their order, changes nothing but each device's read time, so it costs one list comparison
        and a ``still`` per device instead of a bus-id normalisation, a comparison of the link and a
        tuple of counters per device (the simulator's 16 devices a report: 150 us of its ~400 us
        fleet update per whole report, issue 47). Any entry that differs takes the long way."""
        held = node.pcie
        if len(section) == len(held):
            hists = list(held.values())
            if [hist.last for hist in hists] == section:  # each entry its held device's (identity first)
                for hist in hists:
                    if not hist.counters.still(now):
                        break  # no baseline to stand for this read (a reboot forgot it): the long way
                else:
                    return
        self._take_pcie_section(node, section, now, revision, refused)

    def _take_pcie_section(self, node: NodeState, section: list[PcieDevice], now: float, revision: int,
                           refused: dict[str, int]) -> None:
        """The long way: each entry of ``section`` in turn (what the short way stands for)."""
        held = node.pcie
        taken: dict[str, PcieHistory] = {}
        limit, maxlen = self.config.max_pcie_devices_per_node, self.config.history_reports
        for device in section:
            raw = device.pci_bus_id
            # A held key is normal already, and normal_bus_id(normal_bus_id(x)) == normal_bus_id(x): an id
            # found as it came is its own normal form (the agent sends sysfs's), so it is normalised only when not.
            hist = held.get(raw)
            bus_id = raw if hist is not None else normal_bus_id(raw)
            if bus_id in taken:
                _count(refused, "duplicate_pcie_device")
                continue
            if len(taken) >= limit:
                _count(refused, "too_many_pcie_devices")
                continue
            if hist is None:
                hist = held.get(bus_id)
            if hist is None or hist.last.kind != device.kind:
                hist = PcieHistory(device, bus_id, maxlen)
                node.pcie_revision = revision
            changed, rose = hist.observe(device, now)
            if changed:
                node.pcie_revision = revision
            if rose and node.pcie_aer_moved_ts != now:
                node.pcie_aer_moved_ts = now
                self.journals.pcie_links.names.append(node.name)
            taken[bus_id] = hist
        if taken.keys() != held.keys():
            node.pcie_revision = revision
        node.pcie = taken
        below = {bus_id for bus_id, hist in taken.items() if hist.link_below_since is not None}
        if below != node.pcie_links_below:
            self.journals.pcie_links.names.append(node.name)
        node.pcie_links_below = below

    def _mark_recovery(self, node: NodeState, index: int, wanted: str | None) -> None:
        """GPU ``index``'s latest recovery action ``wanted`` into the node's and the fleet's marks
        (from a GPU entry taken whole, or a compact one that carried or cleared it)."""
        if wanted not in _NO_RECOVERY:
            node.recovery_gpus.add(index)
            self.marked.recovery_actions.add(node)
        else:
            node.recovery_gpus.discard(index)
            if not node.recovery_gpus:
                self.marked.recovery_actions.discard(node)

    def _measure_clock(self, node: NodeState, report: Report, now: float) -> None:
        """The node's clock against the aggregator's, from a report newer than any before it."""
        skew = node.clock_skew_seconds = report.ts - now
        tolerance = self.config.clock_offset_tolerance_seconds
        if abs(skew - node.clock_offset_seconds) > tolerance:
            node.clock_offset_seconds = skew if abs(skew) > tolerance else 0.0

    def _make_room(self, node: NodeState, room: _RankRoom, job_name: str) -> str | None:
        """Room on ``node`` for one more rank of ``job_name``, evicting the oldest of the ranks and
        jobs its report does not name; the refusal's reason when there is none."""
        cfg = self.config
        if job_name not in room.jobs and len(room.jobs) >= cfg.max_jobs_per_node:
            idle = room.oldest_idle_job()
            if idle is None:
                return "too_many_jobs"
            for key in [k for k in node.ranks if k[0] == idle]:
                self._evict_rank(node, room, key)
            self.evicted["jobs"] += 1
        while len(node.ranks) >= cfg.max_ranks_per_node:
            oldest = room.oldest_idle_rank()
            if oldest is None:
                return "too_many_ranks"
            self._evict_rank(node, room, oldest)
        return None

    def _evict_rank(self, node: NodeState, room: _RankRoom, key: tuple[str, int]) -> None:
        rhist = node.ranks.pop(key, None)
        if rhist is None:
            return
        self.evicted["ranks"] += 1
        self._ranks_moved(node, self.revision)
        job_name, rank = key
        left = room.jobs[job_name] = room.jobs[job_name] - 1
        if not left:
            del room.jobs[job_name]
        job = self._jobs.get(job_name)
        if job is not None and job.ranks.get(rank) is rhist:
            del job.ranks[rank]
            job.columns.release(rhist)
            job.members_revision = self.revision
            if not job.ranks and job_name not in room.named_jobs:
                del self._jobs[job_name]

    def _ingest_events(self, node: NodeState, report: Report, now: float, refused: dict[str, int]) -> None:
        """The report's events, their times placed on the aggregator's clock (the node's held
        offset; never after the report's arrival)."""
        offset = node.clock_offset_seconds
        for event in report.events:
            ts = event.ts - offset if offset else event.ts
            if ts > now and offset:
                ts = now
            node.events.append((ts, event))
            if event.kind == "xid" and event.code is not None:
                self._record_xid(node, event, ts, refused)
                node.xid_event_ts = max(node.xid_event_ts, ts)
                self.marked.xids.add(node)
            elif event.kind.startswith("amdgpu_"):  # amdgpu_catalog.KIND_PREFIX: the amdgpu detector's
                node.amdgpu_event_ts = max(node.amdgpu_event_ts, ts)
                self.marked.amdgpu_events.add(node)

    def _record_xid(self, node: NodeState, event: Event, ts: float, refused: dict[str, int]) -> None:
        """``event`` (an Xid) at ``ts`` on the aggregator's clock into its GPU's ring, de-duplicated."""
        gpu = event.gpu
        if gpu is not None and gpu not in node.xids and len(node.xids) >= self.config.max_gpus_per_node:
            # Beyond the node's GPUs: kept for the node as a whole (never dropped), counted.
            _count(refused, "too_many_gpus")
            gpu = None
        if gpu is None:
            for hist in node.gpus.values():
                if (event.pci_bus_id and hist.last.pci_bus_id
                        and hist.last.pci_bus_id.lower() == event.pci_bus_id.lower()) or (
                        event.uuid and hist.uuid == event.uuid):
                    gpu = hist.index
                    break
        ring = node.xids.get(gpu)
        if ring is None:
            ring = node.xids[gpu] = deque(maxlen=self.config.event_history)
        window = self.config.xid_dedup_seconds
        for rec in reversed(ring):
            if rec.code == event.code and abs(rec.ts - ts) <= window:
                rec.count = max(rec.count, event.count)
                rec.sources.add(event.source)
                return
            if ts - rec.ts > window:
                break
        ring.append(XidOccurrence(event.code or 0, ts, event.count, event.message, {event.source}))

    def note_action_request(self, request: NodeActionRequest) -> None:
        """A request the outbox made for ``request.node`` (its expiry is what the detector waits to)."""
        node = self._nodes.get(request.node)
        if node is not None:
            _keep(node.action_expiry, request.id, request.expires_at)
            self.revision += 1
            node.revision = self.revision

    def record_action_results(self, name: str, results: list[NodeActionResult], now: float) -> None:
        """Results the outbox matched to its requests for node ``name``, received at ``now``."""
        node = self._nodes.get(name)
        if node is not None:
            for result in results:
                _keep(node.action_results, result.id, ActionOutcome(result, now))
            self.revision += 1
            node.revision = self.revision

    def forget_idle_jobs(self, now: float) -> None:
        horizon = now - self.config.job_forget_seconds
        for name in [n for n, j in self._jobs.items() if j.last_seen < horizon]:
            self.revision += 1
            job = self._jobs.pop(name)
            for rank in job.ranks.values():
                node = self._nodes.get(rank.node)
                if node is not None:
                    node.ranks.pop((name, rank.rank), None)
                    node.revision = self.revision
                    self._ranks_moved(node, self.revision)

    def view(self, removed: Mapping[str, Removal] | None = None) -> FleetView:
        self.journals.trim(len(self._nodes))  # bounded: here, once a pass, not on every append
        return FleetView(self._nodes, self._jobs, removed, agent_resets=self.agent_resets, probes=self.probes,
                         learned_probes=self.learned_probes, isolations=self.isolations, revision=self.revision,
                         fleet=self.identity, gpu_jobs_revision=self.gpu_jobs_revision,
                         config_revision=self.config_revision, journals=self.journals,
                         report_times=self.report_times, marked=self.marked)


EVICTION_KINDS = ("ports", "ranks", "jobs")


def _count(refused: dict[str, int], reason: str) -> None:
    refused[reason] = refused.get(reason, 0) + 1


def _within(sent: PortState, held: Mapping[str, int], limit: int, refused: dict[str, int]) -> PortState:
    """``sent`` with the counters it names beyond ``limit`` names (with those already ``held``)
    left out, each counted: a port cannot grow the aggregator one counter name a report."""
    room = limit - len(held)
    counters: dict[str, int] = {}
    for name, value in sent.counters.items():
        if name in held:
            counters[name] = value
        elif room > 0:
            counters[name] = value
            room -= 1
        else:
            _count(refused, "too_many_counters")
    return msgspec.structs.replace(sent, counters=counters)


class _RankRoom:
    """A node's ranks and jobs as one report changes them: how many ranks each job has there, and
    those the report does not name, oldest first: the ones evicted when a cap is reached. Built
    once per report, at its first rank new to the node."""

    __slots__ = ("_idle_jobs", "_idle_ranks", "_ranks", "jobs", "named_jobs")

    def __init__(self, node: NodeState, report: Report) -> None:
        named = {(s.job, s.rank) for s in report.ranks}
        self.named_jobs = {job for job, _ in named}
        self._ranks = node.ranks
        self.jobs: dict[str, int] = {}
        newest: dict[str, float] = {}
        for (job, _), rhist in node.ranks.items():
            self.jobs[job] = self.jobs.get(job, 0) + 1
            if job not in self.named_jobs:
                newest[job] = max(newest.get(job, -math.inf), rhist.last_seen)
        # Newest first: the oldest is popped from the end.
        self._idle_ranks = sorted((k for k in node.ranks if k not in named),
                                  key=lambda k: node.ranks[k].last_seen, reverse=True)
        self._idle_jobs = sorted(newest, key=newest.__getitem__, reverse=True)

    def oldest_idle_rank(self) -> tuple[str, int] | None:
        while self._idle_ranks:
            key = self._idle_ranks.pop()
            if key in self._ranks:
                return key
        return None

    def oldest_idle_job(self) -> str | None:
        while self._idle_jobs:
            job = self._idle_jobs.pop()
            if job in self.jobs:
                return job
        return None


def _keep(table: dict[str, _V], key: str, value: _V) -> None:
    """Insert or refresh ``key``, dropping the oldest entries beyond ``MAX_NODE_ACTIONS_KEPT``."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_NODE_ACTIONS_KEPT:
        del table[next(iter(table))]
