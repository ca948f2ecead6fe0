"""Alertmanager actuator against a real prometheus-alertmanager (Debian) on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.loopback import free_port
from vigil.aggregator.actuators.alertmanager import AlertmanagerActuator, AlertmanagerConfig, alert_for
from vigil.aggregator.decision import Action, Decision

BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
CONFIG = """\
route:
  receiver: "null"
receivers:
  - name: "null"
"""


_free_port = free_port


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if BINARY is None:
        pytest.skip("prometheus-alertmanager is not installed (apt-get install prometheus-alertmanager)")
    root: Path = tmp_path_factory.mktemp("am")
    (root / "am.yml").write_text(CONFIG)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (root / "am.log").open("wb")
    proc = subprocess.Popen(
        [
            BINARY,
            f"--config.file={root / 'am.yml'}",
            f"--storage.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"alertmanager did not start: {(root / 'am.log').read_text()[-500:]}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def alerts(url: str, node: str) -> list[dict]:
    q = f'filter=node="{node}"'.replace('"', "%22")
    with urllib.request.urlopen(f"{url}/api/v2/alerts?{q}", timeout=5) as r:
        return json.loads(r.read())


def dec(node: str, action: Action, id: str, ts: float) -> Decision:
    return Decision(
        id=id, ts=ts, node=node, action=action, reason="Xid 79: fell off the bus", detector="xid", gpu=3, dry_run=False
    )


def test_alert_shape() -> None:
    a = alert_for(dec("n1", Action.DRAIN, "x1", 1_700_000_000.0), 3600)
    assert a["labels"] == {
        "alertname": "VigilDecision",
        "node": "n1",
        "action": "drain",
        "detector": "xid",
        "severity": "critical",
        "gpu": "3",
    }
    assert a["annotations"]["decision_id"] == "x1"
    assert a["startsAt"] == "2023-11-14T22:13:20Z" and a["endsAt"] == "2023-11-14T23:13:20Z"


@pytest.mark.external
def test_decision_fires_an_alert_and_resume_resolves_it(alertmanager: str) -> None:
    act = AlertmanagerActuator(AlertmanagerConfig(enabled=True, url=alertmanager))
    now = time.time()
    assert "posted" in act.deliver(dec("gpu-7", Action.DRAIN, "dec-1", now - 5))
    act.deliver(dec("gpu-8", Action.RESET_GPU, "dec-2", now - 5))
    [firing] = alerts(alertmanager, "gpu-7")
    assert firing["labels"]["action"] == "drain" and firing["labels"]["severity"] == "critical"
    assert firing["annotations"]["decision_id"] == "dec-1"
    assert firing["annotations"]["reason"] == "Xid 79: fell off the bus"
    assert firing["status"]["state"] == "active"

    out = act.deliver(dec("gpu-7", Action.RESUME, "dec-3", now - 1))
    assert out == "resolved 1 alert(s) for gpu-7"
    assert alerts(alertmanager, "gpu-7") == []  # resolved alerts are no longer listed as active
    assert [a["annotations"]["decision_id"] for a in alerts(alertmanager, "gpu-8")] == ["dec-2"]
    # Delivered twice (at-least-once after a crash): Alertmanager keeps one alert per label set.
    act.deliver(dec("gpu-8", Action.RESET_GPU, "dec-2", now - 5))
    assert len(alerts(alertmanager, "gpu-8")) == 1
