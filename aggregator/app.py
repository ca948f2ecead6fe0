"""The aggregator's HTTP face: routes, request parsing, auth checks, answers; the process around it.

Every route passes the role check of ``aggregator.auth``; each ``POST /v1/reports`` body is read
whole (any framing, bounded in size and time) and handed to the service (aggregator/service.py),
which decodes, refuses or takes it and judges the fleet; this module turns its results into
answers, mounts the gate's operator routes (``aggregator.operator_api``) and Alertmanager's,
answers /healthz 503 while decisions cannot be stored, and measures its own event loop's lag and
garbage-collection pauses. ``serve`` builds the ledger, the dispatcher and the listener, with the
lean report path (aggregator/report_door.py) in front: it answers plain reports itself, by the same
functions, and hands every other request to this application.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from aiohttp import web

from vigil.aggregator.actuators import Actuator, DeliveryError, build_actuators
from vigil.aggregator.actuators.actuator import DeadlineExceeded
from vigil.aggregator.actuators.kubernetes import KubernetesActuator
from vigil.aggregator.actuators.slurm import SlurmActuator
from vigil.aggregator.alertmanager_input import add_routes
from vigil.aggregator.auth import NODE_KEY, Credentials, Refusals, auth_middleware, is_loopback
from vigil.aggregator.clock import SteadyClock
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import REMOVING_ACTIONS, Decision
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
    AggregatorMetrics,
)
from vigil.aggregator.operator_api import add_isolation_routes, add_operator_routes
from vigil.aggregator.outbox import Outbox
from vigil.aggregator.preflight import check_startable, ha_timing_problem, startup_problems
from vigil.aggregator.prober import Prober
from vigil.aggregator.redact import redact_json
from vigil.aggregator.report_door import Answer, ReportDoor, outcome_answer, shed_answer
from vigil.aggregator.service import AggregatorService, node_state
from vigil.aggregator.spares import SparePool
from vigil.aggregator.store import WRITE_ERRORS, Store, read_dsn
from vigil.contract.scrape_encoding import encode_for_scraper
from vigil.contract.validation import ConfigError
from vigil.contract.wire import to_readable

log = logging.getLogger("vigil.aggregator")

ENGINE_KEY = web.AppKey("engine", Engine)
REFUSALS_KEY = web.AppKey("refusals", Refusals)
SINK_KEY = web.AppKey("sink", Ledger)
SERVICE_KEY = web.AppKey("service", AggregatorService)
METRICS_KEY = web.AppKey("metrics", AggregatorMetrics)
CONFIG_KEY = web.AppKey("config", AggregatorConfig)
WAKE_KEY = web.AppKey("wake", asyncio.Event)
PROBER_KEY = web.AppKey("prober", Prober)
CREDENTIALS_KEY = web.AppKey("credentials", Credentials)
# Runs one evaluation now (what the periodic task does): the simulator and tests call it on
# their own clock.
EVALUATE_KEY: web.AppKey[Callable[[], list[Decision]]] = web.AppKey("evaluate")

MAX_DECISIONS_LIMIT = 10_000
# After refusing a body, read what is still coming for at most this long (so a client mid-send sees
# the answer), not aiohttp's default 10 s; the lean report path lingers as long.
LINGERING_SECONDS = 1.0
# The event loop's lag is measured by how late a timer of this period fires.
LAG_PERIOD_SECONDS = 0.25


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


def make_app(config: AggregatorConfig, engine: Engine, ledger: Ledger, *,
             clock: Callable[[], float] | None = None, credentials: Credentials | None = None,
             dispatcher: Dispatcher | None = None, outbox: Outbox | None = None,
             judge_executor: Executor | None = None) -> web.Application:
    """The service (aggregator/service.py) as an aiohttp application: routes, auth, and its
    periodic evaluator, loop-lag and GC-pause measurements as cleanup contexts. ``credentials``
    default to the files named in ``config.auth``; ``outbox``, ``dispatcher`` and
    ``judge_executor`` go to the service. ``clock`` is the time everything is judged on (default:
    a ``SteadyClock`` started now, which a step of the system clock cannot move; a test or the
    simulator passes its own)."""
    if clock is None:
        clock = SteadyClock()
    if credentials is None:
        credentials = Credentials.load(config.auth)
        check_startable(config, credentials)
    service = AggregatorService(config, engine, ledger, clock=clock, dispatcher=dispatcher, outbox=outbox,
                                judge_executor=judge_executor)
    metrics, refusals, leads = service.metrics, service.refusals, service.leads

    def count_report_refusal(reason: str) -> None:
        metrics.rejections.labels(reason).inc()

    # Each report's JSON is ~10 KB; aiohttp's own limit is set just above ours so that we, not
    # aiohttp, answer an oversized body (with our reason and our counter).
    app = web.Application(client_max_size=config.max_body_bytes + 1, middlewares=[
        no_5xx_from_input,
        auth_middleware(credentials, refusals, loopback=is_loopback(config.host), dry_run=config.dry_run,
                        on_report_refusal=count_report_refusal),
    ])
    app[SERVICE_KEY] = service
    app[REFUSALS_KEY] = refusals
    app[CREDENTIALS_KEY] = credentials
    app.on_cleanup.append(credentials.close)  # the TokenReview client, if any
    app[ENGINE_KEY] = engine
    app[SINK_KEY] = ledger
    app[METRICS_KEY] = metrics
    app[CONFIG_KEY] = config
    app[WAKE_KEY] = service.wake
    app[PROBER_KEY] = service.prober
    app[EVALUATE_KEY] = service.evaluate_now
    app.cleanup_ctx.append(background("vigil-aggregator-loop-lag",
                                      lambda: measure_loop_lag(metrics, seen=service.note_loop_lag)))

    async def gc_pauses(_: web.Application) -> AsyncIterator[None]:
        with timing_gc_pauses(metrics):
            yield

    app.cleanup_ctx.append(gc_pauses)
    app.cleanup_ctx.append(background("vigil-aggregator-evaluate", service.evaluate_forever))
    if config.spares.enabled:
        app.cleanup_ctx.append(background("vigil-aggregator-spares", wire_spares(
            config, engine, ledger, metrics, dispatcher.actuators if dispatcher is not None else {}, clock)))

    def answer(a: Answer) -> web.Response:
        headers = {"Content-Type": a.content_type}
        if a.retry_after_seconds is not None:
            headers["Retry-After"] = str(a.retry_after_seconds)
        return web.Response(body=a.body, status=a.status, headers=headers)

    async def post_report(request: web.Request) -> web.Response:
        # The report door for every request the lean path (aggregator/report_door.py) hands to
        # aiohttp; the same answers, built by the same functions.
        # Behind on its work, the aggregator sheds before parsing (the cost a shed saves): the
        # sender takes nothing from the answer but when to come back, keeps its compact base
        # (nothing was taken) and resends no sooner than Retry-After (docs/reports.md, "Overload").
        speaker = request.get(NODE_KEY)
        shed = service.shed(speaker)
        if shed is not None:
            return answer(shed_answer(shed))
        try:
            body = await read_body(request, config.max_body_bytes, config.server.body_timeout_seconds)
        except BodyRefused as exc:
            return answer(outcome_answer(service.refuse(exc.status, exc.reason, exc.detail)))
        return answer(outcome_answer(service.receive(body, speaker, time.perf_counter())))

    async def list_nodes(_: web.Request) -> web.Response:
        now = clock()
        by_node = service.findings_by_node()
        nodes = []
        for n in sorted(engine.fleet.view().nodes.values(), key=lambda n: n.name):
            found = by_node.get(n.name, [])
            nodes.append({
                "node": n.name, "state": node_state(n, found, now, service.silent_after),
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
        found = service.findings_by_node().get(name, [])
        decisions = [redact_json(d.model_dump(mode="json")) for d in ledger.recent(MAX_DECISIONS_LIMIT)
                     if d.node == name][:100]
        body = {
            "node": n.name, "state": node_state(n, found, now, service.silent_after), "last_seen": n.last_seen,
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
        decisions = ledger.recent(MAX_DECISIONS_LIMIT if node else limit)
        if node:
            decisions = [d for d in decisions if d.node == node][:limit]
        body: dict[str, Any] = {"decisions": [d.model_dump(mode="json") for d in decisions],
                                # delivery state per actuator, from the store
                                "deliveries": {d.id: ledger.delivery_states(d.id) for d in decisions}}
        # Delivery errors and evidence may quote a configured URL: never its password or key.
        return web.json_response(redact_json(body))

    async def metrics_handler(request: web.Request) -> web.Response:
        body, headers = encode_for_scraper(metrics.render(), request.headers.get("Accept-Encoding"),
                                           CONTENT_TYPE)
        return web.Response(body=body, headers=headers)

    async def healthz(_: web.Request) -> web.Response:
        """503 while decisions cannot be stored (this replica must not take reports then); a
        stalled acting path is ``status: degraded`` with 200: intake goes on, and restarting the
        process would not unstick a receiver (docs/ha.md, "Probes")."""
        problem = ledger.problem()
        path, stalls = service.acting_path()
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
    add_operator_routes(app, ledger, clock=clock, reporting=service.reporting, dry_run=config.dry_run,
                        void_node_actions=service.node_actions.void, refusals=refusals)
    add_isolation_routes(app, service.prober, view=engine.view, clock=clock, leads=leads)
    add_routes(app, service.alert_sink, clock=clock, dry_run=config.dry_run, refusals=refusals,
               # the nodes that reported within the breaker's window: forged or departed
               # nodes cannot inflate its budget
               fleet_nodes=lambda now: engine.fleet.reporting_since(now - service.breaker_window),
               is_member=engine.fleet.is_member, max_body_bytes=config.max_body_bytes,
               body_timeout_seconds=config.server.body_timeout_seconds, breaker=ledger, leads=leads)
    leadership = ledger.leadership
    if isinstance(leadership, Leadership):
        app.cleanup_ctx.append(background("vigil-aggregator-leadership",
                                          lambda: keep_leadership(config, ledger, leadership, service.wake,
                                                                  dispatcher)))
    return app


def wire_spares(config: AggregatorConfig, engine: Engine, ledger: Ledger, metrics: AggregatorMetrics,
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


def report_door(app: web.Application, fallback: Callable[[], asyncio.Protocol]) -> ReportDoor:
    """The lean report path (aggregator/report_door.py) in front of ``fallback``, aiohttp's protocol
    factory for ``app``, with ``app``'s service, credentials and limits."""
    config = app[CONFIG_KEY]
    return ReportDoor(app[SERVICE_KEY], app[CREDENTIALS_KEY], fallback, max_body_bytes=config.max_body_bytes,
                      body_timeout_seconds=config.server.body_timeout_seconds,
                      keepalive_timeout_seconds=config.server.keepalive_timeout_seconds,
                      lingering_seconds=LINGERING_SECONDS,
                      open_without_credential=is_loopback(config.host) and config.dry_run)


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
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           keepalive_timeout=config.server.keepalive_timeout_seconds, lingering_time=LINGERING_SECONDS)
    await runner.setup()
    loop = asyncio.get_running_loop()
    assert runner.server is not None
    # Plain reports are answered by the lean path, everything else by aiohttp's protocol (the
    # application above); aiohttp's request machinery alone cost more than issue 47's 150 us budget
    # for a report all included.
    door = report_door(app, runner.server)
    guard = ConnectionGuard(door, config.server,
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
        door.close_all()
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
