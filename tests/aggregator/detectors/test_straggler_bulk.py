"""The straggler detector's bulk reading of a window (issue 47: each rank's entry picked with C-level
reads, each node's statistics from slices of the job's columns) gives exactly the node statistics
the long way (rank by rank, on a view without markers) gives, over a randomized fleet whose ranks'
window ends do not line up with the judged windows, skip windows, repeat, or lack a phase, and
whose nodes hold different numbers of ranks; and over the window bounds' edges."""

from __future__ import annotations

import math
import random

import pytest

from vigil.aggregator.detectors.straggler import StragglerConfig, StragglerDetector, _window_ends
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import RankSummary, Report

WIDTH = 5.0
INTERVAL = 2.5


def _report(rng: random.Random, n: int, seq: int, t: float, ranks: int, mode: str) -> Report:
    """``mode``: "mixed" (phases and waits missing at random, steps 0 now and then), "uniform" (every
    rank with a data phase and a collective wait), "no_data" (no rank with a data phase)."""
    uniform = mode != "mixed"
    odd = 0.1 if mode == "mixed" else 0.01
    out = []
    data_everywhere = rng.random() < 0.5
    for k in range(ranks):
        # A node's ranks end their windows near each other, off the judged grid, now and then
        # a window late, early, repeated or exactly on a boundary.
        end = WIDTH * math.floor(t / WIDTH) + (0.7 * n % WIDTH) - WIDTH
        roll = rng.random()
        if roll < odd:
            end -= WIDTH
        elif roll < 1.5 * odd:
            end = WIDTH * math.floor(t / WIDTH)
        elif roll < 2 * odd:
            end = math.nextafter(WIDTH * math.floor(t / WIDTH), -math.inf)
        compute = 1.0 + 0.01 * rng.uniform(-1, 1) + (0.2 if n == 3 else 0.0)
        data = 0.05 * rng.random() if (data_everywhere or rng.random() < 0.5) and rng.random() < 0.9 else None
        out.append(RankSummary(
            job="j", rank=n * 4 + k, gpu=k, state="running", window_seconds=WIDTH, window_end_ts=end,
            steps=rng.choice((0, 1, 3, 3, 3) if not uniform else (1, 3, 3)), last_step=seq, last_progress_ts=t,
            step_seconds_p50=compute + 0.2, compute_seconds_p50=compute,
            comm_seconds_p50=None if not uniform and rng.random() < 0.05 else 0.2 * rng.random(),
            data_seconds_p50=data if not uniform else None if mode == "no_data" else 0.01 * rng.random()))
    return Report(node=f"n{n:02d}", boot_id=f"boot-{n}", seq=seq, ts=t, interval_seconds=INTERVAL, ranks=out)


@pytest.mark.parametrize(("seed", "mode", "per_node"),
                         [(1, "mixed", 0), (2, "mixed", 0), (3, "uniform", 4), (4, "uniform", 3), (5, "no_data", 4),
                          (6, "no_data", 0), (7, "uniform", 1)])
def test_bulk_node_statistics_are_the_long_ways(seed: int, mode: str, per_node: int) -> None:
    rng = random.Random(seed)
    fleet = Fleet()
    fast, slow = StragglerDetector(StragglerConfig()), StragglerDetector(StragglerConfig())
    nodes = 10
    ranks = {n: per_node or rng.choice((1, 2, 4)) for n in range(nodes)}
    compared = 0
    t = 1000.0
    for seq in range(1, 80):
        t += INTERVAL
        for n in range(nodes):
            if mode != "mixed" or rng.random() < 0.9:  # a report lost: its ranks stay a window behind
                fleet.ingest(_report(rng, n, seq, t + 0.2 * n, ranks[n], mode), t + 0.2 * n)
        view = fleet.view()
        fast.evaluate(view, t + 2.0)
        slow.evaluate(view.without_markers(), t + 2.0)
        job = view.jobs["j"]
        now_index = math.floor(t / WIDTH)
        for index in range(now_index - 4, now_index + 2):
            before = fast.bulk_windows
            got = fast._node_stats(job, index, WIDTH)
            assert fast.bulk_windows == before + 1  # the bulk reading was taken ...
            assert got == slow._node_stats(job, index, WIDTH)  # ... and found what the long way finds
            assert list(got) == list(slow._node_stats(job, index, WIDTH))
            compared += len(got)
    assert compared > 1000


@pytest.mark.parametrize("width", [5.0, 0.1, 3.0, 7.3, 1e-3])
def test_window_ends_bound_the_long_ways_test(width: float) -> None:
    rng = random.Random(int(width * 1000))
    for _ in range(300):
        index = rng.choice((1, 7, 200_000_000, 340_000_016, rng.randrange(1, 10**9)))
        lo, hi = _window_ends(index, width)
        for edge in (lo, hi):
            for e in (math.nextafter(edge, -math.inf), edge, math.nextafter(edge, math.inf)):
                x = e / width - 1e-9
                assert (index - 1 < x <= index) == (lo < e <= hi), (index, width, e)
