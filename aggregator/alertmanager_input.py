"""Inputs from Alertmanager, and the breaker's manual reset, as aiohttp routes.

``POST /v1/alertmanager`` takes Alertmanager's webhook payload (version "4"): each firing alert
with a ``vigil_action`` label (and a ``node`` or ``instance`` label) becomes a Decision of
detector "alertmanager" passed through the same sink (the gate) as the detectors' own, so a
site's PromQL rules can propose actions but never bypass the breaker. ``POST /v1/breaker/reset``
is the manual reset. Malformed bodies get 400 with the reason; nothing here acts on a node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aggregator.decision import Action, Decision, Finding
from aggregator.sink import DecisionSink

MAX_BODY_BYTES = 1 << 20
ACTION_LABEL = "vigil_action"


class _AlertIn(BaseModel):
    # Alertmanager adds fields over versions; only these are read, the rest are ignored.
    model_config = ConfigDict(extra="ignore")

    status: str
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: datetime  # Alertmanager's field names
    fingerprint: str = ""
    generatorURL: str = ""


class WebhookPayload(BaseModel):
    """Alertmanager's webhook body (https://prometheus.io/docs/alerting/latest/configuration/#webhook_config)."""

    model_config = ConfigDict(extra="ignore")

    version: str
    status: str
    receiver: str = ""
    alerts: list[_AlertIn]


class Resettable(Protocol):
    def reset_breaker(self) -> bool: ...


def decisions_from_payload(payload: WebhookPayload, now: float, dry_run: bool) -> tuple[list[Decision], Counter[str]]:
    """Firing alerts that name an action become decisions; the rest are counted by why they were skipped."""
    skipped: Counter[str] = Counter()
    out: list[Decision] = []
    for alert in payload.alerts:
        if alert.status != "firing":
            skipped["resolved"] += 1
            continue
        raw = alert.labels.get(ACTION_LABEL)
        if raw is None:
            skipped["no_vigil_action"] += 1
            continue
        try:
            action = Action(raw)
        except ValueError:
            skipped["unknown_action"] += 1
            continue
        # node_exporter's convention: the target is instance="host:port"
        node = alert.labels.get("node") or alert.labels.get("instance", "").rsplit(":", 1)[0]
        if not node:
            skipped["no_node"] += 1
            continue
        gpu = alert.labels.get("gpu")
        finding = Finding(
            detector="alertmanager",
            node=node,
            action=action,
            reason=alert.annotations.get("summary")
            or alert.annotations.get("description")
            or alert.labels.get("alertname", "alert"),
            since=alert.startsAt.timestamp(),
            gpu=int(gpu) if gpu is not None and gpu.isdigit() else None,
            job=alert.labels.get("job_id"),
            key=alert.fingerprint or alert.labels.get("alertname", ""),
            evidence={"labels": alert.labels, "generator_url": alert.generatorURL},
        )
        out.append(Decision.from_finding(finding, now, dry_run=dry_run))
    return out, skipped


def add_routes(
    app: web.Application,
    sink: DecisionSink,
    *,
    clock: Callable[[], float],
    dry_run: bool,
    fleet_nodes: Callable[[], int],
    breaker: Resettable | None = None,
) -> Counter[str]:
    """Register ``POST /v1/alertmanager`` and ``POST /v1/breaker/reset``; returns the counter of
    rejected or skipped alerts by reason (for the aggregator's /metrics)."""
    counts: Counter[str] = Counter()

    def bad(reason: str, detail: str) -> web.Response:
        counts[reason] += 1
        return web.json_response({"error": reason, "detail": detail}, status=400)

    async def alertmanager_webhook(request: web.Request) -> web.Response:
        body = await request.content.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            counts["too_large"] += 1
            return web.json_response({"error": "too_large", "detail": f"over {MAX_BODY_BYTES} bytes"}, status=413)
        try:
            payload = WebhookPayload.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(body)"
            return bad("malformed", f"{where}: {first['msg']}")
        if payload.version != "4":
            return bad("unsupported_version", f"webhook version {payload.version!r}; vigil reads version 4")
        now = clock()
        decisions, skipped = decisions_from_payload(payload, now, dry_run)
        counts.update(skipped)
        admitted = sink.submit(decisions, now, fleet_nodes()) if decisions else []
        return web.json_response(
            {"proposed": len(decisions), "admitted": [d.id for d in admitted], "skipped": dict(skipped)}
        )

    async def breaker_reset(_: web.Request) -> web.Response:
        if breaker is None:
            return web.json_response({"error": "no_breaker", "detail": "this sink has no circuit breaker"}, status=404)
        was_tripped = breaker.reset_breaker()
        return web.json_response({"reset": True, "was_tripped": was_tripped})

    app.router.add_post("/v1/alertmanager", alertmanager_webhook)
    app.router.add_post("/v1/breaker/reset", breaker_reset)
    return counts
