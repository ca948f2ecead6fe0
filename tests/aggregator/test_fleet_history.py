"""The fleet's per-entry histories (aggregator/fleet/history.py) keep what their plain definitions
say on their short paths: a rank's columns and window marker over summaries completed in place
(compact reports) or sent whole, the usual flags written without ``summary_flags``, a port's
activity read from the usual spellings without the general test, a counter read that moved nothing
taken without ``CounterBaseline.observe_values``. Each is held to the long way over randomized input."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings

from tests.aggregator.detectors.test_straggler_columns import assert_columns_mirror_ranks
from tests.aggregator.test_fleet_compact_property import _compact, _ingested, _wire, report_bodies
from vigil.aggregator.fleet import Fleet, JobState, port_is_active
from vigil.aggregator.fleet.history import (
    AER_COUNTERS,
    GPU_COUNTERS,
    CounterBaseline,
    GpuHistory,
    PortHistory,
    RankHistory,
    summary_flags,
)
from vigil.contract.wire import GpuState, PortState, RankSummary, Report


def _columns(job: JobState) -> tuple[Any, ...]:
    """Everything a job's columns hold, NaN compared by its bytes."""
    c = job.columns
    return ([(r.job, r.rank) for r in c.ranks], c.ends.tobytes(), c.owns.tobytes(), c.computes.tobytes(),
            c.comms.tobytes(), bytes(c.no_comm), c.steps, c.seen.tobytes(), c.marks.tobytes(), c.losses.tobytes(),
            c.progress.tobytes(), c.report_ts.tobytes(), bytes(c.flags), c.last_steps, c.window_seconds_changes)


@settings(max_examples=120, deadline=None)
@given(bodies=report_bodies())
def test_a_compact_chain_leaves_the_columns_and_window_marker_of_a_whole_one(bodies: list[dict[str, Any]]) -> None:
    """A compact summary is completed into the rank's held state in place, so ``observe`` is handed
    the state it holds: what it compares must not be read back from it."""
    reports = [_wire(b) for b in bodies]
    whole_jobs = _ingested(reports).view().jobs
    compact_jobs = _ingested(_compact(reports, 3)).view().jobs
    assert whole_jobs.keys() == compact_jobs.keys()
    for name, job in whole_jobs.items():
        assert_columns_mirror_ranks(job)
        assert_columns_mirror_ranks(compact_jobs[name])
        assert _columns(compact_jobs[name]) == _columns(job)
        assert {k: r.window_count for k, r in compact_jobs[name].ranks.items()} == \
            {k: r.window_count for k, r in job.ranks.items()}


def _report(seq: int, t: float, width: float) -> Report:
    return Report(node="n0", boot_id="b", seq=seq, ts=t, interval_seconds=2.5, ranks=[RankSummary(
        job="j", rank=0, window_seconds=width, window_end_ts=5.0 * (t // 5), steps=3, last_step=seq,
        last_progress_ts=t, step_seconds_p50=1.0)])


def test_a_compact_summary_that_changes_its_window_moves_the_window_marker() -> None:
    """The straggler detectors re-read a job's judged width only when this count moves: a compact
    report's summary widening its window left it still (the width stale) until a whole report."""
    fleet = Fleet()
    t = 1000.0
    fleet.ingest(_report(1, t, 5.0), t)
    for seq, width in ((2, 5.0), (3, 5.0), (4, 10.0), (5, 10.0), (6, 5.0)):
        t += 2.5
        sent = Report(node="n0", boot_id="b", seq=seq, ts=t, interval_seconds=2.5, base_seq=seq - 1, ranks=[
            RankSummary(job="j", rank=0, window_seconds=width, steps=3, last_step=seq, last_progress_ts=t)])
        assert fleet.refusal(sent, t) is None
        fleet.ingest(sent, t)
        rank = fleet.view().jobs["j"].ranks[0]
        assert rank.last.window_seconds == width and rank.last is rank.owned  # completed in place
    assert fleet.view().jobs["j"].columns.window_seconds_changes == 2


def _random_summary(rng: random.Random, step: int, t: float) -> dict[str, Any]:
    """A summary whose every flag input, window figure and column value varies (usually as a steady
    rank's: steps, a loss or none, running, no phase)."""
    odd = rng.random() < 0.3
    return dict(
        job="j", rank=0, window_seconds=rng.choice((5.0, 5.0, 10.0)),
        window_end_ts=rng.choice((5.0 * (t // 5), 5.0 * (t // 5), None, 5.0 * (t // 5) - 40)),
        steps=rng.choice((0, 3)) if odd else 3, last_step=step, last_progress_ts=t - rng.choice((0.0, 0.0, 30.0)),
        step_seconds_p50=rng.choice((1.0, None)), compute_seconds_p50=rng.choice((0.8, 0.8, None)),
        comm_seconds_p50=rng.choice((0.1, None)), data_seconds_p50=rng.choice((0.02, None)),
        loss_p50=rng.choice((2.0 + rng.random(), None)),
        nonfinite_steps=rng.choice((0, 0, 2)) if odd else 0, nonfinite_loss_steps=rng.choice((0, 1)) if odd else 0,
        state=rng.choice(("running", "running", "exited", "stopped")) if odd else "running",
        phase=rng.choice((None, None, "checkpointing")) if odd else None)


def test_a_ranks_columns_and_windows_follow_its_summaries_whether_new_or_completed_in_place() -> None:
    """The rank's slot, its windows and its window marker, written on the short paths (the flags'
    usual values tested, not computed), against the plain definitions, summary after summary,
    with the summary a new object or the held one changed in place (as the fleet completes them)."""
    rng = random.Random(47)
    ts, step = 1000.0, 0
    first = RankSummary(**_random_summary(rng, step, ts))
    rank = RankHistory(first, "n0", ts, maxlen=16)
    other = RankHistory(RankSummary(**_random_summary(rng, step, ts)), "n1", ts, maxlen=16)
    job = JobState("j")
    job.columns.take(other)  # a slot other than 0
    job.columns.take(rank)
    job.ranks = {0: rank, 1: other}
    held = first
    widths, windows = 0, [] if not rank.windows else list(rank.windows)
    for _ in range(3000):
        ts += 2.5
        step += 1
        fields = _random_summary(rng, step, ts)
        if rng.random() < 0.5:
            s = RankSummary(**fields)
        else:
            s = held  # changed in place: ``observe`` is handed the state it holds
            for name, value in fields.items():
                setattr(s, name, value)
        widths += s.window_seconds != rank.window_seconds
        offset = rng.choice((0.0, 0.0, 1.5))
        compute = s.compute_seconds_p50 if s.compute_seconds_p50 is not None else s.step_seconds_p50
        end = (s.window_end_ts - offset if s.window_end_ts is not None else ts)
        if s.steps > 0 and compute is not None and (not windows or windows[-1][0] < end):
            windows.append((end, compute, s.comm_seconds_p50, s.steps, s.data_seconds_p50))
        rank.observe(s, "n0", ts, ts - 0.5, offset)
        held = s
        assert job.columns.flags[rank.slot] == summary_flags(s)
        assert_columns_mirror_ranks(job)
        assert list(rank.windows) == windows[-16:] and rank.window_count == len(windows)
        assert job.columns.window_seconds_changes == widths
    assert widths > 100 and len(windows) > 100


def test_a_port_is_active_exactly_when_its_state_ends_in_active_whatever_the_case() -> None:
    rng = random.Random(5)
    texts = [None, "", "4: ACTIVE", "ACTIVE", "4: active", "Active", "1: DOWN", "2: INIT", "3: ARMED",
             "5: ACTIVE_DEFER", "INACTIVE", "4: ACTIVE ", "ACTIV", "4: ACTIVE\n"]
    texts += ["".join(rng.choice("aActiveIVE: 45") for _ in range(rng.randint(0, 10))) for _ in range(2000)]
    for text in texts:
        state = PortState(device="mlx5_0", port=1, state=text)
        assert port_is_active(state) == (text is not None and text.upper().endswith("ACTIVE")), text
        history = PortHistory(state, 0.0, 8, 8, None)
        history.observe(state, 1.0)
        assert history.samples[-1].active == port_is_active(state)
        assert history.active_this_boot == port_is_active(state)


def test_gpu_and_port_counter_reads_match_a_baseline_fed_the_same_values() -> None:
    """The histories answer a read that moved nothing themselves (CounterBaseline's first test,
    inlined): over counters that stay, rise, reset, go unread and come back, with the state new
    or changed in place, each read's answer and every increase are a plain baseline's."""
    rng = random.Random(11)
    gpu_state = GpuState(index=0, uuid="GPU-0")
    gpu = GpuHistory(gpu_state, 0.0, 64, 8)
    port_state = PortState(device="mlx5_0", port=1, state="4: ACTIVE", counters={"symbol_error": 0, "port_rcv_data": 0})
    port = PortHistory(port_state, 0.0, 64, 8, frozenset({"symbol_error", "link_downed"}))
    gpu_twin, port_twin = CounterBaseline(64), CounterBaseline(64)
    gpu_values: dict[str, int | None] = dict.fromkeys(GPU_COUNTERS, 0)
    port_values = {"symbol_error": 0, "port_rcv_data": 0, "link_downed": 0}
    moved = 0
    for k in range(1, 3000):
        ts = k * 2.5
        for name in GPU_COUNTERS:
            roll = rng.random()
            if roll < 0.03:
                gpu_values[name] = None
            elif roll < 0.06:
                gpu_values[name] = 0
            elif roll < 0.1:
                gpu_values[name] = (gpu_values[name] or 0) + rng.randint(1, 3)
        for name in port_values:
            if rng.random() < 0.08 and k not in (2199, 2200):
                port_values[name] = 0 if rng.random() < 0.2 else port_values[name] + rng.randint(1, 3)
        if k == 2199:  # then the judged names change while the values read stay: one of them rose
            port_values["symbol_error"] = port_values["link_downed"] + 5
        elif k == 2200:
            port_values["link_downed"] = port_values["symbol_error"]
        if rng.random() < 0.5:
            gpu_state = GpuState(index=0, uuid="GPU-0", **gpu_values)
        else:
            for name, value in gpu_values.items():
                setattr(gpu_state, name, value)
        counters = {n: v for n, v in port_values.items() if n != "link_downed" or k > 1000}  # a counter appears
        flags = {"link_downed": "saturated"} if 2000 < k < 2200 else \
            {"symbol_error": "saturated"} if 2200 <= k < 2400 else {}
        port_state = PortState(device="mlx5_0", port=1, state="4: ACTIVE", counters=counters, flags=flags)
        got = gpu.observe(gpu_state, ts)
        assert got == gpu_twin.observe_values(ts, GPU_COUNTERS, tuple(gpu_values[n] for n in GPU_COUNTERS))
        moved += got
        names = tuple(n for n in counters if n in {"symbol_error", "link_downed"} and flags.get(n) != "saturated")
        rose = port_twin.observe_values(ts, names, tuple(counters[n] for n in names))
        assert port.observe(port_state, ts) & 2 == (2 if rose else 0)
        for history, twin, names_all in ((gpu.counters, gpu_twin, GPU_COUNTERS), (port.counters, port_twin,
                                                                                   tuple(port_values))):
            assert (history.last_ts, history.last_increase_ts, history.resets) == \
                (twin.last_ts, twin.last_increase_ts, twin.resets)
            for name in names_all:
                assert history.increases_since(name, 0.0) == twin.increases_since(name, 0.0)
                assert history.covered_seconds(name, 0.0) == twin.covered_seconds(name, 0.0)
    assert moved > 100
    assert AER_COUNTERS  # the PCIe history's read is CounterBaseline's own, untouched here
