"""sd_notify: READY/WATCHDOG/STOPPING datagrams reach a systemd-style notify socket, from the
notifier alone and from a running `vigil agent`; without a socket nothing is sent or raised."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from vigil.agent.daemon import watchdog_pings
from vigil.agent.sd_notify import SdNotifier


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    # A short directory: AF_UNIX paths must fit in 108 bytes, which pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="vsd") as root:
        path = os.path.join(root, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(10)
        try:
            yield sock, path
        finally:
            sock.close()


def test_ready_watchdog_stopping_reach_the_socket(notify_socket) -> None:
    sock, path = notify_socket
    notifier = SdNotifier(path)
    assert notifier.ready("serving 127.0.0.1:9400") and notifier.watchdog() and notifier.stopping()
    assert [sock.recv(4096).decode() for _ in range(3)] == ["READY=1\nSTATUS=serving 127.0.0.1:9400",
                                                           "WATCHDOG=1", "STOPPING=1"]


def test_abstract_socket_address() -> None:
    name = f"vigil-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert SdNotifier("@" + name).ready()
        assert sock.recv(64) == b"READY=1"


def test_outside_systemd_nothing_is_sent() -> None:
    notifier = SdNotifier.from_environment({})
    assert not notifier.enabled and notifier.watchdog_interval_seconds is None
    assert notifier.ready() is False


def test_a_dead_socket_is_counted_not_raised(tmp_path: Path) -> None:
    notifier = SdNotifier(str(tmp_path / "gone"))
    assert notifier.watchdog() is False and notifier.watchdog() is False
    assert notifier.failures == 2


def test_watchdog_interval_from_the_environment() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000"}
    assert SdNotifier.from_environment(env).watchdog_interval_seconds == 15.0
    # WATCHDOG_PID names another process (a parent that exec'd us keeps it): not ours to ping.
    other = {**env, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert SdNotifier.from_environment(other).watchdog_interval_seconds is None
    assert SdNotifier.from_environment({**env, "WATCHDOG_USEC": "0"}).watchdog_interval_seconds is None


async def test_watchdog_pings_until_stopped(notify_socket) -> None:
    sock, path = notify_socket
    stop = asyncio.Event()
    task = asyncio.create_task(watchdog_pings(SdNotifier(path, watchdog_usec=20_000), stop))
    loop = asyncio.get_running_loop()
    first = await loop.run_in_executor(None, sock.recv, 64)
    second = await loop.run_in_executor(None, sock.recv, 64)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert first == second == b"WATCHDOG=1"


def test_running_agent_notifies_ready_and_pings(notify_socket, tmp_path: Path) -> None:
    sock, path = notify_socket
    config = tmp_path / "agent.yml"
    off = {"enabled": False}
    config.write_text(yaml.safe_dump({"collectors": {"training": off, "xid": off, "rdma": off}}))
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vigil", "agent", "--config", str(config), "--backend",
                                 "fake", "--listen", "127.0.0.1:0", "--node", "sd-test", "--log-level", "WARNING"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            messages = [sock.recv(4096).decode() for _ in range(3)]
        except TimeoutError:
            pytest.fail(f"no notification from the agent:\n{log.read_text()[-2000:]}")
        assert messages[0].startswith("READY=1\nSTATUS=serving 127.0.0.1:")
        assert messages[1:] == ["WATCHDOG=1", "WATCHDOG=1"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    deadline = time.monotonic() + 5
    tail = []
    while time.monotonic() < deadline:
        message = sock.recv(4096).decode()
        tail.append(message)
        if message == "STOPPING=1":
            break
    assert tail[-1] == "STOPPING=1"
