"""agent/probes/collective.py and probe_baselines.slow_members without other processes: the pairing
rounds, bus bandwidth as nccl-tests defines it, the sampling bound, the verdict that names a slow
member (and the lookalikes it must not name), and a rendezvous nobody joins (peer_timeout)."""

from __future__ import annotations

import time
from itertools import combinations

import pytest

from tests.loopback import free_port
from vigil.agent.probes import collective
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.contract.probe_baselines import slow_members
from vigil.contract.wire import MAX_PROBE_METRICS, ProbeGroup, ProbeResult


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 9, 16, 17])
def test_every_pair_meets_once_and_nobody_twice_in_a_round(n: int) -> None:
    rounds = collective.pair_rounds(n)
    pairs = [pair for round_ in rounds for pair in round_]
    assert sorted(pairs) == list(combinations(range(n), 2))
    for round_ in rounds:
        members = [m for pair in round_ for m in pair]
        assert len(members) == len(set(members))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_bus_bandwidth_is_nccl_tests_all_reduce_factor() -> None:
    assert collective.bus_bandwidth(10.0, 8) == pytest.approx(10.0 * 2 * 7 / 8)
    assert collective.bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert collective.bus_bandwidth(10.0, 1) == 0.0


def test_a_large_group_measures_at_most_the_wires_bound_the_same_rounds_on_every_member() -> None:
    group = ProbeGroup(group="run-7", rank=0, world_size=64, rendezvous="10.0.0.1:29500")
    rounds = collective.sampled_rounds(group)
    assert len(rounds) == collective.MAX_PEER_METRICS == MAX_PROBE_METRICS - 2
    assert rounds == collective.sampled_rounds(ProbeGroup(group="run-7", rank=33, world_size=64, rendezvous="x"))
    assert rounds != collective.sampled_rounds(ProbeGroup(group="run-8", rank=0, world_size=64, rendezvous="x"))


def results(pairs: dict[tuple[int, int], float], n: int, status: str = "pass") -> dict[str, ProbeResult]:
    """Each member's collective result from symmetric pair figures (GB/s)."""
    out = {}
    for rank in range(n):
        peers = {f"peer_{b if a == rank else a}": v for (a, b), v in pairs.items() if rank in (a, b)}
        out[f"node-{rank}"] = ProbeResult(probe="collective", status=status, value=1.0,  # type: ignore[arg-type]
                                          metrics={"rank": float(rank), **peers})
    return out


def uniform(n: int, gb_per_s: float = 20.0) -> dict[tuple[int, int], float]:
    return {pair: gb_per_s * (1 + 0.03 * (i % 3)) for i, pair in enumerate(combinations(range(n), 2))}


def test_the_member_slow_with_every_peer_is_named() -> None:
    pairs = uniform(8)
    pairs.update({p: 4.0 for p in pairs if 5 in p})
    assert slow_members(results(pairs, 8)) == ["node-5"]


def test_two_slow_members_are_both_named() -> None:
    pairs = uniform(8)
    pairs.update({p: 3.0 for p in pairs if 1 in p or 6 in p})
    assert slow_members(results(pairs, 8)) == ["node-1", "node-6"]


def test_lookalikes_name_nobody() -> None:
    assert slow_members(results(uniform(8), 8)) == []  # uniform within a few percent
    one_cable = uniform(8) | {(2, 3): 4.0}  # one slow pair between two otherwise healthy members
    assert slow_members(results(one_cable, 8)) == []
    everyone_slow = uniform(8, 4.0)  # a slow fabric is not a slow member
    assert slow_members(results(everyone_slow, 8)) == []
    assert slow_members(results({(0, 1): 1.0}, 2)) == []  # two members: the pair accuses both alike
    assert slow_members(results(uniform(4) | {p: 1.0 for p in uniform(4) if 0 in p}, 4, status="error")) == []


def test_a_member_that_did_not_report_is_still_judged_by_its_peers_figures() -> None:
    pairs = uniform(4) | {p: 1.0 for p in uniform(4) if 3 in p}
    reported = results(pairs, 4)
    partial = {node: r for node, r in reported.items() if node != "node-0"}
    assert slow_members(partial) == ["node-3"]


def context(group: ProbeGroup | None, seconds: float = 2.0) -> ProbeContext:
    return ProbeContext(config=ProbesConfig(collective_bytes=1 << 12, collective_iterations=1), gpus=[], nvml=None,
                        engine=None, run=lambda argv, timeout: "", clock=time.monotonic,
                        deadline=time.monotonic() + seconds, group=group)


def test_without_a_group_or_alone_nothing_is_measured() -> None:
    assert collective.measure(context(None)).reason == "no_group"
    alone = collective.measure(context(ProbeGroup(group="g", world_size=1, rendezvous="127.0.0.1:1")))
    assert (alone.status, alone.reason) == ("skipped", "group_of_one")


def test_peers_that_never_join_are_a_peer_timeout_within_the_deadline() -> None:
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    group = ProbeGroup(group="g", rank=0, world_size=2, rendezvous=f"127.0.0.1:{free_port()}", backend="gloo")
    result = collective.measure(context(group, seconds=2.0))
    assert (result.status, result.reason) == ("error", "peer_timeout")
