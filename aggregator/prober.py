"""The prober: the one owner of probe runs the aggregator asks nodes' agents for (``run_probes``).

After each evaluation (``plan``) it reads the findings and the fleet and queues signed run_probes requests in
the outbox (recovery runs, suspect runs, one group-testing isolation at a time) within its bounds, then
collects the verified results and publishes learned figures, probe runs and isolations to the fleet. It
decides nothing about a node: the recovery and probe-verdict detectors judge the results (docs/probes.md,
"Orchestration in the aggregator").
"""

from __future__ import annotations

import fnmatch
import logging
import math
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from pydantic import Field, field_validator, model_validator

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors import REGISTRY
from vigil.aggregator.detectors.probe_verdict import (
    TRIGGERS,
    IsolationOutcome,
    IsolationTest,
    Trigger,
    judge_run,
    learned_key,
    probe_request_id,
)
from vigil.aggregator.detectors.recovery import PROBING
from vigil.aggregator.fleet import Fleet, FleetView, NodeState
from vigil.aggregator.group_testing import GroupIsolation, GroupTest, information_bound
from vigil.aggregator.outbox import Outbox, transient
from vigil.contract.probe_baselines import ProbeBaselines
from vigil.contract.validation import StrictModel
from vigil.contract.wire import NodeActionRequest, ProbeGroup, ProbeName

log = logging.getLogger("vigil.aggregator.prober")

RECOVERY_PROBES: tuple[ProbeName, ...] = ("gpu_compute", "gpu_memory", "gpu_p2p", "dcgm_diag")
SUSPECT_PROBES: tuple[ProbeName, ...] = ("gpu_compute", "gpu_memory")
# Probes that need other nodes (a ProbeGroup): only a group test runs them.
GROUP_PROBES: frozenset[str] = frozenset({"collective", "rdma_bw"})
RUN_OUTCOMES = ("pass", "fail", "error", "timeout")
# Learned figures are kept for at most this many (hardware class, probe) pairs: classes come from
# the nodes' reports, so a node naming a new GPU model each report must not grow the table.
MAX_LEARNED_KEYS = 256
# Why a wanted run did not start now (it is tried again next evaluation): share_cap (the fleet
# share is in use), busy (the node has a job), outbox (the outbox could not queue it).
DEFER_REASONS = ("share_cap", "busy", "outbox")
# Who started an isolation: an operator (POST /v1/probes/isolations), the prober itself (idle
# suspects), the simulator (a scenario's ``isolations``).
ISOLATION_SOURCES = ("operator", "auto", "sim")
ISOLATION_STATES = ("done", "aborted")
# Why an isolation was not started (counted, and the operator route's 4xx reason).
ISOLATION_REFUSALS = ("disabled", "running", "too_many", "bad_d_hint", "unknown_node", "removed", "probe_running",
                      "fleet_share", "no_partner", "standby", "invalid_json", "unknown_field", "bad_nodes",
                      "bad_note")
# Finished isolations kept (the newest; the fleet's view and GET /v1/probes/isolations show them).
FINISHED_ISOLATIONS_KEPT = 32
# Known-healthy partners handed to one isolation at most (its tests alone take them leaf first).
MAX_PARTNERS = 64


class IsolationRefused(ValueError):
    """An isolation that cannot start: ``reason`` (one of ISOLATION_REFUSALS) and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class SuspectTrigger(StrictModel):
    """A finding that makes its node a suspect to probe when idle: its detector, its key (an
    fnmatch pattern) and its action. A finding about a whole job (no node) is never one."""

    # A detector's config section name (detectors.<name>), e.g. straggler.
    detector: str
    # fnmatch pattern over the finding's key, e.g. "*:intermittent" (the straggler's long horizon).
    key: str = "*"
    # The findings' actions that make a suspect: alert, below the removal threshold.
    actions: list[Action] = Field(default_factory=lambda: [Action.ALERT], min_length=1)

    @field_validator("detector")
    @classmethod
    def _known(cls, detector: str) -> str:
        if detector not in REGISTRY and detector != "topology":
            raise ValueError(f"no detector {detector!r} (one of {', '.join(sorted(REGISTRY))}, topology)")
        return detector

    def matches(self, finding: Finding) -> bool:
        return (finding.detector == self.detector and finding.action in self.actions
                and fnmatch.fnmatchcase(finding.key, self.key))


def _default_triggers() -> list[SuspectTrigger]:
    # Below the removal threshold (docs/detectors.md): the straggler's long-horizon alert (an
    # intermittent straggler, key "<job>:intermittent") and the GPU peer detector's alert (a GPU
    # clocked or capped below its job's peers, key "<job>"). A whole-job slowdown flags nobody.
    return [SuspectTrigger(detector="straggler", key="*:intermittent"),
            SuspectTrigger(detector="gpu_peer")]


class ProbesConfig(StrictModel):
    """``probes``: active validation orchestrated by the aggregator (docs/probes.md). Needs
    ``node_actions.key_file``: each run is a signed request, each result signed by the node."""

    enabled: bool = False
    # What a probe must reach per hardware class (shared with ``vigil check --baselines``).
    baselines: ProbeBaselines = ProbeBaselines()
    # What a removed node must pass before it is resumed (after the recovery detector's passive
    # checks): a skipped probe (no DCGM, one GPU) does not count against it, but one must pass.
    recovery_probes: list[ProbeName] = Field(
        default_factory=lambda: list(RECOVERY_PROBES), min_length=1)
    # What a suspect is probed with when idle: the two that find a slow GPU in about a minute.
    suspect_probes: list[ProbeName] = Field(default_factory=lambda: list(SUSPECT_PROBES), min_length=1)
    suspect_triggers: list[SuspectTrigger] = Field(default_factory=_default_triggers)
    # At most this share of the nodes reporting probes at once (at least one node): 2% of the
    # fleet, the order of what a site keeps out for maintenance anyway.
    max_fleet_share: float = Field(default=0.02, gt=0, le=1)
    # Never probe a node with a job (the fleet knows it from the GPUs' processes and live ranks).
    allow_with_job: bool = False
    # A run not reported within this long is void: retried once (recovery), then alerted. 15 min
    # covers dcgmi diag -r 3 (~10 min on 8 GPUs) and the burns.
    run_timeout_seconds: float = Field(default=900.0, gt=0, le=86400)
    # A suspect is probed at most once this long (a pass clears it for that long).
    suspect_cooldown_seconds: float = Field(default=3600.0, ge=0)
    # A suspect not named by a trigger finding for this long is forgotten (still busy, or gone).
    suspect_ttl_seconds: float = Field(default=3600.0, gt=0)
    # Suspects kept at most (the oldest named first is forgotten): bounded memory whatever the findings.
    max_suspects: int = Field(default=4096, ge=1, le=1_000_000)
    # Learned figures: the latest passing value of this many GPUs per (hardware class, probe).
    learned_samples: int = Field(default=64, ge=2, le=4096)
    # A group test's rendezvous: rank 0's node name and this port (the agents' collective store).
    group_port: int = Field(default=29500, ge=1, le=65535)
    # At least this many idle suspects waiting are isolated as one group (collective group tests)
    # instead of probed one by one; 0: never automatically. 4: below it, the suspect probes alone
    # cost about as many runs as a group isolation's tests (log2 C(4, 1) + confirmation = 3).
    group_min_suspects: int = Field(default=4, ge=0, le=100_000)
    # The topology label that names a node's leaf switch: tests stay within a leaf first.
    group_leaf_label: str = Field(default="leaf_switch", min_length=1, max_length=64)
    # Nodes in one isolation at most (the operator route refuses more with 400 too_many).
    max_isolation_nodes: int = Field(default=1024, ge=2, le=100_000)
    # A node whose probe run passed within this long is a known-healthy partner before one that
    # only reports clean (the prober's own record; an hour: the suspect cooldown).
    partner_pass_seconds: float = Field(default=3600.0, gt=0)
    # A group test that errored or timed out (no member failed) is run again this many times,
    # then the isolation is aborted: an error is no evidence, so it never names anyone.
    group_test_retries: int = Field(default=1, ge=0, le=10)

    @field_validator("recovery_probes", "suspect_probes")
    @classmethod
    def _own_node(cls, probes: list[ProbeName]) -> list[ProbeName]:
        if len(set(probes)) != len(probes):
            raise ValueError("lists a probe twice")
        group = sorted(GROUP_PROBES.intersection(probes))
        if group:
            raise ValueError(f"{', '.join(group)} need other nodes (a probe group): group tests run them")
        return probes

    @model_validator(mode="after")
    def _samples(self) -> ProbesConfig:
        if self.learned_samples < self.baselines.learned_min_samples:
            raise ValueError(f"learned_samples ({self.learned_samples}) must be at least "
                             f"baselines.learned_min_samples ({self.baselines.learned_min_samples})")
        return self


def node_job(node: NodeState, now: float, rank_hold_seconds: float) -> str | None:
    """The job the node runs, as its reports show it: a GPU's attributed job or compute
    processes, or a rank reported live within ``rank_hold_seconds``; None: idle."""
    for hist in node.gpus.values():
        if hist.last.job is not None or hist.last.processes:
            return hist.last.job or f"processes on GPU {hist.index}"
    for (job, _), rank in node.ranks.items():
        if rank.last.state != "exited" and now - rank.last_seen <= rank_hold_seconds:
            return job
    return None


@dataclass
class _Run:
    request_id: str
    node: str
    trigger: Trigger
    probes: tuple[ProbeName, ...]
    deadline: float


@dataclass
class _Suspect:
    since: float  # first named
    last_seen: float
    detector: str
    key: str
    reason: str


@dataclass
class _GroupRun:
    test: GroupTest
    group: str
    members: tuple[str, ...]
    outcomes: dict[str, str] = field(default_factory=dict)  # member -> run outcome


@dataclass
class _IsolationRun:
    name: str
    isolation: GroupIsolation
    started: float
    nodes: tuple[str, ...]
    d_hint: int
    source: str
    note: str
    leaf_of: dict[str, str]
    tests: list[_GroupRun] = field(default_factory=list)  # in flight
    queued: list[GroupTest] = field(default_factory=list)  # next, not started (no room yet)
    used: int = 0  # runs started (retries included): a new group id each
    recorded: list[IsolationTest] = field(default_factory=list)
    attempts: Counter[GroupTest] = field(default_factory=Counter)

    def outcome(self, state: str = "running", finished: float | None = None, detail: str = "") -> IsolationOutcome:
        iso = self.isolation
        faulty = tuple(sorted(iso.faulty)) if state == "done" else ()
        d = len(faulty) if state == "done" else min(self.d_hint, len(self.nodes))
        return IsolationOutcome(
            name=self.name, source=self.source, note=self.note, nodes=self.nodes, d_hint=self.d_hint,
            started=self.started, state=state, finished=finished,  # type: ignore[arg-type]
            faulty=faulty, cleared=tuple(sorted(iso.cleared)), tests_used=iso.tests_used,
            information_bound=information_bound(len(self.nodes), d), tests=tuple(self.recorded),
            leaf_of=MappingProxyType(dict(self.leaf_of)), detail=detail)


class Prober:
    """Probe runs in flight, suspects, learned figures. Single-threaded use (the app's event loop)."""

    def __init__(self, config: ProbesConfig, outbox: Outbox, fleet: Fleet) -> None:
        self.config = config
        self.outbox = outbox
        self.fleet = fleet
        if config.enabled:
            fleet.probes = config  # the recovery detector now resumes only after probes pass
        self._runs: dict[str, _Run] = {}  # node -> its one run
        self._suspects: OrderedDict[str, _Suspect] = OrderedDict()
        self._probed_at: dict[str, float] = {}  # node -> its latest suspect run's start (cooldown)
        self._learned: OrderedDict[tuple[str, str], OrderedDict[tuple[str, int | None], float]] = OrderedDict()
        self._isolation: _IsolationRun | None = None
        self._finished: deque[IsolationOutcome] = deque(maxlen=FINISHED_ISOLATIONS_KEPT)
        self._passed_at: dict[str, float] = {}  # node -> its latest passing probe run (partners)
        self._flagged: frozenset[str] = frozenset()  # nodes the latest evaluation's findings named
        self._isolations_begun = 0
        self.runs: Counter[tuple[str, str]] = Counter()  # (trigger, outcome)
        self.deferred: Counter[str] = Counter()
        self.isolations_started: Counter[str] = Counter()  # source
        self.isolations_finished: Counter[str] = Counter()  # done, aborted
        self.isolation_tests = 0  # group tests recorded (retries of an errored test not counted)
        self.isolation_refusals: Counter[str] = Counter()  # reason

    @property
    def enabled(self) -> bool:
        return self.config.enabled and self.outbox.enabled

    def in_flight(self) -> dict[str, int]:
        counts = Counter(run.trigger for run in self._runs.values())
        return {t: counts.get(t, 0) for t in TRIGGERS}

    def suspects(self) -> list[str]:
        return list(self._suspects)

    @property
    def isolations(self) -> list[IsolationOutcome]:
        """The finished isolations kept (oldest first), then the running one."""
        running = [self._isolation.outcome()] if self._isolation is not None else []
        return [*self._finished, *running]

    def plan(self, view: FleetView, findings: Sequence[Finding], now: float) -> list[NodeActionRequest]:
        """One round after an evaluation: collect finished runs, note suspects, start the runs
        wanted within the fleet share. Returns the requests queued now."""
        if not self.enabled:
            return []
        self._collect(view, now)
        self._note_suspects(view, findings, now)
        self._flagged = frozenset(f.node for f in findings if f.node != WHOLE_JOB)
        cap = self._cap(view, now)
        started: list[NodeActionRequest] = []
        self._start_recovery(findings, now, cap, started)
        self._auto_isolate(view, now, cap)
        self._start_group(view, now, cap, started)
        self._start_suspects(view, now, cap, started)
        self._publish()
        return started

    # Group testing -----------------------------------------------------------------------------

    def start_isolation(self, nodes: Sequence[str], d_hint: int, view: FleetView, now: float, *,
                        source: str, note: str = "") -> IsolationOutcome:
        """Isolate the faulty ones among ``nodes`` (expecting about ``d_hint``) with collective
        group tests from the next ``plan`` on: topology from the nodes' leaf label, known-healthy
        partners by ``partners``. Raises IsolationRefused (counted) when it cannot start."""
        try:
            return self._start_isolation(list(nodes), d_hint, view, now, source, note)
        except IsolationRefused as exc:
            self.isolation_refusals[exc.reason] += 1
            log.warning("isolation (%s) of %d nodes refused: %s: %s", source, len(nodes), exc.reason, exc.detail)
            raise

    def _start_isolation(self, nodes: list[str], d_hint: int, view: FleetView, now: float, source: str,
                         note: str) -> IsolationOutcome:
        if not self.enabled:
            raise IsolationRefused("disabled", "probing is off (probes.enabled, node_actions.key_file)")
        if self._isolation is not None:
            raise IsolationRefused("running", f"isolation {self._isolation.name} is running (one at a time)")
        if not 1 <= len(nodes) <= self.config.max_isolation_nodes or len(set(nodes)) != len(nodes):
            raise IsolationRefused("too_many", f"1..{self.config.max_isolation_nodes} distinct nodes, got "
                                               f"{len(nodes)} ({len(set(nodes))} distinct)")
        if not 1 <= d_hint <= len(nodes):
            raise IsolationRefused("bad_d_hint", f"d_hint must be in 1..{len(nodes)}, got {d_hint}")
        unknown = [n for n in nodes if n not in view.nodes]
        if unknown:
            raise IsolationRefused("unknown_node", f"not in the fleet: {', '.join(unknown[:5])}"
                                                   + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
        removed = [n for n in nodes if n in view.removed]
        if removed:
            raise IsolationRefused("removed", "out of service (the recovery path probes them): "
                                              + ", ".join(removed[:5]))
        running = [n for n in nodes if n in self._runs]
        if running:
            raise IsolationRefused("probe_running", f"a probe run is in flight on {', '.join(running[:5])}")
        cap = self._cap(view, now)
        if max(len(nodes), 2) > cap:
            raise IsolationRefused("fleet_share", f"a group test may span all {len(nodes)} nodes but "
                                                  f"probes.max_fleet_share allows {cap} at once")
        partners = self.partners(view, set(nodes), now)
        if not partners:
            raise IsolationRefused("no_partner", "no known-healthy partner: every other node is busy, flagged, "
                                                 "removed or silent")
        label = self.config.group_leaf_label
        leaf_of = {n: view.nodes[n].topology.get(label, "") for n in (*nodes, *partners)}
        self._isolations_begun += 1
        name = f"iso-{source}-{self._isolations_begun}-{int(now)}"
        isolation = GroupIsolation(nodes, partners, d_hint, leaf_of)
        return self.isolate(name, isolation, now, nodes=nodes, d_hint=d_hint, source=source, note=note,
                            leaf_of=leaf_of)

    def refused(self, reason: str) -> None:
        """Count an isolation the operator route refused before asking (its own checks)."""
        self.isolation_refusals[reason] += 1

    def partners(self, view: FleetView, exclude: set[str], now: float) -> list[str]:
        """Known-healthy partners for a test alone: nodes not in ``exclude``, reporting, in service,
        no suspect, named by no finding of the latest evaluation, idle (unless ``allow_with_job``);
        those whose probe run passed within ``partner_pass_seconds`` first (the latest first), then
        by name; at most MAX_PARTNERS."""
        hold = self.fleet.config.rank_hold_seconds
        out = [n for n, node in view.nodes.items()
               if n not in exclude and n not in view.removed and n not in self._suspects and n not in self._flagged
               and now - node.last_seen <= 3 * node.interval_seconds
               and (self.config.allow_with_job or node_job(node, now, hold) is None)]
        window = self.config.partner_pass_seconds
        out.sort(key=lambda n: (-self._passed_at[n] if now - self._passed_at.get(n, -math.inf) <= window else math.inf,
                                n))
        return out[:MAX_PARTNERS]

    def isolate(self, name: str, isolation: GroupIsolation, now: float, *, nodes: Sequence[str], d_hint: int,
                source: str = "operator", note: str = "", leaf_of: dict[str, str] | None = None) -> IsolationOutcome:
        """Drive ``isolation`` of ``nodes`` from the next ``plan`` on (one at a time)."""
        if self._isolation is not None:
            raise IsolationRefused("running", f"isolation {self._isolation.name} is running (one at a time)")
        self._isolation = _IsolationRun(name, isolation, now, tuple(nodes), d_hint, source, note, dict(leaf_of or {}))
        self.isolations_started[source] += 1
        log.warning("group isolation %s (%s) started: %d nodes, d_hint %d%s", name, source, len(nodes), d_hint,
                    f": {note}" if note else "")
        self._publish()
        return self._isolation.outcome()

    def _auto_isolate(self, view: FleetView, now: float, cap: int) -> None:
        """``group_min_suspects`` idle suspects waiting (past their cooldown, no run): isolate them
        as one group (the oldest named first, as many as the fleet share holds), about a quarter
        expected faulty (a suspect is named below the removal threshold: most are not)."""
        wanted = self.config.group_min_suspects
        if wanted == 0 or self._isolation is not None:
            return
        hold = self.fleet.config.rank_hold_seconds
        idle = [n for n in self._suspects if (node := view.nodes.get(n)) is not None and n not in view.removed
                and n not in self._runs and n not in self._probed_at
                and (self.config.allow_with_job or node_job(node, now, hold) is None)]
        idle = idle[:min(cap, self.config.max_isolation_nodes)]
        if len(idle) < max(wanted, 2):
            return
        try:
            self.start_isolation(idle, max(1, len(idle) // 4), view, now, source="auto",
                                 note=f"{len(idle)} idle suspects")
        except IsolationRefused:
            return  # counted and logged; the suspects are probed alone meanwhile
        for n in idle:
            del self._suspects[n]
            self._probed_at[n] = now

    def _publish(self) -> None:
        self.fleet.isolations = tuple(self.isolations)

    def _finish(self, iso: _IsolationRun, state: str, now: float, detail: str) -> None:
        outcome = iso.outcome(state, now, detail)
        self._finished.append(outcome)
        self.isolations_finished[state] += 1
        self._isolation = None
        log.warning("group isolation %s %s after %d tests (information bound %.1f): faulty %s%s", iso.name, state,
                    outcome.tests_used, outcome.information_bound, ", ".join(outcome.faulty) or "none",
                    f" ({detail})" if detail else "")

    def _start_group(self, view: FleetView, now: float, cap: int, started: list[NodeActionRequest]) -> None:
        iso = self._isolation
        if iso is None:
            return
        if not iso.tests and not iso.queued:
            if iso.isolation.done:
                self._finish(iso, "done", now, "")
                return
            iso.queued = list(iso.isolation.next_tests())
        while iso.queued:
            test = iso.queued[0]
            members = tuple(test.members) + ((test.partner,) if test.partner is not None else ())
            if any(m in self._runs for m in members) or len(self._runs) + len(members) > cap:
                self.deferred["share_cap"] += 1
                return
            if not self.config.allow_with_job and any(
                    (node := view.nodes.get(m)) is not None and node_job(node, now, self.fleet.config.rank_hold_seconds)
                    for m in members):
                self.deferred["busy"] += 1
                return
            group = probe_request_id("group", f"{iso.name}\0{iso.used}")
            rendezvous = f"{members[0]}:{self.config.group_port}"
            run = _GroupRun(test, group, members)
            for rank, member in enumerate(members):
                request_id = probe_request_id("group", f"{group}\0{member}")
                pg = ProbeGroup(group=group, rank=rank, world_size=len(members), rendezvous=rendezvous)
                request = self._start(member, request_id, "group", ("collective",), now,
                                      f"group test {iso.used} of isolation {iso.name}", probe_group=pg)
                if request is None:
                    run.outcomes[member] = "error"  # could not be asked: the test cannot pass
                else:
                    started.append(request)
            iso.queued.pop(0)
            iso.tests.append(run)
            iso.used += 1

    def _group_result(self, run: _Run, outcome: str, now: float) -> None:
        """A member's run outcome. A test passes when every member passed, fails when one failed
        (below the collective's floor); when none failed but one errored or timed out it is run
        again (``group_test_retries``), then the isolation is aborted: an error names nobody."""
        iso = self._isolation
        if iso is None:
            return
        for test in list(iso.tests):
            if run.node in test.members and run.request_id == probe_request_id("group", f"{test.group}\0{run.node}"):
                test.outcomes[run.node] = outcome
                if len(test.outcomes) < len(test.members):
                    return
                iso.tests.remove(test)
                outcomes = set(test.outcomes.values())
                if "fail" in outcomes or outcomes == {"pass"}:
                    passed = outcomes == {"pass"}
                    iso.isolation.record(test.test, passed)
                    iso.recorded.append(IsolationTest(test.test.members, test.test.partner, passed))
                    self.isolation_tests += 1
                elif iso.attempts[test.test] < self.config.group_test_retries:
                    iso.attempts[test.test] += 1
                    iso.queued.insert(0, test.test)
                    log.warning("group test of %s in isolation %s did not complete (%s): run again", ", ".join(
                        test.members), iso.name, ", ".join(sorted(outcomes)))
                else:
                    self._finish(iso, "aborted", now, f"a group test of {', '.join(test.test.nodes)} did not "
                                                      f"complete ({', '.join(sorted(outcomes))}) after "
                                                      f"{iso.attempts[test.test] + 1} tries: no node named")
                return

    # Runs ---------------------------------------------------------------------------------------

    def _cap(self, view: FleetView, now: float) -> int:
        reporting = sum(1 for n in view.nodes.values() if now - n.last_seen <= 3 * n.interval_seconds)
        return max(1, math.floor(self.config.max_fleet_share * reporting))

    def _start(self, node: str, request_id: str, trigger: Trigger, probes: tuple[ProbeName, ...], now: float,
               reason: str, probe_group: ProbeGroup | None = None) -> NodeActionRequest | None:
        request = self.outbox.enqueue_request(node, request_id, "run_probes", now, probes=probes,
                                              probe_group=probe_group, reason=reason,
                                              ttl_seconds=self.config.run_timeout_seconds)
        if request is None:
            if not self.outbox.queued(node, request_id):
                self.deferred["outbox"] += 1
            return None
        self._runs[node] = _Run(request_id, node, trigger, probes, now + self.config.run_timeout_seconds)
        log.info("probe run %s (%s) requested on %s: %s", request_id, trigger, node, ", ".join(probes))
        return request

    def _start_recovery(self, findings: Sequence[Finding], now: float, cap: int,
                        started: list[NodeActionRequest]) -> None:
        for f in findings:
            if f.detector != "recovery" or f.evidence.get("signal") != PROBING or f.node in self._runs:
                continue
            if len(self._runs) >= cap:
                self.deferred["share_cap"] += 1
                continue
            request = self._start(f.node, str(f.evidence["probe_request"]), "recovery",
                                  tuple(self.config.recovery_probes), now, f.reason)
            if request is not None:
                started.append(request)

    def _note_suspects(self, view: FleetView, findings: Sequence[Finding], now: float) -> None:
        for f in findings:
            if f.node == WHOLE_JOB or f.node not in view.nodes or f.node in view.removed:
                continue
            if not any(t.matches(f) for t in self.config.suspect_triggers):
                continue
            known = self._suspects.get(f.node)
            if known is not None:
                known.last_seen = now
                continue
            self._suspects[f.node] = _Suspect(now, now, f.detector, f.key, f.reason)
            log.info("suspect %s (%s %s): probed with %s when idle", f.node, f.detector, f.key,
                     ", ".join(self.config.suspect_probes))
            while len(self._suspects) > self.config.max_suspects:
                self._suspects.popitem(last=False)
        for name in [n for n, s in self._suspects.items() if now - s.last_seen > self.config.suspect_ttl_seconds]:
            del self._suspects[name]
        cooldown = self.config.suspect_cooldown_seconds
        for name in [n for n, t in self._probed_at.items() if now - t >= cooldown]:
            del self._probed_at[name]
        for name in [n for n, t in self._passed_at.items() if n not in view.nodes
                     or now - t > self.config.partner_pass_seconds]:
            del self._passed_at[name]

    def _start_suspects(self, view: FleetView, now: float, cap: int, started: list[NodeActionRequest]) -> None:
        hold = self.fleet.config.rank_hold_seconds
        for name, suspect in list(self._suspects.items()):
            node = view.nodes.get(name)
            if node is None or name in view.removed:
                del self._suspects[name]  # gone, or out of service (the recovery path probes it)
                continue
            if name in self._runs or name in self._probed_at:
                continue
            if not self.config.allow_with_job and node_job(node, now, hold) is not None:
                self.deferred["busy"] += 1
                continue
            if len(self._runs) >= cap:
                self.deferred["share_cap"] += 1
                return
            request_id = probe_request_id("suspect", f"{name}\0{suspect.detector}\0{suspect.key}\0{suspect.since}")
            request = self._start(name, request_id, "suspect", tuple(self.config.suspect_probes), now,
                                  f"suspect: {suspect.reason}")
            if request is not None:
                started.append(request)
                self._probed_at[name] = now
                del self._suspects[name]

    def _collect(self, view: FleetView, now: float) -> None:
        """Each run's result (the outbox verified it and the fleet holds it): counted, learned
        from, handed to a group test; a run with none by its deadline timed out."""
        learned = False
        for name, run in list(self._runs.items()):
            node = view.nodes.get(name)
            outcome = node.action_results.get(run.request_id) if node is not None else None
            if outcome is not None and not transient(outcome.result):
                assert node is not None
                verdict = judge_run(outcome.result, node, run.probes, self.config.baselines,
                                    self.fleet.learned_probes)
                result: str = verdict.outcome
                if result == "pass":
                    for j in verdict.judged:
                        if j.status == "pass" and j.value is not None:
                            self._learn(learned_key(node, j.probe), (name, j.gpu), j.value)
                            learned = True
                log_at = logging.INFO if result == "pass" else logging.WARNING
                log.log(log_at, "probe run %s (%s) on %s: %s: %s", run.request_id, run.trigger, name, result,
                        verdict.detail)
            elif now >= run.deadline or node is None:
                result = "timeout"
                log.warning("probe run %s (%s) on %s: no result within %.0f s", run.request_id, run.trigger,
                            name, self.config.run_timeout_seconds)
            else:
                continue
            del self._runs[name]
            self.runs[(run.trigger, result)] += 1
            if result == "pass":
                self._passed_at[name] = now
            if run.trigger == "group":
                self._group_result(run, result, now)
        if learned:
            self.fleet.learned_probes = MappingProxyType(
                {key: (statistics.median(values.values()), len(values)) for key, values in self._learned.items()})

    def _learn(self, key: tuple[str, str], sample: tuple[str, int | None], value: float) -> None:
        ring = self._learned.get(key)
        if ring is None:
            ring = self._learned[key] = OrderedDict()
            while len(self._learned) > MAX_LEARNED_KEYS:
                self._learned.popitem(last=False)
        ring.pop(sample, None)  # one figure per GPU: a node cannot weigh the median by repeating itself
        ring[sample] = value
        while len(ring) > self.config.learned_samples:
            ring.popitem(last=False)

    # Metrics ------------------------------------------------------------------------------------

    def collector(self) -> PromCollector:
        return _ProberMetrics(self)


class _ProberMetrics(PromCollector):
    def __init__(self, prober: Prober) -> None:
        self._prober = prober

    def collect(self) -> Iterator[Metric]:
        p = self._prober
        runs = CounterMetricFamily("vigil_aggregator_probe_runs",
                                   "Probe runs finished, by trigger (recovery, suspect, group) and outcome (pass, "
                                   "fail: a probe below its baseline or failed by the agent; error: refused, a probe "
                                   "errored or every one skipped; timeout: no result within run_timeout_seconds).",
                                   labels=["trigger", "outcome"])
        for trigger_name in TRIGGERS:
            for outcome in RUN_OUTCOMES:
                runs.add_metric([trigger_name, outcome], p.runs.get((trigger_name, outcome), 0))
        yield runs
        flight = GaugeMetricFamily("vigil_aggregator_probes_in_flight",
                                   "Probe runs requested and not yet finished, by trigger.", labels=["trigger"])
        for trigger, n in p.in_flight().items():
            flight.add_metric([trigger], n)
        yield flight
        yield GaugeMetricFamily("vigil_aggregator_probe_suspects",
                                "Nodes a trigger finding named, waiting to be probed (idle, room in the fleet share, "
                                "past their cooldown).", value=len(p.suspects()))
        yield _by_label("vigil_aggregator_probe_runs_deferred",
                        "Wanted probe runs not started at an evaluation, by reason (share_cap: probes.max_fleet_share "
                        "in use; busy: the node has a job; outbox: the outbox could not queue it); tried again at "
                        "the next.", "reason", DEFER_REASONS, p.deferred)
        yield _by_label("vigil_aggregator_isolations_started",
                        "Group-testing isolations started, by source (operator: POST /v1/probes/isolations; auto: "
                        "probes.group_min_suspects idle suspects; sim).", "source", ISOLATION_SOURCES,
                        p.isolations_started)
        yield _by_label("vigil_aggregator_isolations_finished",
                        "Group-testing isolations finished, by outcome (done: every node faulty or cleared; aborted: "
                        "a group test kept erroring, nobody named).", "outcome", ISOLATION_STATES,
                        p.isolations_finished)
        yield CounterMetricFamily("vigil_aggregator_isolation_tests",
                                  "Group tests (collective probes over a group) recorded by isolations.",
                                  value=p.isolation_tests)
        yield _by_label("vigil_aggregator_isolation_refusals",
                        "Isolations not started, by reason (the prober's: disabled, running, too_many, bad_d_hint, "
                        "unknown_node, removed, probe_running, fleet_share, no_partner; the operator route's: "
                        "standby, invalid_json, unknown_field, bad_nodes, bad_note).", "reason", ISOLATION_REFUSALS,
                        p.isolation_refusals)


def _by_label(name: str, documentation: str, label: str, values: Sequence[str],
              counts: Counter[str]) -> CounterMetricFamily:
    """A counter family with one series per value of its one label (0 until counted)."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value in values:
        family.add_metric([value], counts.get(value, 0))
    return family
