"""Loopback ports for tests that start servers.

``bind(0)`` hands out ports from the kernel's ephemeral range, the same range every outgoing
connection takes its source port from (Prometheus scraping, HTTP clients), so a port chosen that
way can be taken by a connection before the server under test binds it. These ports come from
below the ephemeral range, are checked free for TCP and UDP, and are never handed out twice by one
test process.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20000, 32000  # Linux's default ephemeral range starts at 32768
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
