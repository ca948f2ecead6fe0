"""The report door's lean HTTP/1.1 path: ``POST /v1/reports`` answered without aiohttp's request machinery.

It reads each connection's bytes first; a plain keep-alive report (HTTP/1.1, Content-Length within the
limit, no other framing, a node credential already verified, or none needed on a loopback dry run) is
cut from the buffer, admitted or shed, decoded and taken by the service (aggregator/service.py) and
answered with the same status, body and counters as the aiohttp route. Anything else — another route,
another method, chunked or compressed bodies, Expect, a credential it cannot verify at once (TokenReview),
a refusal of the headers or the credential — hands the connection, from that request on, to aiohttp's
protocol (the full application), which answers as it always did. It does not judge, parse a report, or
decide who may speak: it calls what the application calls.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, NamedTuple

from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE

from vigil.aggregator.admission import Shed
from vigil.aggregator.auth import MAX_VERIFIED_TOKENS, TOKEN_SEPARATOR, Credentials, Role
from vigil.aggregator.service import Accepted, AggregatorService, Refused
from vigil.contract.wire import encode

log = logging.getLogger("vigil.aggregator")

# Headers (request line included) longer than this are aiohttp's to refuse (its line and field limit,
# 8,190 bytes, is within it); a report's headers are ~300 bytes.
MAX_HEAD_BYTES = 16_384
REQUEST_LINE = b"POST /v1/reports HTTP/1.1"
# The head as the lean path takes it: its request line, then header lines of a token, a colon and
# visible ASCII, spaces or tabs. Obsolete line folding, other bytes, a space before a colon: the
# connection goes to aiohttp (which refuses or takes it as it always did). Checked with C-level bytes
# operations as each line is read (bytes allowed anywhere by deleting them, a name's token characters
# likewise, CR and LF only as pairs by counting): 1,500 instructions fewer than one regular expression
# over the head before the same loop (tests/aggregator/test_app_report_door.py compares the two).
_TOKEN_BYTES = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_HEAD_BYTES = bytes([0x09, 0x0A, 0x0D, *range(0x20, 0x7F)])
# Request headers that change how the body or the connection is read: aiohttp's.
_AIOHTTP_FRAMING = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})
_BLANKS = b" \t"
JSON = "application/json"
JSON_UTF8 = "application/json; charset=utf-8"  # what aiohttp's json_response says


class Answer(NamedTuple):
    """A report door answer, whichever path serves it: aiohttp's route (app.py) and this one build it here."""

    status: int
    body: bytes
    content_type: str
    retry_after_seconds: int | None = None


def error_answer(status: int, reason: str, detail: str, **extra: Any) -> Answer:
    # json.dumps, as web.json_response: the same bytes on both paths.
    return Answer(status, json.dumps({"error": reason, "detail": detail, **extra}).encode(), JSON_UTF8)


def shed_answer(shed: Shed) -> Answer:
    return Answer(shed.status, encode({"error": "overloaded", "detail": shed.detail, "reason": shed.reason,
                                       "retry_after_seconds": shed.retry_after_seconds}),
                  JSON, shed.retry_after_seconds)


def outcome_answer(outcome: Accepted | Refused) -> Answer:
    if isinstance(outcome, Accepted):
        # The wire's own encoder (Structs as they are): 2.9 us against json_response's 8.1 us.
        return Answer(202, encode(outcome.answer), JSON)
    return error_answer(outcome.status, outcome.reason, outcome.detail, **outcome.extra)


INTERNAL = ("internal", "unexpected error; see the aggregator's log")


@functools.cache
def _status_line(status: int, content_type: str) -> str:
    return f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"


class _Head(NamedTuple):
    length: int
    authorization: bytes | None
    close: bool


def parse_head(head: bytes, max_body_bytes: int) -> _Head | None:
    """A report request's head (request line and headers, without the blank line) as the lean path
    takes it, or None: aiohttp's to read."""
    if head.translate(None, _HEAD_BYTES) or not head.count(b"\r") == head.count(b"\n") == head.count(b"\r\n"):
        return None  # a byte no header line may hold, or a CR or LF on its own
    lines = head.split(b"\r\n")
    if lines[0] != REQUEST_LINE:
        return None
    length: int | None = None
    authorization: bytes | None = None
    close = False
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name.translate(None, _TOKEN_BYTES):
            return None  # not "token:value" (a fold, a space before the colon, no colon)
        name = name.lower()
        if name == b"content-length":
            value = value.strip(_BLANKS)
            if length is not None or not value.isdigit() or len(value) > 12:
                return None
            length = int(value)
        elif name == b"authorization":
            if authorization is not None:
                return None
            authorization = value.strip(_BLANKS)
        elif name == b"connection":
            value = value.strip(_BLANKS).lower()
            if value == b"close":
                close = True
            elif value != b"keep-alive":
                return None
        elif name in _AIOHTTP_FRAMING:
            return None
    if length is None or length > max_body_bytes:
        return None  # aiohttp answers 413 (and lingers), or reads a bodiless POST its own way
    return _Head(length, authorization, close)


class ReportDoor:
    """The lean path's settings and its open connections; ``__call__`` is the protocol factory the
    connection guard wraps (aggregator/listener.py), ``fallback`` aiohttp's (``web.Server``)."""

    def __init__(self, service: AggregatorService, credentials: Credentials, fallback: Callable[[], asyncio.Protocol],
                 *, max_body_bytes: int, body_timeout_seconds: float, keepalive_timeout_seconds: float,
                 lingering_seconds: float, open_without_credential: bool) -> None:
        self.service = service
        self.credentials = credentials
        self.fallback = fallback
        self.max_body_bytes = max_body_bytes
        self.body_timeout_seconds = body_timeout_seconds
        self.keepalive_timeout_seconds = keepalive_timeout_seconds
        self.lingering_seconds = lingering_seconds
        # No node credential configured, a loopback listener in dry run: the route is open (auth.py).
        self.open_without_credential = open_without_credential and not credentials.configured(Role.NODE)
        self.connections: set[LeanReports] = set()
        # Authorization header -> the node it verified for, as ``speaker`` found it: a connection
        # carries many nodes' reports behind a proxy or a pooled client (vigil loadgen's), and the
        # header's parse and check cost ~4 us a request. Only verified credentials are kept (forged
        # ones cannot fill it), for the exact bytes that verified; these Credentials never change.
        self._speakers: dict[bytes, str] = {}
        self.answered = 0  # reports answered on the lean path (tests read it)
        self.handed_over = 0  # connections handed to aiohttp

    def __call__(self) -> asyncio.Protocol:
        return LeanReports(self)

    def speaker(self, authorization: bytes | None) -> tuple[bool, str | None]:
        """(served here, the node the credential speaks for), as auth_middleware decides for a report
        it lets through; (False, None) for anything it would refuse or must ask TokenReview about."""
        if self.open_without_credential:
            return True, None
        if authorization is None or self.credentials.site_secret is None:
            return False, None
        node: str | None = self._speakers.get(authorization)
        if node is not None:
            return True, node
        scheme, _, given = authorization.decode("ascii").partition(" ")
        token = given.strip()
        if scheme.lower() != "bearer" or TOKEN_SEPARATOR not in token:
            return False, None
        roles, node = self.credentials.roles_of(token.encode())
        if node is None or Role.NODE not in roles:
            return False, None
        if len(self._speakers) >= MAX_VERIFIED_TOKENS:
            self._speakers.clear()
        self._speakers[authorization] = node
        return True, node

    def close_all(self) -> None:
        for conn in list(self.connections):
            conn.close()


class LeanReports(asyncio.Protocol):
    """One connection: plain reports answered here until a request is not one, then aiohttp's."""

    def __init__(self, door: ReportDoor) -> None:
        self.door = door
        self.transport: asyncio.Transport | None = None
        self.inner: asyncio.Protocol | None = None  # aiohttp's protocol, once handed over
        self._buf = b""
        self._head: _Head | None = None  # headers in, the body awaited
        self._speaker: str | None = None
        self._authorization: bytes | None = None  # the last credential taken on this connection
        self._authorized: str | None = None  # and the node it speaks for
        self._skip = 0  # body bytes of an answered request still to discard (shed, body timeout)
        self._close_after_skip = False
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._writing_paused = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.door.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # As aiohttp does: an answer goes out at once, not after the client's delayed ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
            return
        self._buf = self._buf + data if self._buf else data
        self._serve()

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            return self.inner.eof_received()
        return False  # nothing half-done is answered after the client's end: close

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()
            return
        # The client does not read its answers: read no more requests until it does (aiohttp waits
        # for the drain likewise), so the answers queued stay bounded.
        self._writing_paused = True
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
            return
        self._writing_paused = False
        assert self.transport is not None
        self.transport.resume_reading()
        self._serve()

    def connection_lost(self, exc: Exception | None) -> None:
        self.door.connections.discard(self)
        self._cancel_timers()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def close(self) -> None:
        if self.inner is None and self.transport is not None:
            self.transport.close()

    # the lean path

    def _cancel_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _hand_over(self) -> None:
        """From this request on, the connection is aiohttp's (its buffer, its timers)."""
        assert self.transport is not None
        self._cancel_timers()
        self.door.handed_over += 1
        inner = self.inner = self.door.fallback()
        inner.connection_made(self.transport)  # never while writing is paused: _serve reads nothing then
        buf, self._buf = self._buf, b""
        if buf:
            inner.data_received(buf)

    def _serve(self) -> None:
        """Answer every whole request in the buffer, in order."""
        transport = self.transport
        assert transport is not None
        while self.inner is None and not self._writing_paused and not transport.is_closing():
            if self._skip:
                taken = min(self._skip, len(self._buf))
                self._buf = self._buf[taken:]
                self._skip -= taken
                if self._skip:
                    return
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                if self._close_after_skip:
                    transport.close()
                    return
                continue
            head = self._head
            if head is None:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > MAX_HEAD_BYTES:
                        self._hand_over()
                    return
                head = parse_head(self._buf[:end], self.door.max_body_bytes)
                if head is None:
                    self._hand_over()
                    return
                if head.authorization is None or head.authorization != self._authorization:
                    # An agent sends the same credential on each request of a connection: checked once.
                    served, speaker = self.door.speaker(head.authorization)
                    if not served:
                        self._hand_over()
                        return
                    self._authorization, self._authorized = head.authorization, speaker
                speaker = self._authorized
                self._buf = self._buf[end + 4:]
                self._head, self._speaker = head, speaker
                # Behind on its work, the aggregator sheds before reading the body (the cost a
                # shed saves), as the aiohttp route does; the body is then read and dropped.
                shed = self.door.service.shed(speaker)
                if shed is not None:
                    self._answer(shed_answer(shed), head.close)
                    self._drop_body(head)
                    continue
            if len(self._buf) < head.length:
                if self._timer is None:
                    self._timer = asyncio.get_running_loop().call_later(self.door.body_timeout_seconds,
                                                                        self._body_timeout)
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            body, self._buf = self._buf[:head.length], self._buf[head.length:]
            self._head = None
            self._answer(self._take(body), head.close)
            if head.close:
                transport.close()
                return

    def _take(self, body: bytes) -> Answer:
        try:
            return outcome_answer(self.door.service.receive(body, self._speaker, time.perf_counter()))
        except Exception:  # as app.py's no_5xx_from_input: a logged 500, never a dropped connection
            log.exception("unexpected error serving POST /v1/reports")
            return error_answer(500, *INTERNAL)

    def _drop_body(self, head: _Head) -> None:
        """An answered request's body is read and dropped within the lingering time (aiohttp's
        lingering close), then the connection goes on; not within it, it is closed."""
        self._head = None
        self._skip = head.length
        self._close_after_skip = head.close
        if self._skip > len(self._buf) and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.door.lingering_seconds, self._linger_expired)

    def _linger_expired(self) -> None:
        self._timer = None
        if self.transport is not None:
            self.transport.close()

    def _body_timeout(self) -> None:
        """The body did not arrive within ``server.body_timeout_seconds``: 408, as read_body's."""
        self._timer = None
        head = self._head
        if head is None or self.transport is None or self.transport.is_closing():
            return
        refused = self.door.service.refuse(408, "body_timeout",
                                           f"body not complete within {self.door.body_timeout_seconds:g}s")
        self._answer(outcome_answer(refused), head.close)
        self._drop_body(head)
        self._serve()

    def _answer(self, answer: Answer, close: bool) -> None:
        assert self.transport is not None
        self.door.answered += 1
        head = (_status_line(answer.status, answer.content_type)
                + (f"Retry-After: {answer.retry_after_seconds}\r\n" if answer.retry_after_seconds is not None else "")
                + f"Content-Length: {len(answer.body)}\r\nDate: {rfc822_formatted_time()}\r\n"
                  f"Server: {SERVER_SOFTWARE}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
        self.transport.write(head.encode() + answer.body)
        self._idle_since = time.monotonic()
        if self._idle_timer is None and not close:
            self._idle_timer = asyncio.get_running_loop().call_later(self.door.keepalive_timeout_seconds,
                                                                      self._idle_check)

    def _idle_check(self) -> None:
        """A keep-alive connection with no whole request for ``keepalive_timeout_seconds`` since its
        last answer is closed (aiohttp's keep-alive timer); one timer a connection, re-armed lazily."""
        self._idle_timer = None
        if self.transport is None or self.transport.is_closing() or self.inner is not None:
            return
        waited = time.monotonic() - self._idle_since
        if self._head is None and not self._skip and waited >= self.door.keepalive_timeout_seconds:
            self.transport.close()
            return
        self._idle_timer = asyncio.get_running_loop().call_later(
            max(0.05, self.door.keepalive_timeout_seconds - waited), self._idle_check)
