"""Clock steps against a real aggregator process under libfaketime (issue 37).

The aggregator runs with libfaketime preloaded: its wall clock reads an offset from a file the test
rewrites (FAKETIME_TIMESTAMP_FILE, read at every call), its monotonic clock is left real
(FAKETIME_DONT_FAKE_MONOTONIC), as an NTP step leaves it. Two fake agents post real reports twice
a second while the aggregator's clock steps +180 s, back (-180 s) and -180 s again, and then one
node's own clock steps +180 s and carries a fatal Xid, then -180 s. With a silence drain of 20 s,
judging on the wall clock would have drained both nodes at the first step; nobody is removed but
for the Xid's GPU, the aggregator's steps are counted and the node's skew shows in /metrics and
/v1/nodes.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.aggregator.aggregator_process import ROLE_TOKENS, AggregatorProcess
from tests.aggregator.conftest import FakeNode
from vigil.contract.wire import Event

LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(not LIBFAKETIME or shutil.which("faketime") is None,
                       reason="libfaketime missing (apt-get install faketime; scripts/ensure-system-packages.sh)"),
]
REPORT_SECONDS = 0.5
PHASE_SECONDS = 5.0  # ten reports per node, ~five evaluations: past the topology hold, within the silence drain


class Stepper:
    """The aggregator's clock offset, in the file libfaketime reads at every call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.set(0)

    def set(self, offset_seconds: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{offset_seconds:+d}\n")
        os.replace(tmp, self.path)  # never a half-written file


@pytest.fixture
def faked(tmp_path: Path) -> Iterator[tuple[AggregatorProcess, Stepper]]:
    stepper = Stepper(tmp_path / "faketime.offset")
    config = {
        "dry_run": False,
        "evaluate_interval_seconds": 0.5,
        # A short drain, so that a wall-clock difference would have drained within a phase.
        "detectors": {"silence": {"drain_after_seconds": 20.0, "alert_after_seconds_min": 5.0}},
    }
    agg = AggregatorProcess(tmp_path, config)
    try:
        agg.start(env={"LD_PRELOAD": LIBFAKETIME[0], "FAKETIME_TIMESTAMP_FILE": str(stepper.path),
                       "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
        yield agg, stepper
    finally:
        agg.stop()


def metrics(agg: AggregatorProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    req = urllib.request.Request(agg.url + "/metrics", headers={"Authorization": f"Bearer {ROLE_TOKENS['read']}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run_phase(agg: AggregatorProcess, nodes: list[FakeNode], skew: dict[str, float],
              events: dict[str, list[Event]] | None = None) -> None:
    """The agents report for PHASE_SECONDS, each on its own clock (real time plus its skew)."""
    events = dict(events or {})
    end = time.monotonic() + PHASE_SECONDS
    while time.monotonic() < end:
        for node in nodes:
            sent = events.pop(node.name, [])
            agg.post_report(node.report(time.time() + skew[node.name], events=sent, urgent=bool(sent)))
        time.sleep(REPORT_SECONDS)  # the agents' cadence; nothing here waits on the aggregator's timing


def removals(agg: AggregatorProcess) -> list[tuple[str, str, str]]:
    decisions, _ = agg.decisions()
    return sorted((d["node"], d["detector"], d["action"]) for d in decisions
                  if d["action"] in ("drain", "reboot_node", "reset_gpu", "inspect_hardware", "restart_job"))


def test_clock_steps_under_libfaketime_drain_nobody_and_the_xid_is_decided(faked) -> None:
    agg, stepper = faked
    nodes = [FakeNode("gpu-a1"), FakeNode("gpu-a2")]
    skew = {"gpu-a1": 0.0, "gpu-a2": 0.0}
    run_phase(agg, nodes, skew)
    for offset in (180, 0, -180):  # +180 s, back by 180 s, and 180 s behind
        stepper.set(offset)
        run_phase(agg, nodes, skew)
        assert removals(agg) == [], offset
    got = metrics(agg)
    assert got[("vigil_aggregator_clock_steps_total", (("clock", "aggregator"),))] == 3
    assert got[("vigil_aggregator_clock_offset_seconds", ())] == pytest.approx(-180, abs=2)
    assert got[("vigil_aggregator_nodes_clock_skewed", ())] == 0
    assert "the system clock stepped" in agg.log()

    # One node's clock steps +180 s and carries a fatal Xid stamped by it; later it steps back.
    skew["gpu-a2"] = 180.0
    xid = Event(kind="xid", ts=time.time() + 179.0, code=79, gpu=3, urgent=True, source="kmsg",
                message="NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.")
    run_phase(agg, nodes, skew, events={"gpu-a2": [xid]})
    got = metrics(agg)
    assert got[("vigil_aggregator_nodes_clock_skewed", ())] == 1
    assert got[("vigil_aggregator_node_clock_skew_seconds", (("node", "gpu-a2"),))] == pytest.approx(180, abs=2)
    listed = {n["node"]: n for n in agg.request("GET", "/v1/nodes")["nodes"]}
    assert listed["gpu-a2"]["clock_skewed"] is True and listed["gpu-a1"]["clock_skewed"] is False
    skew["gpu-a2"] = 0.0
    run_phase(agg, nodes, skew)
    assert metrics(agg)[("vigil_aggregator_nodes_clock_skewed", ())] == 0
    # Nobody removed but for the fallen GPU, whose Xid was neither refused nor lost.
    assert removals(agg) == [("gpu-a2", "xid", "reboot_node")]
    assert {n["state"] for n in agg.request("GET", "/v1/nodes")["nodes"]} <= {"ok", "failing"}
