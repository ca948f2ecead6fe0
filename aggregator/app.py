"""The aggregator's HTTP service: report intake, fleet and decision queries, its own metrics.

Every route passes the role check of ``aggregator.auth``; each ``POST /v1/reports`` body is read
whole (any framing, bounded in size and time), validated strictly (finite, bounded, typed),
checked against the node's credential, the clock and the node's last report, and every refusal
is counted by reason. It hands accepted reports to the engine, forgets departed nodes into the
store's archive, and runs the engine's evaluation periodically and at once after an urgent
report, so a fatal Xid becomes a decision within about a second. The detectors run on a worker
thread (``judge_executor``) while the loop keeps answering: reports accepted meanwhile are held
and ingested right after, so the detectors read a fleet nobody writes, and their findings come
back to the loop, which alone proposes them to the gate. It judges nothing itself (the
engine does) and acts on nothing (the ledger and the dispatcher do). It mounts the gate's
operator routes (``aggregator.operator_api``), answers /healthz 503 while decisions cannot be
stored, and measures its own event loop's lag and garbage-collection pauses. Its answer to a
report carries the node-action requests due for that node, and the report's action results go
to the outbox (aggregator/outbox.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import re
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from aiohttp import web

from vigil.aggregator.actuators import Actuator, DeliveryError, build_actuators
from vigil.aggregator.actuators.actuator import DeadlineExceeded
from vigil.aggregator.actuators.kubernetes import KubernetesActuator
from vigil.aggregator.actuators.slurm import SlurmActuator
from vigil.aggregator.admission import Admission
from vigil.aggregator.alertmanager_input import add_routes
from vigil.aggregator.auth import NODE_KEY, Credentials, Refusals, auth_middleware, is_loopback
from vigil.aggregator.clock import FLEET_CLOCK_HORIZON_SECONDS, FleetClockWatch, SteadyClock
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import REMOVING_ACTIONS, WHOLE_JOB, Action, Decision, Finding
from vigil.aggregator.dispatch import DEADLINE_GRACE_SECONDS, Dispatcher
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import NodeState
from vigil.aggregator.gate import Gate
from vigil.aggregator.leadership import Leadership, SoleLeader
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.listener import BodyRefused, ConnectionGuard, read_body, tls_context
from vigil.aggregator.metrics import (
    CONTENT_TYPE,
    GC_GENERATIONS,
    ActingReadings,
    AggregatorMetrics,
    FleetReadings,
    WorkersReading,
)
from vigil.aggregator.node_standing import NodeStanding
from vigil.aggregator.operator_api import add_isolation_routes, add_no_gate_routes, add_operator_routes
from vigil.aggregator.outbox import Outbox
from vigil.aggregator.preflight import check_startable, ha_timing_problem, startup_problems
from vigil.aggregator.prober import Prober
from vigil.aggregator.redact import redact_json
from vigil.aggregator.sink import DecisionSink
from vigil.aggregator.spares import SparePool
from vigil.aggregator.store import WRITE_ERRORS, Store, read_dsn
from vigil.aggregator.synthetic_nodes import REFUSAL_REASON as SYNTHETIC_REFUSAL
from vigil.aggregator.synthetic_nodes import forget_after_seconds as synthetic_forget_after
from vigil.aggregator.synthetic_nodes import refusal as synthetic_refusal
from vigil.contract.scrape_encoding import encode_for_scraper
from vigil.contract.validation import ConfigError
from vigil.contract.wire import REPORT_VERSIONS, Report, SchemaError, WireError, decode_report, encode, to_readable

log = logging.getLogger("vigil.aggregator")

ENGINE_KEY = web.AppKey("engine", Engine)
REFUSALS_KEY = web.AppKey("refusals", Refusals)
SINK_KEY = web.AppKey("sink", DecisionSink)
METRICS_KEY = web.AppKey("metrics", AggregatorMetrics)
CONFIG_KEY = web.AppKey("config", AggregatorConfig)
WAKE_KEY = web.AppKey("wake", asyncio.Event)
PROBER_KEY = web.AppKey("prober", Prober)
# Runs one evaluation now (what the periodic task does): the simulator and tests call it on
# their own clock.
EVALUATE_KEY: web.AppKey[Callable[[], list[Decision]]] = web.AppKey("evaluate")

MAX_DECISIONS_LIMIT = 10_000
# The event loop's lag is measured by how late a timer of this period fires.
LAG_PERIOD_SECONDS = 0.25
# An evaluation that finds the ledger writing another batch tries again this much later.
BUSY_RETRY_SECONDS = 0.05
# Reports held while the detectors read the fleet are ingested this many at a time between turns
# of the event loop (~0.1 ms each: a batch holds the loop ~25 ms, a quarter of the 100 ms intake
# budget of issue #20).
HELD_INGEST_BATCH = 250
# The 202 answer's header, whole: aiohttp copies it into each response (no content-type parse).
JSON_HEADERS = {"Content-Type": "application/json"}
# A node whose reports keep naming more than its caps is logged at most this often (each entry is
# counted in vigil_aggregator_refusals_total): an attack must not flood the log.
REFUSED_ENTRIES_LOG_SECONDS = 60.0

# The aggregator keeps every node's latest GPU, port and rank state alive: ~10^6 objects for a
# 100k-GPU fleet, and each report allocates a few hundred more. With CPython's default
# thresholds (a collection every 700 allocations) the collector re-walks that population every
# couple of reports and halves the ingest rate (bench/bench_ingest.py); collections every 50k
# allocations keep the same guarantees for cycles at a fraction of the cost.
GC_THRESHOLDS = (50_000, 20, 100)
# The judging thread and the event loop share one interpreter lock: each time the loop wakes
# from waiting on its sockets it waits for the judge to hand the lock over, CPython's 5 ms by
# default, several times per request. 0.5 ms keeps intake p99 in tens of milliseconds while
# 5,000 nodes are judged (bench/bench_fleet_memory.py: 1.5 s at the default, see the README).
GIL_SWITCH_SECONDS = 0.0005


def tune_gc() -> None:
    """Freeze start-up objects out of the collector's way and space collections out; let the
    event loop take the interpreter lock back from the judging thread sooner."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(GIL_SWITCH_SECONDS)


def _error(status: int, reason: str, detail: str, **extra: Any) -> web.Response:
    return web.json_response({"error": reason, "detail": detail, **extra}, status=status)


# msgspec names an unknown or missing key in its message and the object holding it in the path.
_NAMED_KEY = re.compile(r"Object (?P<what>contains unknown|missing required) field `(?P<key>[^`]*)`")


def _schema_errors(exc: SchemaError) -> list[dict[str, str]]:
    """The decoder's refusal as [{path, message}]: the path dotted (``gpus.0.index``), an unknown
    key or a missing one named in its path. The decoder stops at the first fault, so there is one."""
    message, _, where = str(exc).partition(" - at `")
    path = re.sub(r"\[(\d+)\]", r".\1", where.rstrip("`").removeprefix("$")).lstrip(".")
    named = _NAMED_KEY.fullmatch(message)
    if named is not None:
        path = ".".join(p for p in (path, named["key"]) if p)
        message = "unknown key" if named["what"] == "contains unknown" else "missing required key"
    return [{"path": path or "(body)", "message": message}]


def background(name: str,
               run: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[web.Application], AsyncIterator[None]]:
    """A task that lives as long as the application (an aiohttp cleanup context)."""

    async def context(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(run(), name=name)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return context


def clock_state(node: NodeState, skewed: bool) -> dict[str, Any]:
    """A node's clock as /v1/nodes shows it: its offset from the aggregator's clock (its latest
    report's, less that report's delay) and whether it is beyond ``fleet.max_clock_skew_seconds``."""
    return {"clock_offset_seconds": round(node.clock_skew_seconds, 3), "clock_skewed": skewed}


def node_state(node: NodeState, findings: list[Finding], now: float, silent_after: float) -> str:
    if now - node.last_seen >= max(silent_after, 6 * node.interval_seconds):
        return "silent"
    actions = {f.action for f in findings}
    if actions & REMOVING_ACTIONS:
        return "failing"
    if actions - {Action.OBSERVE}:
        return "suspect"
    return "ok"


async def measure_loop_lag(metrics: AggregatorMetrics, *, period_seconds: float = LAG_PERIOD_SECONDS,
                          monotonic: Callable[[], float] | None = None,
                          sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                          seen: Callable[[float], None] | None = None) -> None:
    """Forever: how late a ``period_seconds`` timer fires on this event loop, into the gauge (the
    last measurement), the histogram (every one) and ``seen`` (admission control reads it).
    ``monotonic`` defaults to the loop's clock."""
    now = monotonic or asyncio.get_running_loop().time
    while True:
        due = now() + period_seconds
        await sleep(period_seconds)
        lag = max(0.0, now() - due)
        metrics.loop_lag.set(lag)
        metrics.loop_lag_observed.observe(lag)
        if seen is not None:
            seen(lag)


@contextlib.contextmanager
def timing_gc_pauses(metrics: AggregatorMetrics, *,
                     clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """While open, each cyclic garbage collection's pause (it holds the interpreter lock: intake
    and judging both wait) goes into ``metrics.gc_pause_seconds`` by generation. Two clock reads
    a collection; the callback leaves ``gc.callbacks`` on exit."""
    by_generation = tuple(metrics.gc_pause_seconds.labels(g) for g in GC_GENERATIONS)
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            by_generation[info["generation"]].observe(clock() - started[0])

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


@web.middleware
async def no_5xx_from_input(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The last line of defence: an unexpected exception is a logged 500 with a JSON body, never
    a dropped connection or a traceback to the client (the causes are fixed where found)."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return _error(500, "internal", "unexpected error; see the aggregator's log")


def make_app(config: AggregatorConfig, engine: Engine, sink: DecisionSink, *,
             clock: Callable[[], float] | None = None, credentials: Credentials | None = None,
             dispatcher: Dispatcher | None = None, outbox: Outbox | None = None,
             judge_executor: Executor | None = None) -> web.Application:
    """The service as an aiohttp application (routes, auth, the periodic evaluator as a cleanup
    context). ``credentials`` default to the files named in ``config.auth``; ``outbox`` (the
    node-action requests) to one built from ``config`` (its key file read here), which the
    dispatcher then feeds with delivered reset_gpu drains. ``judge_executor`` runs the periodic
    evaluations' detectors (default: one thread of the application's own, shut down with it).
    ``clock`` is the time everything is judged on (default: a ``SteadyClock`` started now, which a
    step of the system clock cannot move; a test or the simulator passes its own)."""
    if clock is None:
        clock = SteadyClock()
    steady = clock if isinstance(clock, SteadyClock) else None
    wall = steady.wall if steady is not None else clock
    clock_watch = FleetClockWatch(config.fleet.max_clock_skew_seconds, config.fleet.clock_offset_tolerance_seconds)
    if credentials is None:
        credentials = Credentials.load(config.auth)
        check_startable(config, credentials)
    node_actions = outbox if outbox is not None else Outbox.from_config(config, engine.fleet)
    if dispatcher is not None and node_actions.enabled:
        dispatcher.on_delivered = node_actions.on_delivered
    # Probe runs (aggregator/prober.py): planned after each evaluation's decisions, queued in the outbox.
    prober = Prober(config.probes, node_actions, engine.fleet)
    silent_after = config.detectors.silence.alert_after_seconds_min

    def findings_by_node() -> dict[str, list[Finding]]:
        out: dict[str, list[Finding]] = {}
        for f in engine.last_findings:
            if f.node != WHOLE_JOB:  # a job-level finding is no node's
                out.setdefault(f.node, []).append(f)
        return out

    def state_counts() -> dict[str, int]:
        now = clock()
        by_node = findings_by_node()
        return dict(Counter(node_state(n, by_node.get(n.name, []), now, silent_after)
                            for n in engine.fleet.view().nodes.values()))

    ledger = sink if isinstance(sink, Ledger) else None
    breaker_window = config.gate.breaker_window_seconds
    leadership = ledger.leadership if ledger is not None else SoleLeader()
    leads = ledger.leads if ledger is not None else (lambda: True)
    if dispatcher is not None:
        dispatcher.acting = leads

    # Each report's answer says whether vigil trusts the node (aggregator/node_standing.py).
    standing = NodeStanding(lambda: ledger.store.state if ledger is not None else None,
                            lambda: engine.last_findings, dry_run=config.dry_run or config.gate.dry_run)

    def reporting() -> int:
        return engine.fleet.reporting_since(clock() - breaker_window)

    def acting() -> ActingReadings:
        readings = ActingReadings(decisions=dict(sink.recorded), store_ok=sink.problem() is None)
        if dispatcher is not None:
            readings.deliveries = dict(dispatcher.outcomes)
            readings.actuators = tuple(sorted(dispatcher.actuators))
            readings.workers = {name: WorkersReading(w.size, w.busy(), w.oldest_seconds(), w.stalled())
                                for name, w in dispatcher.workers.items()}
            readings.deadline_exceeded = {(name, phase): n for name, w in dispatcher.workers.items()
                                          for phase, n in w.deadline_exceeded.items()}
            readings.deliveries_not_acting = dispatcher.not_acting
            readings.round_age_seconds = dispatcher.round_age()
            kube = dispatcher.actuators.get("kubernetes")
            if isinstance(kube, KubernetesActuator):
                readings.kubernetes_events_not_recorded = kube.events_not_recorded
            readings.actuator_refusals = {(name, reason): n for name, a in dispatcher.actuators.items()
                                          if isinstance(a, SlurmActuator | KubernetesActuator)
                                          for reason, n in list(a.refusals.items())}
        if ledger is not None:
            b = ledger.breaker_budget(clock(), reporting())
            readings.breaker_tripped = bool(b["tripped"])
            readings.breaker_removals = int(b["removals_in_window"])  # type: ignore[call-overload]
            readings.breaker_budget = int(b["budget"])  # type: ignore[call-overload]
            readings.store_errors = {**ledger.store_errors,
                                     "delivery_update": dispatcher.store_errors if dispatcher else 0}
            readings.unstored = ledger.unstored
            readings.leader = ledger.leads()
            readings.leader_transitions = leadership.transitions
            readings.leadership_errors = getattr(leadership, "errors", 0)
            readings.leadership_fenced = leadership.fenced
            readings.leadership_relinquished = leadership.relinquished
            try:
                readings.open_deliveries = ledger.store.delivery_counts()
            except WRITE_ERRORS:
                readings.open_deliveries = None  # the store is failing: store_up says so
        return readings

    def fleet_readings() -> FleetReadings:
        return FleetReadings(clocks=clock_watch.reading, offset_seconds=steady.offset_seconds() if steady else 0.0,
                             steps={"aggregator": steady.steps if steady else 0, "fleet": clock_watch.fleet_steps},
                             evictions=dict(engine.fleet.evicted))

    def watch_clocks(now: float) -> None:
        """Once an evaluation: a step of the aggregator's own clock, and the fleet's clocks against it
        (logged and counted; nothing is judged on either)."""
        if steady is not None and (stepped := steady.check()) is not None:
            log.warning("the system clock stepped %+.1f s; judging goes on on the step-free clock (wall minus it: "
                        "%+.1f s; persisted times keep that offset until a restart)", stepped, steady.offset_seconds())
        before = clock_watch.fleet_steps
        reading = clock_watch.observe(engine.fleet.clock_offsets(now - FLEET_CLOCK_HORIZON_SECONDS))
        if clock_watch.fleet_steps != before:
            log.warning("most of the fleet's clocks moved at once (median offset now %+.1f s from the aggregator's): "
                        "a step of the site's time source, or of the aggregator's clock before it started",
                        reading.median_offset_seconds)

    metrics = AggregatorMetrics(state_counts, acting, fleet_readings)
    metrics.registry.register(node_actions.collector())
    metrics.registry.register(prober.collector())
    refusals = metrics.refusals
    refusals.count("reports", SYNTHETIC_REFUSAL, 0)  # the series exists at 0 from the start

    def count_report_refusal(reason: str) -> None:
        metrics.rejections.labels(reason).inc()

    # Each report's JSON is ~10 KB; aiohttp's own limit is set just above ours so that we, not
    # aiohttp, answer an oversized body (with our reason and our counter).
    app = web.Application(client_max_size=config.max_body_bytes + 1, middlewares=[
        no_5xx_from_input,
        auth_middleware(credentials, refusals, loopback=is_loopback(config.host), dry_run=config.dry_run,
                        on_report_refusal=count_report_refusal),
    ])
    app[REFUSALS_KEY] = refusals
    app.on_cleanup.append(credentials.close)  # the TokenReview client, if any
    app[ENGINE_KEY] = engine
    app[SINK_KEY] = sink
    app[METRICS_KEY] = metrics
    app[CONFIG_KEY] = config
    wake = asyncio.Event()
    app[WAKE_KEY] = wake
    app[PROBER_KEY] = prober

    def plan_probes(now: float) -> None:
        """The prober's round after the decisions (the leader only: only it offers requests)."""
        if prober.enabled and leads():
            prober.plan(engine.view(), engine.last_findings, now)

    def forget_departed(now: float) -> None:
        store = getattr(sink, "store", None)
        for node in engine.fleet.forget_departed(now):
            log.info("node %s silent since %.0f: forgotten (fleet.forget_after_seconds)", node.name, node.last_seen)
            if store is None:
                continue
            try:
                store.archive_node(node.name, now, node.summary())
            except WRITE_ERRORS as exc:  # the fleet forgets it anyway; only the post-mortem copy is lost
                log.error("could not archive forgotten node %s in the store: %s", node.name, exc)
        # vigil loadgen's nodes go as soon as they stop (no archive: nothing was judged of them).
        gone = engine.synthetic.forget_departed(now, lambda n: synthetic_forget_after(n.interval_seconds))
        if gone:
            log.info("forgot %d synthetic node(s) (%s...) that stopped reporting", len(gone), gone[0].name)

    # The fleet has one writer, this loop; while the detectors read it on the judging thread
    # (``judging``), accepted reports wait in ``held`` (in order, with their arrival time) and
    # are ingested right after. The node-action tables are the one exception: the outbox keeps
    # writing them, and the recovery detector reads them only by key (atomic under the GIL).
    held: deque[tuple[Report, float]] = deque()
    # Each held node's latest (boot id, seq): the base a compact report arriving meanwhile must name.
    held_last: dict[str, tuple[str, int]] = {}
    judging: Future[list[Finding]] | None = None
    # Whether to take one more report now (aggregator/admission.py; it keeps the loop lag it judges).
    admission = Admission(config.server.admission, clock)
    metrics.held_now.set_function(lambda: len(held))
    entries_refused_logged: dict[str, float] = {}  # node -> when its refused entries were last logged
    superseded = 0  # bumped when a synchronous evaluation takes over from an in-flight one

    def ingest(report: Report, now: float) -> bool:
        """``report`` into the fleet; False when that failed. Everything that can refuse a report
        was checked before it was accepted, so a failure here is a defect: it is logged with its
        traceback and counted (VigilAggregatorIngestFailing), and never stops the reports after
        it (held ones included) nor the judging loop that ingests them."""
        try:
            refused = engine.ingest(report, now)
        except Exception:
            metrics.ingest_failures.inc()
            log.exception("report %d of node %s (boot %s, version %d) failed to enter the fleet", report.seq,
                          report.node, report.boot_id, report.version)
            return False
        if refused:  # entries over the node's caps or on another node's ranks
            for reason, n in refused.items():
                refusals.count("reports", reason, n)
            last = entries_refused_logged.get(report.node)
            if last is None or now - last >= REFUSED_ENTRIES_LOG_SECONDS:
                entries_refused_logged[report.node] = now
                log.warning("node %s: refused entries of its report %s (fleet.max_*_per_node, or ranks another "
                            "node runs); logged once a minute per node, all counted", report.node,
                            ", ".join(f"{reason}={n}" for reason, n in sorted(refused.items())))
        return True

    def intake(report: Report, now: float) -> bool:
        """``report`` ingested now, or held while the detectors read; False: it failed to enter."""
        if judging is not None or held:
            held.append((report, now))
            held_last[report.node] = (report.boot_id, report.seq)
            metrics.held_reports.inc()
            return True
        return ingest(report, now)

    def ingest_held(limit: int | None = None) -> None:
        for _ in range(len(held) if limit is None else min(limit, len(held))):
            ingest(*held.popleft())
        if not held:
            held_last.clear()

    async def ingest_held_now() -> None:
        """The reports held now, in batches between other work; those arriving meanwhile queue
        behind them and wait for the next drain. Bounded: draining until ``held`` was empty never
        ended on a busy machine (each turn of the loop took more reports than a batch, so the
        next judging pass never began; bench_loadgen's busy run, issue 47)."""
        left = len(held)
        while left > 0 and held:
            batch = min(left, HELD_INGEST_BATCH)
            ingest_held(batch)
            left -= batch
            await asyncio.sleep(0)

    async def ingest_held_until(due: float) -> None:
        """Between passes: held reports in batches until none is left, or the next pass is due
        (``due`` on the loop's clock) or woken."""
        loop = asyncio.get_running_loop()
        while held and not wake.is_set() and loop.time() < due:
            ingest_held(HELD_INGEST_BATCH)
            await asyncio.sleep(0)

    def turn() -> contextlib.AbstractContextManager[bool]:
        return ledger.turn() if ledger is not None else contextlib.nullcontext(True)

    def finished(admitted: list[Decision], started: float) -> None:
        metrics.evaluate_seconds.observe(time.perf_counter() - started)
        metrics.last_evaluation.set(wall())  # Prometheus compares it with its own wall clock
        if ledger is None:  # the ledger logs what it records
            for d in admitted:
                log.info("decision %s: %s %s%s (%s) %s", d.id, d.action.value, d.subject,
                         f" gpu {d.gpu}" if d.gpu is not None else "", d.detector, d.reason)

    def evaluate_now() -> list[Decision]:
        """One whole evaluation on the calling thread (the simulator's and the tests' way): an
        evaluation in flight on the judging thread is waited for and its findings dropped."""
        nonlocal judging, superseded
        if judging is not None:
            with contextlib.suppress(Exception):  # its failure was its own cycle's
                judging.result()
            judging = None
            superseded += 1
        ingest_held()
        started = time.perf_counter()
        admitted: list[Decision] = []
        try:
            now = clock()
            watch_clocks(now)
            forget_departed(now)
            admitted = engine.evaluate(now)
            plan_probes(now)
        finally:
            finished(admitted, started)
        return admitted

    async def evaluate_off_loop(executor: Executor) -> None:
        """One evaluation: prepare on the loop, the detectors on ``executor``, the decisions back
        on the loop (through the gate, as ``evaluate_now``)."""
        nonlocal judging
        await ingest_held_now()  # everything accepted before this pass is judged by it
        started = time.perf_counter()
        with turn() as free:
            if not free:  # a batch (Alertmanager's, an operator's) is being written: never wait on the loop
                asyncio.get_running_loop().call_later(BUSY_RETRY_SECONDS, wake.set)
                return
            now = clock()
            watch_clocks(now)
            forget_departed(now)
            view = engine.prepare(now)
        generation = superseded
        future = judging = executor.submit(engine.judge, view, now)
        try:
            found = await asyncio.wrap_future(future)
        finally:
            if judging is future:
                judging = None
            metrics.judge_seconds.observe(time.perf_counter() - started)
        if generation != superseded:
            return
        while True:
            with turn() as free:
                if free:
                    admitted = engine.decide(found, now)
                    plan_probes(now)
                    finished(admitted, started)
                    return
            await asyncio.sleep(BUSY_RETRY_SECONDS)

    async def evaluate_forever() -> None:
        executor = judge_executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="vigil-judge")
        loop = asyncio.get_running_loop()
        try:
            while True:
                # The next pass is due an interval after the last one ended (or at once when
                # woken), whatever is still held: judging is never starved by intake.
                due = loop.time() + config.evaluate_interval_seconds
                await ingest_held_until(due)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(due):
                        await wake.wait()
                wake.clear()
                try:
                    await evaluate_off_loop(executor)
                except Exception:  # one bad cycle must not stop judging the fleet
                    log.exception("evaluation failed; the next cycle will try again")
        finally:
            if judge_executor is None:  # a judge in flight finishes first (about a second at most)
                executor.shutdown(wait=True)

    def lag_seen(lag: float) -> None:
        admission.note_loop_lag(lag)

    app.cleanup_ctx.append(background("vigil-aggregator-loop-lag", lambda: measure_loop_lag(metrics, seen=lag_seen)))

    async def gc_pauses(_: web.Application) -> AsyncIterator[None]:
        with timing_gc_pauses(metrics):
            yield

    app.cleanup_ctx.append(gc_pauses)
    app.cleanup_ctx.append(background("vigil-aggregator-evaluate", evaluate_forever))
    if engine.job_recovery is not None:
        metrics.registry.register(engine.job_recovery.collector())
    if config.spares.enabled:
        app.cleanup_ctx.append(background("vigil-aggregator-spares", wire_spares(
            config, engine, ledger, metrics, dispatcher.actuators if dispatcher is not None else {}, clock)))
    app[EVALUATE_KEY] = evaluate_now

    def refuse_report(status: int, reason: str, detail: str, **extra: Any) -> web.Response:
        count_report_refusal(reason)
        refusals.count("reports", reason)
        return _error(status, reason, detail, **extra)

    def quiet_seconds(node: str | None) -> float | None:
        """How long since ``node``'s last report was taken (None: no node credential, or none taken);
        0 while one of its reports is held (ingested after the detectors' pass, as of its arrival)."""
        if node is None:
            return None
        if node in held_last:
            return 0.0
        n = engine.fleet_of(node).view().nodes.get(node)
        return None if n is None else clock() - n.last_seen

    async def post_report(request: web.Request) -> web.Response:
        # Behind on its work, the aggregator sheds before parsing (the cost a shed saves): the
        # sender takes nothing from the answer but when to come back, keeps its compact base
        # (nothing was taken) and resends no sooner than Retry-After (docs/reports.md, "Overload").
        shed = admission.check(len(held), admission.loop_lag_seconds, lambda: quiet_seconds(request.get(NODE_KEY)))
        if shed is not None:
            metrics.shed.labels(shed.reason).inc()
            return web.Response(body=encode({"error": "overloaded", "detail": shed.detail, "reason": shed.reason,
                                             "retry_after_seconds": shed.retry_after_seconds}),
                                status=shed.status, content_type="application/json",
                                headers={"Retry-After": str(shed.retry_after_seconds)})
        try:
            body = await read_body(request, config.max_body_bytes, config.server.body_timeout_seconds)
        except BodyRefused as exc:
            return refuse_report(exc.status, exc.reason, exc.detail)
        started = time.perf_counter()
        try:
            # Strict (wire.py): no float for an int, no string for a number, no 1 for a bool, no
            # unknown key; NaN, Infinity and 1e400 are refused, as is every value out of bounds.
            report = decode_report(body)
        except SchemaError as exc:
            errors = _schema_errors(exc)
            return refuse_report(400, "schema", "; ".join(f"{e['path']}: {e['message']}" for e in errors),
                                 errors=errors)
        except WireError as exc:
            return refuse_report(400, "invalid_json", f"the body is not JSON: {exc}")
        speaker = request.get(NODE_KEY)
        if speaker is not None and speaker != report.node:
            return refuse_report(403, "node_mismatch", f"the credential of {speaker!r} may not report for "
                                 f"{report.node!r}")
        synthetic = synthetic_refusal(report.node, config.dry_run)
        if synthetic is not None:
            return refuse_report(403, SYNTHETIC_REFUSAL, synthetic)
        now = clock()
        fleet = engine.fleet_of(report.node)
        pending = held_last.get(report.node) if held_last else None
        refused = fleet.refusal(report, now, pending)
        if refused is not None:
            extra: dict[str, Any] = {}
            if refused[0] == "delta_base":
                # What it holds of this boot, so an agent whose answer was lost can resend compact
                # against that report rather than whole (agent/reporter.py).
                last = pending or next(((n.boot_id, n.seq) for n in (fleet.view().nodes.get(report.node),)
                                        if n is not None), None)
                if last is not None and last[0] == report.boot_id:
                    extra["held"] = {"boot_id": last[0], "seq": last[1]}
            return refuse_report(409 if refused[0] in ("seq_jump", "delta_base") else 422, *refused, **extra)
        if not intake(report, now):
            # Not accepted: the agent counts a server error and goes on (a compact report whose base
            # the fleet no longer matches is then refused with delta_base and resent whole).
            return _error(500, "ingest_failed", "the report passed every check but failed to enter the fleet "
                          "(a defect, logged by the aggregator); send it again")
        metrics.ingest_seconds.observe(time.perf_counter() - started)
        metrics.reports.inc()
        if report.events:
            metrics.count_events(e.kind for e in report.events)
        if report.urgent or any(e.urgent for e in report.events):
            wake.set()
        # report_versions: what this aggregator takes, so an agent may move to the compact form.
        answer: dict[str, Any] = {"status": "accepted", "node": report.node, "seq": report.seq,
                                  "report_versions": REPORT_VERSIONS}
        # Node actions: the agent's results first (a final one ends its request), then what is due.
        if report.action_results:
            node_actions.record(report.node, report.action_results, now)
        # The leader asks, with each request's validity on the node's own clock.
        requests = node_actions.due(report.node, now, report.boot_id, engine.fleet.clock_offset(report.node)) \
            if leads() else []
        if requests:
            answer["requests"] = requests
        if leads():  # a standby's gate state is read back only when it takes over
            answer["standing"] = standing.of(report.node)
        # The wire's own encoder (Structs as they are): 2.9 us against json_response's 8.1 us, on the
        # path every report takes; its header given whole (1.7 us a response against content_type's 2.5).
        return web.Response(body=encode(answer), status=202, headers=JSON_HEADERS)

    async def list_nodes(_: web.Request) -> web.Response:
        now = clock()
        by_node = findings_by_node()
        nodes = []
        for n in sorted(engine.fleet.view().nodes.values(), key=lambda n: n.name):
            found = by_node.get(n.name, [])
            nodes.append({
                "node": n.name, "state": node_state(n, found, now, silent_after),
                "last_seen": n.last_seen, "seconds_since_report": round(now - n.last_seen, 3),
                "boot_id": n.boot_id, "seq": n.seq, "topology": n.topology, "gpus": len(n.gpus),
                "ports": len(n.ports), "jobs": sorted({job for job, _ in n.ranks}), "findings": len(found),
                **clock_state(n, engine.fleet.is_skewed(n)),
            })
        return web.json_response({"nodes": nodes})

    async def get_node(request: web.Request) -> web.Response:
        name = request.match_info["node"]
        n = engine.fleet.view().nodes.get(name)
        if n is None:
            return _error(404, "unknown_node", f"no report from node {name!r}")
        now = clock()
        found = findings_by_node().get(name, [])
        decisions = [redact_json(d.model_dump(mode="json")) for d in sink.recent(MAX_DECISIONS_LIMIT)
                     if d.node == name][:100]
        body = {
            "node": n.name, "state": node_state(n, found, now, silent_after), "last_seen": n.last_seen,
            "seconds_since_report": round(now - n.last_seen, 3), "first_seen": n.first_seen,
            "boot_id": n.boot_id, "seq": n.seq, "reports": n.reports, "seq_gaps": n.seq_gaps,
            "reboots": n.reboots, "interval_seconds": n.interval_seconds, "topology": n.topology,
            **clock_state(n, engine.fleet.is_skewed(n)),
            "nvml_available": n.nvml_available, "failed_collectors": n.failed_collectors,
            "gpus": [to_readable(g.last) for _, g in sorted(n.gpus.items())],
            "missing_gpus": sorted(n.missing_gpus),
            "ports": [{k: v for k, v in to_readable(p.last).items() if k != "counters"}
                      for _, p in sorted(n.ports.items())],
            "ranks": [{"job": job, "rank": rank, "state": r.last.state, "last_step": r.last.last_step,
                       "compute_seconds_p50": r.last.compute_seconds_p50,
                       "comm_seconds_p50": r.last.comm_seconds_p50}
                      for (job, rank), r in sorted(n.ranks.items())],
            "evidence": [f.model_dump(mode="json") for f in found],
            "events": [to_readable(e) for _, e in list(n.events)[-50:]],
            "decisions": decisions,
        }
        return web.json_response(body)

    async def list_decisions(request: web.Request) -> web.Response:
        raw = request.query.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_DECISIONS_LIMIT:
            return _error(400, "bad_limit", f"limit must be an integer in 1..{MAX_DECISIONS_LIMIT}, got {raw!r}")
        limit = int(raw)
        node = request.query.get("node")
        decisions = sink.recent(MAX_DECISIONS_LIMIT if node else limit)
        if node:
            decisions = [d for d in decisions if d.node == node][:limit]
        body: dict[str, Any] = {"decisions": [d.model_dump(mode="json") for d in decisions]}
        if ledger is not None:  # delivery state per actuator, from the store
            body["deliveries"] = {d.id: ledger.delivery_states(d.id) for d in decisions}
        # Delivery errors and evidence may quote a configured URL: never its password or key.
        return web.json_response(redact_json(body))

    async def metrics_handler(request: web.Request) -> web.Response:
        body, headers = encode_for_scraper(metrics.render(), request.headers.get("Accept-Encoding"),
                                           CONTENT_TYPE)
        return web.Response(body=body, headers=headers)

    def acting_path() -> tuple[dict[str, Any], list[str]]:
        """The acting path at a glance for /healthz, and what stalls it (empty: nothing)."""
        if dispatcher is None or not dispatcher.actuators:  # nothing configured to act through
            return {}, []
        stalled = sorted(name for name, w in dispatcher.workers.items() if w.stalled())
        problems = [f"actuator {name}: its target answers nothing within the deadline, or every worker is busy "
                    "past it" for name in stalled]
        age = dispatcher.round_age()
        if age is not None and age > config.ha.progress_timeout_seconds:
            problems.append(f"the delivery loop completed no round for {age:.1f}s")
        return {"stalled_actuators": stalled,
                "busy_workers": {name: w.busy() for name, w in sorted(dispatcher.workers.items())},
                "round_age_seconds": None if age is None else round(age, 3)}, problems

    async def healthz(_: web.Request) -> web.Response:
        """503 while decisions cannot be stored (this replica must not take reports then); a
        stalled acting path is ``status: degraded`` with 200: intake goes on, and restarting the
        process would not unstick a receiver (docs/ha.md, "Probes")."""
        problem = sink.problem()
        path, stalls = acting_path()
        status = "failing" if problem is not None else "degraded" if stalls else "ok"
        body: dict[str, Any] = {"status": status, "nodes": len(engine.fleet.view().nodes),
                                "dry_run": config.dry_run, "role": "leader" if leads() else "standby"}
        synthetic = len(engine.synthetic.view().nodes)
        if synthetic:  # vigil loadgen's nodes, held apart (aggregator/synthetic_nodes.py)
            body["synthetic_nodes"] = synthetic
        if path:
            body["acting"] = path
        if stalls:
            body["degraded"] = stalls
        if problem is not None:
            return web.json_response({**body, "reason": problem}, status=503)
        return web.json_response(body)

    app.router.add_post("/v1/reports", post_report)
    app.router.add_get("/v1/nodes", list_nodes)
    app.router.add_get("/v1/nodes/{node}", get_node)
    app.router.add_get("/v1/decisions", list_decisions)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    if ledger is not None:
        add_operator_routes(app, ledger, clock=clock, reporting=reporting, dry_run=config.dry_run,
                            void_node_actions=node_actions.void, refusals=refusals)
    else:
        add_no_gate_routes(app)
    add_isolation_routes(app, prober, view=engine.view, clock=clock, leads=leads)
    add_routes(app, sink, clock=clock, dry_run=config.dry_run, refusals=refusals,
               # the nodes that reported within the breaker's window: forged or departed
               # nodes cannot inflate its budget
               fleet_nodes=lambda now: engine.fleet.reporting_since(now - breaker_window),
               is_member=engine.fleet.is_member, max_body_bytes=config.max_body_bytes,
               body_timeout_seconds=config.server.body_timeout_seconds, breaker=ledger, leads=leads)
    if ledger is not None and isinstance(leadership, Leadership):
        app.cleanup_ctx.append(background("vigil-aggregator-leadership",
                                          lambda: keep_leadership(config, ledger, leadership, wake, dispatcher)))
    return app


def wire_spares(config: AggregatorConfig, engine: Engine, ledger: Ledger | None, metrics: AggregatorMetrics,
                actuators: dict[str, Actuator], clock: Callable[[], float]) -> Callable[[], Coroutine[Any, Any, None]]:
    """The spare pool (aggregator/spares.py): its metrics, its count fed to the job-recovery
    planner, the Slurm actuator's refill, and the loop that reads and sizes it every
    ``spares.refresh_seconds`` (each read within ``spares.timeout_seconds`` in all)."""
    cfg = config.spares
    pool = SparePool(cfg)
    metrics.registry.register(pool.collector())
    engine.spares_available = lambda: pool.available
    slurm, kube = actuators.get("slurm"), actuators.get("kubernetes")
    read: Callable[[], list[str]] | None = None
    if isinstance(slurm, SlurmActuator):
        slurm.spare_feature, slurm.spare_wanted = cfg.slurm_feature, pool.wants_spare
        pool.refills = lambda: (slurm.spares_added, slurm.spares_add_failed)
        read = functools.partial(slurm.spare_nodes, cfg.slurm_feature)
    elif isinstance(kube, KubernetesActuator):
        read = functools.partial(kube.spare_nodes, cfg.kubernetes_label)
    started = clock()

    def size(now: float) -> None:
        removals, oldest = 0, started
        if ledger is not None:
            for entries in ledger.store.state.history.values():
                for e in entries:
                    if now - e.ts <= cfg.history_seconds and e.action in REMOVING_ACTIONS:
                        removals += 1
                        oldest = min(oldest, e.ts)
        nodes = engine.fleet.reporting_since(now - config.gate.breaker_window_seconds)
        pool.size(nodes, removals, nodes * min(cfg.history_seconds, max(now - oldest, 0.0)) / 3600.0)

    async def keep() -> None:
        if read is None:
            log.warning("spares.enabled, but neither the slurm nor the kubernetes actuator is enabled: the pool "
                        "is not read (vigil_aggregator_spares_available absent)")
        loop = asyncio.get_running_loop()
        while True:
            size(clock())
            if read is not None:
                try:
                    async with asyncio.timeout(cfg.timeout_seconds):
                        pool.observe(await loop.run_in_executor(None, read))
                except TimeoutError:
                    pool.failed("timeout")
                    log.error("spares: the pool was not read within %gs", cfg.timeout_seconds)
                except DeliveryError as exc:
                    pool.failed("error")
                    log.error("spares: the pool could not be read: %s", exc)
                except Exception:  # a reader's bug must not stop the loop
                    pool.failed("error")
                    log.exception("spares: the pool could not be read")
            await asyncio.sleep(cfg.refresh_seconds)

    return keep


async def keep_leadership(config: AggregatorConfig, ledger: Ledger, leadership: Leadership, wake: asyncio.Event,
                          dispatcher: Dispatcher | None, *, monotonic: Callable[[], float] = time.monotonic) -> None:
    """Forever, every ``ha.check_interval_seconds``: the leader verifies it holds the lock and
    records its acting loop's progress (or gives the lock up when that stalled), a warm standby
    tries to take it (fencing a leader whose progress stalled). Taking over reads the gate's state
    back from the database before anything is proposed or delivered; losing the lock (or its lease)
    stops both at once. The checks run on a thread of their own: no delivery, store call or other
    work of the default pool can hold them."""
    started = monotonic()
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vigil-leadership")
    try:
        while True:
            warm = monotonic() - started >= config.ha.warm_after_seconds
            try:
                leader = await loop.run_in_executor(executor, leadership.check, warm)
                if leader and not ledger.leads():
                    await loop.run_in_executor(executor, ledger.take_over)
                    log.warning("taking over: gate state read back from the store; evaluating and delivering now")
                    wake.set()
                    if dispatcher is not None:
                        dispatcher.wake()
                elif not leader:
                    ledger.stand_by()  # lock or lease lost: the next leadership reads the state back again
            except WRITE_ERRORS as exc:  # reading the state back failed: not leading until it works
                ledger.stand_by()
                log.error("taking over failed, the store could not be read: %s; trying again", exc)
            except Exception:
                ledger.stand_by()
                log.exception("leadership check failed; standing by until the next check")
            await asyncio.sleep(config.ha.check_interval_seconds)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def build_sink(config: AggregatorConfig, started: float | None = None) -> tuple[Ledger, Dispatcher]:
    """The gate over the durable store, and the worker that delivers what it admits. Raises
    ``StoreError`` (one line naming the file) when the store cannot be opened."""
    try:
        actuators = build_actuators(config.actuators)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    leadership: Leadership | SoleLeader = SoleLeader()
    if config.store.backend == "postgresql":
        assert config.store.dsn_file is not None  # the config's validator insists
        dsn = read_dsn(config.store.dsn_file)
        if (ha_problem := ha_timing_problem(config)) is not None:
            raise ConfigError(ha_problem)
        ha = Leadership(dsn, config.ha.lock_key, progress_timeout_seconds=config.ha.progress_timeout_seconds)
        store = Store("postgresql", dsn=dsn, fence=lambda: ha.holder_pid, lock_key=config.ha.lock_key)
        leadership = ha
    else:
        store = Store(config.store_path, busy_timeout_seconds=config.store.busy_timeout_seconds)
    dispatcher = Dispatcher(store, actuators, config.actuators.delivery)
    if isinstance(leadership, Leadership) and config.actuators.delivery.enabled:
        leadership.progress = dispatcher.round_age  # leadership follows the acting loop's rounds
    ledger = Ledger(Gate(config.gate, started=started), store, actuators, wake=dispatcher.wake, config=config.store,
                    leadership=leadership)
    dispatcher.acting = ledger.leads
    return ledger, dispatcher


async def check_actuators(dispatcher: Dispatcher, metrics: AggregatorMetrics) -> None:
    """Each enabled actuator reaches for its target once, on its own workers and within its
    deadline, all at once and after the listener opened (intake never waits on them); each start
    and outcome is a log line and ``vigil_aggregator_actuator_up``. A failure does not stop the
    service (deliveries retry); a check past its deadline is counted like a delivery's."""

    async def check(name: str, actuator: Actuator) -> None:
        workers = dispatcher.workers[name]
        deadline = actuator.timeout_seconds + DEADLINE_GRACE_SECONDS
        log.info("actuator %s: checking that it reaches its target (deadline %gs)", name, actuator.timeout_seconds)
        try:
            async with asyncio.timeout(deadline):
                said = await asyncio.wrap_future(workers.submit(actuator.check))
        except (DeadlineExceeded, TimeoutError) as exc:
            workers.count_deadline("check")
            metrics.actuator_up.labels(name).set(0)
            log.error("actuator %s cannot reach its target: no answer within its deadline of %gs (%s)", name,
                      actuator.timeout_seconds, exc or "the check did not return")
        except DeliveryError as exc:
            workers.answered()
            metrics.actuator_up.labels(name).set(0)
            log.error("actuator %s cannot reach its target: %s", name, exc)
        except Exception:  # an actuator's bug must not stop the start
            metrics.actuator_up.labels(name).set(0)
            log.exception("actuator %s check failed", name)
        else:
            workers.answered()
            metrics.actuator_up.labels(name).set(1)
            log.info("actuator %s reaches its target: %s", name, said)

    await asyncio.gather(*(check(name, a) for name, a in sorted(dispatcher.actuators.items())))


async def serve(config: AggregatorConfig, *, stop: asyncio.Event | None = None,
                on_ready: Callable[[str], None] | None = None) -> None:
    """Run the service until ``stop`` is set (or forever). It refuses to start (ConfigError, every
    reason on one line) where preflight.startup_problems finds any: ``--check`` runs the same."""
    problems = startup_problems(config)
    if problems:
        raise ConfigError("cannot start: " + "; ".join(problems))
    clock = SteadyClock()  # everything is judged on it: a step of the system clock drains nobody
    sink, dispatcher = build_sink(config, started=clock())
    engine = Engine(config, sink)
    app = make_app(config, engine, sink, dispatcher=dispatcher, clock=clock)
    tune_gc()
    ssl_context = tls_context(config.tls.cert_file, config.tls.key_file) \
        if config.tls.cert_file and config.tls.key_file else None
    # lingering: after refusing a body, read what is still coming for at most a second (so a
    # client mid-send sees the answer), not aiohttp's default 10 s.
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           keepalive_timeout=config.server.keepalive_timeout_seconds, lingering_time=1.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    assert runner.server is not None
    guard = ConnectionGuard(runner.server, config.server,
                            lambda reason: app[REFUSALS_KEY].count("connections", reason))
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(guard.exception_handler(previous_handler))
    # Deliveries left open by a previous run (a crash between store and delivery) go out first.
    delivering = asyncio.create_task(dispatcher.run(), name="vigil-aggregator-dispatch") \
        if config.actuators.delivery.enabled else None
    try:
        # A TLS handshake is held to the header timeout too (asyncio's default is 60 s).
        try:
            server = await loop.create_server(
                guard, config.host, config.port, ssl=ssl_context, backlog=config.server.listen_backlog,
                reuse_address=True,
                ssl_handshake_timeout=config.server.header_timeout_seconds if ssl_context else None)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {config.listen} (listen): {exc.strerror or exc}") from None
        log.info("at most %d connections at once (server.max_connections, open-file limit)", guard.limit)
        if on_ready is not None:
            on_ready(config.listen)
        # The reach checks only once the listener is open: a receiver that never answers delays
        # neither the start nor intake (each check is held to its actuator's deadline).
        checking = asyncio.create_task(check_actuators(dispatcher, app[METRICS_KEY]), name="vigil-actuator-checks") \
            if not config.dry_run else None
        try:
            await (stop or asyncio.Event()).wait()
        finally:
            server.close()
            if checking is not None:
                checking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checking
    finally:
        await runner.cleanup()
        loop.set_exception_handler(previous_handler)
        if delivering is not None:
            # A delivery cut off here stays open in the store and is retried at the next start.
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await delivering
        dispatcher.close()
        sink.leadership.release()  # a clean stop hands the lock over at once
        sink.store.close()
