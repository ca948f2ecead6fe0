"""Process and HTTP plumbing for the end-to-end tests: child processes stopped by pid at teardown,
free loopback ports, polling with a deadline, and a webhook receiver that records what it is sent."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.slurm_cluster import slurm_cluster  # noqa: F401 - a real slurmctld for the drain test

T = TypeVar("T")
SEARCH_PATH = "/usr/bin:/usr/sbin:/bin:/sbin:/usr/local/bin"


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SEARCH_PATH)




def http_json(url: str, body: Any = None, timeout_seconds: float = 2.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_seconds) as response:
        return json.loads(response.read() or b"null")


def wait_for(what: str, check: Callable[[], T | None], deadline: float, logs: Callable[[], str] = str) -> T:
    """Poll ``check`` until it returns something truthy or the monotonic ``deadline`` passes."""
    while True:
        try:
            result = check()
        except (OSError, urllib.error.URLError, ValueError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.25)


class Processes:
    """Children started by a test; each writes to its own log and is stopped by its pid."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("wb")
        try:
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        finally:
            log.close()
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}\n{self.logs()}")

    def logs(self, tail_chars: int = 1500) -> str:
        parts = []
        for name, _ in self.procs:
            text = (self.root / f"{name}.log").read_text(errors="replace")
            parts.append(f"--- {name} ---\n{text[-tail_chars:]}")
        return "\n".join(parts)

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


class WebhookReceiver:
    """Records the JSON bodies POSTed to it (Alertmanager's webhook), on a loopback port."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.authorizations: list[str] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                received.paths.append(self.path)
                received.authorizations.append(self.headers.get("Authorization", ""))
                received.bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test asserts on bodies, not on an access log

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    try:
        yield receiver
    finally:
        receiver.close()
