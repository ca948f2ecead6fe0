"""The straggler detector's evidence beyond compute: the data phase (a node whose ranks wait for
data is slow for its own reasons; a job-wide data stall is nobody's), peers by hardware class (a
class slower by design is observed, never drained; the outlier guard is per class), and windows
that carry no data of a node (they neither break nor extend its run)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.straggler import StragglerConfig, StragglerDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import RankSummary

WINDOW = 5.0
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


class Job:
    """A synchronous job of ``nodes`` x 8 ranks: per window each rank's compute and data p50 (its
    own time) and its collective wait (the slowest rank's own time minus its own, plus 0.1 s).
    ``compute`` maps a node to its compute factor, ``data`` a node (or "*": every node) to its
    extra data seconds, each as a function of the window's end."""

    def __init__(self, n: int, *, h100: int = 0, h100_factor: float = 1.12, sigma: float = 0.02, seed: int = 0,
                 interval: float = 2.5) -> None:
        self.nodes = [FakeNode(f"n{i:03d}", ports=0, interval=interval) for i in range(n)]
        for i, node in enumerate(self.nodes):
            for g in node.gpus.values():
                g["name"] = H100 if i >= n - h100 else H200
                g["power_limit_watts"] = 700.0
        self.h100 = {node.name for node in self.nodes[n - h100:]} if h100 else set()
        self.h100_factor = h100_factor
        self.sigma = sigma
        self.rng = np.random.default_rng(seed)
        self.compute: dict[str, Callable[[float], float]] = {}
        self.data: dict[str, Callable[[float], float]] = {}
        self.skip: set[tuple[str, float]] = set()  # (node, window end) whose summaries never arrive
        self._windows: dict[float, list[RankSummary]] = {}

    def _window(self, end: float) -> list[RankSummary]:
        if end not in self._windows:
            out = []
            rows = []
            for node in self.nodes:
                base = 1.4 * (self.h100_factor if node.name in self.h100 else 1.0)
                compute = base * self.compute.get(node.name, lambda _: 1.0)(end)
                extra = sum(self.data.get(key, lambda _: 0.0)(end) for key in (node.name, "*"))
                for _ in range(8):
                    c = compute * self.rng.lognormal(0.0, self.sigma)
                    d = (0.1 + extra) * self.rng.lognormal(0.0, self.sigma)
                    rows.append((node.name, c, d))
            slowest = max(c + d for _, c, d in rows)
            for rank, (_, c, d) in enumerate(rows):
                out.append(RankSummary(job="job", rank=rank, gpu=rank % 8, window_seconds=WINDOW, window_end_ts=end,
                                       steps=3, last_step=int(end), last_progress_ts=end, compute_seconds_p50=c,
                                       data_seconds_p50=d, comm_seconds_p50=slowest - (c + d) + 0.1))
            self._windows[end] = out
        return self._windows[end]

    def run(self, seconds: float, config: StragglerConfig | None = None) -> list[tuple[float, list[Finding]]]:
        """Every node reports each interval with its latest complete window; [(t, findings)]."""
        detector = StragglerDetector(config or StragglerConfig())
        fleet = Fleet()
        interval = self.nodes[0].interval
        out = []
        t = interval
        while t <= seconds:
            end = math.floor(t / WINDOW) * WINDOW
            ranks = self._window(end)
            for i, node in enumerate(self.nodes):
                if (node.name, end) in self.skip:
                    node.ranks = []
                    continue
                node.ranks = ranks[i * 8:(i + 1) * 8]
                fleet.ingest(node.report(t), t)
            out.append((t, detector.evaluate(fleet.view(), t)))
            t += interval
        return out


def from_(start: float, value: float, before: float = 0.0) -> Callable[[float], float]:
    """``value`` for windows ending at ``start`` or later, else ``before``."""
    return lambda end: value if end >= start else before


def removals(found: list[tuple[float, list[Finding]]]) -> dict[str, float]:
    """node -> time of its first drain."""
    out: dict[str, float] = {}
    for t, findings in found:
        for f in findings:
            if f.action is Action.DRAIN:
                out.setdefault(f.node, t)
    return out


def kinds(found: list[tuple[float, list[Finding]]], action: Action) -> list[Finding]:
    return [f for _, fs in found for f in fs if f.action is action]


# The data phase ---------------------------------------------------------------------------------

def test_a_node_waiting_for_data_is_drained_within_30_s_and_alone():
    job = Job(32)
    job.data["n011"] = from_(30.0, 0.7)  # its ranks wait 0.7 s more per step for data (compute alike)
    found = job.run(90.0)
    assert list(removals(found)) == ["n011"]
    assert removals(found)["n011"] - 25.0 <= 30.0  # the first slow window is [25, 30)
    drain = kinds(found, Action.DRAIN)[0]
    assert drain.evidence["signal"] == "compute_plus_data_seconds_p50"
    assert abs(drain.evidence["data_excess_seconds"] - 0.7) < 0.05
    assert abs(drain.evidence["compute_excess_seconds"]) < 0.05
    assert "data +0.7" in drain.reason


def test_a_job_wide_data_stall_drains_nobody():
    job = Job(32, seed=1)
    job.data["*"] = from_(30.0, 1.5)  # every rank waits 1.5 s more (a slow shared filesystem)
    found = job.run(120.0)
    assert [f for _, fs in found for f in fs] == []


def test_a_whole_job_slowdown_drains_nobody():
    job = Job(32, seed=2)
    for node in job.nodes:
        job.compute[node.name] = from_(30.0, 1.25, 1.0)
    assert [f for _, fs in job.run(120.0) for f in fs] == []


# Peers by hardware class ------------------------------------------------------------------------

def test_a_class_slower_by_design_is_observed_once_and_never_drained():
    # 8 H100 nodes of 64 (12.5%: more than the 10% outlier share, so not even "job-wide" hides
    # them window by window; 6 of 64 would all be flagged) computing 12% longer by design.
    job = Job(64, h100=8)
    found = job.run(120.0)
    assert removals(found) == {}
    assert kinds(found, Action.ALERT) == []
    [observed] = kinds(found, Action.OBSERVE)
    assert observed.evidence["hardware_class"].startswith(H100) and observed.evidence["class_nodes"] == 8
    assert observed.evidence["reference_class"].startswith(H200) and observed.evidence["reference_nodes"] == 56
    assert 0.09 < observed.evidence["class_excess_ratio"] < 0.13
    assert observed.evidence["too_few_to_judge"] is False


def test_without_classes_the_minority_hardware_is_drained():
    # The lookalike's other side, proving the test above can fail: one job, one class, 6 of 64
    # nodes 12% slower by design are all drained.
    job = Job(64, h100=6)
    found = job.run(60.0, StragglerConfig(by_hardware_class=False))
    assert set(removals(found)) == {f"n{i:03d}" for i in range(58, 64)}
    assert removals(Job(64, h100=6).run(60.0)) == {}


def test_a_class_too_small_to_judge_is_not_judged_and_is_said_once():
    job = Job(20, h100=2)
    found = job.run(120.0)
    assert removals(found) == {}
    [observed] = kinds(found, Action.OBSERVE)
    assert observed.evidence["too_few_to_judge"] is True and observed.evidence["class_nodes"] == 2
    assert "does not judge them" in observed.reason


def test_a_slow_node_of_the_majority_class_is_drained_in_a_mixed_job():
    job = Job(40, h100=8, seed=3)
    job.compute["n017"] = from_(30.0, 1.10, 1.0)  # an H200 10% slow, still faster than the H100s
    found = job.run(90.0)
    assert list(removals(found)) == ["n017"]
    assert removals(found)["n017"] - 25.0 <= 30.0
    drain = kinds(found, Action.DRAIN)[0]
    assert drain.evidence["hardware_class"].startswith(H200) and drain.evidence["class_nodes"] == 32


def test_a_slow_node_of_the_minority_class_is_drained_within_its_class():
    job = Job(40, h100=8, seed=4)
    job.compute["n035"] = from_(30.0, 1.10, 1.0)  # an H100 10% slower than the H100s
    assert list(removals(job.run(90.0))) == ["n035"]


def test_the_outlier_guard_is_per_class():
    # Two of the 10 H100 nodes slow: more than 10% of their class (one allowed): class-wide, nobody.
    job = Job(50, h100=10, seed=5)
    job.compute["n041"] = job.compute["n042"] = from_(30.0, 1.3, 1.0)
    assert removals(job.run(90.0)) == {}
    # One of them: its own fault.
    job = Job(50, h100=10, seed=5)
    job.compute["n041"] = from_(30.0, 1.3, 1.0)
    assert list(removals(job.run(90.0))) == ["n041"]


# Windows without data ---------------------------------------------------------------------------

def test_reports_slower_than_the_window_drain_on_the_short_horizon():
    # Agents reporting every 10 s send every other 5 s window: the windows between carry no data
    # of anyone. They neither break nor extend the run: three judged windows, not 18 of 30 min.
    job = Job(32, interval=10.0, seed=6)
    job.compute["n013"] = from_(30.0, 1.10, 1.0)
    found = job.run(200.0)
    assert list(removals(found)) == ["n013"]
    assert removals(found)["n013"] - 25.0 <= 45.0
    drain = kinds(found, Action.DRAIN)[0]
    assert drain.evidence["horizon"] == "short" and drain.evidence["windows"] == 3


def test_a_window_without_the_nodes_data_does_not_extend_the_run():
    # Slow in the windows ending at 30 and 35, its summary of 40 lost, healthy from 45: two
    # judged windows, not three.
    job = Job(16, seed=7)
    job.compute["n003"] = lambda end: 1.3 if 30.0 <= end < 45.0 else 1.0
    job.skip.add(("n003", 40.0))
    assert removals(job.run(80.0)) == {}
    # the same with its summary of 40 delivered (slow): three in a row, drained
    job = Job(16, seed=7)
    job.compute["n003"] = lambda end: 1.3 if 30.0 <= end < 45.0 else 1.0
    assert list(removals(job.run(80.0))) == ["n003"]


def test_a_window_without_the_nodes_data_does_not_break_the_run():
    # Slow from the window ending at 30, its summary of 40 lost: drained when the window ending at
    # 45 is judged, on three judged windows (30, 35, 45).
    job = Job(16, seed=8)
    job.compute["n003"] = from_(30.0, 1.3, 1.0)
    job.skip.add(("n003", 40.0))
    found = job.run(80.0)
    assert list(removals(found)) == ["n003"]
    assert kinds(found, Action.DRAIN)[0].evidence["windows"] == 3
    assert all(f.node != "n003" for t, fs in found if t < 45.0 for f in fs)


def test_a_judged_healthy_window_breaks_the_run():
    job = Job(16, seed=9)
    # slow in the windows ending at 30, 35 | 45, 50 | 60, 65: never three judged in a row
    job.compute["n003"] = lambda end: 1.0 if end < 30.0 or end in (40.0, 55.0, 70.0) else 1.3
    assert removals(job.run(80.0)) == {}
