"""Alertmanager actuator: each admitted decision becomes an alert posted to ``/api/v2/alerts``.

Labels ``alertname=VigilDecision, node, action, detector, severity`` identify the alert (plus
``gpu``/``job`` where the decision has them); annotations carry the reason and the decision id.
A ``resume`` resolves every VigilDecision alert still firing for that node (re-posted with
``endsAt`` = the resume's time). Routing, grouping and silencing stay with Alertmanager.
Credentials in the URL (``https://user:password@alertmanager``) are sent as basic auth and never
shown in what it returns, raises or logs. Each request is held to the total deadline
``timeout_seconds`` (aggregator/actuators/deadline.py).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from typing import Any

from pydantic import Field

from vigil.aggregator.actuators.actuator import ActuatorConfig, DeliveryError
from vigil.aggregator.actuators.deadline import exchange
from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision
from vigil.aggregator.redact import RedactedUrlRepr, redact_text, redact_url, split_userinfo

ALERTNAME = "VigilDecision"


class AlertmanagerConfig(RedactedUrlRepr, ActuatorConfig):
    url: str = "http://127.0.0.1:9093"
    # Alerts inform people, so they are sent in dry run too (marked dry_run) unless disabled.
    notify_in_dry_run: bool = True
    # An alert with no endsAt resolves after Alertmanager's resolve_timeout (5 min by default);
    # a drained node stays drained until resumed, so the alert is posted to last this long.
    firing_seconds: float = Field(default=7 * 86400.0, gt=0)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def severity(action: Action) -> str:
    # A held job waits for a person: it pages like a removal.
    if action in REMOVING_ACTIONS or action is Action.HOLD_JOB:
        return "critical"
    return "warning" if action in (Action.RESTART_JOB, Action.ALERT) else "info"


def alert_for(decision: Decision, firing_seconds: float) -> dict[str, Any]:
    labels = {
        "alertname": ALERTNAME,
        "action": decision.action.value,
        "detector": decision.detector,
        "severity": severity(decision.action),
    }
    if decision.node is not None:  # a job-level decision names the job alone: no node is to blame
        labels["node"] = decision.node
    if decision.gpu is not None:
        labels["gpu"] = str(decision.gpu)
    if decision.job is not None:
        labels["job"] = decision.job
    return {
        "labels": labels,
        "annotations": {
            "reason": decision.reason,
            "decision_id": decision.id,
            "dry_run": str(decision.dry_run).lower(),
        },
        "startsAt": _iso(decision.ts),
        "endsAt": _iso(decision.ts + firing_seconds),
    }


class AlertmanagerActuator:
    name = "alertmanager"

    def __init__(self, config: AlertmanagerConfig) -> None:
        self.config = config
        url, self._authorization = split_userinfo(config.url)
        self.base = url.rstrip("/")
        self.display_url = redact_url(config.url)
        self.notify_in_dry_run = config.notify_in_dry_run
        self.timeout_seconds = config.timeout_seconds

    def __repr__(self) -> str:
        return f"AlertmanagerActuator(url={self.display_url!r})"

    def handles(self, decision: Decision) -> bool:
        return decision.action is not Action.OBSERVE

    def deliver(self, decision: Decision) -> str:
        if decision.action is Action.RESUME and decision.node is not None:  # a resume always names its node
            firing = self._firing(decision.node)
            for alert in firing:
                alert["endsAt"] = _iso(decision.ts)
            if firing:
                self._post(firing)
            return f"resolved {len(firing)} alert(s) for {decision.node}"
        self._post([alert_for(decision, self.config.firing_seconds)])
        return f"alert {decision.action.value} on {decision.subject} posted"

    def close(self) -> None:
        pass

    def check(self) -> str:
        """Alertmanager's readiness endpoint (``/-/ready``) answers 200 once it can take alerts."""
        self._request("GET", f"{self.base}/-/ready", None, parse=False)
        return f"{self.base}/-/ready: ready"

    def _firing(self, node: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode(
            [("filter", f'alertname="{ALERTNAME}"'), ("filter", f'node="{node}"'), ("active", "true")]
        )
        found = self._request("GET", f"{self.base}/api/v2/alerts?{query}", None)
        return [
            {k: a[k] for k in ("labels", "annotations", "startsAt") if k in a}
            for a in found
            # the breaker's alert (detector "gate") is about the fleet, not this node: a reset clears it
            if isinstance(a, dict) and a.get("labels", {}).get("detector") != "gate"
        ]

    def _post(self, alerts: list[dict[str, Any]]) -> None:
        self._request("POST", f"{self.base}/api/v2/alerts", alerts)

    def _request(self, method: str, url: str, body: Any, parse: bool = True) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self._authorization:
            headers["Authorization"] = self._authorization
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        shown = f"{method} {redact_url(url)}"
        status, raw = exchange(request, self.timeout_seconds, shown)
        if status >= 400:
            detail = raw[:300].decode(errors="replace")
            raise DeliveryError(f"{shown}: HTTP {status} {redact_text(detail)}", status >= 500 or status == 429)
        if not parse:
            return None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError as exc:
            raise DeliveryError(f"{shown}: answer is not JSON: {exc}") from None


def build(config: AlertmanagerConfig) -> AlertmanagerActuator:
    return AlertmanagerActuator(config)
