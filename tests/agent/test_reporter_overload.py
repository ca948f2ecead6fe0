"""The agent's side of graceful overload (agent/reporter.py): its backoff on an injected jitter
source (never sooner than its cadence; what the aggregator's Retry-After asks after a shed answer;
doubling per failure otherwise, up to its ceiling; back to the cadence after a success); against
the real aggregator application behind a loopback front, a shed report (503 with Retry-After)
keeps the compact base, so the next report is compact and nothing is lost; a report whose answer
was lost, but which the aggregator took, is followed by compact reports only (the 409 delta_base
names it held), never a whole resend."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from tests.agent.test_report_versions import (
    NODE,
    SECRET,
    Seen,
    aggregator_app,
    node_snapshot,
    reporting,
    serving,
    xid,
)
from tests.loopback import free_port
from vigil.agent.reporter import BACKOFF_JITTER, Backoff, Reporter, retry_after
from vigil.agent.snapshot import Snapshot
from vigil.aggregator.auth import node_token


class Draws:
    """The jitter source: returns ``lo`` or ``hi`` of each draw as told, and records the bounds."""

    def __init__(self, pick_high: bool = False) -> None:
        self.pick_high = pick_high
        self.bounds: list[tuple[float, float]] = []

    def __call__(self, lo: float, hi: float) -> float:
        self.bounds.append((lo, hi))
        return hi if self.pick_high else lo


def test_backoff_starts_at_the_cadence_doubles_to_its_ceiling_and_resets_after_a_success() -> None:
    draws = Draws()
    b = Backoff(interval_seconds=2.5, max_seconds=60.0, uniform=draws)
    assert [b.failed() for _ in range(7)] == [2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert set(draws.bounds) == {(1.0, 1.0 + BACKOFF_JITTER)}  # jitter only ever lengthens a wait
    b.succeeded()
    assert b.failed() == 2.5


def test_backoff_waits_what_retry_after_asks_without_growing_bounded_and_jittered_above_it() -> None:
    b = Backoff(interval_seconds=2.5, max_seconds=60.0, uniform=Draws(pick_high=True))
    assert b.failed(retry_after_seconds=30.0) == 30.0 * (1 + BACKOFF_JITTER)
    # Shed again and again: the aggregator's word, not a doubling (a node must not look silent).
    assert [b.failed(retry_after_seconds=5.0) for _ in range(4)] == [5.0 * (1 + BACKOFF_JITTER)] * 4
    assert b.failed(retry_after_seconds=3600.0) == 60.0 * (1 + BACKOFF_JITTER)  # a hostile answer is bounded
    assert b.failed() == 60.0 * (1 + BACKOFF_JITTER)  # a timeout, the 7th failure in a row: the ceiling
    low = Backoff(interval_seconds=2.5, max_seconds=60.0, uniform=Draws())
    assert low.failed(retry_after_seconds=0.5) == 2.5  # a short Retry-After never beats the cadence
    assert low.failed() == 5.0  # an unguided failure after it doubles


def test_retry_after_reads_delay_seconds_only() -> None:
    assert retry_after("5") == 5.0 and retry_after(" 12 ") == 12.0
    assert retry_after(None) is None and retry_after("-1") is None and retry_after("1.5") is None
    assert retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None


def overloaded_front(seen: Seen, backend_url: str, shed: list[int], lose: list[int],
                     release: asyncio.Event) -> web.Application:
    """Loopback in front of the real aggregator: while ``shed[0]`` > 0 it answers 503 with
    Retry-After itself (nothing reaches the aggregator); while ``lose[0]`` > 0 it passes the report
    on and withholds the answer until ``release`` (the agent times out: an answer lost)."""

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if shed[0] > 0:
            shed[0] -= 1
            await seen.add(503, body)
            return web.json_response({"error": "overloaded", "detail": "test", "reason": "held_full",
                                      "retry_after_seconds": 1}, status=503, headers={"Retry-After": "1"})
        async with aiohttp.ClientSession() as session, session.post(
                backend_url + "/v1/reports", data=body, headers={"Authorization": request.headers["Authorization"]}
        ) as resp:
            answer = await resp.read()
        await seen.add(resp.status, body)
        if resp.status == 202 and lose[0] > 0:
            lose[0] -= 1
            await release.wait()
        return web.Response(status=resp.status, body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/reports", forward)
    return app


def overload_reporter(url: str, snap: Snapshot) -> Reporter:
    return Reporter(url=url, token=node_token(SECRET, NODE), node=NODE, boot_id="boot-1", topology={"rack": "r1"},
                    snapshot=snap, interval_seconds=0.02, max_backoff_seconds=0.05, timeout_seconds=0.5)


async def run_against_front(act: Callable[[Seen, list[int], list[int], Reporter], Awaitable[None]]) -> Seen:
    seen, port, backend = Seen(), free_port(), free_port()
    shed, lose, release = [0], [0], asyncio.Event()
    rep = overload_reporter(f"http://127.0.0.1:{port}", node_snapshot(40.0, 1000, 2000))
    async with serving(aggregator_app(), backend), \
            serving(overloaded_front(seen, f"http://127.0.0.1:{backend}", shed, lose, release), port), \
            reporting(rep):
        try:
            await act(seen, shed, lose, rep)
        finally:
            release.set()  # a withheld answer goes before the front shuts down
    return seen


async def test_a_shed_report_keeps_the_compact_base_and_its_events_arrive_later() -> None:
    async def act(seen: Seen, shed: list[int], lose: list[int], rep: Reporter) -> None:
        await seen.until(lambda: len(seen.accepted()) >= 3)
        shed[0] = 2
        rep.add_events([xid(79)])
        await seen.until(lambda: any(79 in codes for _, _, codes in seen.accepted()))
        await seen.until(lambda: len(seen.accepted()) >= 6)
        assert rep.counts["rebased"] == 0 and rep.errors["server_error"] == 2

    seen = await run_against_front(act)
    statuses = [status for status, *_ in seen.bodies]
    first_shed = statuses.index(503)
    last_taken = max(i for i in range(first_shed) if statuses[i] == 202)
    after = next(i for i in range(first_shed, len(statuses)) if statuses[i] == 202)
    assert statuses[first_shed:after] == [503, 503]
    # Nothing was taken of the shed ones: the report after them is compact against the last one taken.
    assert seen.raw[after].get("base_seq") == seen.raw[last_taken]["seq"]
    assert all(r.get("base_seq") is not None for r in seen.raw[first_shed:])


async def test_a_lost_answer_of_a_report_taken_is_followed_by_compact_reports_not_a_whole_one() -> None:
    async def act(seen: Seen, shed: list[int], lose: list[int], rep: Reporter) -> None:
        await seen.until(lambda: len(seen.accepted()) >= 3)
        lose[0] = 1
        await seen.until(lambda: lose[0] == 0)
        await seen.until(lambda: len(seen.accepted()) >= 7)
        assert rep.errors["timeout"] == 1 and rep.counts["rebased"] == 1

    seen = await run_against_front(act)
    statuses = [status for status, *_ in seen.bodies]
    assert statuses.count(409) == 1
    refused = statuses.index(409)
    lost = refused - 1  # taken by the aggregator, its answer withheld past the agent's timeout
    assert statuses[lost] == 202
    # The resend right after the 409 is compact against the lost report, and so is every one after it.
    assert seen.raw[refused + 1].get("base_seq") == seen.raw[lost]["seq"]
    assert all(r.get("base_seq") is not None for r in seen.raw[lost:])
    assert seen.raw[refused + 1]["version"] == 3
