"""The collective culprit detector: the node holding the rank that never entered the collective its
group waits in is drained, from real torch 2.13 gloo Flight Recorder dumps read by the agent's
collector; the lookalikes (healthy, finished, stale, other groups, earlier dumps, too few dumps)
decide nothing."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from tests.aggregator.conftest import FakeNode
from vigil.agent.collectors.flight_recorder import FlightRecorderCollector, FlightRecorderConfig
from vigil.aggregator.decision import WHOLE_JOB, Action
from vigil.aggregator.detectors.collective_culprit import CollectiveCulpritConfig, CollectiveCulpritDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import CollectiveState

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "flight_recorder"
T0 = 1_800_000_000.0
JOB = "4242"


def _from_real_dumps(tmp_path: Path) -> dict[int, list[CollectiveState]]:
    """rank -> the states the agent's collector reads from that rank's recorded dump."""
    out = {}
    for r in range(3):
        root = tmp_path / f"n{r}"
        path = root / "var/tmp/vigil-fr/run/nccl_trace_rank_" f"{r}"
        path.parent.mkdir(parents=True)
        path.write_bytes((FIXTURES / f"fr_hang_rank{r}.json").read_bytes())
        os.utime(path, (T0 - 5, T0 - 5))
        collector = FlightRecorderCollector(FlightRecorderConfig(enabled=True), root=root,
                                            jobs_of_uid=lambda r=r: {os.getuid(): {JOB: {r}}})
        out[r] = collector.collect(T0).report["collectives"]
    return out


def state(rank: int, entered: int | None, completed: int | None, *, group: str = "0", size: int | None = None,
          dump_ts: float = T0 - 5, job: str = JOB) -> CollectiveState:
    stage = "completed" if entered is not None and completed == entered else "scheduled"
    return CollectiveState(job=job, rank=rank, group=group, group_size=size, last_entered_seq=entered,
                           last_completed_seq=completed, op="all_reduce", stage=stage, size_bytes=4096,
                           dump_ts=dump_ts)


def run(per_node: dict[str, list[CollectiveState]], *, rounds: int = 4, step: float = 2.5,
        detector: CollectiveCulpritDetector | None = None, silent_from: dict[str, float] | None = None):
    """Each node reports its states every ``step`` s (a node in ``silent_from`` stops reporting at
    that time); the detector evaluates after each round. Returns every round's findings."""
    detector = detector or CollectiveCulpritDetector(CollectiveCulpritConfig())
    fleet = Fleet()
    nodes = {name: FakeNode(name, gpus=0, ports=0) for name in per_node}
    rounds_out = []
    for i in range(rounds):
        t = T0 + i * step
        for name, states in per_node.items():
            if silent_from and t >= silent_from.get(name, float("inf")):
                continue
            fleet.ingest(msgspec.structs.replace(nodes[name].report(t), collectives=states), t)
        rounds_out.append(detector.evaluate(fleet.view(), t))
    return rounds_out


def test_real_gloo_dumps_name_the_node_of_the_rank_that_never_entered(tmp_path: Path) -> None:
    states = _from_real_dumps(tmp_path)
    found = run({f"n{r}": states[r] for r in range(3)})
    assert found[0] == [] and found[1] == []  # persistence: 5 s
    (f,) = found[2]
    assert (f.node, f.job, f.action, f.key) == ("n2", JOB, Action.DRAIN, "hang")
    assert f.evidence["signal"] == "flight_recorder"
    assert (f.evidence["group"], f.evidence["seq"], f.evidence["op"]) == ("0", 6, "all_reduce")
    assert f.evidence["waiting_ranks"] == [0, 1] and f.evidence["missing_ranks"] == [2]
    assert found[3] == [f]  # the same episode (same since) while the dumps stay


def test_healthy_ranks_at_the_same_seq_decide_nothing() -> None:
    nodes = {f"n{r}": [state(r, 9, 9), state(r, 4, 4, group="1")] for r in range(3)}
    assert run(nodes) == [[]] * 4


def test_every_rank_waiting_in_the_same_collective_names_nobody() -> None:
    # A plain hang with no missing rank: the hang detectors' case, not a culprit.
    assert run({f"n{r}": [state(r, 9, 8)] for r in range(3)}) == [[]] * 4


def test_a_finished_job_whose_dumps_left_the_reports_decides_nothing() -> None:
    # The agent refuses a dump whose job no longer runs on its node (test_flight_recorder.py), so
    # the reports carry none; a node still carrying a stale list for it has gone silent.
    hang = {"n0": [state(0, 6, 5)], "n1": [state(1, 6, 5)], "n2": [state(2, 5, 5)]}
    found = run({**hang, "n2": []})
    assert found == [[]] * 4
    # n0 and n1 fall silent after T0 + 2.5: judged while fresh, and their dumps stale after 15 s.
    found = run(hang, rounds=12, silent_from={"n0": T0 + 5, "n1": T0 + 5})
    assert [f.node for f in found[2]] == ["n2"]
    assert all(f == [] for f in found[-4:])


def test_dumps_minutes_apart_are_not_one_cut() -> None:
    nodes = {"n0": [state(0, 6, 5)], "n1": [state(1, 6, 5)], "n2": [state(2, 5, 5, dump_ts=T0 - 180)]}
    assert run(nodes) == [[]] * 4


def test_a_rank_dumped_earlier_within_the_skew_is_still_judged_and_beyond_it_is_not() -> None:
    det = CollectiveCulpritConfig(dump_skew_seconds=30)
    early = {"n0": [state(0, 6, 5)], "n1": [state(1, 6, 5)], "n2": [state(2, 5, 5, dump_ts=T0 - 40)]}
    assert run(early, detector=CollectiveCulpritDetector(det)) == [[]] * 4
    close = {"n0": [state(0, 6, 5)], "n1": [state(1, 6, 5)], "n2": [state(2, 5, 5, dump_ts=T0 - 20)]}
    assert [f.node for f in run(close, detector=CollectiveCulpritDetector(det))[-1]] == ["n2"]


def test_ranks_of_two_process_groups_are_never_compared() -> None:
    # Ranks 0 and 1 wait in seq 10 of group "1"; rank 2 is not in it (its group "0" is at 3).
    nodes = {"n0": [state(0, 10, 9, group="1", size=2), state(0, 3, 3)],
             "n1": [state(1, 10, 9, group="1", size=2), state(1, 3, 3)],
             "n2": [state(2, 3, 3)]}
    assert run(nodes) == [[]] * 4


def test_a_stated_group_size_needs_every_ranks_dump() -> None:
    nodes = {"n0": [state(0, 6, 5, size=4)], "n1": [state(1, 6, 5, size=4)], "n2": [state(2, 5, 5, size=4)]}
    assert run(nodes) == [[]] * 4  # rank 3 never dumped: it may be missing too
    nodes["n3"] = [state(3, 6, 5, size=4)]
    assert [f.node for f in run(nodes)[-1]] == ["n2"]


def test_a_node_of_the_job_without_dumps_blocks_judgement() -> None:
    nodes = {"n0": [state(0, 6, 5)], "n1": [state(1, 6, 5)], "n2": [state(2, 5, 5)], "n3": []}
    fleet_nodes = {name: FakeNode(name, gpus=1, ports=0) for name in nodes}
    fleet_nodes["n3"].gpus[0]["job"] = JOB  # the scheduler places the job on n3 too
    det = CollectiveCulpritDetector(CollectiveCulpritConfig())
    fleet = Fleet()
    for i in range(4):
        t = T0 + i * 2.5
        for name, states in nodes.items():
            fleet.ingest(msgspec.structs.replace(fleet_nodes[name].report(t), collectives=states), t)
        assert det.evaluate(fleet.view(), t) == []


def test_missing_ranks_on_several_nodes_are_an_alert_that_drains_nobody() -> None:
    nodes = {"n0": [state(0, 6, 5)], "n1": [state(1, 6, 5)], "n2": [state(2, 5, 5)], "n3": [state(3, 4, 4)]}
    (f,) = run(nodes)[-1]
    assert (f.node, f.action) == (WHOLE_JOB, Action.ALERT)
    assert f.evidence["culprit_nodes"] == ["n2", "n3"] and f.evidence["missing_ranks"] == [2, 3]


def test_one_rank_reported_by_two_nodes_is_trusted_from_neither() -> None:
    nodes = {"n0": [state(0, 6, 5)], "n1": [state(1, 6, 5)], "n2": [state(2, 5, 5)], "n3": [state(2, 6, 5)]}
    assert run(nodes) == [[]] * 4


def test_one_node_claiming_its_ranks_are_ahead_cannot_drain_its_only_peer() -> None:
    # A 2-node job: n0's dumps (its root may write anything for its own ranks) say they wait in #7;
    # n1's ranks are at #6. n1 has a single witness against it: an alert, no drain.
    (f,) = run({"n0": [state(0, 7, 6), state(1, 7, 6)], "n1": [state(2, 6, 6), state(3, 6, 6)]})[-1]
    assert (f.node, f.action) == (WHOLE_JOB, Action.ALERT)
    assert f.evidence["culprit_nodes"] == ["n1"]
    # With waiting ranks on two other nodes the same cut drains n1.
    (f,) = run({"n0": [state(0, 7, 6)], "n2": [state(1, 7, 6)], "n1": [state(2, 6, 6)]})[-1]
    assert (f.node, f.action) == ("n1", Action.DRAIN)


def test_a_single_node_job_is_an_alert_not_a_drain() -> None:
    (f,) = run({"n0": [state(0, 6, 5), state(1, 6, 5), state(2, 5, 5)]})[-1]
    assert (f.node, f.action) == (WHOLE_JOB, Action.ALERT)


def test_the_fleet_keeps_each_nodes_latest_list_whole() -> None:
    fleet, node = Fleet(), FakeNode("n0", gpus=0, ports=0)
    fleet.ingest(msgspec.structs.replace(node.report(T0), collectives=[state(0, 6, 5), state(1, 6, 5)]), T0)
    assert [s.rank for s in fleet.view().nodes["n0"].collectives] == [0, 1]
    fleet.ingest(msgspec.structs.replace(node.report(T0 + 2.5), collectives=[state(1, 7, 6)]), T0 + 2.5)
    assert [(s.rank, s.last_entered_seq) for s in fleet.view().nodes["n0"].collectives] == [(1, 7)]
    fleet.ingest(node.report(T0 + 5), T0 + 5)  # dumps no longer fresh: the agent sends none
    assert fleet.view().nodes["n0"].collectives == ()
