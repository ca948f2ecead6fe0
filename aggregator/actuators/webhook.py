"""Webhook actuator: POSTs each admitted decision as signed JSON to a configured URL.

The body is the Decision's wire form; ``X-Vigil-Signature: sha256=<hex HMAC-SHA256 of the
body>`` with a shared secret lets the receiver check it, and ``Idempotency-Key`` (the decision
id) lets it drop the repeat that at-least-once delivery allows. Retries, backoff and the
dead-letter record are the dispatcher's; this module only sends one request.
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import Field, field_validator

from aggregator.actuators.actuator import ActuatorConfig, DeliveryError
from aggregator.decision import Action, Decision

SIGNATURE_HEADER = "X-Vigil-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
# 408 Request Timeout and 429 Too Many Requests are worth retrying (RFC 9110 section 15.5.9,
# RFC 6585 section 4); any other 4xx means the request itself is wrong.
RETRYABLE_CLIENT_ERRORS = frozenset({408, 429})


def _acting() -> list[Action]:
    return [a for a in Action if a is not Action.OBSERVE]


class WebhookConfig(ActuatorConfig):
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


def sign(body: bytes, secret: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class WebhookActuator:
    name = "webhook"

    def __init__(self, config: WebhookConfig, secret: bytes | None = None) -> None:
        if not config.url:
            raise ValueError("actuators.webhook.url is required when the webhook is enabled")
        if secret is None and config.secret_file:
            secret = Path(config.secret_file).read_bytes().strip()
        if not secret:
            raise ValueError("actuators.webhook.secret_file is required (an unsigned webhook can be forged)")
        self.config = config
        self.secret = secret
        self.notify_in_dry_run = config.notify_in_dry_run
        self.timeout_seconds = config.timeout_seconds

    def handles(self, decision: Decision) -> bool:
        return decision.action in self.config.actions

    def deliver(self, decision: Decision) -> str:
        body = decision.model_dump_json().encode()
        request = urllib.request.Request(
            self.config.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                SIGNATURE_HEADER: sign(body, self.secret),
                IDEMPOTENCY_HEADER: decision.id,
                "User-Agent": "vigil-aggregator",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                return f"POST {self.config.url}: {response.status}"
        except urllib.error.HTTPError as exc:
            exc.close()  # it holds the response's socket
            retryable = exc.code >= 500 or exc.code in RETRYABLE_CLIENT_ERRORS
            raise DeliveryError(f"POST {self.config.url}: HTTP {exc.code} {exc.reason}", retryable) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise DeliveryError(f"POST {self.config.url}: {exc}") from exc

    def close(self) -> None:
        pass


def build(config: WebhookConfig) -> WebhookActuator:
    return WebhookActuator(config)
