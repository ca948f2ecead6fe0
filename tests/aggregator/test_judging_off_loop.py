"""Judging off the event loop, the loop's lag, and departed nodes leaving memory: a slow detector
on the judging thread never holds intake (a report posted meanwhile gets its 202, is held, and is
ingested once the detectors are done); the lag probe measures how late its timer fires; a node
silent past ``fleet.forget_after_seconds`` leaves the fleet, its job's ranks and memory, a node
inside the window never does; each garbage collection's pause is timed."""

from __future__ import annotations

import asyncio
import gc
import threading
import tracemalloc
from collections.abc import Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import FakeNode, proposals_ledger, set_training
from vigil.aggregator.app import EVALUATE_KEY, METRICS_KEY, make_app, measure_loop_lag, timing_gc_pauses
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet, FleetConfig, FleetView
from vigil.aggregator.metrics import AggregatorMetrics
from vigil.contract.wire import Report, encode

SECRET = b"site-secret-of-the-judging-test-0123456789"
T0 = 1_800_000_000.0
# Bounds on waiting for the other thread (never reached when the code works).
WAIT_SECONDS = 10.0
POLL_SECONDS = 0.01


class BlockingDetector:
    """Blocks in ``evaluate`` (on the judging thread) until the test releases it, then finds
    every node it sees worth an alert."""

    name = "blocking"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(WAIT_SECONDS), "the test never released the detector"
        return [Finding(detector=self.name, node=name, action=Action.ALERT, reason="test", since=now)
                for name in sorted(view.nodes)]


async def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) for something the other thread or a background task does."""
    for _ in range(int(WAIT_SECONDS / POLL_SECONDS)):
        if condition():
            return
        await asyncio.sleep(POLL_SECONDS)
    raise AssertionError("condition not met in time")


def auth(node: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {node_token(SECRET, node)}", "Content-Type": "application/json"}


async def test_a_slow_detector_never_holds_intake_and_its_findings_go_through_the_sink() -> None:
    now = [T0]
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    detector = BlockingDetector()
    engine = Engine(config, sink, detectors=[detector])
    app = make_app(config, engine, sink, clock=lambda: now[0], credentials=Credentials(site_secret=SECRET))
    metrics = app[METRICS_KEY]
    a, b = FakeNode("a"), FakeNode("b")
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        # An urgent report wakes the periodic evaluation, which judges on its own thread.
        resp = await client.post("/v1/reports", data=encode(a.report(T0, urgent=True)), headers=auth("a"))
        assert resp.status == 202
        assert await asyncio.to_thread(detector.entered.wait, WAIT_SECONDS)
        # The detector is still running: intake answers, and holds the report back from the fleet.
        resp = await client.post("/v1/reports", data=encode(b.report(T0)), headers=auth("b"))
        assert resp.status == 202
        assert set(engine.fleet.view().nodes) == {"a"}
        assert metrics.held_reports.value == 1
        assert (await client.get("/healthz")).status == 200
        assert not sink.recent(10)
        detector.release.set()
        await until(lambda: bool(sink.recent(10)))
        # The findings came back to the loop and through the sink; the held report is in.
        assert [(d.node, d.detector) for d in sink.recent(10)] == [("a", "blocking")]
        await until(lambda: set(engine.fleet.view().nodes) == {"a", "b"})
        assert detector.threads == ["vigil-judge_0"]
        # A synchronous evaluation (the simulator's and the tests' way) judges on the caller's thread.
        now[0] = T0 + 1
        app[EVALUATE_KEY]()
        assert detector.threads[-1] == threading.current_thread().name
        assert {d.node for d in sink.recent(10)} == {"a", "b"}


async def test_the_lag_probe_records_how_late_its_timer_fires() -> None:
    metrics = AggregatorMetrics(dict)
    clock = [100.0]
    late = [0.375, 0.0, 0.125]  # exact in binary

    class Done(Exception):
        pass

    async def sleep(seconds: float) -> None:
        if not late:
            raise Done
        clock[0] += seconds + late.pop(0)

    with pytest.raises(Done):
        await measure_loop_lag(metrics, period_seconds=0.5, monotonic=lambda: clock[0], sleep=sleep)
    assert metrics.loop_lag._value.get() == 0.125
    text = metrics.render().decode()
    assert "vigil_aggregator_event_loop_lag_observed_seconds_count 3.0" in text
    assert "vigil_aggregator_event_loop_lag_observed_seconds_sum 0.5" in text
    assert 'vigil_aggregator_event_loop_lag_observed_seconds_bucket{le="0.25"} 2.0' in text


async def test_the_service_exposes_its_loop_lag_and_keeps_measuring_it() -> None:
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    app = make_app(config, Engine(config, sink), sink, credentials=Credentials(site_secret=SECRET))
    histogram = app[METRICS_KEY].loop_lag_observed

    def count() -> float:
        return next(s.value for s in next(iter(histogram.collect())).samples if s.name.endswith("_count"))

    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        await until(lambda: count() >= 2)  # the real 0.25 s timer, twice
        text = await (await client.get("/metrics")).text()
    assert "vigil_aggregator_event_loop_lag_seconds " in text
    assert "vigil_aggregator_event_loop_lag_observed_seconds_count" in text


def test_each_garbage_collection_pause_is_timed_by_generation_while_open() -> None:
    metrics = AggregatorMetrics(dict)
    ticks = iter(range(1_000_000))
    step_seconds = 0.125  # exact in binary: every pause reads as one step of this clock

    def observed(generation: str) -> tuple[float, float]:
        text = metrics.render().decode()
        get = lambda s: float(text.split(f'vigil_aggregator_gc_pause_seconds_{s}{{generation="{generation}"}} ')[1]  # noqa: E731
                              .split("\n")[0])
        return get("count"), get("sum")

    with timing_gc_pauses(metrics, clock=lambda: next(ticks) * step_seconds):
        gc.collect(0)
        gc.collect(2)
    for generation in ("0", "2"):
        count, total = observed(generation)
        assert count >= 1  # others may have run meanwhile, each timed the same way
        assert total == count * step_seconds
    after = observed("2")
    gc.collect(2)
    assert observed("2") == after  # closed: no longer timed


async def test_the_service_times_its_garbage_collections() -> None:
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    app = make_app(config, Engine(config, sink), sink, credentials=Credentials(site_secret=SECRET))

    def full_collections(text: str) -> float:
        return float(text.split('vigil_aggregator_gc_pause_seconds_count{generation="2"} ')[1].split("\n")[0])

    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        before = full_collections(await (await client.get("/metrics")).text())
        gc.collect()
        after = full_collections(await (await client.get("/metrics")).text())
    assert after >= before + 1
    gc.collect()
    assert full_collections(app[METRICS_KEY].render().decode()) == after  # the server stopped: no longer timed


def test_forget_after_removes_a_departed_node_and_its_ranks_never_a_node_inside_the_window() -> None:
    fleet = Fleet(FleetConfig(forget_after_seconds=3600))
    gone, kept = FakeNode("gone"), FakeNode("kept")
    set_training([gone, kept], "job-1", T0)
    fleet.ingest(gone.report(T0), T0)
    fleet.ingest(kept.report(T0), T0)
    assert len(fleet.view().jobs["job-1"].ranks) == 16
    # "kept" reports again at the last moment; "gone" falls silent.
    fleet.ingest(kept.report(T0 + 3599), T0 + 3599)
    assert fleet.forget_departed(T0 + 3600) == []  # exactly at the horizon: still a member
    assert [n.name for n in fleet.forget_departed(T0 + 3601)] == ["gone"]
    view = fleet.view()
    assert set(view.nodes) == {"kept"}
    assert {r.node for r in view.jobs["job-1"].ranks.values()} == {"kept"}
    assert len(view.jobs["job-1"].ranks) == 8
    # Inside the window, however long a node has been silent, it stays (it is still judged).
    assert fleet.forget_departed(T0 + 3599 + 3599) == []
    assert set(fleet.view().nodes) == {"kept"}


def test_departed_nodes_leave_memory() -> None:
    fleet = Fleet(FleetConfig(forget_after_seconds=3600))
    nodes = [FakeNode(f"n{i:03d}") for i in range(40)]
    set_training(nodes, "job-1", T0)
    fleet.ingest(FakeNode("stays").report(T0), T0)  # the first node's one-off allocations
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4):
            for node in nodes:
                fleet.ingest(node.report(T0 + 2.5 * i), T0 + 2.5 * i)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        fleet.ingest(FakeNode("stays").report(T0 + 3600), T0 + 3600)
        assert len(fleet.forget_departed(T0 + 3611)) == len(nodes)
        fleet.forget_idle_jobs(T0 + 3611 + 3600)  # the job none of whose ranks report any more
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held > 40 * 20_000  # the nodes did take memory (tens of KiB each) ...
    assert left < held / 20  # ... and gave it back


class BrokenIngestEngine(Engine):
    """An engine whose ingest has a defect for one node's reports (the fake of an aggregator bug)."""

    def __init__(self, *args: object, broken: str, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.broken = broken

    def ingest(self, report: Report, now: float) -> None:
        if report.node == self.broken:
            raise RuntimeError("a defect in the fleet update")
        super().ingest(report, now)


async def test_a_report_failing_to_enter_the_fleet_is_counted_and_stops_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """Held while the detectors read, a report whose ingest fails is logged and counted, and the
    reports held after it still enter the fleet, and judging goes on; taken at once, it is
    answered 500 (not accepted) with the same count."""
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    detector = BlockingDetector()
    engine = BrokenIngestEngine(config, sink, detectors=[detector], broken="bad")
    app = make_app(config, engine, sink, clock=lambda: T0, credentials=Credentials(site_secret=SECRET))
    metrics = app[METRICS_KEY]
    a, bad, c = FakeNode("a"), FakeNode("bad"), FakeNode("c")
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.post("/v1/reports", data=encode(a.report(T0, urgent=True)), headers=auth("a"))
        assert resp.status == 202
        assert await asyncio.to_thread(detector.entered.wait, WAIT_SECONDS)
        for node in (bad, c):  # held, in this order, behind the detectors
            resp = await client.post("/v1/reports", data=encode(node.report(T0)), headers=auth(node.name))
            assert resp.status == 202
        detector.release.set()
        await until(lambda: "c" in engine.fleet.view().nodes)
        assert set(engine.fleet.view().nodes) == {"a", "c"}
        assert metrics.ingest_failures._value.get() == 1
        assert "report 1 of node bad (boot boot-bad-1, version 3) failed to enter the fleet" in caplog.text
        # Judging goes on: the next urgent report wakes another evaluation.
        detector.entered.clear()
        resp = await client.post("/v1/reports", data=encode(a.report(T0, urgent=True)), headers=auth("a"))
        assert resp.status == 202
        assert await asyncio.to_thread(detector.entered.wait, WAIT_SECONDS)
        await until(lambda: engine.fleet.view().nodes["a"].reports == 2)
        # Taken at once (nothing held): not accepted.
        resp = await client.post("/v1/reports", data=encode(bad.report(T0)), headers=auth("bad"))
        assert resp.status == 500
        assert (await resp.json())["error"] == "ingest_failed"
        assert metrics.ingest_failures._value.get() == 2
        assert "vigil_aggregator_ingest_failures_total 2.0" in metrics.render().decode()
