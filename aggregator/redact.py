"""Redaction of secrets carried in URLs, for everything the aggregator shows (API, CLI, logs).

A configured URL may hold a password (``https://user:pw@host``) or a key in its query
(``?api_key=...``); actuators put URLs into delivery errors and details. ``redact`` rewrites
every URL inside a string, ``redact_json`` every string inside a JSON-like value, and
``RedactingFilter`` every log record a handler writes (message and traceback). It knows no
configuration and changes nothing but the secret parts.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "REDACTED"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*[^\s\"'<>.,:;)]")
# Query parameters that carry credentials in the webhook and chat services sites use
# (api_key, token, sig, signature, access_token, secret, password, code, auth ...).
_SECRET_PARAM = re.compile(r"key|token|secret|pass|sig|auth|code|credential|session", re.IGNORECASE)


def _redact_url(match: re.Match[str]) -> str:
    url = match.group(0)
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, MASK if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe=MASK)
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return f"{url.split('://', 1)[0]}://{MASK}"


def redact(text: str) -> str:
    """``text`` with the userinfo and secret query values of every URL in it masked."""
    return _URL.sub(_redact_url, text) if "://" in text else text


def redact_json(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_json(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """A handler filter: the record's message and traceback with URL secrets masked, whatever
    module logged it (an actuator's error may quote its URL, a urllib3 traceback its query)."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text and "://" in record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True
