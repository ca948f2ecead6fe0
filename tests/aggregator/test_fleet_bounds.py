"""One node's credential cannot grow the aggregator without bound, nor take another node's ranks (issue 37).

The attack: a node with a valid credential sends, in every report, a new job name for each of its
1,024 ranks, new GPU indices, new port names and new counter names. What the fleet keeps for it
stays within the per-node caps however long it goes on (counted in objects, not timed), the rest
is refused by reason or evicted (oldest of what its latest report no longer names), and the
honest node beside it keeps its job, ranks and history. A (job, rank) an honest node reports live
cannot be taken by another node's report until that node's hold lapses; the lookalikes that must
still move it: the rank exited on its node, or its node stopped reporting it.
"""

from __future__ import annotations

import gc

import msgspec
import pytest

from tests.aggregator.conftest import FakeNode, rank_summary
from vigil.aggregator.fleet import Fleet, FleetConfig
from vigil.contract.wire import REPORT_VERSION, Event, GpuState, PortState, Report

T0 = 1_800_000_000.0
INTERVAL = 2.5


def _attack(node: FakeNode, n: int, ts: float, new_jobs: bool = True) -> Report:
    """Report ``n`` of the attacking node: everything in it is new (a job per rank, or new ranks of
    one job)."""
    report = node.report(ts)
    ranks = [rank_summary(f"atk-{n}-{r}", r, compute=1.0, comm=0.1, ts=ts) if new_jobs
             else rank_summary("atk", 1024 * n + r, compute=1.0, comm=0.1, ts=ts) for r in range(1024)]
    gpus = [GpuState(index=1000 + 256 * n + i, uuid=f"GPU-atk-{n}-{i}") for i in range(16)]
    ports = [PortState(device=f"atk{n}_{p}", port=1, counters={f"c{n}_{p}_{k}": k for k in range(64)})
             for p in range(16)]
    return msgspec.structs.replace(report, ranks=ranks, gpus=[*report.gpus, *gpus], ports=[*report.ports, *ports])


def _held(fleet: Fleet, name: str) -> dict[str, int]:
    node = fleet.view().nodes[name]
    return {"ranks": len(node.ranks), "jobs": len({j for j, _ in node.ranks}), "gpus": len(node.gpus),
            "ports": len(node.ports), "xid_keys": len(node.xids),
            "counters": max(len(p.last.counters) for p in node.ports.values()),
            "fleet_jobs": len(fleet.view().jobs)}


@pytest.mark.parametrize("new_jobs", [True, False], ids=["a-job-per-rank", "new-ranks-of-one-job"])
def test_a_new_job_per_rank_per_report_keeps_the_fleet_within_its_caps(new_jobs: bool) -> None:
    cfg = FleetConfig()
    fleet = Fleet(cfg)
    honest, attacker = FakeNode("honest"), FakeNode("mallory")
    honest.ranks = [rank_summary("train", r, compute=1.0, comm=0.1, ts=T0) for r in range(8)]
    totals: dict[str, int] = {}
    tracked: list[int] = []
    for n in range(120):
        ts = T0 + n * INTERVAL
        fleet.ingest(honest.report(ts), ts)
        for reason, count in fleet.ingest(_attack(attacker, n, ts, new_jobs), ts).items():
            totals[reason] = totals.get(reason, 0) + count
        if n in (40, 119):
            gc.collect()
            tracked.append(len(gc.get_objects()))
    held = _held(fleet, "mallory")
    assert held["ranks"] <= cfg.max_ranks_per_node and held["jobs"] <= cfg.max_jobs_per_node
    assert held["gpus"] <= cfg.max_gpus_per_node and held["ports"] <= cfg.max_ports_per_node
    assert held["counters"] <= cfg.max_counters_per_port
    # The fleet's jobs: the honest one and at most the attacker's cap (an evicted job leaves).
    assert held["fleet_jobs"] <= 1 + cfg.max_jobs_per_node
    # Refused by reason, and what was evicted counted by kind.
    assert totals["too_many_jobs" if new_jobs else "too_many_ranks"] > 50_000 and totals["too_many_gpus"] > 0
    assert set(totals) <= {"too_many_jobs", "too_many_ranks", "too_many_gpus", "too_many_ports",
                           "too_many_counters"}
    assert fleet.evicted["ranks"] > 0 and fleet.evicted["ports"] > 0 and (fleet.evicted["jobs"] > 0) == new_jobs
    # Flat: 80 more reports of the attack add no objects the collector walks (a margin for the
    # interpreter's own few), where before each report added ~1,024 jobs and ranks.
    assert tracked[1] - tracked[0] < 500, tracked
    # The honest node beside it keeps its job, ranks and their history.
    assert {r for (job, r) in fleet.view().nodes["honest"].ranks if job == "train"} == set(range(8))
    assert len(fleet.view().jobs["train"].ranks[0].windows) > 0


def test_a_compact_report_cannot_grow_a_ports_counters_one_name_at_a_time() -> None:
    cfg = FleetConfig(max_counters_per_port=32)
    fleet = Fleet(cfg)
    node = FakeNode("mallory", gpus=1, ports=1)
    fleet.ingest(node.report(T0), T0)
    refused = 0
    for n in range(1, 40):
        ts = T0 + n * INTERVAL
        whole = node.report(ts)
        port = msgspec.structs.replace(whole.ports[0], counters={f"new_{n}_{k}": 1 for k in range(8)})
        compact = msgspec.structs.replace(whole, version=REPORT_VERSION, base_seq=node.seq - 1, ports=[port])
        refused += fleet.ingest(compact, ts).get("too_many_counters", 0)
    counters = fleet.view().nodes["mallory"].ports[("mlx5_0", 1)].last.counters
    assert len(counters) == 32 and refused == 39 * 8 - (32 - 6)
    assert "symbol_error" in counters  # the port's real counters were there first and stay


def test_an_honest_nodes_jobs_coming_and_going_are_never_refused() -> None:
    """The lookalike: a node running a new 8-rank job every 25 s for an hour goes past the caps in
    ranks and jobs over time; only what its reports no longer name is evicted, nothing refused."""
    fleet = Fleet(FleetConfig(max_ranks_per_node=64, max_jobs_per_node=4))
    node = FakeNode("busy")
    for n in range(1440):
        ts = T0 + n * INTERVAL
        node.ranks = [rank_summary(f"job-{n // 10}", r, compute=1.0, comm=0.1, ts=ts) for r in range(8)]
        assert fleet.ingest(node.report(ts), ts) == {}
    ranks = fleet.view().nodes["busy"].ranks
    assert {job for job, _ in ranks} >= {"job-143"} and len(ranks) <= 32
    assert fleet.evicted["jobs"] > 0


def test_an_xid_naming_gpus_beyond_the_cap_is_kept_for_the_node() -> None:
    cfg = FleetConfig(max_gpus_per_node=8)
    fleet = Fleet(cfg)
    node = FakeNode("mallory")
    refused = 0
    for n in range(20):
        ts = T0 + n * 10.0  # beyond the de-duplication window: twenty distinct Xids
        events = [Event(kind="xid", ts=ts, code=79, gpu=100 + n, source="kmsg")]
        refused += fleet.ingest(node.report(ts, events=events), ts).get("too_many_gpus", 0)
    xids = fleet.view().nodes["mallory"].xids
    assert len(xids) <= cfg.max_gpus_per_node + 1 and refused > 0
    assert sum(len(ring) for ring in xids.values()) == 20  # every Xid kept


def test_a_live_rank_stays_its_nodes_until_it_exits_or_the_hold_lapses() -> None:
    cfg = FleetConfig(rank_hold_seconds=30.0)
    fleet = Fleet(cfg)
    a, b = FakeNode("a"), FakeNode("b")
    a.ranks = [rank_summary("victim", 0, compute=1.0, comm=0.1, ts=T0)]
    fleet.ingest(a.report(T0), T0)
    # b claims a's live rank: refused for that entry, counted; the rest of b's report is taken.
    b.ranks = [rank_summary("victim", 0, compute=9.0, comm=0.1, ts=T0 + 1), rank_summary("mine", 0, compute=1.0,
                                                                                       comm=0.1, ts=T0 + 1)]
    assert fleet.ingest(b.report(T0 + 1), T0 + 1) == {"rank_owner_conflict": 1}
    view = fleet.view()
    assert view.jobs["victim"].ranks[0].node == "a" and view.jobs["victim"].ranks[0].last.compute_seconds_p50 == 1.0
    assert ("mine", 0) in view.nodes["b"].ranks and ("victim", 0) not in view.nodes["b"].ranks
    # a keeps reporting it: still a's, whatever b says.
    for t in (T0 + 2.5, T0 + 20.0):
        fleet.ingest(a.report(t), t)
        assert fleet.ingest(b.report(t + 1), t + 1) == {"rank_owner_conflict": 1}
    # a stops reporting it (the node went quiet): after the hold, b may take it.
    t = T0 + 20.0 + cfg.rank_hold_seconds + 1
    assert fleet.ingest(b.report(t), t) == {}
    assert fleet.view().jobs["victim"].ranks[0].node == "b"
    assert ("victim", 0) not in fleet.view().nodes["a"].ranks


def test_a_rank_that_exited_on_its_node_moves_at_once_and_its_tail_claims_nothing() -> None:
    fleet = Fleet(FleetConfig())
    a, b = FakeNode("a"), FakeNode("b")
    a.ranks = [rank_summary("job", 3, compute=1.0, comm=0.1, ts=T0)]
    fleet.ingest(a.report(T0), T0)
    a.ranks = [rank_summary("job", 3, compute=1.0, comm=0.1, ts=T0 + 2.5, state="exited")]
    fleet.ingest(a.report(T0 + 2.5), T0 + 2.5)
    b.ranks = [rank_summary("job", 3, compute=1.0, comm=0.1, ts=T0 + 3)]
    assert fleet.ingest(b.report(T0 + 3), T0 + 3) == {}
    assert fleet.view().jobs["job"].ranks[3].node == "b"
    # a's agent reports the exited rank a while longer: neither a conflict nor a move back.
    assert fleet.ingest(a.report(T0 + 5), T0 + 5) == {}
    assert fleet.view().jobs["job"].ranks[3].node == "b"
