"""The aggregator's listening socket, guarded so that slow or hostile clients cannot starve it.

Every connection goes through ``ConnectionGuard``: it counts connections, closes one that has
not finished its request headers within ``header_timeout_seconds``, and at ``max_connections``
(never more than the open-file limit allows) sheds the oldest connection still sending its
headers to make room, so an operator's ``/healthz`` is answered while a thousand half-sent
requests sit idle. Accept errors (EMFILE) are counted and logged at a bounded rate. It serves
whatever aiohttp protocol it is given; it reads no request itself beyond spotting the header end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import Field

from vigil.aggregator.admission import AdmissionConfig
from vigil.contract.validation import StrictModel

log = logging.getLogger("vigil.aggregator.listener")

HEADER_END = b"\r\n\r\n"
# File descriptors kept free of connections: the store (SQLite and its WAL), logs, the
# actuators' subprocess pipes and sockets, the event loop itself. asyncio also accepts up to
# ``listen_backlog`` connections in one go before any shed one is closed, so that many more
# are kept free on top (an EMFILE at accept stops asyncio accepting anything for a second).
RESERVED_FDS = 64
ACCEPT_LOG_INTERVAL_SECONDS = 10.0


class ServerConfig(StrictModel):
    # Open connections at most (clamped to the process's open-file limit less a reserve). A
    # 12,500-node fleet reporting every 2.5 s over short connections holds a few hundred at once.
    max_connections: int = Field(default=16_384, ge=16)
    # A client must finish its request line and headers within this (slowloris).
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    # And send its whole body within this once the headers are in.
    body_timeout_seconds: float = Field(default=10.0, gt=0)
    # An idle keep-alive connection is closed after this (aiohttp's own timer).
    keepalive_timeout_seconds: float = Field(default=30.0, gt=0)
    # The kernel's queue of connections not yet accepted, and the most asyncio accepts at once.
    listen_backlog: int = Field(default=512, ge=16, le=65535)
    # When reports are shed with 503/429 and Retry-After instead of queued (aggregator/admission.py).
    admission: AdmissionConfig = AdmissionConfig()


def connection_limit(configured: int, backlog: int) -> int:
    """``configured``, clamped so that connections never exhaust the open-file limit (an
    EMFILE at accept stops asyncio accepting anything for a second)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 32
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(8, min(configured, soft - in_use - RESERVED_FDS - backlog))


class _Guarded(asyncio.Protocol):
    """Delegates to aiohttp's protocol; tells the guard when its first request's headers are in."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.awaiting_headers = True
        self._tail = b""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.guard._opened(self)
        self._deadline = asyncio.get_running_loop().call_later(self.guard.config.header_timeout_seconds,
                                                               self._header_timeout)
        self.inner.connection_made(transport)

    def _header_timeout(self) -> None:
        if self.awaiting_headers:
            self.guard._count("header_timeout")
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.awaiting_headers:
            seen = self._tail + data
            if HEADER_END in seen:
                self.awaiting_headers = False
                self.guard._headers_in(self)
                if self._deadline is not None:
                    self._deadline.cancel()
            else:
                self._tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.guard._closed(self)
        self.inner.connection_lost(exc)


class ConnectionGuard:
    """Wraps a protocol factory (aiohttp's ``web.Server``); ``count`` is told each refusal."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], config: ServerConfig,
                 count: Callable[[str], None]) -> None:
        self.factory = factory
        self.config = config
        self.limit = connection_limit(config.max_connections, config.listen_backlog)
        self._count = count
        self.open = 0
        # Connections still sending their first request's headers, oldest first.
        self._pending: OrderedDict[int, _Guarded] = OrderedDict()
        self._last_accept_log = -ACCEPT_LOG_INTERVAL_SECONDS
        self._accept_errors_unlogged = 0

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self, self.factory())

    def _opened(self, conn: _Guarded) -> None:
        self.open += 1
        self._pending[id(conn)] = conn
        if self.open > self.limit:
            # Make room: the oldest connection that has not even sent its headers goes first
            # (a slow or idle client); a connection mid-request is never cut.
            oldest = next(iter(self._pending.values()))
            self._count("shed")
            oldest.awaiting_headers = False
            del self._pending[id(oldest)]
            oldest.abort()

    def _headers_in(self, conn: _Guarded) -> None:
        self._pending.pop(id(conn), None)

    def _closed(self, conn: _Guarded) -> None:
        self.open -= 1
        self._pending.pop(id(conn), None)

    def exception_handler(self, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None
                          ) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
        """A loop exception handler that counts accept errors and logs them at most once per
        ``ACCEPT_LOG_INTERVAL_SECONDS`` (with how many were not logged), passing the rest on."""

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if "socket.accept()" in str(context.get("message", "")):
                self._count("accept_error")
                now = time.monotonic()
                if now - self._last_accept_log >= ACCEPT_LOG_INTERVAL_SECONDS:
                    log.error("accepting connections failed: %s (%d more since the last report; %d open "
                              "connections, limit %d)", context.get("exception"), self._accept_errors_unlogged,
                              self.open, self.limit)
                    self._last_accept_log = now
                    self._accept_errors_unlogged = 0
                else:
                    self._accept_errors_unlogged += 1
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        return handle


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


class BodyRefused(Exception):
    """A request body that is refused before it is parsed: too large (413) or too slow (408)."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


async def read_body(request: web.Request, max_bytes: int, timeout_seconds: float) -> bytes:
    """The whole body, whatever its framing (Content-Length or chunked, in one TCP segment or
    many): read until its end, at most ``max_bytes`` and ``timeout_seconds``."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyRefused(413, "too_large", f"body of {request.content_length} bytes exceeds {max_bytes}")
    content = request.content
    parts: list[bytes] = []
    size = 0
    if content.is_eof():
        # Its framing has ended: the whole body is here already (a report in one or a few TCP
        # segments, the usual case), taken without arming a timer (~10 us a request).
        try:
            body = content.read_nowait(max_bytes + 1)
        except (ClientPayloadError, HttpProcessingError, ConnectionError) as exc:
            raise BodyRefused(400, "bad_framing", f"body could not be read: {exc}") from None
        if len(body) > max_bytes:
            raise BodyRefused(413, "too_large", f"body exceeds {max_bytes} bytes")
        if content.at_eof():
            return body
        parts, size = [body], len(body)
    try:
        async with asyncio.timeout(timeout_seconds):
            while size <= max_bytes:
                # read(n) returns what has arrived (up to n): gather until EOF or past the limit.
                chunk = await content.read(max_bytes + 1 - size)
                if not chunk:
                    break
                parts.append(chunk)
                size += len(chunk)
    except TimeoutError:
        raise BodyRefused(408, "body_timeout", f"body not complete within {timeout_seconds:g}s") from None
    except (ClientPayloadError, HttpProcessingError, ConnectionError) as exc:
        raise BodyRefused(400, "bad_framing", f"body could not be read: {exc}") from None
    if size > max_bytes:
        raise BodyRefused(413, "too_large", f"body exceeds {max_bytes} bytes")
    return b"".join(parts)
