"""Fatal Xid in the kernel log -> decision delivered to the actuator, over real processes.

One aggregator (gate on, not dry run, the signed-webhook actuator pointing at a receiver in this
process) and NODES agent processes on the fake backend, each following its own kernel-log file.
For each node an Xid 79 line is appended at a known time; the figure is the time until the
webhook receiver holds that node's decision (DESIGN.md section 9: <= 2 s p95).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from bench.measure import Measurement
from vigil.aggregator.auth import new_secret, node_token

NODES = 20
XID_79 = ("[ 2071.315227] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
          "GPU has fallen off the bus.\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Receiver(BaseHTTPRequestHandler):
    arrivals: dict[str, float] = {}

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        node = json.loads(body).get("node", "")
        self.arrivals.setdefault(node, time.monotonic())
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _wait(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=0.5).read()
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def measure() -> list[Measurement]:
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    hook = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    exe = [sys.executable, "-m", "vigil"]
    with tempfile.TemporaryDirectory(prefix="vigil-latency-") as d:
        tmp = Path(d)
        try:
            agg_port = _free_port()
            (tmp / "hook.secret").write_text("bench-secret\n")
            # As deployed: acting needs credentials, and each agent reports with its node token.
            secret = new_secret()
            (tmp / "site.secret").write_text(secret + "\n")
            (tmp / "site.secret").chmod(0o600)  # the aggregator refuses a credential others may read
            (tmp / "agg.yaml").write_text(yaml.safe_dump({
                "listen": f"127.0.0.1:{agg_port}", "store_path": str(tmp / "store.sqlite"), "dry_run": False,
                "auth": {"site_secret_file": str(tmp / "site.secret")},
                # Every node gets a fatal Xid here on purpose: let the breaker allow all of them.
                "gate": {"breaker_max_share": 1.0, "breaker_startup_grace_seconds": 0},
                "actuators": {"webhook": {"enabled": True, "url": hook, "secret_file": str(tmp / "hook.secret")}},
            }))
            procs.append(subprocess.Popen([*exe, "aggregator", "--config", str(tmp / "agg.yaml")], env=env,
                                          stdout=subprocess.DEVNULL, stderr=open(tmp / "agg.log", "wb")))  # noqa: SIM115
            _wait(f"http://127.0.0.1:{agg_port}/healthz", time.monotonic() + 30)
            ports = []
            for i in range(NODES):
                port = _free_port()
                ports.append(port)
                kmsg = tmp / f"node-{i}.kmsg"
                kmsg.write_text("")
                token = tmp / f"node-{i}.token"
                token.write_text(node_token(secret.encode(), f"lat-node-{i:02d}") + "\n")
                (tmp / f"node-{i}.yaml").write_text(yaml.safe_dump({
                    "node": f"lat-node-{i:02d}", "listen": f"127.0.0.1:{port}",
                    "nvml": {"backend": "fake"},
                    "aggregator": {"url": f"http://127.0.0.1:{agg_port}", "token_file": str(token)},
                    "collectors": {"training": {"enabled": False}},
                }))
                procs.append(subprocess.Popen([*exe, "agent", "--config", str(tmp / f"node-{i}.yaml"), "--kmsg",
                                               str(kmsg)], env=env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))
            for port in ports:
                _wait(f"http://127.0.0.1:{port}/healthz", time.monotonic() + 60)
            time.sleep(3.0)  # every agent has reported once and its follower sits at the end of its log
            written: dict[str, float] = {}
            for i in range(NODES):
                with open(tmp / f"node-{i}.kmsg", "a") as f:
                    written[f"lat-node-{i:02d}"] = time.monotonic()
                    f.write(XID_79)
                time.sleep(1.3)  # spread the faults so each is measured on its own
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and len(_Receiver.arrivals) < NODES:
                time.sleep(0.1)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
            receiver.shutdown()
    per_node = {n: round(_Receiver.arrivals[n] - t, 3) for n, t in written.items() if n in _Receiver.arrivals}
    latencies = sorted(per_node.values())
    missing = NODES - len(latencies)
    if not latencies:
        raise RuntimeError("no decision reached the webhook receiver")
    p95 = latencies[min(len(latencies) - 1, round(0.95 * len(latencies)) - 1)]
    p50 = latencies[len(latencies) // 2]
    return [Measurement("fatal Xid in the kernel log -> decision delivered to the actuator (p95)", p95, "s", 2.0,
                        note=f"{len(latencies)} nodes, real agent + aggregator processes, signed webhook; "
                             f"p50 {p50:.2f} s, max {latencies[-1]:.2f} s" + (f"; {missing} never arrived" if missing
                                                                               else ""))]


if __name__ == "__main__":
    for m in measure():
        print(m)
