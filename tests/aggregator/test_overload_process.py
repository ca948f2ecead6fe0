"""Graceful overload against a real aggregator process (tests/aggregator/aggregator_process.py):
configured to admit 20 reports/s (server.admission.max_reports_per_second), it is offered 80/s by
vigil loadgen's 40 nodes (which do what the agent does: one report at a time, Retry-After and
jittered backoff, the compact base kept). It sheds with 429 and Retry-After (never a 5xx, never a
timeout), the nodes back off, and once the load drops to half its capacity every node is taken
again. Nothing accepted is lost: the aggregator ingested exactly the reports it answered 202, and
counted exactly the ones it shed."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.aggregator.aggregator_process import ROLE_TOKENS, SITE_SECRET, AggregatorProcess
from tests.aggregator.conftest import FakeNode
from vigil.aggregator.auth import node_token
from vigil.cli.loadgen import Plan, Target, run_load
from vigil.contract.wire import encode

ADMITTED_PER_SECOND = 20
# A burst of reports from one node, sent back to back until one is shed: the bucket holds one
# second's worth, so this many can only all be taken if each took over 1/20 s to send.
BURST_MAX = 2_000


def post(url: str, body: bytes, node: str) -> tuple[int, dict[str, str], dict]:
    req = urllib.request.Request(url + "/v1/reports", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {node_token(SITE_SECRET.encode(), node)}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())


def counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def test_past_its_capacity_it_sheds_with_retry_after_and_takes_every_node_again_once_load_drops(
        tmp_path: Path) -> None:
    agg = AggregatorProcess(tmp_path, {"dry_run": True, "server": {"admission": {
        "max_reports_per_second": ADMITTED_PER_SECOND, "retry_after_seconds": 1}}})
    agg.start()
    try:
        assert agg.proc is not None
        target = Target(agg.url, SITE_SECRET.encode(), ROLE_TOKENS["read"], agg.proc.pid)
        hot = run_load(target, Plan(nodes=40, duration_seconds=3, interval_seconds=0.5, node_prefix="hot"))
        burst = FakeNode("burst", interval=1.0)
        taken, shed_answer = 0, None
        for _ in range(BURST_MAX):
            status, headers, body = post(agg.url, encode(burst.report(time.time())), burst.name)
            if status != 202:
                shed_answer = (status, headers.get("Retry-After"), body)
                break
            taken += 1
        calm = run_load(target, Plan(nodes=10, duration_seconds=3, interval_seconds=1.0, node_prefix="calm"))
        req = urllib.request.Request(agg.url + "/metrics", headers={"Authorization": f"Bearer {ROLE_TOKENS['read']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        agg.stop()
    # Past its capacity: shed, never an error (no 5xx, no timeout), and the nodes backed off.
    assert hot["shed"] > 0 and hot["deferred"] > 0 and hot["accepted"] > 0
    assert hot["errors"] == {}
    # No resend storm: a shed report keeps the node's compact base, so none is resent whole (a
    # node sends version 3 whole once, right after its first answer).
    assert hot["rebased"] == 0 and hot["accepted_by_form"]["whole v3"] <= 40
    assert shed_answer is not None
    status, after, body = shed_answer
    assert (status, after) == (429, "1")
    assert body["error"] == "overloaded" and body["reason"] == "rate" and body["retry_after_seconds"] == 1
    # The load dropped to half the capacity: every node is taken again.
    assert calm["errors"] == {} and calm["fleet_nodes"] == 10
    # Nothing accepted is lost, and every shed answer is counted (by reason).
    assert counter(metrics, "vigil_aggregator_reports_total") == hot["accepted"] + taken + calm["accepted"]
    assert counter(metrics, "vigil_aggregator_reports_shed_total") == hot["shed"] + 1 + calm["shed"]
    assert 'vigil_aggregator_reports_shed_total{reason="rate"}' in metrics
    assert "Traceback" not in agg.log()


def test_judging_back_to_back_fills_the_held_bound_sheds_and_every_node_is_taken_again_after(tmp_path: Path) -> None:
    """Made busy by configuration: passes back to back (``evaluate_interval_seconds`` 0.02) and a
    held bound of 1, so reports arriving while the detectors read are held and, where two arrive in
    one pass, the excess is shed (503 held_full, Retry-After). How many arrive in one pass depends
    on how fast this machine judges (on a quiet one a pass of this fleet takes about a
    millisecond): that a full queue sheds with held_full is held by tests/aggregator/test_admission.py;
    here, that reports are held, only held_full is ever shed, nothing is lost, and judging never
    starves intake nor intake judging: passes go on while a calm load follows, every one of its
    reports is taken, and nothing is left held."""
    agg = AggregatorProcess(tmp_path, {"dry_run": True, "evaluate_interval_seconds": 0.02, "server": {"admission": {
        "max_held_reports": 1, "retry_after_seconds": 1}}})
    agg.start()

    def scrape() -> str:
        req = urllib.request.Request(agg.url + "/metrics", headers={"Authorization": f"Bearer {ROLE_TOKENS['read']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return str(resp.read().decode())

    try:
        assert agg.proc is not None
        target = Target(agg.url, SITE_SECRET.encode(), ROLE_TOKENS["read"], agg.proc.pid)
        hot = run_load(target, Plan(nodes=120, duration_seconds=3, interval_seconds=0.25, node_prefix="hot"))
        before_calm = scrape()
        calm = run_load(target, Plan(nodes=10, duration_seconds=3, interval_seconds=1.0, node_prefix="calm"))
        after_calm = scrape()
    finally:
        agg.stop()
    # Behind on its work: reports held while passes ran; whatever was shed was shed for the held
    # bound (503), never an error, and every shed answer is counted.
    held_full = re.search(r'^vigil_aggregator_reports_shed_total\{reason="held_full"\} (\S+)$', before_calm, re.M)
    assert held_full is not None and float(held_full[1]) == hot["shed"]
    assert counter(before_calm, "vigil_aggregator_reports_shed_total") == hot["shed"]
    assert counter(before_calm, "vigil_aggregator_reports_held_total") > 0
    assert hot["errors"] == {} and hot["rebased"] == 0
    # Taken again: every node of the calm load is taken while passes go on, and nothing is left held.
    assert calm["errors"] == {} and calm["accepted"] > 0 and calm["fleet_nodes"] == 10
    passes = "vigil_aggregator_judge_duration_seconds_count"
    assert counter(after_calm, passes) > counter(before_calm, passes)
    assert counter(after_calm, "vigil_aggregator_reports_held_now") == 0
    assert counter(after_calm, "vigil_aggregator_reports_total") == hot["accepted"] + calm["accepted"]
    assert "Traceback" not in agg.log()
