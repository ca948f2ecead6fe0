"""Secrets in URLs never leave the aggregator: the redaction rule, and the API that applies it."""

from __future__ import annotations

import io
import logging

from tests.aggregator.conftest import FakeNode
from tests.aggregator.test_app import Service, service  # noqa: F401
from vigil.aggregator.redact import RedactingFilter, redact, redact_json


def test_userinfo_and_secret_query_values_are_masked_and_the_rest_kept() -> None:
    text = "POST https://bot:hunter2@hooks.example.com/v1/x?api_key=abc123&channel=ops&sig=zz: HTTP 500"
    out = redact(text)
    assert "hunter2" not in out and "abc123" not in out and "zz" not in out
    assert out == ("POST https://REDACTED@hooks.example.com/v1/x?api_key=REDACTED&channel=ops&sig=REDACTED: "
                   "HTTP 500")
    graph = "http://prometheus:9090/graph?g0.expr=up&g0.tab=1"
    assert redact(graph) == graph
    assert redact("no url here") == "no url here"
    assert redact_json({"a": [f"see {text}", 3, None], "b": {"c": "https://x/?token=t"}}) == {
        "a": [f"see {out}", 3, None], "b": {"c": "https://x/?token=REDACTED"}}


async def test_decisions_api_never_shows_a_urls_secret(service: Service) -> None:  # noqa: F811
    await service.post(FakeNode("a"))
    payload = {"version": "4", "status": "firing", "alerts": [{
        "status": "firing", "labels": {"alertname": "X", "node": "a", "vigil_action": "alert"},
        "startsAt": "2026-01-01T00:00:00Z", "generatorURL": "https://u:pw@prom.example/graph?access_token=s3cr3t"}]}
    resp = await service.client.post("/v1/alertmanager", json=payload)  # loopback, dry run: open
    assert resp.status == 200 and (await resp.json())["proposed"] == 1
    text = await (await service.client.get("/v1/decisions")).text()
    assert "s3cr3t" not in text and ":pw@" not in text and "access_token=REDACTED" in text
    text = await (await service.client.get("/v1/nodes/a")).text()
    assert "s3cr3t" not in text


def test_log_records_are_redacted_message_and_traceback() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    log = logging.getLogger("vigil.test-redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.error("delivery to %s failed", "https://hooks.example/x?api_key=k3y")
        try:
            raise OSError("Max retries exceeded with url: https://u:pw@hooks.example/x?token=t0k")
        except OSError:
            log.exception("actuator failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "k3y" not in text and "t0k" not in text and ":pw@" not in text
    assert "api_key=REDACTED" in text and "OSError" in text
