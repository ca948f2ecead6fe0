"""A second agent on one host (issue 41): ``--heartbeat-listen`` and ``--heartbeat-socket`` give it
its own heartbeat listeners; one started on another agent's fails at once with one line naming the
setting and the flag (no traceback), and never takes over the first agent's Unix socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.loopback import free_port
from tests.pidfile import stop_children

START_TIMEOUT_SECONDS = 30


def _command(tmp_path: Path, node: str, heartbeat_port: int, sock: Path) -> list[str]:
    kmsg = tmp_path / f"{node}.kmsg"
    kmsg.touch()
    return [sys.executable, "-m", "vigil", "agent", "--backend", "fake", "--node", node, "--listen", "127.0.0.1:0",
            "--kmsg", str(kmsg), "--heartbeat-listen", f"127.0.0.1:{heartbeat_port}",
            "--heartbeat-socket", str(sock)]


@contextmanager
def _running(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("w") as err, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err) as proc:
        try:
            assert proc.stdout is not None
            assert b"listening on" in proc.stdout.readline(), log.read_text()
            yield proc
        finally:
            stop_children([proc])


def _refused(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_SECONDS, check=False)
    assert done.returncode == 1, done.stderr
    assert "listening on" not in done.stdout
    assert "Traceback" not in done.stderr
    return done.stderr.strip().splitlines()[-1]


def test_a_second_agent_on_one_host_fails_fast_on_a_taken_listener_and_runs_on_its_own(tmp_path: Path) -> None:
    first_port, second_port = free_port(), free_port()
    first_sock, second_sock = tmp_path / "first.sock", tmp_path / "second.sock"
    with _running(_command(tmp_path, "first", first_port, first_sock), tmp_path / "first.log") as first:
        inode = os.stat(first_sock).st_ino
        # the same UDP/HTTP heartbeat port
        line = _refused(_command(tmp_path, "second", first_port, second_sock))
        assert f"cannot listen on 127.0.0.1:{first_port} (collectors.training.udp_listen)" in line
        assert "--heartbeat-listen" in line
        # with --log-format json, the refusal is one JSON line too, as every line before it
        done = subprocess.run([*_command(tmp_path, "second", first_port, second_sock), "--log-format", "json"],
                              capture_output=True, text=True, timeout=START_TIMEOUT_SECONDS, check=False)
        assert done.returncode == 1
        records = [json.loads(raw) for raw in (done.stdout + done.stderr).splitlines()]
        assert records[-1]["level"] == "ERROR" and "--heartbeat-listen" in records[-1]["message"]
        # its own port, the first agent's Unix socket: refused, the first's socket untouched
        line = _refused(_command(tmp_path, "second", second_port, first_sock))
        assert f"cannot listen on {first_sock} (collectors.training.unix_socket)" in line
        assert "--heartbeat-socket" in line
        assert os.stat(first_sock).st_ino == inode
        # its own of both: it runs beside the first
        with _running(_command(tmp_path, "second", second_port, second_sock), tmp_path / "second.log"):
            assert first.poll() is None
            assert second_sock.exists() and os.stat(first_sock).st_ino == inode
