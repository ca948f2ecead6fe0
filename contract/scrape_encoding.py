"""A Prometheus exposition as a scraper asks for it: gzip where the request's ``Accept-Encoding``
takes it, identity otherwise. The agent's and the aggregator's /metrics handlers both answer through
it; it renders nothing and serves nothing itself.
"""

from __future__ import annotations

import gzip

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Prometheus sends `Accept-Encoding: gzip` on every scrape (scrape/scrape.go, acceptEncodingHeader), as
# node_exporter answers it. Measured on the 8-GPU golden exposition (156 KB, bench/bench_agent.py):
# level 1 gives 15.8 KB in ~0.8 ms, level 6 13.6 KB in ~2.3 ms: the last 2 KB are not worth
# tripling the time of a scrape whose render budget is 2 ms.
GZIP_LEVEL = 1


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an ``Accept-Encoding`` header (RFC 9110 12.5.3) accepts gzip: listed (or ``*``) with
    a q-value other than 0. An explicit ``gzip`` entry outranks ``*``; a malformed q is no."""
    if not accept_encoding:
        return False
    star: bool | None = None
    for entry in accept_encoding.split(","):
        coding, _, params = entry.strip().partition(";")
        coding = coding.strip().lower()
        if coding not in ("gzip", "x-gzip", "*"):
            continue
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if coding == "*":
            star = q > 0
        else:
            return q > 0
    return bool(star)


def encode_for_scraper(body: bytes, accept_encoding: str | None,
                       content_type: str = CONTENT_TYPE) -> tuple[bytes, dict[str, str]]:
    """The /metrics response body and headers: gzip (``GZIP_LEVEL``) where the request accepts it,
    identity otherwise. ``Vary`` tells a cache between them that the body depends on the header."""
    headers = {"Content-Type": content_type, "Vary": "Accept-Encoding"}
    if not accepts_gzip(accept_encoding):
        return body, headers
    headers["Content-Encoding"] = "gzip"
    return gzip.compress(body, GZIP_LEVEL, mtime=0), headers
