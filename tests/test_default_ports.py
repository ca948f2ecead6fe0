"""The session-wide guard over the shipped default ports (tests/conftest.py): which ports it holds,
and that a service started on one of them in a test is refused."""

from __future__ import annotations

import errno
import socket

import pytest

from tests.conftest import default_ports
from tests.loopback import free_port, hold_ports


def test_the_guard_holds_every_shipped_default() -> None:
    # The agent's /metrics (19400), its heartbeat listener (9401), the aggregator's (9500).
    assert default_ports() == {19400, 9401, 9500}


@pytest.mark.parametrize("port", sorted(default_ports()))
@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_test_cannot_listen_on_a_default_port(port: int, kind: int, host: str) -> None:
    with socket.socket(socket.AF_INET, kind) as s:
        # asyncio's servers set SO_REUSEADDR on TCP: the guard's listening socket still refuses them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, kind == socket.SOCK_STREAM)
        with pytest.raises(OSError) as refused:
            s.bind((host, port))
    assert refused.value.errno == errno.EADDRINUSE


def test_a_port_held_elsewhere_is_left_to_its_holder() -> None:
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen(1)
        held = hold_ports({port})
    try:
        assert [s.type for s in held] == [socket.SOCK_DGRAM]  # TCP was taken; UDP was free
    finally:
        for s in held:
            s.close()
