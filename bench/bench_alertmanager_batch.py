"""A 1,000-alert Alertmanager POST against the real aggregator process, while /healthz is polled.

It starts ``vigil aggregator`` (dry_run false, a real store on disk, a webhook actuator to a
loopback receiver), sends one version-4 webhook body of 1,000 firing alerts that each name a
``vigil_action``, and polls ``/healthz`` every 10 ms meanwhile. It reports the slowest /healthz
answer (budget 100 ms: the batch is judged and written in ONE transaction, one fsync) and the
POST's own duration. It asserts nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from bench.measure import Measurement
from vigil.aggregator.auth import new_secret, node_token
from vigil.contract.wire import Report, encode

ALERTS = 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def payload(n: int, now: float) -> bytes:
    starts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    alerts = [{"status": "firing", "labels": {"alertname": "SiteGpuCheck", "node": f"bench-{i:04d}",
                                              "vigil_action": "drain", "gpu": str(i % 8)},
               "annotations": {"summary": f"site check failed on bench-{i:04d}"}, "startsAt": starts,
               "fingerprint": f"{i:016x}"} for i in range(n)]
    return json.dumps({"version": "4", "status": "firing", "receiver": "vigil-aggregator", "groupKey": "{}",
                       "alerts": alerts}).encode()


def measure() -> list[Measurement]:
    with tempfile.TemporaryDirectory(prefix="vigil-am-batch-") as d:
        tmp = Path(d)
        port = _free_port()
        # As deployed: acting (dry_run false) needs credentials; alerts may name only nodes that
        # reported, so every bench node reports once, with its own token, before the batch.
        secret = new_secret()
        (tmp / "site.secret").write_text(secret + "\n")
        (tmp / "site.secret").chmod(0o600)  # the aggregator refuses a credential others may read
        am_token = new_secret()
        (tmp / "alertmanager.token").write_text(am_token + "\n")
        (tmp / "alertmanager.token").chmod(0o600)
        (tmp / "agg.yaml").write_text(yaml.safe_dump({
            "listen": f"127.0.0.1:{port}", "store_path": str(tmp / "store.sqlite"), "dry_run": False,
            "gate": {"breaker_startup_grace_seconds": 0},
            "auth": {"site_secret_file": str(tmp / "site.secret"),
                     "alertmanager_token_file": str(tmp / "alertmanager.token")},
        }))
        base = f"http://127.0.0.1:{port}"
        with open(tmp / "agg.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "vigil", "aggregator", "--config", str(tmp / "agg.yaml")],
                                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    urllib.request.urlopen(base + "/healthz", timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("aggregator did not start") from None
                    time.sleep(0.1)
            for i in range(ALERTS):
                node = f"bench-{i:04d}"
                report = Report(node=node, boot_id="bench", seq=1, ts=time.time(), interval_seconds=2.5)
                urllib.request.urlopen(urllib.request.Request(
                    base + "/v1/reports", data=encode(report), method="POST",
                    headers={"Content-Type": "application/json",
                             "Authorization": f"Bearer {node_token(secret.encode(), node)}"}), timeout=10).close()
            latencies: list[float] = []
            done = threading.Event()

            def poll() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    urllib.request.urlopen(base + "/healthz", timeout=10).close()
                    latencies.append(time.perf_counter() - t)
                    time.sleep(0.01)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            time.sleep(0.2)
            body = payload(ALERTS, time.time())
            request = urllib.request.Request(base + "/v1/alertmanager", data=body, method="POST",
                                             headers={"Content-Type": "application/json",
                                                      "Authorization": f"Bearer {am_token}"})
            started = time.perf_counter()
            with urllib.request.urlopen(request, timeout=60) as resp:
                answer = json.loads(resp.read())
            post_seconds = time.perf_counter() - started
            time.sleep(0.3)
            done.set()
            poller.join(timeout=15)
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
    worst = max(latencies) * 1000
    return [Measurement(f"/healthz during a {ALERTS}-alert Alertmanager POST (worst)", worst, "ms", 100.0,
                        note=f"{len(latencies)} polls; the POST took {post_seconds * 1000:.0f} ms, "
                             f"{answer['proposed']} proposed, {len(answer['admitted'])} admitted or alerted "
                             "(breaker budget), one transaction")]


if __name__ == "__main__":
    for m in measure():
        print(m)
