"""Loopback HTTP peers that hold a request open, for the acting path's deadline tests.

``TricklingReceiver`` answers a whole, valid HTTP response one byte every ``interval_seconds``
(each read of the client succeeds well within any per-read timeout; only a total deadline cuts
it off); ``SilentReceiver`` reads the request and never answers. Both count the connections
they hold and those the client cut, and ``RecordingAlertmanager`` answers Alertmanager's routes
at once and keeps what was posted. All stop on ``close`` (their threads end on an event).
"""

from __future__ import annotations

import abc
import contextlib
import json
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# 61 bytes: at one byte every 0.2 s the whole answer takes ~12 s.
TRICKLED_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class _HoldingServer(abc.ABC):
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.accepted = 0  # connections taken
        self.holding = 0  # connections open now
        self.cut = 0  # connections the client closed before the answer was whole
        self.completed = 0  # answers sent whole
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/vigil"
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, name=type(self).__name__, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self.holding += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        outcome = "cut"
        try:
            with conn:
                conn.settimeout(5)
                _read_request(conn)
                outcome = self.answer(conn)
        except OSError:
            pass
        finally:
            with self._lock:
                self.holding -= 1
                if outcome == "cut":
                    self.cut += 1
                elif outcome == "completed":
                    self.completed += 1

    @abc.abstractmethod
    def answer(self, conn: socket.socket) -> str:
        """Answer (or hold) one request; returns "cut" or "completed"."""

    def _peer_closed(self, conn: socket.socket, wait_seconds: float) -> bool:
        """Waits up to ``wait_seconds`` (or until stopped); True when the client closed or shut
        the connection down meanwhile."""
        if self._stop.wait(0):
            return False
        readable, _, _ = select.select([conn], [], [], wait_seconds)
        if not readable:
            return False
        try:
            return conn.recv(1024) == b""
        except OSError:
            return True

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._accepting.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


class TricklingReceiver(_HoldingServer):
    def __init__(self, interval_seconds: float = 0.2) -> None:
        self.interval_seconds = interval_seconds
        super().__init__()

    def answer(self, conn: socket.socket) -> str:
        for i in range(len(TRICKLED_ANSWER)):
            try:
                conn.sendall(TRICKLED_ANSWER[i:i + 1])
            except OSError:
                return "cut"
            if i == len(TRICKLED_ANSWER) - 1:
                break
            if self._peer_closed(conn, self.interval_seconds):
                return "cut"
            if self._stop.is_set():
                return "stopped"
        return "completed"


class SilentReceiver(_HoldingServer):
    def answer(self, conn: socket.socket) -> str:
        while not self._stop.is_set():
            if self._peer_closed(conn, 0.1):
                return "cut"
        return "stopped"


class RecordingAlertmanager:
    """Answers ``/-/ready`` and ``/api/v2/alerts`` at once; ``alerts`` holds every alert posted."""

    def __init__(self) -> None:
        self.alerts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(b"[]")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with owner._lock:
                    owner.alerts.extend(json.loads(body))
                self._answer(b"")

            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="alertmanager", daemon=True)
        self._thread.start()

    def nodes(self) -> list[str]:
        with self._lock:
            return [a["labels"]["node"] for a in self.alerts]

    def close(self) -> None:
        self.server.shutdown()
        with contextlib.suppress(OSError):
            self.server.server_close()
        self._thread.join(timeout=5)
