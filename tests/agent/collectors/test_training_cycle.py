"""The training collector's cycle (``collect``: eviction, trim, watch and summary in one pass per
rank, the rank's last summary reused or copied while what it is built from is unchanged) against
the long way: the separate passes, every window computed afresh and every summary built by
``RankSummary``'s own constructor, over randomized evolving input (sparse and bursty heartbeat
streams, random cycle times, processes that die and restart, checkpoints, phases, application
signals, hangs and evictions)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.agent.collectors.test_training import T0, FakeProcesses
from tests.agent.collectors.test_training_window import _reference
from vigil.agent.attribution import IN_PROCESS
from vigil.agent.collectors.training import TrainingCollector, TrainingConfig, _Rank
from vigil.agent.metric import Sample
from vigil.contract.wire import Event, RankSummary, encode


def _summary_afresh(c: TrainingCollector, r: _Rank, end: float) -> RankSummary:
    fields = _reference(r, end)
    ckpt = r.checkpoint
    if ckpt is not None:
        fields.update(checkpoint_step=ckpt.step, checkpoint_ts=ckpt.ts, checkpoint_seconds=ckpt.seconds)
    return RankSummary(job=r.job, rank=r.rank, gpu=r.gpu, pid=r.pid, state=r.state,
                       window_seconds=c.config.window_seconds, window_end_ts=end, last_step=r.last.step,
                       last_progress_ts=r.last_progress_ts, phase=r.last.phase, **fields)  # type: ignore[arg-type]


def _collect_long_way(c: TrainingCollector, now: float) -> tuple[list[RankSummary], list[Event], list[Sample]]:
    """``collect`` as separate passes over every rank: evict, then trim and watch, then summarise
    each rank from scratch (no reused window, summary or sample)."""
    events: list[Event] = []
    start, end = c._window(now)
    config = c.config
    for key, r in list(c._ranks.items()):
        idle = now - r.last_seen_ts
        if idle < config.evict_after_seconds or idle < max(config.evict_after_seconds, 2 * c._hang_threshold(r)):
            continue
        if r.pid is not None and r.state != "exited" and c._pid_alive(r.pid):
            continue
        del c._ranks[key]
        c._evicted += 1
    ranks = list(c._ranks.values())
    for r in ranks:
        c._trim(r, start)
        alive = True if r.pid is None else c._pid_alive(r.pid)
        c._watch(r, now, events, alive)
    summaries = [_summary_afresh(c, r, end) for r in ranks]
    for r in ranks:
        r.window = r.sampled = r.window_samples = None
    samples = c._samples(ranks, summaries)
    tracked = {r.job for r in ranks}
    for job in [j for j in c._names if j not in tracked]:
        del c._names[job]
    return summaries, events, samples


def _heartbeat(rng: random.Random, rank: int, step: int, pid: int, phase: str | None) -> bytes:
    body: dict[str, Any] = {"job": f"j{rank % 3}", "rank": rank, "step": step, "gpu": rank % 8, "pid": pid,
                            "step_seconds": rng.choice((0.0, rng.uniform(0.5, 4.0)))}
    if rng.random() < 0.8:
        body.update(compute_seconds=rng.uniform(0, 3), comm_seconds=rng.uniform(0, 1))
    if rng.random() < 0.4:
        body["data_seconds"] = rng.uniform(0, 0.1)
    if phase is not None:
        body["phase"] = phase
    if rng.random() < 0.1:
        body["loss"] = rng.choice((rng.uniform(0, 5), "nan"))
    if rng.random() < 0.1:
        body["grad_norm"] = rng.choice((rng.uniform(0, 5), "inf"))
    return json.dumps(body).encode()


@pytest.mark.parametrize("seed", range(8))
def test_cycle_equals_the_long_way(seed: int) -> None:
    rng = random.Random(seed)
    config = {"window_seconds": rng.choice((2.5, 5.0, 10.0)), "hang_seconds": 20.0, "evict_after_seconds": 40.0,
              "max_steps_per_rank": rng.choice((16, 2048))}
    ranks = 12
    pids = {rank: 1000 + rank for rank in range(ranks)}
    procs = FakeProcesses(*pids.values())
    fast, slow = (TrainingCollector(TrainingConfig.model_validate(config), pid_alive=procs) for _ in range(2))
    lean = TrainingCollector(TrainingConfig.model_validate(config), pid_alive=procs, samples=False)
    steps = dict.fromkeys(range(ranks), 0)
    period = {rank: rng.choice((0.5, 2.0, 3.4, 4.5, 12.0)) for rank in range(ranks)}
    silent_until = dict.fromkeys(range(ranks), 0.0)
    saving: dict[int, bool] = dict.fromkeys(range(ranks), False)
    now = T0
    reused = copied = compared = with_events = 0
    for _ in range(250):
        cycle = rng.choice((0.4, 2.5, 2.5, 2.5, 10.0, rng.uniform(0.1, 15.0)))
        beats: list[tuple[float, bytes]] = []
        for rank in range(ranks):
            if rng.random() < 0.02:  # a rank falls silent for a while: a hang, an eviction
                silent_until[rank] = now + rng.uniform(10, 120)
            ts = now + rng.uniform(0, period[rank])
            while ts < now + cycle:
                if ts >= silent_until[rank]:
                    phase: str | None = None
                    if saving[rank]:
                        saving[rank] = rng.random() < 0.5
                        phase = "checkpointing" if saving[rank] else rng.choice((None, "training"))
                    elif rng.random() < 0.05:
                        saving[rank] = True
                        phase = "checkpointing"
                    elif rng.random() < 0.03:
                        phase = "evaluating"
                    elif rng.random() < 0.03:
                        steps[rank] = max(0, steps[rank] - rng.randrange(1, 5))  # a restart from a checkpoint
                    else:
                        steps[rank] += rng.choice((0, 1, 1, 1, 2))
                    beats.append((ts, _heartbeat(rng, rank, steps[rank], pids[rank], phase)))
                ts += period[rank] * rng.uniform(0.7, 1.3)
        beats.sort(key=lambda b: b[0])
        for ts, payload in beats:
            got = fast.ingest(payload, ts, IN_PROCESS)
            assert slow.ingest(payload, ts, IN_PROCESS) == got == lean.ingest(payload, ts, IN_PROCESS)
        now += cycle
        if rng.random() < 0.03:  # the clock steps back
            now -= rng.uniform(0.1, 3.0)
        for rank in range(ranks):
            if rng.random() < 0.01:  # the process dies; sometimes it restarts under a new pid
                procs.alive.discard(pids[rank])
                if rng.random() < 0.5:
                    pids[rank] += 100
                    procs.alive.add(pids[rank])
        before = {key: (r.summary, r.summary_of) for key, r in fast._ranks.items()}
        collection = fast.collect(now)
        summaries, events, samples = _collect_long_way(slow, now)
        assert collection.report["ranks"] == summaries
        assert [encode(s) for s in collection.report["ranks"]] == [encode(s) for s in summaries]
        assert collection.events == events
        assert collection.samples == samples
        lean_collection = lean.collect(now)
        assert lean_collection.report == collection.report and lean_collection.events == events
        assert fast._ranks.keys() == slow._ranks.keys() and fast._evicted == slow._evicted
        assert fast._names == slow._names
        for key, r in fast._ranks.items():
            was, was_of = before.get(key, (None, None))
            reused += was is not None and r.summary is was
            copied += was_of is not None and r.summary is not was and r.summary_of is not None \
                and r.summary_of[0] is was_of[0]
        compared += len(summaries)
        with_events += bool(events)
    # The shortcuts were taken, and against what matters: a summary reused whole, one copied with
    # the rank's own fields, and cycles that raised hangs and exits.
    assert reused > 50 and copied > 50 and with_events > 3 and compared > 1500


@pytest.mark.parametrize(("stalled", "state"), [(19.0, "running"), (20.0, "hung"), (21.0, "hung")])
def test_a_stall_of_exactly_hang_seconds_is_a_hang(stalled: float, state: str) -> None:
    """The cycle's shortcut for a rank that is not stalled long enough keeps _watch's boundary."""
    c = TrainingCollector(TrainingConfig(hang_seconds=20.0), pid_alive=FakeProcesses(7))
    payload = json.dumps({"job": "j", "rank": 0, "step": 5, "step_seconds": 1.0, "pid": 7}).encode()
    assert c.ingest(payload, T0, IN_PROCESS) is None
    collection = c.collect(T0 + stalled)
    assert collection.report["ranks"][0].state == state
    assert [e.kind for e in collection.events] == ([] if state == "running" else ["hang"])


class _FailsOnce:
    """pid_alive seam: every pid lives, but the check of ``pid`` raises the first time."""

    def __init__(self, pid: int) -> None:
        self.pid: int | None = pid

    def __call__(self, pid: int) -> bool:
        if pid == self.pid:
            self.pid = None
            raise OSError("process table unreadable")
        return True


def test_a_failed_eviction_check_loses_no_hang() -> None:
    """Eviction's pid check raises (the cycle fails) before any rank's hang is marked reported:
    the next cycle still reports it."""
    c = TrainingCollector(TrainingConfig(hang_seconds=20.0, evict_after_seconds=40.0), pid_alive=_FailsOnce(8))
    stalled = json.dumps({"job": "j", "rank": 0, "step": 5, "step_seconds": 1.0, "pid": 7}).encode()
    idle = json.dumps({"job": "j", "rank": 1, "step": 5, "step_seconds": 1.0, "pid": 8}).encode()
    assert c.ingest(stalled, T0, IN_PROCESS) is None and c.ingest(idle, T0, IN_PROCESS) is None
    assert c.ingest(stalled, T0 + 30.0, IN_PROCESS) is None  # heard from, not advancing: hung, not idle
    with pytest.raises(OSError):
        c.collect(T0 + 45.0)  # rank 1 is idle past evict_after: its pid check raises
    collection = c.collect(T0 + 47.5)
    assert sorted((e.kind, e.rank) for e in collection.events) == [("hang", 0), ("hang", 1)]
