"""``vigil aggregator`` as a process: starts on safe defaults, answers, stops on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.loopback import free_port
from vigil.cli import main

REPO = Path(__file__).resolve().parents[2]




def test_config_typo_exits_2_naming_the_key(tmp_path, capsys):
    cfg = tmp_path / "agg.yaml"
    cfg.write_text("detectors:\n  hang:\n    stall_secnds: 5\n")
    assert main(["aggregator", "--config", str(cfg)]) == 2
    assert "detectors.hang.stall_secnds: unknown key" in capsys.readouterr().err
    assert main(["aggregator", "--listen", "nowhere"]) == 2


def test_serves_and_stops_on_sigterm(tmp_path):
    port = free_port()
    token = tmp_path / "token"
    token.write_text("s" * 40 + "\n")
    token.chmod(0o600)  # the aggregator refuses a credential others may read
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "vigil", "aggregator", "--listen", f"127.0.0.1:{port}",
                             "--site-secret-file", str(token), "--store", str(tmp_path / "d.sqlite")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
                    health = json.load(resp)
                break
            except OSError:
                time.sleep(0.1)
        assert health == {"status": "ok", "nodes": 0, "dry_run": True, "role": "leader"}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/reports", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=2)
        assert err.value.code == 401
        err.value.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
