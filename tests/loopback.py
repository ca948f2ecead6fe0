"""Loopback ports for tests that start servers.

``bind(0)`` hands out ports from the kernel's ephemeral range, the same range every outgoing
connection takes its source port from (Prometheus scraping, HTTP clients), so a port chosen that
way can be taken by a connection before the server under test binds it. These ports come from
below the ephemeral range, are checked free for TCP and UDP, and are never handed out twice by one
test process. Under pytest-xdist (``make test`` runs the suite in parallel workers) each worker
draws from its own slice of that range, so two workers never pick the same port between one's
check and its server's bind. ``hold_ports`` keeps ports taken (the suite holds vigil's default
ports with it: tests/conftest.py).
"""

from __future__ import annotations

import errno
import os
import random
import socket
from collections.abc import Mapping

_LOW, _HIGH = 20000, 32000  # Linux's default ephemeral range starts at 32768


def _slice(low: int, high: int, environ: Mapping[str, str]) -> tuple[int, int]:
    """This process's part of [low, high): the whole of it, or under pytest-xdist the worker's
    own (``PYTEST_XDIST_WORKER`` gwN of ``PYTEST_XDIST_WORKER_COUNT``)."""
    worker, count = environ.get("PYTEST_XDIST_WORKER", ""), environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()
            and int(worker[2:]) < int(count)):
        return low, high
    index, total = int(worker[2:]), int(count)
    width = (high - low) // total
    return low + index * width, low + (index + 1) * width


_LOW, _HIGH = _slice(_LOW, _HIGH, os.environ)
_handed: set[int] = set()
_rng = random.Random()


def _bindable(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    for _ in range(1000):
        port = _rng.randrange(_LOW, _HIGH)
        if port not in _handed and _bindable(port):
            _handed.add(port)
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def hold_ports(ports: set[int]) -> list[socket.socket]:
    """A listening TCP socket and a UDP socket on 127.0.0.1 for each of ``ports``; a port already
    held (by another worker's guard, or a service on this machine) is left as it is: a test binding
    it fails either way. Neither socket sets SO_REUSEADDR, and the TCP one listens, so a later bind
    on the port, loopback or wildcard, is refused."""
    held: list[socket.socket] = []
    for port in sorted(ports):
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
            s = socket.socket(socket.AF_INET, kind)
            try:
                s.bind(("127.0.0.1", port))
                if kind == socket.SOCK_STREAM:
                    s.listen(1)
            except OSError as exc:
                s.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            held.append(s)
    return held
