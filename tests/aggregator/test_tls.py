"""The aggregator's optional TLS listener: a real process serves https with the configured
certificate (verified by a client that trusts it), reports get in over it with a node token, and
plain http on that port gets nothing."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from tests.aggregator.aggregator_process import SITE_SECRET, AggregatorProcess
from tests.aggregator.conftest import FakeNode
from vigil.aggregator.auth import node_token
from vigil.contract.wire import encode

OPENSSL = shutil.which("openssl")


def self_signed(root: Path) -> tuple[Path, Path]:
    assert OPENSSL is not None
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=30)
    return cert, key


@pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed")
def test_https_listener_with_the_configured_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    agg = AggregatorProcess(tmp_path, {"tls": {"cert_file": str(cert), "key_file": str(key)}})
    agg.start()
    try:
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", agg.port, context=context, timeout=10)
        conn.request("GET", "/healthz")
        assert json.loads(conn.getresponse().read())["status"] == "ok"
        body = encode(FakeNode("gpu-1").report(time.time()))
        conn.request("POST", "/v1/reports", body, {
            "Authorization": f"Bearer {node_token(SITE_SECRET.encode(), 'gpu-1')}", "Content-Type": "application/json"})
        assert conn.getresponse().status == 202
        conn.close()
        # A client that does not trust the certificate is refused by its own verification.
        with pytest.raises(ssl.SSLCertVerificationError):
            http.client.HTTPSConnection("127.0.0.1", agg.port, context=ssl.create_default_context(),
                                        timeout=10).request("GET", "/healthz")
        # Plain http on the TLS port gets no HTTP answer.
        plain = http.client.HTTPConnection("127.0.0.1", agg.port, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/healthz")
            plain.getresponse()
    finally:
        agg.stop()
