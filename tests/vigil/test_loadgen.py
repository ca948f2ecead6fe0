"""``vigil loadgen`` against a real aggregator process on loopback: every report offered is
accepted and the fleet lists every node; each node moves to the compact form (version 3) as the
agent does; a wrong site secret shows up as counted errors. Against a running aggregator its
nodes are synthetic (loadgen-*): never judged, never counted by the breaker, forgotten when the
run ends, and refused by an aggregator that acts. The generator says when it fell behind."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from tests.aggregator.aggregator_process import ROLE_TOKENS, SITE_SECRET, AggregatorProcess, wait_for
from tests.aggregator.conftest import FakeNode
from vigil.aggregator.auth import node_token
from vigil.cli import main
from vigil.cli.loadgen import LATE_SECONDS, Pace, pace_line, pace_summary
from vigil.cli.loadgen_cmd import EXIT_BEHIND_SCHEDULE
from vigil.contract.wire import encode

NODES = 20


def _loadgen(capsys: pytest.CaptureFixture[str], *argv: str, seconds: int = 2) -> dict:
    rc = main(["loadgen", "--nodes", str(NODES), "--duration", str(seconds), "--interval", "1", "--json", *argv])
    s = json.loads(capsys.readouterr().out)
    # A shared test machine may starve the generator: the run then says so (exit 3, valid false)
    # and its figures are the generator's; the assertions below hold either way.
    assert rc == (0 if s["valid"] else EXIT_BEHIND_SCHEDULE)
    assert s["valid"] is not s["generator"]["behind_schedule"]
    return s


def test_spawned_aggregator_accepts_every_report_and_lists_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    s = _loadgen(capsys, "--spawn", seconds=4)
    assert s["sent"] == NODES * 4  # every node, every second, for 4 s
    assert s["accepted"] == s["sent"]
    assert s["errors"] == {}
    assert s["fleet_nodes"] == NODES  # GET /v1/nodes with the read token
    assert s["report_bytes"] > 15_000  # a real 8-GPU, 8-HCA report, not a stub
    # Whole first (no report accepted yet), then compact relative to the last accepted report; the
    # aggregator had every base.
    forms = s["accepted_by_form"]
    assert sum(forms.values()) == s["accepted"]
    assert forms["whole v3"] >= NODES and forms["compact v3"] >= NODES
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
    # Every node had its answers in the warm-up: none starts the measured part whole.
    assert s["accepted_by_form"]["whole v3"] == 0
    assert s["accepted_by_form"]["compact v3"] >= NODES
    assert s["aggregator"]["cpu_seconds_per_report"] > 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_generator_on_schedule_sends_the_offered_rate() -> None:
    clock = FakeClock()
    pace = Pace(clock)
    slot = 0.01  # 100 reports/s
    for i in range(200):
        due = 100.0 + i * slot
        clock.now = due + 0.002  # each send 2 ms after its due time
        pace.started(due)
    g = pace_summary([pace], 100.0, slot)
    assert not g["behind_schedule"] and g["late_sends"] == 0
    assert g["sent_reports_per_second"] == pytest.approx(100.0, rel=0.01)
    assert g["lateness_seconds"]["p99"] == pytest.approx(0.002)
    assert pace_line(g).startswith("generator on schedule: offered 100 reports/s, sent 100/s")


def test_a_starved_generator_is_behind_schedule_and_says_its_figures_measure_itself() -> None:
    """Sends due every 10 ms that the generator can only start every 16 ms: it offers 100/s and
    sends 62.5/s, later and later."""
    clock = FakeClock()
    pace = Pace(clock)
    for i in range(200):
        due = 100.0 + i * 0.01
        clock.now = 100.0 + i * 0.016
        pace.started(due)
    g = pace_summary([pace], 100.0, 0.01)
    assert g["behind_schedule"]
    assert g["sent_reports_per_second"] == pytest.approx(62.5, rel=0.02)
    assert g["lateness_seconds"]["max"] == pytest.approx(199 * 0.006)
    line = pace_line(g)
    assert "generator behind schedule: offered 100 reports/s, sent 63/s" in line
    assert "measure the generator, not the aggregator" in line


def test_a_passing_stall_is_not_a_generator_behind_schedule() -> None:
    """The lookalike: one 50 ms stall delays 5 of 200 sends (2.5%), then the generator is back on time."""
    clock = FakeClock()
    pace = Pace(clock)
    for i in range(200):
        due = 100.0 + i * 0.01
        clock.now = max(due, 100.5 + 0.05) if 50 <= i < 55 else due
        pace.started(due)
    g = pace_summary([pace], 100.0, 0.01)
    assert g["late_sends"] == sum(1 for i in range(50, 55) if 100.55 - (100.0 + i * 0.01) > LATE_SECONDS) > 0
    assert not g["behind_schedule"]


def _health(agg: AggregatorProcess) -> dict:
    with urllib.request.urlopen(agg.url + "/healthz", timeout=10) as resp:
        return json.loads(resp.read())


def _refusals(agg: AggregatorProcess, reason: str) -> float:
    with urllib.request.urlopen(agg.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf'^vigil_aggregator_refusals_total{{door="reports",reason="{reason}"}} (\S+)$', text, re.M)
    assert m is not None, f"no refusals series for {reason}"
    return float(m.group(1))


def _secret_files(tmp_path: Path) -> tuple[Path, Path]:
    secret, read = tmp_path / "loadgen.secret", tmp_path / "loadgen.read"
    secret.write_text(SITE_SECRET + "\n")
    read.write_text(ROLE_TOKENS["read"] + "\n")
    return secret, read


def test_loadgen_against_a_running_aggregator_leaves_no_node_behind(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A dry-run aggregator with a real node beside the run: the synthetic nodes are taken and held
    apart (never listed, never counted by the breaker, never judged: no silence decision although
    they all stop at once), then forgotten within seconds. The lookalike, a real node whose name
    merely starts "loadgen" (no hyphen), that stops with them is judged silent."""
    agg = AggregatorProcess(tmp_path, {"dry_run": True, "evaluate_interval_seconds": 0.5,
                                       "detectors": {"silence": {"alert_after_intervals": 2,
                                                                 "alert_after_seconds_min": 0}}})
    secret, read = _secret_files(tmp_path)
    real = FakeNode("loadgen1", interval=1.0)  # not in the reserved namespace loadgen-*
    agg.start()
    try:
        assert _refusals(agg, "synthetic_node") == 0  # the series exists from the start
        agg.post_report(real.report(time.time()))
        s = _loadgen(capsys, "--url", agg.url, "--site-secret-file", str(secret), "--read-token-file", str(read))
        agg.post_report(real.report(time.time()))
        assert s["accepted"] == s["sent"] and s["errors"] == {}
        assert s["fleet_nodes"] == NODES  # held, as the aggregator's synthetic count says
        nodes = agg.request("GET", "/v1/nodes")["nodes"]
        assert [n["node"] for n in nodes] == ["loadgen1"]
        breaker = agg.request("GET", "/v1/breaker")
        assert breaker["reporting_nodes"] == 1  # the real node only
        # Everything stops: the real node is judged silent; the synthetic nodes are forgotten.
        wait_for("the real node's silence decision",
                 lambda: any(d["node"] == "loadgen1" and d["detector"] == "silence" for d in agg.decisions()[0]))
        wait_for("the synthetic nodes to be forgotten", lambda: "synthetic_nodes" not in _health(agg))
        decisions, _ = agg.decisions()
        assert not [d for d in decisions if d["node"].startswith("loadgen-")]
        assert agg.request("GET", "/v1/breaker")["reporting_nodes"] == 1
        assert _refusals(agg, "synthetic_node") == 0
    finally:
        agg.stop()


def test_an_aggregator_that_acts_refuses_loadgen_and_its_synthetic_nodes(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Not in dry run: loadgen refuses to start, with the reason; a synthetic node's report with a
    valid node token (the site secret's holder forging one) is refused 403 synthetic_node and
    counted; a real node's report is taken."""
    agg = AggregatorProcess(tmp_path, {"dry_run": False})
    secret, _ = _secret_files(tmp_path)
    agg.start()
    try:
        rc = main(["loadgen", "--nodes", "2", "--duration", "1", "--url", agg.url, "--site-secret-file", str(secret)])
        assert rc == 2
        err = capsys.readouterr().err
        assert "refused" in err and "not in dry run" in err
        assert "synthetic_nodes" not in _health(agg)
        phantom = FakeNode("loadgen-00000").report(time.time())
        answer = agg.request("POST", "/v1/reports", encode(phantom), expect=403,
                             token=node_token(SITE_SECRET.encode(), "loadgen-00000"))
        assert answer["error"] == "synthetic_node" and "dry run" in answer["detail"]
        assert _refusals(agg, "synthetic_node") == 1
        agg.post_report(FakeNode("gpu-a1").report(time.time()))
        assert _health(agg)["nodes"] == 1
    finally:
        agg.stop()


def test_url_node_names_outside_the_reserved_namespace_are_refused(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--url with node names outside loadgen-* is refused before anything is sent: against a
    running aggregator they would be judged as real nodes."""
    secret, _ = _secret_files(tmp_path)
    rc = main(["loadgen", "--nodes", "2", "--duration", "1", "--url", "http://127.0.0.1:9", "--node-prefix", "load",
               "--site-secret-file", str(secret)])
    assert rc == 2
    assert "reserved synthetic namespace" in capsys.readouterr().err
