"""The prober: the one owner of probe runs the aggregator asks nodes' agents for (``run_probes``).

After each evaluation (``plan(view, findings, now)``: the app calls it right after the engine's
decisions, the simulator the same) it reads the detectors' findings and the fleet, and queues
signed run_probes requests in the outbox: the recovery probe set for a removed node the recovery
detector found clean on passive evidence ("probing" findings, retried once there), the suspect
probe set for a node a trigger finding names once it is idle (no job, unless ``allow_with_job``),
and the collective runs of one group-testing isolation; never two runs on one node, never more
than ``max_fleet_share`` of the reporting fleet at once. It collects each run's signed result
from the fleet (the outbox verified it), counts it, and learns the fleet's own probe figures per
(hardware class, probe) from passing runs, which it publishes to the fleet for the detectors
(``Fleet.learned_probes``; it owns that and ``Fleet.probes``). It decides nothing about a node:
the recovery detector resumes or escalates, the probe verdict detector drains a failed suspect.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import statistics
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from pydantic import Field, field_validator, model_validator

from vigil.agent.probe_baselines import ProbeBaselines
from vigil.agent.validation import StrictModel
from vigil.agent.wire import NodeActionRequest, ProbeGroup, ProbeName
from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.probe_verdict import (
    TRIGGERS,
    Trigger,
    judge_run,
    learned_key,
    probe_request_id,
)
from vigil.aggregator.detectors.recovery import PROBING
from vigil.aggregator.fleet import Fleet, FleetView, NodeState
from vigil.aggregator.outbox import BUSY, Outbox

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


class SuspectTrigger(StrictModel):
    """A finding that makes its node a suspect to probe when idle: its detector, its key (an
    fnmatch pattern) and its action. A finding about a whole job (no node) is never one."""

    detector: str
    key: str = "*"
    actions: list[Action] = Field(default_factory=lambda: [Action.ALERT], min_length=1)

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
    max_suspects: int = Field(default=4096, ge=1, le=1_000_000)
    # Learned figures: the latest passing value of this many GPUs per (hardware class, probe).
    learned_samples: int = Field(default=64, ge=2, le=4096)
    # A group test's rendezvous: rank 0's node name and this port (the agents' collective store).
    group_port: int = Field(default=29500, ge=1, le=65535)

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


class GroupTest(Protocol):
    """aggregator/group_testing.py's test: the members probed together, and a known-healthy partner."""

    @property
    def members(self) -> tuple[str, ...]: ...

    @property
    def partner(self) -> str | None: ...


class Isolation(Protocol):
    """aggregator/group_testing.py's ``GroupIsolation``: the tests to run next, and their outcomes."""

    @property
    def done(self) -> bool: ...

    @property
    def faulty(self) -> Sequence[str] | set[str] | frozenset[str]: ...

    def next_tests(self) -> Sequence[GroupTest]: ...

    def record(self, test: GroupTest, passed: bool) -> None: ...


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
    isolation: Isolation
    started: float
    tests: list[_GroupRun] = field(default_factory=list)  # in flight
    queued: list[GroupTest] = field(default_factory=list)  # next, not started (no room yet)
    used: int = 0


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
        self.isolations: list[tuple[str, tuple[str, ...], int]] = []  # finished: (name, faulty, tests used)
        self.runs: Counter[tuple[str, str]] = Counter()  # (trigger, outcome)
        self.deferred: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.config.enabled and self.outbox.enabled

    def in_flight(self) -> dict[str, int]:
        counts = Counter(run.trigger for run in self._runs.values())
        return {t: counts.get(t, 0) for t in TRIGGERS}

    def suspects(self) -> list[str]:
        return list(self._suspects)

    def plan(self, view: FleetView, findings: Sequence[Finding], now: float) -> list[NodeActionRequest]:
        """One round after an evaluation: collect finished runs, note suspects, start the runs
        wanted within the fleet share. Returns the requests queued now."""
        if not self.enabled:
            return []
        self._collect(view, now)
        self._note_suspects(view, findings, now)
        cap = self._cap(view, now)
        started: list[NodeActionRequest] = []
        self._start_recovery(findings, now, cap, started)
        self._start_group(view, now, cap, started)
        self._start_suspects(view, now, cap, started)
        return started

    # Group testing -----------------------------------------------------------------------------

    def isolate(self, name: str, isolation: Isolation, now: float) -> bool:
        """Drive ``isolation`` (one at a time) from the next ``plan`` on; False while one runs."""
        if self._isolation is not None:
            return False
        self._isolation = _IsolationRun(name, isolation, now)
        log.info("group isolation %s started", name)
        return True

    def _start_group(self, view: FleetView, now: float, cap: int, started: list[NodeActionRequest]) -> None:
        iso = self._isolation
        if iso is None:
            return
        if not iso.tests and not iso.queued:
            if iso.isolation.done:
                faulty = tuple(sorted(iso.isolation.faulty))
                self.isolations.append((iso.name, faulty, iso.used))
                log.warning("group isolation %s done after %d tests: faulty %s", iso.name, iso.used,
                            ", ".join(faulty) or "none")
                self._isolation = None
                return
            iso.queued = list(iso.isolation.next_tests())
        while iso.queued:
            test = iso.queued[0]
            members = tuple(test.members) + ((test.partner,) if test.partner is not None else ())
            if any(m in self._runs for m in members) or len(self._runs) + len(members) > cap:
                self.deferred["share_cap"] += 1
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

    def _group_result(self, run: _Run, outcome: str) -> None:
        iso = self._isolation
        if iso is None:
            return
        for test in list(iso.tests):
            if run.node in test.members and run.request_id == probe_request_id("group", f"{test.group}\0{run.node}"):
                test.outcomes[run.node] = outcome
                if len(test.outcomes) == len(test.members):
                    iso.tests.remove(test)
                    iso.isolation.record(test.test, all(o == "pass" for o in test.outcomes.values()))
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
            if outcome is not None and not (outcome.result.outcome == "refused" and outcome.result.reason == BUSY):
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
            if run.trigger == "group":
                self._group_result(run, result)
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
        deferred = CounterMetricFamily("vigil_aggregator_probe_runs_deferred",
                                       "Wanted probe runs not started at an evaluation, by reason (share_cap: "
                                       "probes.max_fleet_share in use; busy: the node has a job; outbox: the outbox "
                                       "could not queue it); tried again at the next.", labels=["reason"])
        for reason in DEFER_REASONS:
            deferred.add_metric([reason], p.deferred.get(reason, 0))
        yield deferred
