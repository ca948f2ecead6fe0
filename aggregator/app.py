"""The aggregator's HTTP service: report intake, fleet and decision queries, its own metrics.

It validates each ``POST /v1/reports`` body (bearer token, size, JSON schema), counts every
rejection by reason, hands accepted reports to the engine, and runs the engine's evaluation
periodically and at once after an urgent report, so a fatal Xid becomes a decision within about a
second. It judges nothing itself (the engine does) and acts on nothing (the sink does).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from agent.config import ConfigError
from agent.wire import Report
from aggregator.actuators import build_actuators
from aggregator.alertmanager_input import add_routes
from aggregator.config import AggregatorConfig
from aggregator.decision import REMOVING_ACTIONS, Action, Decision, Finding
from aggregator.dispatch import Dispatcher, GatedSink
from aggregator.engine import Engine
from aggregator.fleet import NodeState
from aggregator.gate import Gate
from aggregator.metrics import CONTENT_TYPE, AggregatorMetrics
from aggregator.sink import DecisionSink
from aggregator.store import Store

log = logging.getLogger("vigil.aggregator")

ENGINE_KEY = web.AppKey("engine", Engine)
SINK_KEY = web.AppKey("sink", DecisionSink)
METRICS_KEY = web.AppKey("metrics", AggregatorMetrics)
CONFIG_KEY = web.AppKey("config", AggregatorConfig)
WAKE_KEY = web.AppKey("wake", asyncio.Event)
# Runs one evaluation now (what the periodic task does): the simulator and tests call it on
# their own clock.
EVALUATE_KEY: web.AppKey[Callable[[], list[Decision]]] = web.AppKey("evaluate")

MAX_DECISIONS_LIMIT = 10_000

# The aggregator keeps every node's latest GPU, port and rank state alive: ~10^6 objects for a
# 100k-GPU fleet, and each report allocates a few hundred more. With CPython's default
# thresholds (a collection every 700 allocations) the collector re-walks that population every
# couple of reports and halves the ingest rate (bench/bench_ingest.py); collections every 50k
# allocations keep the same guarantees for cycles at a fraction of the cost.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Freeze start-up objects out of the collector's way and space collections out."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def _error(status: int, reason: str, detail: str, **extra: Any) -> web.Response:
    return web.json_response({"error": reason, "detail": detail, **extra}, status=status)


def _schema_errors(exc: ValidationError) -> list[dict[str, str]]:
    out = []
    for err in exc.errors()[:20]:
        path = ".".join(str(p) for p in err["loc"]) or "(body)"
        out.append({"path": path, "message": "unknown key" if err["type"] == "extra_forbidden" else err["msg"]})
    return out


def node_state(node: NodeState, findings: list[Finding], now: float, silent_after: float) -> str:
    if now - node.last_seen >= max(silent_after, 6 * node.interval_seconds):
        return "silent"
    actions = {f.action for f in findings}
    if actions & REMOVING_ACTIONS:
        return "failing"
    if actions - {Action.OBSERVE}:
        return "suspect"
    return "ok"


def make_app(config: AggregatorConfig, engine: Engine, sink: DecisionSink, *,
             clock: Callable[[], float] = time.time, token: str | None = None) -> web.Application:
    """The service as an aiohttp application (routes, the periodic evaluator as a cleanup
    context). ``token`` defaults to the contents of ``config.token_file`` when it is set."""
    if token is None and config.token_file:
        token = read_token(config.token_file)
    expected_auth = f"Bearer {token}".encode() if token else None
    silent_after = config.detectors.silence.alert_after_seconds_min

    def findings_by_node() -> dict[str, list[Finding]]:
        out: dict[str, list[Finding]] = {}
        for f in engine.last_findings:
            out.setdefault(f.node, []).append(f)
        return out

    def state_counts() -> dict[str, int]:
        now = clock()
        by_node = findings_by_node()
        return dict(Counter(node_state(n, by_node.get(n.name, []), now, silent_after)
                            for n in engine.fleet.view().nodes.values()))

    metrics = AggregatorMetrics(state_counts)
    # Each report's JSON is ~10 KB; aiohttp's own limit is set just above ours so that we, not
    # aiohttp, answer an oversized body (with our reason and our counter).
    app = web.Application(client_max_size=config.max_body_bytes + 1)
    app[ENGINE_KEY] = engine
    app[SINK_KEY] = sink
    app[METRICS_KEY] = metrics
    app[CONFIG_KEY] = config
    wake = asyncio.Event()
    app[WAKE_KEY] = wake

    def evaluate_now() -> list[Decision]:
        started = time.perf_counter()
        try:
            admitted = engine.evaluate(clock())
        finally:
            metrics.evaluate_seconds.observe(time.perf_counter() - started)
        for d in admitted:
            metrics.decisions.labels(d.action.value, d.detector).inc()
            log.info("decision %s: %s %s%s (%s) %s", d.id, d.action.value, d.node,
                     f" gpu {d.gpu}" if d.gpu is not None else "", d.detector, d.reason)
        return admitted

    async def evaluator(_: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(config.evaluate_interval_seconds):
                        await wake.wait()
                wake.clear()
                try:
                    evaluate_now()
                except Exception:  # one bad cycle must not stop judging the fleet
                    log.exception("evaluation failed; the next cycle will try again")

        task = asyncio.create_task(loop(), name="vigil-aggregator-evaluate")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(evaluator)
    app[EVALUATE_KEY] = evaluate_now

    async def post_report(request: web.Request) -> web.Response:
        if expected_auth is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected_auth):
                metrics.rejections.labels("unauthorized").inc()
                return _error(401, "unauthorized", "missing or wrong bearer token")
        if request.content_length is not None and request.content_length > config.max_body_bytes:
            metrics.rejections.labels("too_large").inc()
            return _error(413, "too_large", f"body of {request.content_length} bytes exceeds "
                          f"{config.max_body_bytes}")
        # read(n) returns what has arrived (up to n), so gather until EOF or past the limit.
        parts: list[bytes] = []
        size = 0
        while size <= config.max_body_bytes:
            chunk = await request.content.read(config.max_body_bytes + 1 - size)
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        if size > config.max_body_bytes:
            metrics.rejections.labels("too_large").inc()
            return _error(413, "too_large", f"body exceeds {config.max_body_bytes} bytes")
        body = b"".join(parts)
        started = time.perf_counter()
        try:
            report = Report.model_validate_json(body)
        except ValidationError as exc:
            errors = _schema_errors(exc)
            reason = "invalid_json" if any(e["type"] == "json_invalid" for e in exc.errors()) else "schema"
            metrics.rejections.labels(reason).inc()
            return _error(400, reason, "; ".join(f"{e['path']}: {e['message']}" for e in errors), errors=errors)
        engine.ingest(report, clock())
        metrics.ingest_seconds.observe(time.perf_counter() - started)
        metrics.reports.inc()
        if report.urgent or any(e.urgent for e in report.events):
            wake.set()
        return web.json_response({"status": "accepted", "node": report.node, "seq": report.seq}, status=202)

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
            })
        return web.json_response({"nodes": nodes})

    async def get_node(request: web.Request) -> web.Response:
        name = request.match_info["node"]
        n = engine.fleet.view().nodes.get(name)
        if n is None:
            return _error(404, "unknown_node", f"no report from node {name!r}")
        now = clock()
        found = findings_by_node().get(name, [])
        decisions = [d.model_dump(mode="json") for d in sink.recent(MAX_DECISIONS_LIMIT)
                     if d.node == name][:100]
        body = {
            "node": n.name, "state": node_state(n, found, now, silent_after), "last_seen": n.last_seen,
            "seconds_since_report": round(now - n.last_seen, 3), "first_seen": n.first_seen,
            "boot_id": n.boot_id, "seq": n.seq, "reports": n.reports, "seq_gaps": n.seq_gaps,
            "reboots": n.reboots, "interval_seconds": n.interval_seconds, "topology": n.topology,
            "nvml_available": n.nvml_available, "failed_collectors": n.failed_collectors,
            "gpus": [g.last.model_dump(mode="json", exclude_none=True) for _, g in sorted(n.gpus.items())],
            "missing_gpus": sorted(n.missing_gpus),
            "ports": [p.last.model_dump(mode="json", exclude_none=True, exclude={"counters"})
                      for _, p in sorted(n.ports.items())],
            "ranks": [{"job": job, "rank": rank, "state": r.last.state, "last_step": r.last.last_step,
                       "compute_seconds_p50": r.last.compute_seconds_p50,
                       "comm_seconds_p50": r.last.comm_seconds_p50}
                      for (job, rank), r in sorted(n.ranks.items())],
            "evidence": [f.model_dump(mode="json") for f in found],
            "events": [e.model_dump(mode="json", exclude_none=True) for _, e in list(n.events)[-50:]],
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
        if isinstance(sink, GatedSink):  # delivery state per actuator, from the store
            body["deliveries"] = {d.id: sink.delivery_states(d.id) for d in decisions}
        return web.json_response(body)

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "nodes": len(engine.fleet.view().nodes),
                                  "dry_run": config.dry_run})

    app.router.add_post("/v1/reports", post_report)
    app.router.add_get("/v1/nodes", list_nodes)
    app.router.add_get("/v1/nodes/{node}", get_node)
    app.router.add_get("/v1/decisions", list_decisions)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    add_routes(app, sink, clock=clock, dry_run=config.dry_run, fleet_nodes=lambda: len(engine.fleet.view().nodes),
               breaker=sink if isinstance(sink, GatedSink) else None)
    return app


def build_sink(config: AggregatorConfig) -> tuple[GatedSink, Dispatcher]:
    """The gate over the durable store, and the worker that delivers what it admits."""
    try:
        actuators = build_actuators(config.actuators)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    store = Store(config.store_path)
    dispatcher = Dispatcher(store, actuators, config.actuators.delivery)
    return GatedSink(Gate(config.gate), store, actuators, wake=dispatcher.wake), dispatcher


async def serve(config: AggregatorConfig, *, stop: asyncio.Event | None = None,
                on_ready: Callable[[str], None] | None = None) -> None:
    """Run the service until ``stop`` is set (or forever)."""
    sink, dispatcher = build_sink(config)
    engine = Engine(config, sink)
    app = make_app(config, engine, sink)
    tune_gc()
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    # Deliveries left open by a previous run (a crash between store and delivery) go out first.
    delivering = asyncio.create_task(dispatcher.run(), name="vigil-aggregator-dispatch") \
        if config.actuators.delivery.enabled else None
    try:
        site = web.TCPSite(runner, config.host, config.port, shutdown_timeout=1.0)
        await site.start()
        if on_ready is not None:
            on_ready(config.listen)
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
        if delivering is not None:
            # A delivery cut off here stays open in the store and is retried at the next start.
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await delivering
        dispatcher.close()
        sink.store.close()
