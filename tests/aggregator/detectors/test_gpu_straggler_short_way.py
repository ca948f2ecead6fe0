"""The GPU straggler detector's short ways (a pass whose newest ended window is judged already
reads no rank; the newest-window reading of a job whose ranks all report; a window whose every
rank's newest entry lies in it cut into columns whole) find exactly what the long way finds
(``LongWayGpuStraggler``: straggler.py's last_complete_window and the walk over every rank's
windows), every pass, over a randomized job that breaks them: nodes reporting at their own phase
(windows completing at different times), ranks leaving and joining, a rank that sends no
collective wait, a rank with a longer summary window, a node whose clock steps back, two
hardware classes that become one, lost reports, skipped passes and passes whose time goes backwards."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.aggregator.conftest import FakeNode
from tests.aggregator.detectors.test_incremental_gpu_side import LongWayGpuStraggler
from vigil.aggregator.detectors.gpu_straggler import (
    GpuStragglerConfig,
    GpuStragglerDetector,
    _JobMemo,
    _Roster,
    _sorted_mad,
    _sorted_median,
    _Window,
)
from vigil.aggregator.detectors.peer_class import HardwareClass
from vigil.aggregator.fleet import Fleet, FleetView, JobState
from vigil.contract.wire import RankSummary

WINDOW = 5.0
NODES = 12


class CountingGpuStraggler(GpuStragglerDetector):
    """The detector as it is, counting how often each short way was taken."""

    def __init__(self, config: GpuStragglerConfig) -> None:
        super().__init__(config)
        self.skipped = self.cut = self.walked = self.widths_kept = 0

    def _width(self, view: FleetView, job: JobState) -> float:
        held = self._widths.get(job.name)
        width = super()._width(view, job)
        self.widths_kept += held is not None and self._widths.get(job.name) is held
        return width

    def _judged_up_to_date(self, memo: _JobMemo, now: float) -> bool:
        up_to_date = super()._judged_up_to_date(memo, now)
        self.skipped += up_to_date
        return up_to_date

    def _newest_columns(self, view: FleetView, roster: _Roster, index: int, width: float,
                        now: float) -> dict[HardwareClass, _Window] | None:
        out = super()._newest_columns(view, roster, index, width, now)
        if out is None:
            self.walked += 1
        else:
            self.cut += 1
        return out


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_short_ways_find_what_the_long_way_finds_every_pass(seed: int) -> None:
    rng = random.Random(seed)
    nodes = [FakeNode(f"n{i:02d}", gpus=8, ports=0) for i in range(NODES)]
    for node in nodes[10:]:
        for g in node.gpus.values():
            g["power_limit_watts"] = 500.0  # a second hardware class (two nodes: 16 ranks)
    phase = {node.name: rng.uniform(0, 2.5) for node in nodes}  # each node's report time in the 2.5 s
    plan = {name: rng.uniform(40, 500) for name in ("slow", "leave", "join", "nocomm", "wide", "back", "drop",
                                                     "limit")}
    fleet = Fleet()
    short, long = CountingGpuStraggler(GpuStragglerConfig()), LongWayGpuStraggler(GpuStragglerConfig())
    found = 0
    now = 0.0
    t = 0.0
    while t < 700:
        reports = []
        if plan["limit"] <= t < plan["limit"] + 2.5:
            for node in nodes[10:]:
                for g in node.gpus.values():
                    g["power_limit_watts"] = 700.0  # one hardware class from now on, read within 30 s
        for ni, node in enumerate(nodes):
            at = t + phase[node.name]
            if rng.random() < 0.03:
                continue  # a lost report
            if ni == 9 and plan["drop"] <= at < plan["drop"] + 30:
                continue  # a node silent for 30 s: its ranks stop being live
            # The agent's aligned window; a node whose clock stepped back for a while repeats older ends.
            end = math.floor(at / WINDOW) * WINDOW - (10.0 if ni == 4 and plan["back"] <= at < plan["back"] + 20
                                                      else 0.0)
            node.ranks = []
            for local in range(8):
                rank = ni * 8 + local
                if ni == 2 and local == 5 and plan["leave"] <= at < plan["leave"] + 60:
                    continue  # a rank that left the job (its history stays until forgotten)
                if ni == 3 and local == 0 and at < plan["join"]:
                    continue  # a rank that joins late
                slow = (ni, local) == (6, 2) and plan["slow"] <= at < plan["slow"] + 120
                compute = (1.3 if slow else 1.0) * (1 + rng.uniform(-0.01, 0.01))
                nocomm = ni == 7 and local == 1 and plan["nocomm"] <= at < plan["nocomm"] + 40
                # A rank whose summary window is longer for a while, and the late rank's first 20 s.
                wide = ((ni == 8 and local == 7 and plan["wide"] <= at < plan["wide"] + 30)
                        or (ni == 3 and local == 0 and at < plan["join"] + 20))
                node.ranks.append(RankSummary(
                    job="j", rank=rank, gpu=local, pid=1000 + rank, window_seconds=10.0 if wide else WINDOW,
                    window_end_ts=end, steps=2, last_step=int(at), last_progress_ts=at,
                    step_seconds_p50=compute + 0.4, compute_seconds_p50=compute,
                    comm_seconds_p50=None if nocomm else (0.05 if slow else 0.4)))
            reports.append((at, node.report(at)))
        for at, report in sorted(reports, key=lambda r: r[0]):
            fleet.ingest(report, at)
            if rng.random() < 0.1:
                # A pass between two nodes' reports (some of a window in, some not), now and then
                # one whose time goes back a few seconds.
                now = at - (rng.uniform(0, 6) if rng.random() < 0.1 else 0.0)
                view = fleet.view()
                got = short.evaluate(view, now)
                assert got == long.evaluate(view, now)
                # The memory the findings grow from too: each class's spreads, each rank's run.
                assert {n: (m.last_judged, m.spreads, m.runs) for n, m in short._memo.items()} == {
                    n: (m.last_judged, m.spreads, m.runs) for n, m in long._memo.items()}
                found += len(got)
        t += 2.5
    assert found  # the slow rank was found the short way and the long way alike
    assert short.skipped and short.cut and short.walked and short.widths_kept  # each way was taken


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.0, 1.01, 1.1, 2.0, 1e-9, 3.3]) | st.floats(0, 10),
                min_size=1, max_size=40))
def test_the_deviations_middle_is_the_sorted_deviations_middle(values: list[float]) -> None:
    values.sort()
    med = statistics.median(values)
    assert _sorted_mad(values, med) == _sorted_median(sorted(abs(v - med) for v in values))
