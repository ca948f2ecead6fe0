"""Replay: a trace of what an aggregator took (aggregator/trace.py) run again through the real
service, with a given configuration, on a clock driven by the recorded receive times.

It reads the trace's records (and, for a trace ``vigil sim --trace`` wrote, the run file beside them:
the scenario, its configuration and its decisions) and returns the decisions the replayed service
made, the diff against the recorded ones (added, removed, changed action, verdict or timing), and,
where the trace is labelled (a simulated run's scenario, or the outcomes the traced aggregator's store
holds for its removals), precision and recall of both. It never
sleeps, acts on nothing (the gate runs in dry run over an in-memory store) and writes no trace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vigil.aggregator.config import AggregatorConfig, parse_config
from vigil.aggregator.decision import REMOVING_ACTIONS, Decision
from vigil.aggregator.gate import GateConfig
from vigil.aggregator.outcomes import CONFIRMED, NOT_CONFIRMED
from vigil.aggregator.service import Accepted, AggregatorService
from vigil.aggregator.trace import ALERTS, EVALUATION, REPORT, Problem, TraceConfig, TraceReading, read_trace
from vigil.sim.run import SimDecision, SimResult, _rows_after
from vigil.sim.scenario import Scenario, parse_scenario
from vigil.sim.score import score

# Beside a simulated run's trace segments: what the run was and what it decided (``record_run``).
RUN_FILE = "sim-run.json"
# Two decisions of one subject and detector whose times differ by at most this are the same
# decision at the same time: one evaluation cadence (the shipped 2.5 s) absorbs a pass's phase.
TIMING_TOLERANCE_SECONDS = 2.5
SCHEDULES = ("auto", "recorded", "cadence")
REMOVING_VALUES = frozenset(a.value for a in REMOVING_ACTIONS)


class ReplayError(Exception):
    """A trace or run file that cannot be replayed (named, with why)."""


@dataclass(frozen=True)
class RecordedRun:
    """What ``vigil sim --trace`` wrote beside the trace: the scenario (its labels: faults and
    expectations), the aggregator and gate sections the simulated service ran with and the
    decisions it made (``t``: from the simulation's start, the trace's opening)."""

    scenario: Scenario
    seed: int
    aggregator: dict[str, Any]
    gate: dict[str, Any]
    decisions: list[dict[str, Any]]

    def config(self) -> tuple[AggregatorConfig, GateConfig]:
        return parse_config({**self.aggregator, "dry_run": True}), GateConfig.model_validate({**self.gate,
                                                                                              "dry_run": True})


def record_run(result: SimResult, directory: Path) -> Path:
    """``result``'s run file in the trace directory ``directory`` (its segments are the service's)."""
    sc = result.scenario
    data = {"source": "vigil sim", "scenario": sc.model_dump(mode="json", exclude_unset=True), "seed": result.seed,
            "aggregator": sc.aggregator, "gate": sc.gate,
            "decisions": [d.to_json() for d in result.decisions]}
    path = directory / RUN_FILE
    path.write_text(json.dumps(data, indent=None, default=str) + "\n")
    return path


def load_run(directory: Path) -> RecordedRun | None:
    path = directory / RUN_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return RecordedRun(parse_scenario(data["scenario"], str(path)), int(data["seed"]), dict(data["aggregator"]),
                           dict(data["gate"]), list(data["decisions"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ReplayError(f"{path}: not a run file vigil sim --trace wrote: {exc}") from None


class ReplayClock:
    """The service's clock during a replay: the recorded receive time of the record being replayed."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Replayed:
    """One replay: the decisions (``t``: seconds since the trace's origin), what the service refused
    that the recorded one took, how many records of each kind, and the trace's unreadable parts."""

    decisions: list[SimDecision]
    schedule: str
    reports: int = 0
    alerts: int = 0
    evaluations: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    simulated_seconds: float = 0.0
    wall_seconds: float = 0.0


def replay(reading: TraceReading, config: AggregatorConfig, gate: GateConfig, *, origin: float | None = None,
           schedule: str = "auto") -> Replayed:
    """``reading``'s records through a fresh service with ``config`` and ``gate`` (dry run, no trace).
    Evaluations: ``recorded``, where the recorded service evaluated (exact for the same cadence);
    ``cadence``, every ``config.evaluate_interval_seconds`` after the last pass and at once after an
    urgent report, as the service's loop does; ``auto``: recorded when the trace holds evaluations
    made at ``config``'s cadence. ``origin``: time 0 of the decisions' ``t`` (default: the first
    segment's opening)."""
    if schedule not in SCHEDULES:
        raise ReplayError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    header = reading.headers[0] if reading.headers else {}
    records = reading.records
    interval = config.evaluate_interval_seconds
    if schedule == "auto":
        same = header.get("evaluate_interval_seconds") == interval
        schedule = "recorded" if same and any(r.kind == EVALUATION for r in records) else "cadence"
    first = records[0].t if records else 0.0
    opened = float(header.get("opened_clock", first))
    origin = opened if origin is None else origin
    started = header.get("started")
    clock = ReplayClock(opened)
    config = config.model_copy(update={"trace": TraceConfig(), "dry_run": True})
    service = AggregatorService.in_memory(config, gate.model_copy(update={"dry_run": True}), clock=clock,
                                          started=None if started is None else float(started))
    out = Replayed([], schedule, problems=list(reading.problems))
    seq = 0

    def collect(t: float) -> None:
        nonlocal seq
        rows = _rows_after(service.ledger.store, seq)
        if rows:
            seq = max(r.seq for r in rows)
        out.decisions.extend(SimDecision.of(r.decision, t - origin, r.admitted, r.verdict)
                             for r in sorted(rows, key=lambda r: r.seq))

    def evaluate(t: float) -> None:
        clock.now = max(clock.now, t)
        service.wake.clear()
        service.evaluate_now()
        out.evaluations += 1
        collect(clock.now)

    wall0 = time.perf_counter()
    due = opened + interval
    for rec in records:
        if schedule == "cadence":
            while due <= rec.t:
                evaluate(due)
                due = clock.now + interval
        clock.now = max(clock.now, rec.t)
        if rec.kind == REPORT:
            out.reports += 1
            taken = service.take(rec.report())
            if not isinstance(taken, Accepted):
                out.refused[taken.reason] = out.refused.get(taken.reason, 0) + 1
            elif schedule == "cadence" and service.wake.is_set():  # an urgent report: judged at once
                evaluate(rec.t)
                due = clock.now + interval
        elif rec.kind == EVALUATION:
            if schedule == "recorded":
                evaluate(rec.t)
        elif rec.kind == ALERTS:
            out.alerts += 1
            decisions = [Decision.model_validate(d) for d in rec.alerts()]
            service.take_alerts(decisions)
            collect(clock.now)
    out.simulated_seconds = (records[-1].t - first) if records else 0.0
    out.wall_seconds = time.perf_counter() - wall0
    return out


# -- the diff -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One difference: ``added`` (only the replay decided it), ``removed`` (only the recording),
    ``changed_action``, ``changed_verdict`` (the gate admitted one and refused the other) or
    ``changed_timing`` (beyond the tolerance); ``before``/``after`` the decisions as recorded/replayed."""

    kind: str
    node: str | None
    detector: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None

    @property
    def t(self) -> float:
        return float((self.after or self.before or {}).get("t", 0.0))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, "detector": self.detector, "t": self.t,
                "before": self.before, "after": self.after}


def _key(d: dict[str, Any]) -> tuple[Any, ...]:
    return d.get("node"), d.get("gpu"), d.get("job"), d.get("detector")


Pairing = tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[dict[str, Any]], list[dict[str, Any]]]


def pair(recorded: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]]) -> Pairing:
    """``recorded`` and ``replayed`` decisions paired: a decision of the same id in both is the same
    episode; the rest pair in time order per subject and detector. Returns the pairs, the recorded
    decisions left unpaired and the replayed ones left unpaired."""
    left = list(recorded)
    right = list(replayed)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    by_id: dict[str, list[dict[str, Any]]] = {}
    for d in right:
        by_id.setdefault(d["id"], []).append(d)
    unpaired_left: list[dict[str, Any]] = []
    for d in left:
        same = by_id.get(d["id"])
        if same:
            pairs.append((d, same.pop(0)))
        else:
            unpaired_left.append(d)
    unpaired_right = [d for ds in by_id.values() for d in ds]
    unpaired_right.sort(key=lambda d: d["t"])
    rest: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for d in unpaired_right:
        rest.setdefault(_key(d), []).append(d)
    only_left: list[dict[str, Any]] = []
    for d in unpaired_left:
        candidates = rest.get(_key(d))
        if candidates:
            pairs.append((d, candidates.pop(0)))
        else:
            only_left.append(d)
    return pairs, only_left, [d for ds in rest.values() for d in ds]


def diff(recorded: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]],
         tolerance_seconds: float = TIMING_TOLERANCE_SECONDS) -> list[Change]:
    """The changes from ``recorded`` to ``replayed`` (each a decision's JSON with ``t``), paired as
    ``pair`` pairs them."""
    pairs, only_left, only_right = pair(recorded, replayed)
    changes = [Change("removed", d.get("node"), d["detector"], d, None) for d in only_left]
    changes += [Change("added", d.get("node"), d["detector"], None, d) for d in only_right]
    for before, after in pairs:
        kind = None
        if before["action"] != after["action"]:
            kind = "changed_action"
        elif before.get("admitted") != after.get("admitted"):
            kind = "changed_verdict"
        elif abs(float(before["t"]) - float(after["t"])) > tolerance_seconds:
            kind = "changed_timing"
        if kind is not None:
            changes.append(Change(kind, before.get("node"), before["detector"], before, after))
    changes.sort(key=lambda c: (c.t, c.node or "", c.detector, c.kind))
    return changes


def quality(scenario: Scenario, seed: int, decisions: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Precision and recall of ``decisions`` against the simulated run's labels (its scenario's faults
    and expectations, scored as ``vigil sim`` scores them)."""
    judged = [SimDecision.model_validate({"ts": d["t"], **d}) for d in decisions]
    result = SimResult(scenario=scenario, seed=seed, decisions=judged,
                       simulated_seconds=0.0, wall_seconds=0.0, reports=0, heartbeats=0, heartbeats_rejected={},
                       breaker_tripped=False, collectors=[], jobs=[])
    s = score(result)
    return {"precision": s.precision, "recall": s.recall, "removals": float(s.removal_count),
            "false_removals": float(len(s.false_removals))}


def is_removal(d: dict[str, Any]) -> bool:
    """A decision (as the diff reads it) that took a node away: admitted, with a removing action."""
    return bool(d.get("admitted")) and d.get("action") in REMOVING_VALUES and d.get("node") is not None


def _side(labels: Sequence[str | None]) -> dict[str, float | None]:
    confirmed = sum(1 for x in labels if x == CONFIRMED)
    not_confirmed = sum(1 for x in labels if x == NOT_CONFIRMED)
    labelled = confirmed + not_confirmed
    return {"removals": len(labels), "confirmed": confirmed, "not_confirmed": not_confirmed,
            "unlabelled": len(labels) - labelled, "precision": confirmed / labelled if labelled else None}


def outcome_quality(recorded: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]],
                    labels: Mapping[str, str]) -> dict[str, dict[str, float | None]]:
    """Precision of the recorded and the replayed removals from what happened next: ``labels``, each
    recorded removal's outcome by decision id (the store's ``outcomes``: confirmed, not_confirmed;
    anything else, or none, unlabelled). A replayed removal carries the label of the recorded removal
    it pairs with (``pair``); one the recording did not make is unlabelled (nobody followed it).
    ``dropped``: recorded removals the replay does not make (lost true positives: confirmed; avoided
    false removals: not_confirmed). ``replayed.recall``: the confirmed removals the replay keeps over
    the recorded confirmed ones (faults nobody removed are unknown to both)."""
    def label(d: dict[str, Any]) -> str | None:
        x = labels.get(str(d.get("id")))
        return x if x in (CONFIRMED, NOT_CONFIRMED) else None

    pairs, only_left, only_right = pair(recorded, replayed)
    kept: list[str | None] = []
    dropped: list[str | None] = [label(d) for d in only_left if is_removal(d)]
    for before, after in pairs:
        if is_removal(after):
            kept.append(label(before) if is_removal(before) else None)
        elif is_removal(before):
            dropped.append(label(before))
    added: list[str | None] = [None for d in only_right if is_removal(d)]
    mine = _side([label(d) for d in recorded if is_removal(d)])
    theirs = _side(kept + added)
    confirmed = mine["confirmed"] or 0
    theirs["recall"] = (theirs["confirmed"] or 0) / confirmed if confirmed else None
    lost = _side(dropped)
    return {"recorded": mine, "replayed": theirs,
            "dropped": {"removals": lost["removals"], "confirmed": lost["confirmed"],
                        "not_confirmed": lost["not_confirmed"], "unlabelled": lost["unlabelled"]},
            "added": {"removals": float(len(added))}}


@dataclass
class ReplayReport:
    """What ``vigil replay`` prints: the replay, the diff, and precision/recall where labelled."""

    replayed: Replayed
    recorded: list[dict[str, Any]] | None
    changes: list[Change]
    quality: dict[str, dict[str, float | None]]
    outcomes: dict[str, dict[str, float | None]] | None = None

    def to_json(self) -> dict[str, Any]:
        r = self.replayed
        return {"schedule": r.schedule, "reports": r.reports, "alerts": r.alerts, "evaluations": r.evaluations,
                "refused": r.refused, "problems": [str(p) for p in r.problems],
                "simulated_seconds": r.simulated_seconds, "wall_seconds": round(r.wall_seconds, 3),
                "decisions": [d.to_json() for d in r.decisions],
                "recorded_decisions": None if self.recorded is None else len(self.recorded),
                "changes": [c.to_json() for c in self.changes], "quality": self.quality,
                "outcomes": self.outcomes}


def recorded_from_store(rows: Sequence[Any], origin: float, until: float) -> list[dict[str, Any]]:
    """The store's rows (``Store.decisions``) made within [``origin``, ``until``] on the service's clock,
    as the diff reads decisions (``t`` from ``origin``), oldest first."""
    out = [SimDecision.of(r.decision, r.decision.ts - origin, r.admitted, r.verdict).to_json()
           for r in sorted(rows, key=lambda r: r.seq) if origin <= r.decision.ts <= until]
    return out


def trace_span(reading: TraceReading) -> tuple[float, float]:
    """When the trace began (its first segment's opening on the service's clock) and its last record."""
    first = reading.records[0].t if reading.records else 0.0
    opened = float(reading.headers[0].get("opened_clock", first)) if reading.headers else first
    return opened, reading.records[-1].t if reading.records else opened


def replay_directory(directory: Path, config: AggregatorConfig | None = None, *, schedule: str = "auto",
                     recorded: list[dict[str, Any]] | None = None,
                     tolerance_seconds: float = TIMING_TOLERANCE_SECONDS,
                     labels: Mapping[str, str] | None = None) -> ReplayReport:
    """The trace in ``directory`` replayed with ``config`` (None: the simulated run's own, from its run
    file; else the defaults) and compared with ``recorded`` (None: the run file's decisions); with
    ``labels`` (the store's outcomes by decision id), scored from them (``outcome_quality``)."""
    if not directory.is_dir():
        raise ReplayError(f"{directory}: no such trace directory")
    run = load_run(directory)
    reading = read_trace(directory)
    if not reading.records:
        problems = "; ".join(str(p) for p in reading.problems) or "no segments"
        raise ReplayError(f"{directory}: no readable trace records ({problems})")
    if config is None:
        config, gate = run.config() if run is not None else (parse_config({}), GateConfig())
    else:
        gate = config.gate
    replayed = replay(reading, config, gate, schedule=schedule)
    if recorded is None and run is not None:
        recorded = run.decisions
    after = [d.to_json() for d in replayed.decisions]
    changes = diff(recorded, after, tolerance_seconds) if recorded is not None else []
    labelled: dict[str, dict[str, float | None]] = {}
    if run is not None:
        labelled["replayed"] = quality(run.scenario, run.seed, after)
        if recorded is not None:
            labelled["recorded"] = quality(run.scenario, run.seed, recorded)
    scored = outcome_quality(recorded, after, labels) if labels is not None and recorded is not None else None
    return ReplayReport(replayed, recorded, changes, labelled, scored)
