"""A real ``vigil aggregator`` process and a loopback webhook receiver, for end-to-end tests.

``AggregatorProcess`` writes a config, starts ``python -m vigil aggregator --config ...`` on
127.0.0.1, waits for its "listening" line, and stops it by pid (SIGTERM, or SIGKILL to crash it).
``WebhookReceiver`` is the site's side of the webhook: it verifies each request with the snippet
docs/webhooks.md documents (signature, timestamp), applies each ``Idempotency-Key`` once (as a
receiver of at-least-once delivery must), and can be told to fail or to hold requests. Both are
bounded in time and loopback only.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tests.documented_webhook import WebhookRefused, verify_webhook
from tests.loopback import free_port
from vigil.aggregator.auth import node_token
from vigil.contract.wire import Report, encode

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = 20.0
SECRET = b"webhook-shared-secret"
# The aggregator's credentials in these tests (README "Security"): a site secret for node
# tokens, and one token per role.
SITE_SECRET = "site-secret-of-the-test-aggregator-0123456789"
ROLE_TOKENS = {"alertmanager": "alertmanager-token-0123456789", "operator": "operator-token-0123456789",
               "read": "read-token-0123456789abcdef"}




def wait_for(what: str, check: Callable[[], bool], timeout_seconds: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what}")
        time.sleep(0.05)


class WebhookReceiver:
    """``fail_status``: answer every request with it (an outage); ``fail_first``: answer the next
    N requests with 500 (a flaky receiver); ``hold``: keep each request open until released (a
    slow receiver). ``applied`` counts each key's first valid arrival; ``in_flight`` the requests
    applied and not yet answered (a refused one is answered at once and never counted there)."""

    def __init__(self, secret: bytes = SECRET) -> None:
        self.secret = secret
        self.fail_status: int | None = None
        self.fail_first = 0
        self.hold = threading.Event()
        self.hold.set()  # set: answer at once
        self.arrivals: Counter[str] = Counter()  # key -> requests seen (retries and repeats included)
        self.applied: dict[str, dict[str, Any]] = {}  # key -> the decision, applied once
        self.bad_signatures = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    verify_webhook(receiver.secret, self.headers, body)
                except WebhookRefused:
                    with receiver._lock:
                        receiver.bad_signatures += 1
                    self._answer(401)
                    return
                key = self.headers.get("Idempotency-Key", "")
                with receiver._lock:
                    receiver.arrivals[key] += 1
                    failing = receiver.fail_status
                    if failing is None and receiver.fail_first > 0:
                        receiver.fail_first -= 1
                        failing = 500
                    if failing is None:
                        # Applied before answering, as a real receiver commits first: the sender
                        # may still die before it reads the 200, and send it again.
                        receiver.applied.setdefault(key, json.loads(body))
                        receiver.in_flight += 1
                if failing is not None:  # a refusal answers at once: never in flight
                    self._answer(failing)
                    return
                try:
                    receiver.hold.wait(timeout=30)  # only a success is slow
                    self._answer(200)
                finally:
                    with receiver._lock:
                        receiver.in_flight -= 1

            def _answer(self, status: int) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the sender is gone (killed mid-request)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/vigil"
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)
        self._thread.start()

    def actions(self) -> Counter[str]:
        with self._lock:
            return Counter(d["action"] for d in self.applied.values())

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


class AggregatorProcess:
    def __init__(self, root: Path, config: dict[str, Any], store_path: Path | None = None) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = root / "aggregator.yaml"
        self.store_path = store_path or root / "decisions.sqlite"
        (root / "site.secret").write_text(SITE_SECRET + "\n")
        (root / "site.secret").chmod(0o600)  # the aggregator refuses a credential others may read
        auth = {"site_secret_file": str(root / "site.secret")}
        for role, token in ROLE_TOKENS.items():
            (root / f"{role}.token").write_text(token + "\n")
            (root / f"{role}.token").chmod(0o600)
            auth[f"{role}_token_file"] = str(root / f"{role}.token")
        config = {"auth": auth, **config, "listen": f"127.0.0.1:{self.port}", "store_path": str(self.store_path)}
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = root / "aggregator.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, nofile: int | None = None, env: dict[str, str] | None = None) -> None:
        """``nofile``: the process's open-file limit (RLIMIT_NOFILE), to provoke EMFILE; ``env``: more
        environment (libfaketime's, to step its clock)."""

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vigil", "aggregator", "--config", str(self.config_path)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                preexec_fn=limit if nofile is not None else None,
            )
        finally:
            log.close()
        try:
            wait_for("the aggregator to listen", self._listening, START_TIMEOUT_SECONDS)
        except AssertionError:
            self.stop()
            raise AssertionError(f"aggregator did not start:\n{self.log_path.read_text()[-3000:]}") from None

    def _listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"aggregator exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        return "listening on" in self.log_path.read_text()

    def kill(self) -> None:
        """A crash: SIGKILL, no clean-up of any kind."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None
        self._mark_log("--- killed ---")

    def stop(self) -> int | None:
        """SIGTERM by pid and reap it; returns its exit status."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._mark_log("--- stopped ---")
        return proc.returncode

    def _mark_log(self, line: str) -> None:
        # The "listening" check reads the log: a restart must wait for its own line.
        text = self.log_path.read_text().replace("listening on", "listened on")
        self.log_path.write_text(text + line + "\n")

    def post_report(self, report: Report) -> None:
        self.request("POST", "/v1/reports", encode(report), expect=202,
                     token=node_token(SITE_SECRET.encode(), report.node))

    def status(self, path: str) -> tuple[int, Any]:
        """(status, JSON body) of a GET with the read credential, whatever the status."""
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {ROLE_TOKENS['read']}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read() or b"null")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @staticmethod
    def token_for(method: str, path: str) -> str:
        """The credential of the role that may call ``method path`` (aggregator/auth.py's table)."""
        if method == "GET":
            return ROLE_TOKENS["read"]
        return ROLE_TOKENS["alertmanager" if path == "/v1/alertmanager" else "operator"]

    def request(self, method: str, path: str, body: bytes | None = None, expect: int = 200,
                token: str | None = None) -> Any:
        token = token if token is not None else self.token_for(method, path)
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                status, raw = exc.code, exc.read()
        assert status == expect, f"{method} {path}: {status} {raw[:500]!r}"
        return json.loads(raw) if raw else None

    def decisions(self) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        body = self.request("GET", "/v1/decisions?limit=1000")
        return body["decisions"], body.get("deliveries", {})


def slurm_aggregator_config(scontrol: str, slurm_conf: str) -> dict[str, Any]:
    """An aggregator that acts (not dry run) through the Slurm actuator, evaluating and delivering
    quickly enough for a test."""
    return {
        "dry_run": False,
        "evaluate_interval_seconds": 0.5,
        "actuators": {
            "slurm": {"enabled": True, "scontrol": scontrol, "slurm_conf": slurm_conf},
            "delivery": {"base_backoff_seconds": 0.2, "max_backoff_seconds": 1, "poll_seconds": 0.2},
        },
    }
