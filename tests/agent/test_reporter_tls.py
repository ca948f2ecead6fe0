"""The agent's https client (issue 12 point 1): the aggregator's certificate is verified against
``aggregator.ca_file`` (and its hostname), with an optional client certificate for mTLS. A server
signed by another CA is refused and counted (``vigil_agent_report_errors_total{reason="tls"}``),
and the events wait for a server the agent can trust. The CAs are made by ``openssl`` per test."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.loopback import free_port
from vigil.agent.config import parse_config
from vigil.agent.reporter import Reporter, client_ssl_context
from vigil.agent.snapshot import Snapshot
from vigil.contract.validation import ConfigError
from vigil.contract.wire import Event, Report, decode_report

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _leaf(d: Path, ca: str, name: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext + "\nbasicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\n"
                                   "authorityKeyIdentifier=keyid\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "site-ca")
    _ca(d, "other-ca")
    _leaf(d, "site-ca", "aggregator", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    _leaf(d, "site-ca", "gpu-a1", "subjectAltName=DNS:gpu-a1\nextendedKeyUsage=clientAuth")
    return d


class TlsAggregator:
    def __init__(self) -> None:
        self.reports: list[Report] = []
        self.client_names: list[str] = []
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        assert request.transport is not None
        cert = request.transport.get_extra_info("peercert") or {}
        self.client_names += [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
        self.reports.append(decode_report(await request.read()))
        self.arrived.set()
        return web.json_response({"status": "accepted"}, status=202)


@pytest.fixture
async def server(pki: Path) -> AsyncIterator[tuple[TlsAggregator, str]]:
    """An https aggregator with the site CA's certificate that requires a client certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "site-ca.pem"))
    context.load_cert_chain(pki / "aggregator.pem", pki / "aggregator.key")
    context.verify_mode = ssl.CERT_REQUIRED
    fake = TlsAggregator()
    app = web.Application()
    app.router.add_post("/v1/reports", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield fake, f"https://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _reporter(url: str, pki: Path, ca: str) -> Reporter:
    context = client_ssl_context(url, str(pki / f"{ca}.pem"), str(pki / "gpu-a1.pem"), str(pki / "gpu-a1.key"))
    return Reporter(url=url, token="t", node="gpu-a1", boot_id="b", topology={}, snapshot=Snapshot(),
                    interval_seconds=0.01, max_backoff_seconds=0.02, ssl_context=context)


async def test_the_site_ca_is_trusted_and_the_client_certificate_sent(
        server: tuple[TlsAggregator, str], pki: Path) -> None:
    fake, url = server
    reporter = _reporter(url, pki, "site-ca")
    reporter.add_events([Event(kind="xid", ts=1.0, code=79, urgent=True)])
    stop = asyncio.Event()
    task = asyncio.create_task(reporter.run(stop))
    try:
        await asyncio.wait_for(fake.arrived.wait(), 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert [e.code for r in fake.reports for e in r.events] == [79]
    assert "gpu-a1" in fake.client_names and reporter.errors["tls"] == 0


async def test_a_server_signed_by_another_ca_is_refused_and_counted(
        server: tuple[TlsAggregator, str], pki: Path) -> None:
    fake, url = server
    reporter = _reporter(url, pki, "other-ca")
    reporter.add_events([Event(kind="xid", ts=1.0, code=79, urgent=True)])
    stop = asyncio.Event()
    task = asyncio.create_task(reporter.run(stop))
    try:
        async with asyncio.timeout(10):
            while reporter.errors["tls"] < 2:  # refused again on retry, never accepted
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert not fake.reports and reporter.counts["ok"] == 0
    assert reporter.pending_events == 1 and reporter.dropped_events == 0  # kept for a server it can trust
    samples = {(s.name, s.label("reason")): s.value for s in reporter.samples()}
    assert samples[("vigil_agent_report_errors_total", "tls")] >= 2


def test_tls_settings_are_checked_with_the_url(pki: Path) -> None:
    ca = str(pki / "site-ca.pem")
    with pytest.raises(ConfigError, match=r"aggregator\.ca_file: only used with https:// aggregator URLs"):
        parse_config({"aggregator": {"url": "http://agg:9500", "ca_file": ca}})
    with pytest.raises(ConfigError, match=r"cert_file and aggregator\.key_file go together"):
        parse_config({"aggregator": {"url": "https://agg:9500", "cert_file": str(pki / "gpu-a1.pem")}})
    with pytest.raises(ConfigError, match=r"aggregator\.url"):
        parse_config({"aggregator": {"url": "ftp://agg"}})
    assert client_ssl_context("http://agg:9500") is None
    context = client_ssl_context("https://agg:9500", ca)
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
