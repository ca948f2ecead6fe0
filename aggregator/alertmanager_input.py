"""Inputs from Alertmanager, and the breaker's manual reset, as aiohttp routes.

``POST /v1/alertmanager`` reads Alertmanager's webhook payload (version "4") and turns each firing alert with
a ``vigil_action`` label into a Decision of detector "alertmanager" through the same gate as the detectors'; a
bad alert is refused and counted by reason while the batch goes on, answered 200 with the refused listed (so
Alertmanager does not resend forever). ``POST /v1/breaker/reset`` is the manual reset; nothing here acts on a
node (docs/gate.md, "Alertmanager's proposals").
"""
from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vigil.aggregator.auth import Refusals
from vigil.aggregator.decision import Action, Decision, Finding
from vigil.aggregator.listener import BodyRefused, read_body
from vigil.aggregator.sink import DecisionSink
from vigil.aggregator.store import WRITE_ERRORS
from vigil.contract.wire import check_node_name

MAX_BODY_BYTES = 1 << 20
ACTION_LABEL = "vigil_action"
# A batch is at most this many alerts (Alertmanager's max_alerts, 0 = unlimited by default;
# a real group is tens).
MAX_ALERTS = 1000
# Alertmanager may propose these; ``resume`` puts a node back in service and is the operator's.
PROPOSABLE = frozenset(Action) - {Action.RESUME}
_GPU_INDEX = re.compile(r"[0-9]{1,4}")


class _AlertIn(BaseModel):
    # Alertmanager adds fields over versions; only these are read, the rest are ignored.
    model_config = ConfigDict(extra="ignore")

    status: str = Field(max_length=32)
    labels: dict[str, str] = Field(max_length=128)
    annotations: dict[str, str] = Field(default_factory=dict, max_length=128)
    startsAt: datetime  # Alertmanager's field names
    fingerprint: str = Field(default="", max_length=128)
    generatorURL: str = Field(default="", max_length=4096)


class WebhookPayload(BaseModel):
    """Alertmanager's webhook body (https://prometheus.io/docs/alerting/latest/configuration/#webhook_config)."""

    model_config = ConfigDict(extra="ignore")

    version: str = Field(max_length=16)
    status: str = Field(max_length=32)
    receiver: str = Field(default="", max_length=256)
    # Each alert is validated on its own (``_AlertIn``), so one bad alert is refused alone.
    alerts: list[Any] = Field(max_length=MAX_ALERTS)


class Resettable(Protocol):
    def reset_breaker(self) -> bool: ...


Refused = tuple[int, str, str]  # (index in the batch, reason, detail)


def proposal(index: int, raw: Any, now: float, dry_run: bool, is_member: Callable[[str, float], bool]
             ) -> Decision | Refused | str:
    """One alert: its Decision, a refusal (index, reason, detail), or why it was skipped (an
    alert that proposes nothing: resolved, or without a vigil_action label)."""
    try:
        alert = _AlertIn.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        return index, "malformed", f"{'.'.join(str(p) for p in first['loc']) or '(alert)'}: {first['msg']}"
    if alert.status != "firing":
        return "resolved"
    raw_action = alert.labels.get(ACTION_LABEL)
    if raw_action is None:
        return "no_vigil_action"
    try:
        action = Action(raw_action)
    except ValueError:
        return index, "unknown_action", f"{ACTION_LABEL}={raw_action[:64]!r} is not one of vigil's actions"
    if action not in PROPOSABLE:
        return index, "action_not_allowed", f"Alertmanager may not propose {action.value} (an operator's action)"
    # node_exporter's convention: the target is instance="host:port"
    node = alert.labels.get("node") or alert.labels.get("instance", "").rsplit(":", 1)[0]
    if not node:
        return index, "no_node", "neither a node nor an instance label"
    try:
        check_node_name(node)
    except ValueError as exc:
        return index, "bad_node_name", f"{node[:64]!r}: {exc}"
    if not is_member(node, now):
        return index, "unknown_node", f"{node} has not reported recently (not a member of the fleet)"
    gpu = alert.labels.get("gpu")
    if gpu is not None and _GPU_INDEX.fullmatch(gpu) is None:
        return index, "bad_gpu", f"gpu={gpu[:16]!r} is not a GPU index"
    try:
        since = alert.startsAt.timestamp()
    except (OverflowError, ValueError, OSError):
        return index, "malformed", "startsAt is out of range"
    finding = Finding(
        detector="alertmanager",
        node=node,
        action=action,
        reason=alert.annotations.get("summary")
        or alert.annotations.get("description")
        or alert.labels.get("alertname", "alert"),
        since=since,
        gpu=int(gpu) if gpu is not None else None,
        job=alert.labels.get("job_id"),
        key=alert.fingerprint or alert.labels.get("alertname", ""),
        evidence={"labels": alert.labels, "generator_url": alert.generatorURL},
    )
    return Decision.from_finding(finding, now, dry_run=dry_run)


def decisions_from_payload(payload: WebhookPayload, now: float, dry_run: bool,
                           is_member: Callable[[str, float], bool] = lambda node, now: True,
                           ) -> tuple[list[Decision], Counter[str], list[Refused]]:
    """Firing alerts that name an action become decisions; the rest are counted by why they were
    skipped, or refused (index, reason, detail)."""
    skipped: Counter[str] = Counter()
    refused: list[Refused] = []
    out: list[Decision] = []
    for index, raw in enumerate(payload.alerts):
        got = proposal(index, raw, now, dry_run, is_member)
        if isinstance(got, Decision):
            out.append(got)
        elif isinstance(got, str):
            skipped[got] += 1
        else:
            refused.append(got)
    return out, skipped, refused


def add_routes(
    app: web.Application,
    sink: DecisionSink,
    *,
    clock: Callable[[], float],
    dry_run: bool,
    refusals: Refusals,
    fleet_nodes: Callable[[float], int],
    is_member: Callable[[str, float], bool],
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_seconds: float = 10.0,
    breaker: Resettable | None = None,
    leads: Callable[[], bool] = lambda: True,
) -> None:
    """Register ``POST /v1/alertmanager`` and ``POST /v1/breaker/reset``. Every refused batch
    and alert is counted in ``refusals`` (door "alertmanager"). ``fleet_nodes(now)`` is the
    breaker's budget base; ``is_member(node, now)`` whether a decision may name ``node``; a
    standby of an HA pair (``leads()`` false) answers 503 so that Alertmanager sends the batch
    again, to the leader."""

    def bad(status: int, reason: str, detail: str) -> web.Response:
        refusals.count("alertmanager", reason)
        return web.json_response({"error": reason, "detail": detail}, status=status)

    async def alertmanager_webhook(request: web.Request) -> web.Response:
        try:
            body = await read_body(request, max_body_bytes, body_timeout_seconds)
        except BodyRefused as exc:
            return bad(exc.status, exc.reason, exc.detail)
        if not leads():
            return bad(503, "standby", "this aggregator replica stands by; the leader takes alerts (sent again)")
        now = clock()
        fleet = fleet_nodes(now)

        def judge() -> tuple[list[Decision], list[Decision], Counter[str], list[tuple[int, str, str]]] | web.Response:
            # Parsing, judging and the one transaction of the whole batch (one fsync) run in a
            # worker thread: a 1,000-alert body must not stall the event loop.
            try:
                payload = WebhookPayload.model_validate_json(body)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "(body)"
                return bad(400, "malformed", f"{where}: {first['msg']}")
            if payload.version != "4":
                return bad(400, "unsupported_version", f"webhook version {payload.version!r}; vigil reads version 4")
            decisions, skipped, refused = decisions_from_payload(payload, now, dry_run, is_member)
            admitted = sink.submit(decisions, now, fleet) if decisions else []
            return decisions, admitted, skipped, refused

        judged = await asyncio.to_thread(judge)
        if isinstance(judged, web.Response):
            return judged
        decisions, admitted, skipped, refused = judged
        for _, reason, _ in refused:
            refusals.count("alertmanager", reason)
        problem = sink.problem()
        if problem is not None:
            # Kept in memory and retried, but not yet durable: Alertmanager sends it again.
            return web.json_response({"error": "store_unavailable", "detail": problem}, status=503)
        return web.json_response({
            "proposed": len(decisions), "admitted": [d.id for d in admitted], "skipped": dict(skipped),
            "refused": [{"index": i, "error": reason, "detail": detail} for i, reason, detail in refused],
        })

    async def breaker_reset(_: web.Request) -> web.Response:
        if breaker is None:
            return web.json_response({"error": "no_breaker", "detail": "this sink has no circuit breaker"}, status=404)
        if not leads():
            return bad(503, "standby", "this aggregator replica stands by; reset the breaker on the leader")
        try:
            was_tripped = await asyncio.to_thread(breaker.reset_breaker)
        except WRITE_ERRORS as exc:  # the store failing, or the leadership lost meanwhile
            return web.json_response({"error": "store_unavailable", "detail": str(exc)}, status=503)
        return web.json_response({"reset": True, "was_tripped": was_tripped})

    app.router.add_post("/v1/alertmanager", alertmanager_webhook)
    app.router.add_post("/v1/breaker/reset", breaker_reset)
