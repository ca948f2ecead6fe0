"""``vigil loadgen`` against a real aggregator process on loopback: every report offered is
accepted and the fleet lists every node; each node moves to the compact form (version 3) as the
agent does; a wrong site secret shows up as counted errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.aggregator.aggregator_process import ROLE_TOKENS, AggregatorProcess
from vigil.cli import main

NODES = 20


def _loadgen(capsys: pytest.CaptureFixture[str], *argv: str, seconds: int = 2) -> dict:
    assert main(["loadgen", "--nodes", str(NODES), "--duration", str(seconds), "--interval", "1", "--json",
                 *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_spawned_aggregator_accepts_every_report_and_lists_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    s = _loadgen(capsys, "--spawn", seconds=4)
    assert s["sent"] == NODES * 4  # every node, every second, for 4 s
    assert s["accepted"] == s["sent"]
    assert s["errors"] == {}
    assert s["fleet_nodes"] == NODES  # GET /v1/nodes with the read token
    assert s["report_bytes"] > 15_000  # a real 8-GPU, 8-HCA report, not a stub
    # Version 1 first (no answer yet), version 3 whole after the answer lists it, then compact
    # relative to the last accepted report; the aggregator had every base.
    forms = s["accepted_by_form"]
    assert sum(forms.values()) == s["accepted"]
    assert forms["whole v1"] >= NODES and forms["whole v3"] >= NODES and forms["compact v3"] >= NODES
    assert s["rebased"] == 0
    assert 0 < s["compact_report_bytes"] < s["report_bytes"] / 2
    assert s["latency_seconds"]["p50"] > 0
    agg = s["aggregator"]
    assert agg["cpu_seconds_per_report"] > 0 and agg["rss_bytes"] > 0


def test_wrong_site_secret_counts_every_report_as_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    aggregator = AggregatorProcess(tmp_path, {"dry_run": True})
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("not-the-site-secret-of-this-aggregator-0123456789\n")
    read = tmp_path / "read.token"
    read.write_text(ROLE_TOKENS["read"] + "\n")
    aggregator.start()
    try:
        assert aggregator.proc is not None
        s = _loadgen(capsys, "--url", aggregator.url, "--site-secret-file", str(wrong), "--read-token-file", str(read),
                     "--aggregator-pid", str(aggregator.proc.pid))
    finally:
        aggregator.stop()
    assert s["accepted"] == 0
    assert s["errors"] == {"HTTP 401": NODES * 2}
    assert s["fleet_nodes"] == 0


def test_a_warm_up_is_sent_but_not_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """The warm-up's reports go out at the same cadence (each node negotiates the compact form
    in it) and only the measured duration's are counted, with the aggregator's CPU over it."""
    s = _loadgen(capsys, "--spawn", "--warmup", "2", seconds=2)
    assert s["warmup_seconds"] == 2
    assert s["sent"] == NODES * 2  # the measured 2 s only
    assert s["accepted"] == s["sent"] and s["errors"] == {} and s["warmup_errors"] == {}
    # Every node had its answers in the warm-up: none starts the measured part as version 1.
    assert s["accepted_by_form"]["whole v1"] == 0
    assert s["accepted_by_form"]["compact v3"] >= NODES
    assert s["aggregator"]["cpu_seconds_per_report"] > 0
