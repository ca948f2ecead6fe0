"""One HTTP exchange held to a total deadline: connect, TLS, headers and body together.

urllib's ``timeout`` bounds each socket operation, so a receiver that trickles one byte every
few seconds is never cut off. ``exchange`` sends a request through urllib (proxies, TLS and
redirect handling as ``urlopen``) while a watchdog timer shuts the connection's socket down at
the deadline, whatever it is doing; what was read by then is discarded and ``DeadlineExceeded``
is raised. It decides nothing about the answer (the actuator does) and keeps no state across
exchanges. Name resolution (getaddrinfo) cannot be interrupted: it is bounded by the resolver's
own timeouts, and the dispatcher stops waiting on it at the deadline (aggregator/dispatch.py).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import urllib.error
import urllib.request
from typing import Any

from vigil.aggregator.actuators.actuator import DeadlineExceeded, DeliveryError
from vigil.aggregator.redact import redact_text

# An answer's body is read whole (Alertmanager's alert list, a receiver's error text); more than
# this from one receiver is refused rather than buffered (a receiver cannot grow our memory).
MAX_ANSWER_BYTES = 4 * 1024 * 1024


class _Watch:
    """The connections of one exchange, and the watchdog's verdict on them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.expired = False
        self._done = False

    def connected(self, sock: socket.socket | None) -> None:
        """Called once a connection's socket exists: shut it at once if the deadline passed."""
        if sock is None:
            return
        with self._lock:
            self._socks.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)

    def finish(self) -> None:
        with self._lock:
            self._done = True


def _shut(sock: socket.socket) -> None:
    """Shut the socket down under whoever is blocked on it (their recv returns, send fails).
    The plain socket's method even for TLS: ``SSLSocket.shutdown`` also drops its TLS state,
    which the thread reading it still uses."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _HTTPConnection(http.client.HTTPConnection):
    watch: _Watch

    def connect(self) -> None:
        super().connect()
        self.watch.connected(self.sock)


class _HTTPSConnection(http.client.HTTPSConnection):
    watch: _Watch

    def connect(self) -> None:
        # The TCP socket is registered before the TLS handshake, so a trickled handshake is cut too.
        http.client.HTTPConnection.connect(self)
        self.watch.connected(self.sock)
        super().connect()
        self.watch.connected(self.sock)


def _factory(cls: type[http.client.HTTPConnection], watch: _Watch) -> Any:
    def make(host: str, **kwargs: Any) -> http.client.HTTPConnection:
        conn = cls(host, **kwargs)
        conn.watch = watch  # type: ignore[attr-defined]
        return conn

    return make


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self._watch = watch

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_factory(_HTTPConnection, self._watch), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, watch: _Watch, context: ssl.SSLContext | None) -> None:
        super().__init__(context=context)
        self._watch = watch
        self._ctx = context

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_factory(_HTTPSConnection, self._watch), req, context=self._ctx)


def exchange(request: urllib.request.Request, deadline_seconds: float, shown: str, *,
             context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """Send ``request`` and read its whole answer within ``deadline_seconds`` in all; returns
    (status, body) for any HTTP status. Raises ``DeadlineExceeded`` at the deadline and
    ``DeliveryError`` for the other failures (a refused connection, a malformed answer, one too
    large), each starting with ``shown`` (the method and the redacted URL), its text redacted."""
    watch = _Watch()
    opener = urllib.request.build_opener(_HTTPHandler(watch), _HTTPSHandler(watch, context))
    timer = threading.Timer(deadline_seconds, watch.expire)
    timer.daemon = True
    timer.start()
    expired = DeadlineExceeded(f"{shown}: no whole answer within the deadline of {deadline_seconds:g} s")
    try:
        try:
            with opener.open(request, timeout=deadline_seconds) as response:
                answer = response.status, _read(response)
        except urllib.error.HTTPError as exc:
            with exc:  # it holds the response's socket
                answer = exc.code, _read(exc)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        # A socket timeout is the deadline too: each operation's own timeout is the whole budget.
        if watch.expired or isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            raise expired from None
        raise DeliveryError(f"{shown}: {redact_text(str(exc))}") from None
    finally:
        watch.finish()
        timer.cancel()
    if watch.expired:  # a body read to its end-of-file: the end may be the watchdog's shutdown
        raise expired
    return answer


def _read(response: Any) -> bytes:
    body: bytes = response.read(MAX_ANSWER_BYTES + 1)
    if len(body) > MAX_ANSWER_BYTES:
        raise ValueError(f"the answer is larger than {MAX_ANSWER_BYTES} bytes")
    return body
