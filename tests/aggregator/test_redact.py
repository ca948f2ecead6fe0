"""Secrets in URLs never leave the aggregator: the redaction rule, and the API that applies it."""

from __future__ import annotations

import io
import logging

import pytest

from tests.aggregator.conftest import FakeNode
from tests.aggregator.test_app import Service, service  # noqa: F401
from vigil.aggregator.redact import REDACTED, RedactingFilter, redact_json, redact_text, redact_url


def test_userinfo_and_secret_query_values_are_masked_and_the_rest_kept() -> None:
    text = "POST https://bot:hunter2@hooks.example.com/v1/x?api_key=abc123&channel=ops&sig=zz: HTTP 500"
    out = redact_text(text)
    assert "hunter2" not in out and "abc123" not in out and "zz" not in out
    assert out == ("POST https://REDACTED@hooks.example.com/v1/x?api_key=REDACTED&channel=ops&sig=REDACTED: "
                   "HTTP 500")
    graph = "http://prometheus:9090/graph?g0.expr=up&g0.tab=1"
    assert redact_text(graph) == graph
    assert redact_text("no url here") == "no url here"
    assert redact_json({"a": [f"see {text}", 3, None], "b": {"c": "https://x/?token=t"}}) == {
        "a": [f"see {out}", 3, None], "b": {"c": "https://x/?token=REDACTED"}}


# The rules of both former redactors together: each case one of them let through.
@pytest.mark.parametrize(("url", "shown"), [
    # Slack's webhook token is its last path segment, even one without a digit (1 in 70 of them).
    ("https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/abcdEFGH1234ijklMNOP5678",
     "https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/REDACTED"),
    ("https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/abcdEFGHijklMNOPqrstUVWX",
     "https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/REDACTED"),
    # Discord's: the id stays (digits only), the 68-character token goes, as on its /slack endpoint.
    ("https://discord.com/api/webhooks/123456789012345678/" + "aB3_" * 17 + "/slack",
     "https://discord.com/api/webhooks/123456789012345678/REDACTED/slack"),
    # Teams': the hex token and the GUIDs after IncomingWebhook.
    ("https://contoso.webhook.office.com/webhookb2/g@t/IncomingWebhook/0123456789abcdef0123456789abcdef/"
     "4f1c2d3e-5a6b-7c8d-9e0f-a1b2c3d4e5f6",
     "https://contoso.webhook.office.com/webhookb2/g@t/IncomingWebhook/REDACTED/REDACTED"),
    ("https://ops.example/hook?user=vigil&pwd=hunter2&passwd=h2&password=h3",
     "https://ops.example/hook?user=vigil&pwd=REDACTED&passwd=REDACTED&password=REDACTED"),
    ("https://fn.azurewebsites.net/api/alert?code=Zm9vYmFy%3D%3D&clientId=default",
     "https://fn.azurewebsites.net/api/alert?code=REDACTED&clientId=default"),
    ("https://x.logic.azure.com:443/workflows/w/triggers/manual/paths/invoke?api-version=2016-06-01&sig=s1g",
     "https://x.logic.azure.com:443/workflows/w/triggers/manual/paths/invoke?api-version=2016-06-01&sig=REDACTED"),
    ("https://h.example/x?access_token=a&api_key=b&secret=c&signature=d&session_id=e&auth=f&%74oken=g",
     "https://h.example/x?access_token=REDACTED&api_key=REDACTED&secret=REDACTED&signature=REDACTED"
     "&session_id=REDACTED&auth=REDACTED&%74oken=REDACTED"),
    # Any scheme, and the fragment (an OAuth implicit grant carries its token there) is dropped.
    ("postgresql://vigil:pw@db.example:5432/vigil", "postgresql://REDACTED@db.example:5432/vigil"),
    ("https://app.example/cb#access_token=t0k", "https://app.example/cb"),
    ("https://h.example:notaport/x", REDACTED),
])
def test_every_secret_either_redactor_knew_is_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_text(f"POST {url}: HTTP 500") == f"POST {shown}: HTTP 500"


@pytest.mark.parametrize("url", [
    "http://prometheus:9090/graph?g0.expr=up&g0.tab=1",  # no credential names
    "https://hooks.example/v1/alerts/12345678901234567890",  # a long id of digits only
    "https://hooks.example/v1/alerts-for-the-gpu-fleet",  # a long word without digits, off the chat hosts
    "https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB",  # short ids, no token
    "https://h.example/x?channel=ops&team=gpu&node=gpu-17",
])
def test_lookalikes_are_shown_as_written(url: str) -> None:
    assert redact_url(url) == url
    assert redact_text(f"see {url}.") == f"see {url}."


def test_bearer_tokens_and_authorization_values_in_text_are_masked() -> None:
    assert redact_text("401 for Authorization: Bearer eyJhbGciOi.J9eyJzdWIi.OiIxMjM0") == \
        "401 for Authorization: Bearer REDACTED"
    assert redact_text('headers {"Authorization": "Basic dXNlcjpodW50ZXIy"}') == \
        'headers {"Authorization": "Basic REDACTED"}'
    assert redact_text("authorization=token ghp_abc123 refused") == "authorization=token REDACTED refused"
    assert redact_text("sent bearer abc-def_ghi~jkl+mno/pqr== twice") == "sent bearer REDACTED twice"
    # Lookalikes: the words without a credential after them stay.
    for text in ("basic auth failed", "authorization required", "Authorization: denied", "no Authorization header"):
        assert redact_text(text) == text


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
        log.error("answer echoed %s", "Authorization: Bearer b34r3r")
        try:
            raise OSError("Max retries exceeded with url: https://u:pw@hooks.example/x?token=t0k")
        except OSError:
            log.exception("actuator failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "k3y" not in text and "t0k" not in text and ":pw@" not in text and "b34r3r" not in text
    assert "api_key=REDACTED" in text and "OSError" in text
