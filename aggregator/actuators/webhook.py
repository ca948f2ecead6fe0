"""Webhook actuator: POSTs each admitted decision as signed JSON to a configured URL.

The body is the Decision's wire form, signed per the Standard Webhooks scheme: ``webhook-id``
(the delivery's idempotency key, the same on every retry), ``webhook-timestamp`` (Unix seconds at
sending) and ``webhook-signature: v1,<base64 HMAC-SHA256(secret, "id.timestamp.body")>``, so a
receiver can refuse a changed body, an old (replayed) request and a repeat (docs/webhooks.md).
Retries, backoff and the dead-letter record are the dispatcher's; this module only sends one
request, within its total deadline (aggregator/actuators/deadline.py: a receiver trickling its
answer is cut off there), and never shows the URL's credentials in what it returns, raises or logs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pydantic import Field, field_validator

from vigil.aggregator.actuators.actuator import ActuatorConfig, DeliveryError
from vigil.aggregator.actuators.deadline import exchange
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.redact import RedactedUrlRepr, redact_text, redact_url, split_userinfo

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
# The decision id, for receivers that dedupe on it; webhook-id is the per-delivery key.
IDEMPOTENCY_HEADER = "Idempotency-Key"
# Standard Webhooks secrets are "whsec_" + base64 of the key; any other file content is the key.
SECRET_PREFIX = b"whsec_"
# 408 Request Timeout and 429 Too Many Requests are worth retrying (RFC 9110 section 15.5.9,
# RFC 6585 section 4); any other 4xx means the request itself is wrong.
RETRYABLE_CLIENT_ERRORS = frozenset({408, 429})


def _acting() -> list[Action]:
    return [a for a in Action if a is not Action.OBSERVE]


class WebhookConfig(RedactedUrlRepr, ActuatorConfig):
    url: str = ""
    # A file holding the shared secret (trailing whitespace ignored); never inline in the config.
    secret_file: str | None = None
    notify_in_dry_run: bool = False
    actions: list[Action] = Field(default_factory=lambda: _acting())

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if url and not url.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return url


def signing_key(secret: bytes) -> bytes:
    """The HMAC key: a ``whsec_<base64>`` secret decoded, any other secret as it is."""
    secret = secret.strip()
    if secret.startswith(SECRET_PREFIX):
        return base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    return secret


def delivery_id(decision_id: str, actuator: str) -> str:
    """The idempotency key of one decision's delivery to one actuator (stable across retries)."""
    return f"{decision_id}:{actuator}"


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class WebhookActuator:
    name = "webhook"

    def __init__(self, config: WebhookConfig, secret: bytes | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        if not config.url:
            raise ValueError("actuators.webhook.url is required when the webhook is enabled")
        if secret is None and config.secret_file:
            secret = Path(config.secret_file).read_bytes().strip()
        if not secret:
            raise ValueError("actuators.webhook.secret_file is required (an unsigned webhook can be forged)")
        self.config = config
        self.secret = secret
        self._key = signing_key(secret)
        self._clock = clock
        self._url, self._authorization = split_userinfo(config.url)
        self.display_url = redact_url(config.url)
        self.notify_in_dry_run = config.notify_in_dry_run
        self.timeout_seconds = config.timeout_seconds

    def __repr__(self) -> str:
        return f"WebhookActuator(url={self.display_url!r})"

    def handles(self, decision: Decision) -> bool:
        return decision.action in self.config.actions

    def deliver(self, decision: Decision) -> str:
        body = decision.model_dump_json().encode()
        msg_id = delivery_id(decision.id, self.name)
        timestamp = int(self._clock())
        headers = {
            "Content-Type": "application/json",
            ID_HEADER: msg_id,
            TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: sign(self._key, msg_id, timestamp, body),
            IDEMPOTENCY_HEADER: decision.id,
            "User-Agent": "vigil-aggregator",
        }
        if self._authorization:
            headers["Authorization"] = self._authorization
        request = urllib.request.Request(self._url, data=body, method="POST", headers=headers)
        shown = f"POST {self.display_url}"
        status, answer = exchange(request, self.timeout_seconds, shown)
        if status >= 400:
            retryable = status >= 500 or status in RETRYABLE_CLIENT_ERRORS
            raise DeliveryError(f"{shown}: HTTP {status} {redact_text(_reason(status, answer))}", retryable)
        return f"{shown}: {status}"

    def close(self) -> None:
        pass

    def check(self) -> str:
        """An unsigned OPTIONS request to the URL: any HTTP answer (even 404 or 405) proves the
        receiver is reachable; a refused connection, a DNS failure or a timeout does not."""
        headers = {"User-Agent": "vigil-aggregator"}
        if self._authorization:
            headers["Authorization"] = self._authorization
        request = urllib.request.Request(self._url, method="OPTIONS", headers=headers)
        shown = f"OPTIONS {self.display_url}"
        status, _ = exchange(request, self.timeout_seconds, shown)
        return f"{shown}: HTTP {status}"


def _reason(status: int, answer: bytes) -> str:
    """The standard phrase of ``status``, then the start of the receiver's own words, if any."""
    phrase = http.client.responses.get(status, "")
    said = answer[:200].decode(errors="replace").strip()
    return " ".join(p for p in (phrase, said) if p)


def build(config: WebhookConfig) -> WebhookActuator:
    return WebhookActuator(config)
