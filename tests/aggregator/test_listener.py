"""The guarded listener: half-sent requests are shed at the connection limit and cut at the header
timeout, a complete request is served meanwhile, and accept errors are logged at a bounded rate."""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import Counter

import pytest
from aiohttp import web

from vigil.aggregator.listener import ConnectionGuard, ServerConfig


async def healthz(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def serve(config: ServerConfig, counts: Counter[str]) -> tuple[web.AppRunner, asyncio.Server, ConnectionGuard]:
    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    guard = ConnectionGuard(runner.server, config, lambda reason: counts.update([reason]))
    server = await asyncio.get_running_loop().create_server(guard, "127.0.0.1", 0)
    return runner, server, guard


async def get_healthz(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    answer = await reader.read()
    writer.close()
    return answer


async def test_half_sent_connections_are_shed_oldest_first_and_a_whole_request_is_served() -> None:
    counts: Counter[str] = Counter()
    runner, server, guard = await serve(ServerConfig(max_connections=16, header_timeout_seconds=60), counts)
    port = server.sockets[0].getsockname()[1]
    idle = []
    try:
        assert guard.limit == 16
        for _ in range(24):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/reports HTTP/1.1\r\nHost: t\r\nContent-Le")
            idle.append((reader, writer))
        # The oldest are closed by the server (EOF), the newest stay open.
        async with asyncio.timeout(10):
            assert await idle[0][0].read() == b""
        assert (await get_healthz(port)).startswith(b"HTTP/1.1 200")
        assert counts["shed"] >= 24 - 16 + 1
        assert guard.open <= guard.limit + 1
    finally:
        for _, writer in idle:
            writer.close()
        server.close()
        await runner.cleanup()


async def test_headers_not_finished_in_time_close_the_connection_and_are_counted() -> None:
    counts: Counter[str] = Counter()
    runner, server, _ = await serve(ServerConfig(header_timeout_seconds=0.2), counts)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHo")
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # closed by the server, nothing answered
        writer.close()
        assert counts["header_timeout"] == 1
        # A request that completes its headers in time is not affected.
        assert (await get_healthz(port)).startswith(b"HTTP/1.1 200")
        assert counts["header_timeout"] == 1
    finally:
        server.close()
        await runner.cleanup()


async def test_accept_errors_are_counted_each_and_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    counts: Counter[str] = Counter()
    runner, server, guard = await serve(ServerConfig(), counts)
    try:
        handle = guard.exception_handler(None)
        loop = asyncio.get_running_loop()
        with caplog.at_level(logging.ERROR, logger="vigil.aggregator.listener"):
            for _ in range(10_000):
                handle(loop, {"message": "socket.accept() out of system resource",
                              "exception": OSError(errno.EMFILE, "Too many open files")})
        assert counts["accept_error"] == 10_000
        assert len(caplog.records) == 1 and "Too many open files" in caplog.records[0].getMessage()
    finally:
        server.close()
        await runner.cleanup()
