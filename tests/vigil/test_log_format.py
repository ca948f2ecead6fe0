"""``--log-format json``: the agent and the aggregator log one JSON object per line (issue 17)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("command", ["agent", "aggregator"])
def test_json_log_lines_parse(tmp_path: Path, command: str) -> None:
    extra = ["--backend", "fake", "--node", "json-node"] if command == "agent" else \
        ["--store", str(tmp_path / "s.sqlite")]
    log = tmp_path / "err.log"
    with log.open("w") as err, subprocess.Popen(
            [sys.executable, "-m", "vigil", command, "--listen", "127.0.0.1:0", "--log-format", "json", *extra],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert "listening on" in proc.stdout.readline(), log.read_text()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert lines, "no log lines"
    for line in lines:
        assert {"ts", "level", "logger", "message"} <= line.keys()
        assert line["ts"].endswith("+00:00")
