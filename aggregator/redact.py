"""Secrets out of everything the aggregator shows (API, CLI, logs, delivery errors, config reprs).

In every URL inside a text it masks the userinfo, the values of query parameters whose names say
they are credentials and path segments that carry a webhook's token (Slack, Discord, Teams); in
the text itself, bearer tokens and Authorization header values. It rewrites text for display
only: a request still goes to the real URL, its userinfo moved into an ``Authorization: Basic``
header by ``split_userinfo`` (urllib would not send it by itself).
"""

from __future__ import annotations

import base64
import logging
import re
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

REDACTED = "REDACTED"
# Any scheme (http, https, postgresql, ...); a URL's last character is not the sentence's
# punctuation around it ("...?sig=zz: HTTP 500").
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*[^\s\"'<>.,:;)]")
# A query parameter whose lower-cased name contains one of these is a credential: the names the
# webhook, chat and cloud services use (api_key, access_token, token, secret, password, passwd, pwd,
# sig, signature, code (Azure Functions), auth, credential, session ...).
_SECRET_NAME_PARTS = ("key", "token", "secret", "pass", "pwd", "sig", "auth", "code", "credential", "session")
# A path segment this long with both letters and digits is taken for a token (Slack's last segment
# is 24 characters, Discord's 68, a Teams webhook's 32 and GUIDs); ordinary path words and ids are
# shorter or single-kind.
_TOKEN_SEGMENT = re.compile(r"^(?=.*[A-Za-z])(?=.*\d)[A-Za-z0-9_\-]{20,}$")
# On the chat services that carry a webhook's credential in its path, a segment of that length is
# the token whatever its letters (1 in 70 of Slack's 24-character tokens has no digit).
_LONG_SEGMENT = re.compile(r"^[A-Za-z0-9_\-]{20,}$")
_PATH_TOKEN_HOSTS = ("hooks.slack.com", "discord.com", "discordapp.com", "webhook.office.com", "outlook.office.com")
# A bearer token, or an Authorization header's value, quoted in text (an error echoing a request).
_AUTH_IN_TEXT = re.compile(
    r"(\bbearer\s+|\bauthorization[\"']?\s*[:=]\s*[\"']?(?:basic|token)\s+)[A-Za-z0-9\-._~+/]+=*", re.IGNORECASE)


def _secret_name(name: str) -> bool:
    lowered = unquote_plus(name).lower()
    return any(part in lowered for part in _SECRET_NAME_PARTS)


def _redact_query(query: str) -> str:
    """The query as written, each credential's value replaced (nothing else is re-encoded)."""
    pairs = query.split("&")
    for i, pair in enumerate(pairs):
        name, sep, _ = pair.partition("=")
        if sep and _secret_name(name):
            pairs[i] = f"{name}={REDACTED}"
    return "&".join(pairs)


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by REDACTED and its fragment dropped; an unparsable
    URL (a bad IPv6 literal or port) is hidden whole."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    host = (parts.hostname or "").rstrip(".")
    token = _LONG_SEGMENT if any(host == h or host.endswith("." + h) for h in _PATH_TOKEN_HOSTS) else _TOKEN_SEGMENT
    path = "/".join(REDACTED if token.match(seg) else seg for seg in parts.path.split("/"))
    query = _redact_query(parts.query) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, path, query, ""))


def redact_text(text: str) -> str:
    """``text`` (an exception's message, a log line) with every URL in it redacted and every bearer
    token or Authorization value masked."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _AUTH_IN_TEXT.sub(lambda m: m.group(1) + REDACTED, text)


def redact_json(value: object) -> object:
    """Every string inside a JSON-like value redacted (``redact_text``)."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_json(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """A handler filter: the record's message and traceback redacted, whatever module logged it
    (an actuator's error may quote its URL, a urllib3 traceback its query)."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        shown = redact_text(message)
        if shown != message:
            record.msg, record.args = shown, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


class RedactedUrlRepr:
    """Mixin for a pydantic config with a ``url`` field: its repr and str show the URL redacted."""

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():  # type: ignore[misc]
            yield name, redact_url(value) if name == "url" and isinstance(value, str) else value


def split_userinfo(url: str) -> tuple[str, str | None]:
    """(``url`` without ``user:password@``, the ``Authorization: Basic`` value it stood for, or None)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    netloc = parts.netloc.rpartition("@")[2]
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    header = "Basic " + base64.b64encode(pair.encode()).decode()
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), header
