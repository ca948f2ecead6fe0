"""The simulated agents at independent phases, and the aggregator's start-up grace as the service
has it: each agent reports at its own moment of every cycle (a seeded draw), takes in only the
heartbeats sent by then, and the gate counts its grace from the simulation's start."""

from __future__ import annotations

from typing import Any

from vigil.contract.wire import Report
from vigil.sim.run import Simulation, report_offsets, run_scenario
from vigil.sim.scenario import Scenario, parse_scenario

DT = 2.5


class Recorder:
    """Keeps every report the agents send with the time it was sent (the simulator's ``observe``)."""

    def __init__(self) -> None:
        self.reports: list[tuple[float, Report]] = []

    def ingest(self, report: Report, now: float) -> None:
        self.reports.append((now, report))


def _fleet(**extra: Any) -> Scenario:
    data: dict[str, Any] = {"duration_seconds": 30, "report_interval_seconds": DT, "seed": 7,
                            "fleet": {"nodes": 6, "gpus_per_node": 2},
                            "jobs": [{"name": "train", "ranks_per_node": 2, "step_seconds": 0.4}]}
    data.update(extra)
    return parse_scenario(data)


def _recorded(sc: Scenario, seed: int | None = None) -> Recorder:
    rec = Recorder()
    Simulation(sc, seed=seed, observe=rec.ingest).run()
    return rec




def test_each_agent_reports_at_its_own_phase_once_a_cycle() -> None:
    sc = _fleet()
    rec = _recorded(sc)
    first = min(now for now, _ in rec.reports)
    by_node: dict[str, list[float]] = {}
    for now, report in rec.reports:
        assert report.ts == now
        by_node.setdefault(report.node, []).append(now)
    offsets = report_offsets(sc, sc.seed)
    assert len(set(offsets.values())) == sc.fleet.nodes  # no two agents in step
    assert all(0 <= o < DT for o in offsets.values())
    start = first - (DT - max(offsets.values()))  # the earliest agent's first report
    for node, times in by_node.items():
        # Once per interval, always at the same moment of it: k * DT - the node's offset.
        assert len(times) == round(sc.duration_seconds / DT)
        expected = [start + k * DT - offsets[node] for k in range(1, len(times) + 1)]
        assert max(abs(a - b) for a, b in zip(times, expected, strict=True)) < 1e-6, node
    # Reports reach the aggregator in time order, interleaved across nodes.
    ingested = [now for now, _ in rec.reports]
    assert ingested == sorted(ingested)
    assert len({r.node for _, r in rec.reports[:sc.fleet.nodes]}) == sc.fleet.nodes


def test_phases_follow_the_seed() -> None:
    sc = _fleet()
    assert report_offsets(sc, 7) == report_offsets(sc, 7)
    assert report_offsets(sc, 7) != report_offsets(sc, 8)
    a = [(now, r.node) for now, r in _recorded(sc).reports]
    b = [(now, r.node) for now, r in _recorded(sc).reports]
    c = [(now, r.node) for now, r in _recorded(sc, seed=8).reports]
    assert a == b and a != c


def test_lockstep_puts_every_agent_at_the_interval_end() -> None:
    sc = _fleet(agent_phases="lockstep")
    assert set(report_offsets(sc, sc.seed).values()) == {0.0}
    rec = _recorded(sc)
    first = rec.reports[0][0]
    assert {round((now - first) / DT, 9) % 1 for now, _ in rec.reports} == {0.0}


def test_an_agent_takes_in_only_the_heartbeats_sent_before_it_reports() -> None:
    # Every report's training summaries were made from heartbeats the agent had by then: no rank's
    # last progress lies after the report, and each agent's summary reaches the step that was
    # last before its own report time (not the interval's end).
    sc = _fleet()
    rec = _recorded(sc)
    seen_late = False
    for now, report in rec.reports:
        for rank in report.ranks:
            assert rank.last_progress_ts is not None and rank.last_progress_ts <= now
            seen_late |= now - rank.last_progress_ts > 0.0
    assert seen_late


def _xid_storm(grace_seconds: float | None) -> Scenario:
    """Five nodes of a 40-node fleet lose a GPU 20 s in: more than the breaker's floor (3), the
    whole budget during the start-up grace; within its share (20% of 40 is 8) after it."""
    gate: dict[str, Any] = {"breaker_floor_nodes": 3, "breaker_max_share": 0.2}
    if grace_seconds is not None:
        gate["breaker_startup_grace_seconds"] = grace_seconds
    return parse_scenario({
        "duration_seconds": 200, "report_interval_seconds": 5, "seed": 3, "fleet": {"nodes": 40},
        "quiet_collector_intervals": {"gpu": 60, "rdma": 60},
        "faults": [{"kind": "kernel_xid", "nodes": "node-0010..node-0014", "code": 79, "gpu": 1,
                    "at_seconds": 20}],
        "gate": gate})


def test_the_gate_counts_its_start_up_grace_from_the_simulation_start() -> None:
    # Within the default 120 s grace the budget is the floor (3): the 4th and 5th removals wait
    # ("startup_grace") and are admitted once the grace is over, when the budget is 20% of 40.
    result = run_scenario(_xid_storm(None))
    removals = {d.node: d for d in result.decisions if d.admitted and d.action in ("reboot_node", "drain")}
    waited = {d.node for d in result.decisions if d.verdict == "startup_grace"}
    assert len(waited) == 2 and len(removals) == 5
    early = sorted(d.t for n, d in removals.items() if n not in waited)
    late = sorted(d.t for n, d in removals.items() if n in waited)
    assert len(early) == 3 and max(early) < 30
    assert min(late) >= 120
    assert not result.breaker_tripped
    # Without the grace the same fault is five removals at once, within the 20% budget.
    plain = run_scenario(_xid_storm(0))
    assert not [d for d in plain.decisions if d.verdict == "startup_grace"]
    assert max(d.t for d in plain.decisions if d.admitted and d.action in ("reboot_node", "drain")) < 30
