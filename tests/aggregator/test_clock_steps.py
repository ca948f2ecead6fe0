"""Clock steps drain nobody and lose no Xid (issue 37), through the real application over HTTP.

Four fake agents post authenticated reports every 2.5 s to ``make_app`` on a ``SteadyClock`` whose
wall and monotonic clocks are the test's. Mid-run the aggregator's wall clock steps +180 s or -180 s
(an NTP step), or one node's clock does; right after, that node sends a fatal Xid (79, fallen off
the bus) stamped by its own clock. Over the next 200 s (past the silence detector's 120 s drain):
no node is removed but for the Xid's GPU, whose decision is made and placed at the Xid's true time;
the step or the skew shows in /metrics and /v1/nodes. The lookalikes: a node that really stops
reporting is drained as silent across the same step, and an application judging on the stepping
wall clock itself (what the service did before) misses it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.aggregator.conftest import FakeNode, proposals_ledger
from vigil.aggregator.app import EVALUATE_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.clock import FleetClockWatch, SteadyClock
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import REMOVING_ACTIONS, Decision
from vigil.aggregator.engine import Engine
from vigil.contract.wire import Event, encode

SECRET = b"site-secret-of-the-clock-step-tests-0123456789"
T0 = 1_800_000_000.0
INTERVAL = 2.5
STEP_ROUND = 20  # 50 s in: every node has a history
XID_ROUND = STEP_ROUND + 2
ROUNDS = STEP_ROUND + 80  # 200 s after the step: well past the 120 s silence drain
GONE_ROUND = 10  # the lookalike: n4 stops reporting here, for good


class Clocks:
    """The machine's clocks: monotonic seconds, and a wall clock that may be stepped."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall_step = 0.0

    def true_time(self) -> float:
        return T0 + (self.mono - 1000.0)

    def wall(self) -> float:
        return self.true_time() + self.wall_step

    def monotonic(self) -> float:
        return self.mono


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _run(step_of: str, step: float, clock: Callable[[], float] | None = None,
               clocks: Clocks | None = None) -> tuple[list[Decision], Samples, dict[str, dict[str, object]], float]:
    """The run; returns (decisions, /metrics samples, /v1/nodes by name, the Xid's true time)."""
    clocks = clocks or Clocks()
    config = parse_config({"evaluate_interval_seconds": 3600, "dry_run": True})
    sink = proposals_ledger()
    steady = clock or SteadyClock(wall=clocks.wall, monotonic=clocks.monotonic)
    app = make_app(config, Engine(config, sink), sink, clock=steady, credentials=Credentials(site_secret=SECRET))
    nodes = [FakeNode(f"n{i}") for i in range(1, 5)]
    node_step = dict.fromkeys((n.name for n in nodes), 0.0)
    xid_true = 0.0
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for rnd in range(ROUNDS):
            clocks.mono += INTERVAL
            if rnd == STEP_ROUND:
                if step_of == "aggregator":
                    clocks.wall_step += step
                else:
                    node_step["n2"] += step
            app[EVALUATE_KEY]()  # the service evaluates whenever its period says: here before the reports too
            for node in nodes:
                if node.name == "n4" and rnd >= GONE_ROUND:
                    continue
                node_clock = clocks.true_time() + node_step[node.name]
                events = []
                if node.name == "n2" and rnd == XID_ROUND:
                    xid_true = clocks.true_time() - 1.0  # a second before the report, on the node's clock
                    events = [Event(kind="xid", ts=node_clock - 1.0, code=79, gpu=3, source="kmsg",
                                    message="NVRM: Xid (PCI:0000:1b:00): 79, GPU has fallen off the bus.")]
                resp = await client.post("/v1/reports", data=encode(node.report(node_clock, events=events)), headers={
                    "Authorization": f"Bearer {node_token(SECRET, node.name)}", "Content-Type": "application/json"})
                assert resp.status == 202, await resp.text()
            app[EVALUATE_KEY]()
        text = await (await client.get("/metrics")).text()
        listed = (await (await client.get("/v1/nodes")).json())["nodes"]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return sink.recent(10_000), samples, {n["node"]: n for n in listed}, xid_true


def _removals(decisions: list[Decision]) -> dict[tuple[str, str], Decision]:
    return {(d.node, d.detector): d for d in decisions if d.action in REMOVING_ACTIONS}


@pytest.mark.parametrize("step_of", ["aggregator", "node"])
@pytest.mark.parametrize("step", [180.0, -180.0])
async def test_a_clock_step_drains_nobody_and_the_fatal_xid_is_decided(step_of: str, step: float) -> None:
    decisions, samples, listed, xid_true = await _run(step_of, step)
    removals = _removals(decisions)
    # Only what the ground truth justifies: n2's fallen GPU, and n4 that really went silent.
    assert set(removals) == {("n2", "xid"), ("n4", "silence")}, sorted(removals)
    xid = removals[("n2", "xid")]
    assert xid.gpu == 3 and "79" in xid.reason
    # The Xid is placed at its true time on the aggregator's clock, whichever clock stepped.
    assert abs(xid.since - xid_true) <= 5.0
    assert not [d for d in decisions if d.detector == "silence" and d.node != "n4"]
    steps = samples[("vigil_aggregator_clock_steps_total", (("clock", "aggregator"),))]
    skewed = samples[("vigil_aggregator_nodes_clock_skewed", ())]
    if step_of == "aggregator":
        assert steps == 1 and skewed == 0
        assert samples[("vigil_aggregator_clock_offset_seconds", ())] == pytest.approx(step)
        assert not any(n["clock_skewed"] for n in listed.values())
    else:
        assert steps == 0 and skewed == 1
        assert samples[("vigil_aggregator_node_clock_skew_seconds", (("node", "n2"),))] == pytest.approx(step)
        assert listed["n2"]["clock_skewed"] is True and listed["n2"]["clock_offset_seconds"] == pytest.approx(step)
        assert [n for n, v in listed.items() if v["clock_skewed"]] == ["n2"]
    assert listed["n4"]["state"] == "silent" and {listed[n]["state"] for n in ("n1", "n3")} == {"ok"}


async def test_judging_on_the_stepping_wall_clock_itself_hides_a_dead_node() -> None:
    """The lookalike that shows the seam matters: the same run judged on the wall clock that steps
    (the service's ``clock=time.time`` before): after a -180 s step the node that really went silent
    looks 180 s fresher, and is not drained within the run (on the step-free clock it is)."""
    clocks = Clocks()
    decisions, _, _, _ = await _run("aggregator", -180.0, clock=clocks.wall, clocks=clocks)
    assert ("n4", "silence") not in _removals(decisions)


def test_the_steady_clock_counts_a_step_and_ignores_a_slew() -> None:
    clocks = Clocks()
    steady = SteadyClock(wall=clocks.wall, monotonic=clocks.monotonic)
    start = steady()
    for _ in range(100):  # a slew of 0.5 ms a second (NTP's most) for 1,000 s
        clocks.mono += 10.0
        clocks.wall_step += 0.005
        assert steady.check() is None
    clocks.wall_step += 180.0
    assert steady.check() == pytest.approx(180.0) and steady.steps == 1
    assert steady() - start == pytest.approx(1000.0)  # the step never reached the clock judged on
    assert steady.offset_seconds() == pytest.approx(180.5)


def test_most_of_the_fleet_moving_at_once_is_a_fleet_step_not_skewed_nodes_one_by_one() -> None:
    watch = FleetClockWatch(limit_seconds=120.0, tolerance_seconds=5.0)
    watch.observe({f"n{i}": 0.0 for i in range(10)})
    one = watch.observe({**{f"n{i}": 0.0 for i in range(9)}, "n9": 180.0})
    assert (watch.fleet_steps, one.skewed, one.furthest) == (0, 1, (("n9", 180.0),))
    most = watch.observe({**{f"n{i}": -180.0 for i in range(8)}, "n8": 0.0, "n9": 0.0})
    assert watch.fleet_steps == 1 and most.median_offset_seconds == -180.0 and most.skewed == 8
