"""GPU straggler detector: one slow GPU (rank) of a node, its job's slowest with the shortest
collective wait in consecutive windows, is found although its node's median never moves; a
whole-job slowdown, a healthy noisy job, a mostly slow node (the node straggler's), a role that
slows a tenth of the ranks, a slower hardware class and one slow window are not."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.config import ConfigError, DetectorsConfig, parse_config
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors import REGISTRY
from vigil.aggregator.detectors.gpu_straggler import GpuStragglerConfig, GpuStragglerDetector
from vigil.aggregator.detectors.straggler import StragglerConfig, StragglerDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import RankSummary

WINDOW = 5.0  # the agent's summary window
COMPUTE, COLLECTIVE = 1.5, 0.4

Slow = dict[tuple[str, int], float]


def nodes_(n: int = 16, gpus: int = 8) -> list[FakeNode]:
    return [FakeNode(f"n{i:04d}", gpus=gpus, ports=0) for i in range(n)]


def feed(nodes: list[FakeNode], seconds: float, *, slow: Slow | None = None, at: float = 0.0, scale: float = 1.0,
         noise: float = 0.0, seed: int = 0, ranks_per_node: int = 8, gpu_index: bool = True,
         mutate: Callable[[FakeNode, float], None] | None = None, skip: Callable[[FakeNode, float], bool] | None = None,
         detectors: list | None = None, agent_resets: bool = False, comm_override: dict[int, float] | None = None,
         start: float = 0.0, spikes: float = 0.0) -> list[tuple[float, list[Finding]]]:
    """A synchronous job on ``nodes`` at 2.5 s reports with the agent's aligned 5 s windows (each
    window drawn once and repeated by the reports that carry it). ``slow`` maps (node, local rank)
    to a compute factor from ``at`` on; a rank's wait is the slowest rank's compute less its own,
    plus the collective. ``spikes``: the chance that a rank's window is 40% slow (a GC pause, a
    page-fault storm: a heavy tail, independent from window to window). Returns every
    evaluation's findings."""
    rng = random.Random(seed)
    fleet = Fleet(agent_resets=agent_resets)
    dets = detectors if detectors is not None else [GpuStragglerDetector(GpuStragglerConfig())]
    draws: dict[float, list[float]] = {}
    out: list[tuple[float, list[Finding]]] = []
    t = start
    while t <= start + seconds:
        end = math.floor(t / WINDOW) * WINDOW
        if end not in draws:
            draws[end] = [COMPUTE * scale * ((slow or {}).get((n.name, local), 1.0) if end - WINDOW >= at else 1.0)
                          * math.exp(rng.gauss(0.0, noise)) * (1.4 if rng.random() < spikes else 1.0)
                          for n in nodes for local in range(ranks_per_node)]
        computes = draws[end]
        slowest = max(computes)
        for ni, node in enumerate(nodes):
            if mutate is not None:
                mutate(node, t)
            node.ranks = []
            for local in range(ranks_per_node):
                rank = ni * ranks_per_node + local
                c = computes[rank]
                comm = (comm_override or {}).get(rank, slowest - c + COLLECTIVE * scale)
                node.ranks.append(RankSummary(
                    job="llm", rank=rank, gpu=local if gpu_index else None, pid=1000 + rank, window_seconds=WINDOW,
                    window_end_ts=end, steps=2, last_step=int(t), last_progress_ts=t,
                    step_seconds_p50=c + comm, compute_seconds_p50=c, comm_seconds_p50=comm))
            if skip is None or not skip(node, t):
                fleet.ingest(node.report(t), t)
        view = fleet.view()
        out.append((t, [f for d in dets for f in d.evaluate(view, t)]))
        t += 2.5
    return out


def flagged(found: list[tuple[float, list[Finding]]]) -> set[tuple[str, int | None]]:
    return {(f.node, f.gpu) for _, fs in found for f in fs}


def first(found: list[tuple[float, list[Finding]]]) -> tuple[float, Finding] | None:
    return next(((t, fs[0]) for t, fs in found if fs), None)


def test_registered_with_its_config_section() -> None:
    assert REGISTRY["gpu_straggler"] is GpuStragglerDetector
    assert isinstance(DetectorsConfig().gpu_straggler, GpuStragglerConfig)
    assert DetectorsConfig().gpu_straggler.enabled
    with pytest.raises(ConfigError, match=r"detectors\.gpu_straggler\.persistence_windows"):
        parse_config({"detectors": {"gpu_straggler": {"persistence_windows": 0}}})


def test_one_gpu_25_percent_slow_is_drained_within_30_s_and_alone() -> None:
    found = feed(nodes_(32), 120, slow={("n0007", 3): 1.25}, at=40, noise=0.02, seed=1)
    hit = first(found)
    assert hit is not None
    t, f = hit
    assert t - 40 <= 30
    assert flagged(found) == {("n0007", 3)}
    assert f.detector == "gpu_straggler" and f.action is Action.DRAIN and f.job == "llm" and f.gpu == 3
    ev = f.evidence
    assert ev["rank"] == 7 * 8 + 3 and ev["gpu_source"] == "reported" and ev["windows"] == 4
    assert abs(ev["excess_ratio"] - 0.25) < 0.05 and ev["z"] >= 6
    assert ev["node_ranks_slow"] == 1 and ev["node_ranks"] == 8 and ev["causes"] == []
    assert "no cause in its telemetry" in f.reason


def test_the_node_statistic_misses_it_and_this_one_does_not() -> None:
    # The case: one GPU at half speed, every step doubled, and the node median unmoved.
    node, gpu = StragglerDetector(StragglerConfig()), GpuStragglerDetector(GpuStragglerConfig())
    found = feed(nodes_(32), 60, slow={("n0011", 3): 2.0}, noise=0.02, detectors=[node, gpu])
    assert {(f.detector, f.node, f.gpu) for _, fs in found for f in fs} == {("gpu_straggler", "n0011", 3)}


def test_a_node_mostly_slow_is_the_node_stragglers_alone() -> None:
    # 5 of 8 ranks slow: the node median moves; one fault is decided once, by the node detector.
    slow = {("n0003", i): 1.3 for i in range(5)}
    node, gpu = StragglerDetector(StragglerConfig()), GpuStragglerDetector(GpuStragglerConfig())
    found = feed(nodes_(16), 60, slow=slow, noise=0.01, detectors=[node, gpu])
    assert {(f.detector, f.node) for _, fs in found for f in fs} == {("straggler", "n0003")}


def test_half_a_node_slow_is_not_a_gpu_fault_three_of_eight_are() -> None:
    half = feed(nodes_(16), 60, slow={("n0003", i): 1.3 for i in range(4)}, noise=0.01)
    assert flagged(half) == set()
    three = feed(nodes_(16), 60, slow={("n0003", i): 1.3 for i in (1, 4, 6)}, noise=0.01)
    assert flagged(three) == {("n0003", 1), ("n0003", 4), ("n0003", 6)}


def test_whole_job_slowdown_flags_nobody() -> None:
    found = feed(nodes_(32), 90, scale=1.4, noise=0.02, seed=3)
    assert flagged(found) == set()


def test_a_role_that_slows_a_tenth_of_the_ranks_is_job_wide() -> None:
    # Local rank 0 of every node 20% slower (12.5% of the ranks): a job-wide difference.
    slow = {(f"n{i:04d}", 0): 1.2 for i in range(16)}
    assert flagged(feed(nodes_(16), 60, slow=slow, noise=0.01)) == set()


def test_a_slower_hardware_class_is_not_a_straggler() -> None:
    # Two H100 nodes in an H200 job compute 12% slower by design: compared only with their class
    # (two nodes, 16 ranks), nobody stands out; an H200 GPU 25% slow still does.
    nodes = nodes_(16)
    for n in nodes[:2]:
        for g in n.gpus.values():
            g["name"] = "NVIDIA H100 80GB HBM3"
    for n in nodes[2:]:
        for g in n.gpus.values():
            g["name"] = "NVIDIA H200"
    slow: Slow = {(n.name, i): 1.12 for n in nodes[:2] for i in range(8)}
    assert flagged(feed(nodes, 60, slow=slow, noise=0.01)) == set()
    slow[("n0009", 2)] = 1.25
    assert flagged(feed(nodes, 60, slow=slow, noise=0.01)) == {("n0009", 2)}


def test_slow_compute_with_a_long_collective_wait_is_not_the_straggler() -> None:
    # It computes longer AND waits longest: it is waited on by nobody (another rank's fault, or noise).
    assert flagged(feed(nodes_(16), 60, slow={("n0003", 2): 1.3}, comm_override={3 * 8 + 2: 5.0})) == set()


def test_three_slow_windows_are_not_enough_four_are() -> None:
    det = GpuStragglerDetector(GpuStragglerConfig())
    # Slow from window [20, 25) on; windows are judged once every rank has sent them.
    found = feed(nodes_(16), 60, slow={("n0004", 6): 1.5}, at=20, detectors=[det])
    hit = first(found)
    assert hit is not None
    t, f = hit
    assert f.evidence["windows"] == 4 and f.since == 20.0
    judged_before = [fs for tt, fs in found if tt < t]
    assert all(not fs for fs in judged_before)


def test_a_window_without_the_ranks_data_neither_breaks_nor_extends_the_run() -> None:
    slow = {("n0004", 6): 1.5}
    steady = first(feed(nodes_(16), 60, slow=slow))
    # n0004 sends nothing for 10 s (four reports): its windows [10, 15) and [15, 20) have no data.
    late = first(feed(nodes_(16), 60, slow=slow, skip=lambda n, t: n.name == "n0004" and 10 <= t < 20))
    assert steady is not None and late is not None
    assert late[1].evidence["windows"] == 4 and late[0] > steady[0]
    assert late[1].since == steady[1].since


def test_throttle_reasons_are_evidence_and_the_action_stays_drain() -> None:
    def throttle(node: FakeNode, t: float) -> None:
        if node.name == "n0005":
            node.gpus[1]["clock_event_reasons"] = ["hw_slowdown", "hw_thermal_slowdown"]
            node.gpus[1]["sm_clock_hertz"] = 1.2e9
    found = feed(nodes_(16), 60, slow={("n0005", 1): 1.6}, mutate=throttle, agent_resets=True)
    _, f = first(found) or (0, None)
    assert f is not None and f.action is Action.DRAIN and f.gpu == 1
    assert f.evidence["causes"] == ["hw_slowdown", "hw_thermal_slowdown", "sm_clock_low"]
    assert f.evidence["sm_clock_ratio_to_node"] == round(1.2 / 1.98, 3)
    assert "hw_thermal_slowdown" in f.reason


def _remap(node: FakeNode, t: float) -> None:
    if node.name == "n0005":
        node.gpus[1]["remap_pending"] = True


def test_a_cause_a_reset_clears_asks_for_reset_gpu_where_agents_reset() -> None:
    found = feed(nodes_(16), 60, slow={("n0005", 1): 1.6}, mutate=_remap, agent_resets=True)
    _, f = first(found) or (0, None)
    assert f is not None and f.action is Action.RESET_GPU and f.gpu == 1 and f.node == "n0005"
    assert f.evidence["uuid"] == "GPU-n0005-1" and "remap_pending" in f.evidence["causes"]


def test_without_agent_resets_the_same_evidence_drains() -> None:
    found = feed(nodes_(16), 60, slow={("n0005", 1): 1.6}, mutate=_remap, agent_resets=False)
    _, f = first(found) or (0, None)
    assert f is not None and f.action is Action.DRAIN and f.gpu == 1


def test_a_rank_without_a_gpu_index_is_placed_by_its_process() -> None:
    def processes(node: FakeNode, t: float) -> None:
        for local, g in node.gpus.items():  # ranks run on GPUs in reverse order on this node
            g["processes"] = [{"pid": 1000 + int(node.name[1:]) * 8 + 7 - local}]
    found = feed(nodes_(16), 60, slow={("n0005", 1): 1.6}, gpu_index=False, mutate=processes)
    _, f = first(found) or (0, None)
    assert f is not None and f.gpu == 6 and f.evidence["gpu_source"] == "process"


def test_a_guessed_gpu_is_named_only_when_its_telemetry_corroborates() -> None:
    guessed = first(feed(nodes_(16), 60, slow={("n0005", 1): 1.6}, gpu_index=False, agent_resets=True))
    assert guessed is not None
    f = guessed[1]
    assert f.gpu is None and f.action is Action.DRAIN
    assert f.evidence["gpu_source"] == "local_rank" and f.evidence["gpu"] == 1
    corroborated = first(feed(nodes_(16), 60, slow={("n0005", 1): 1.6}, gpu_index=False, mutate=_remap,
                              agent_resets=True))
    assert corroborated is not None
    assert corroborated[1].gpu == 1 and corroborated[1].action is Action.RESET_GPU


def test_later_findings_keep_the_episode_and_the_rank_leaves_the_baseline() -> None:
    det = GpuStragglerDetector(GpuStragglerConfig())
    found = feed(nodes_(16), 200, slow={("n0002", 4): 1.5}, detectors=[det])
    sinces = {f.since for _, fs in found for f in fs}
    assert len(sinces) == 1
    assert len({f.key for _, fs in found for f in fs}) == 1


def test_healthy_noisy_job_for_an_hour_flags_nothing() -> None:
    # 128 ranks at 3% per-window jitter, 720 windows: 92,160 rank-windows.
    assert flagged(feed(nodes_(16), 3600, noise=0.03, seed=5)) == set()


def test_heavy_tailed_spikes_that_do_not_persist_flag_nobody() -> None:
    # 2% of rank-windows 40% slow (far beyond 6 sigma at 2% jitter), for 30 minutes of 128 ranks:
    # ~1,100 spikes, a run of four in a row on one rank ~0.01 expected. The same with one window
    # of persistence removes ranks: the persistence is what holds the budget.
    assert flagged(feed(nodes_(16), 1800, noise=0.02, spikes=0.02, seed=4)) == set()
    hasty = GpuStragglerDetector(GpuStragglerConfig(persistence_windows=1))
    assert flagged(feed(nodes_(16), 1800, noise=0.02, spikes=0.02, seed=4, detectors=[hasty]))


def test_too_few_ranks_are_not_judged() -> None:
    # One node of 4 ranks: no class group of 8 to compare with.
    assert flagged(feed(nodes_(1), 60, slow={("n0000", 1): 2.0}, ranks_per_node=4)) == set()


SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(k=st.floats(min_value=0.05, max_value=20.0), seed=st.integers(0, 1000), factor=st.sampled_from([None, 1.3]))
def test_scaling_every_time_by_k_changes_nothing(k: float, seed: int, factor: float | None) -> None:
    slow = {("n0005", 2): factor} if factor else None
    base = feed(nodes_(16), 40, slow=slow, noise=0.01, seed=seed)
    scaled = feed(nodes_(16), 40, slow=slow, noise=0.01, seed=seed, scale=k)
    assert [(t, [(f.node, f.gpu) for f in fs]) for t, fs in base] == \
        [(t, [(f.node, f.gpu) for f in fs]) for t, fs in scaled]


@SETTINGS
@given(n=st.integers(min_value=4, max_value=24), node=st.integers(0, 23), gpu=st.integers(0, 7),
       factor=st.floats(1.25, 3.0))
def test_one_clear_outlier_is_flagged_and_is_the_only_one(n: int, node: int, gpu: int, factor: float) -> None:
    name = f"n{node % n:04d}"
    assert flagged(feed(nodes_(n), 40, slow={(name, gpu): factor}, noise=0.01, seed=node)) == {(name, gpu)}
