"""``--log-format json``: the agent and the aggregator log one JSON object per line (issue 17); in
either format, text an outsider chose cannot forge a line or carry a control sequence (issue 37)."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.loopback import free_port
from vigil.cli.log_format import TRACEBACK_INDENT, configure_logging, escape_controls

# Raw characters no log line may hold (the test's own list: C0 but the line ends, DEL, C1,
# U+2028/2029, bidi overrides and isolates, surrogates).
_UNSAFE_CHARS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


@pytest.mark.parametrize("command", ["agent", "aggregator"])
def test_json_log_lines_parse(tmp_path: Path, command: str) -> None:
    extra = ["--backend", "fake", "--node", "json-node", "--heartbeat-listen", f"127.0.0.1:{free_port()}"] \
        if command == "agent" else \
        ["--store", str(tmp_path / "s.sqlite")]
    log = tmp_path / "err.log"
    with log.open("w") as err, subprocess.Popen(
            [sys.executable, "-m", "vigil", command, "--listen", "127.0.0.1:0", "--log-format", "json", *extra],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
        try:
            assert proc.stdout is not None
            ready = proc.stdout.readline()
            assert "listening on" in ready, log.read_text()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()
            out = ready + proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    # Every line on either stream, the ready line a supervisor waits for included (issue 41).
    lines = [json.loads(line) for line in (out + log.read_text()).splitlines() if line.strip()]
    assert lines, "no log lines"
    assert json.loads(ready)["message"].startswith(f"vigil {command} listening on 127.0.0.1:")
    for line in lines:
        assert {"ts", "level", "logger", "message"} <= line.keys()
        assert line["ts"].endswith("+00:00")


# What an outsider can put in a logged string: a forged next record, a terminal escape (colour,
# cursor, title), a C1 CSI, a Unicode line separator, a bidi override, an unpaired surrogate.
HOSTILE = ("job\n2026-01-01 00:00:00,000 ERROR vigil.aggregator: FORGED\r\x1b[31mred\x1b]0;title\x07"
           "\x9b2J\u2028sep\u202eevil\ud800\x00end")
LOGGERS = ("vigil.contract.node_actions", "vigil.aggregator.outbox")


def _log_through_configure(fmt: str, capsys: pytest.CaptureFixture[str], with_exception: bool = False) -> str:
    configure_logging("INFO", fmt)  # the handler the commands install, on this test's stderr
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.warning("heartbeat for job %s refused (%r)", HOSTILE, HOSTILE)  # args
        logger.warning(HOSTILE)  # the message itself
        if with_exception:
            try:
                raise ValueError(HOSTILE)
            except ValueError:
                logger.exception("failed on %s", HOSTILE)
    return capsys.readouterr().err


def test_text_log_lines_cannot_be_forged_and_carry_no_control_characters(
        capsys: pytest.CaptureFixture[str]) -> None:
    err = _log_through_configure("text", capsys, with_exception=True)
    records = [line for line in err.split("\n") if line and not line.startswith(TRACEBACK_INDENT)]
    assert len(records) == 3 * len(LOGGERS)  # one line each: no forged record, tracebacks indented
    assert all(" WARNING vigil." in line or " ERROR vigil." in line for line in records)
    assert not any(line.startswith("2026-01-01") for line in err.split("\n"))
    assert _UNSAFE_CHARS.search(err) is None  # no raw control, separator, override or surrogate
    assert "job\\n2026-01-01 00:00:00,000 ERROR vigil.aggregator: FORGED\\r\\x1b[31mred" in err
    assert "\\x9b2J\\u2028sep\\u202eevil\\ud800\\x00end" in err
    assert err.encode("utf-8")  # writable as UTF-8: the surrogate did not lose the record


def test_json_log_lines_stay_valid_json_and_keep_the_text(capsys: pytest.CaptureFixture[str]) -> None:
    err = _log_through_configure("json", capsys, with_exception=True)
    lines = err.splitlines()
    assert len(lines) == 3 * len(LOGGERS)
    assert _UNSAFE_CHARS.search(err) is None
    parsed = [json.loads(line) for line in lines]
    assert {p["logger"] for p in parsed} == set(LOGGERS)
    assert parsed[1]["message"] == HOSTILE  # JSON escapes decode back to exactly what was logged
    assert HOSTILE in parsed[2]["exc"]


def test_escape_controls_leaves_ordinary_text_alone() -> None:
    text = "job llm-7b rank 3 on gpu-node-7: Xid 79 (GPU has fallen off the bus) ünïcödé 日本"
    assert escape_controls(text) is text
    assert escape_controls("a\tb\x7f") == "a\\tb\\x7f"
