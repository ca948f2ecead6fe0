"""DESIGN.md section 9's false-removal figure, measured: 1,000 node-days of a healthy noisy fleet
at the agent's real 2.5 s cadence with shipped defaults, as independent job shards in parallel
processes (sim/shards.py). Slow: `make test-all` only."""

from __future__ import annotations

import pytest

from vigil.sim.scenario import load_scenario
from vigil.sim.shards import default_workers, run_sharded

SCENARIO = "healthy-2s5-1000-node-days"
MIN_NODE_DAYS = 1000.0


@pytest.mark.slow
def test_no_false_removal_in_1000_node_days_at_2_5_s(capsys: pytest.CaptureFixture[str]) -> None:
    sc = load_scenario(SCENARIO)
    assert sc.report_interval_seconds == 2.5 and not (sc.agent or sc.aggregator or sc.gate)  # shipped defaults
    merged = run_sharded(sc, workers=default_workers())
    with capsys.disabled():
        print(f"\n{SCENARIO}: {merged.node_days:,.1f} node-days ({merged.reports:,} node reports) in "
              f"{len(merged.shards)} shards on {merged.workers} workers: {merged.wall_seconds:,.0f} s wall, "
              f"{merged.cpu_seconds:,.0f} s CPU; {merged.proposed_removals} removals proposed, "
              f"{merged.false_removals} false")
    assert merged.node_days >= MIN_NODE_DAYS
    assert merged.reports == sum(s.nodes * s.simulated_seconds / 2.5 for s in merged.shards)
    detail = [d for d in merged.to_json()["decisions"] if d["action"] != "observe"][:5]
    assert merged.proposed_removals == 0 and merged.false_removals == 0, detail
    assert merged.passed
