"""/metrics is gzip-compressed for a scraper that asks (Prometheus always does, as node_exporter
answers it) and identity otherwise, on the agent's listener and the aggregator's: the decoded body
is the plain one, byte for byte."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.test_agent_integration import START, FakeClock, make_agent
from tests.aggregator.conftest import proposals_ledger
from vigil.agent.runner import collect_once
from vigil.agent.server import make_app
from vigil.aggregator.app import make_app as make_aggregator_app
from vigil.aggregator.auth import Credentials
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.contract.scrape_encoding import accepts_gzip

# What Prometheus 2.x/3.x sends on a scrape (scrape/scrape.go: acceptHeader, acceptEncodingHeader).
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.53.0",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
}


@pytest.mark.parametrize(("header", "gzip_ok"), [
    ("gzip", True), ("GZIP", True), ("deflate, gzip;q=0.5", True), ("x-gzip", True), ("*", True),
    ("br;q=1, *;q=0.1", True),
    # the lookalikes that must stay identity
    (None, False), ("", False), ("identity", False), ("deflate, br", False), ("gzip;q=0", False),
    ("gzip;q=0.000", False), ("gzip;q=bogus", False), ("*;q=0", False), ("gzip;q=0, *", False),
    ("gzipped", False),
])
def test_accept_encoding_is_read_as_rfc_9110_says(header: str | None, gzip_ok: bool) -> None:
    assert accepts_gzip(header) is gzip_ok


async def _fetch(session: aiohttp.ClientSession, url: str,
                 headers: dict[str, str]) -> tuple[bytes, aiohttp.ClientResponse]:
    async with session.get(url, headers=headers) as resp:
        assert resp.status == 200
        return await resp.read(), resp


def _series(body: bytes) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items())))
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


async def _check_gzip_and_identity(url: str, *, same_bytes: bool = True) -> bytes:
    """``same_bytes``: the renders are identical (a frozen body); else series are compared, the
    values of a live process's own counters moving between the scrapes."""
    # auto_decompress off: the test sees the bytes on the wire, as Prometheus does before it decodes.
    async with aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=("Accept-Encoding",)) as session:
        wire, resp = await _fetch(session, url, PROMETHEUS_HEADERS)
        assert resp.headers["Content-Encoding"] == "gzip"
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "Accept-Encoding" in resp.headers["Vary"]
        plain, plain_resp = await _fetch(session, url, {k: v for k, v in PROMETHEUS_HEADERS.items()
                                                        if k != "Accept-Encoding"})
        assert "Content-Encoding" not in plain_resp.headers
        refused, refused_resp = await _fetch(session, url, {"Accept-Encoding": "gzip;q=0, deflate"})
        assert "Content-Encoding" not in refused_resp.headers
    assert plain.startswith(b"# HELP ")
    decoded = gzip.decompress(wire)
    if same_bytes:
        assert decoded == plain == refused
    else:
        assert _series(decoded) == _series(plain) == _series(refused)
    assert len(wire) < len(plain) / 4
    return plain


async def test_the_agents_metrics_are_gzipped_for_prometheus_and_identical_decoded(tmp_path: Path) -> None:
    clock = FakeClock(START + 60)
    agent = make_agent(tmp_path, "healthy-h100", clock)
    for c in agent.collectors:
        agent.snapshot.put(c.name, collect_once(c, clock.t))
    frozen = agent.render_metrics()  # one render served twice: the comparison is of encodings only
    app = make_app(snapshot=agent.snapshot, render_metrics=lambda: frozen, state_extra=dict,
                   intake=agent.heartbeats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        assert await _check_gzip_and_identity(f"http://127.0.0.1:{port}/metrics") == frozen
    finally:
        await runner.cleanup()
        for c in agent.collectors:
            c.close()


@pytest.fixture
async def aggregator() -> AsyncIterator[TestClient]:
    config = parse_config({"evaluate_interval_seconds": 3600})
    sink = proposals_ledger()
    credentials = Credentials(site_secret=b"site-secret-for-tests-0123456789abcdef")
    app = make_aggregator_app(config, Engine(config, sink), sink, credentials=credentials)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def test_the_aggregators_metrics_are_gzipped_for_prometheus(aggregator: TestClient) -> None:
    plain = await _check_gzip_and_identity(str(aggregator.make_url("/metrics")), same_bytes=False)
    assert b"vigil_aggregator_" in plain
