"""Secrets out of URLs before a URL is shown anywhere: delivery details and errors, logs, reprs.

A URL's userinfo (``user:password@``), the values of query parameters whose names say they are
credentials (api_key, token, secret, key, password, signature, ...), and path segments that look
like embedded tokens (Slack's and Discord's webhook URLs carry theirs in the path) are replaced by
``REDACTED``. It only rewrites text for display; the request itself still goes to the real URL,
except that userinfo is moved into an ``Authorization: Basic`` header (``split_userinfo``), which
urllib would not send by itself.
"""

from __future__ import annotations

import base64
import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

REDACTED = "REDACTED"
# A query parameter whose lower-cased name contains one of these is a credential.
_SECRET_NAME_PARTS = ("key", "token", "secret", "password", "passwd", "pwd", "signature", "sig", "auth",
                      "credential", "session")
# A path segment this long with both letters and digits is taken for a token (Slack's last segment
# is 24 characters, Discord's 68); ordinary path words and ids are shorter or single-kind.
_TOKEN_SEGMENT = re.compile(r"^(?=.*[A-Za-z])(?=.*\d)[A-Za-z0-9_\-]{20,}$")
_URL_IN_TEXT = re.compile(r"https?://[^\s'\"<>]+")


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in _SECRET_NAME_PARTS)


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by REDACTED; an unparsable URL is hidden whole."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return REDACTED
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{port}" if port is not None else "")
    if parts.username is not None or parts.password is not None:
        netloc = f"{REDACTED}@{netloc}"
    path = "/".join(REDACTED if _TOKEN_SEGMENT.match(seg) else seg for seg in parts.path.split("/"))
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if _secret_name(k) else v) for k, v in pairs], safe="/:")
    return urlunsplit((parts.scheme, netloc, path, query, ""))


def redact_text(text: str) -> str:
    """Every http(s) URL inside ``text`` (an exception's message, a log line) redacted."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


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
