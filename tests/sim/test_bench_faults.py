"""bench/bench_faults.py's table: a row per issue-38 fault class, a clear row for a scenario not
shipped yet, and a flag on a scenario that is not a shipped-defaults run at 2.5 s."""

from __future__ import annotations

import math

from bench import bench_faults
from bench.run import MODULES
from vigil.sim.scenario import load_scenario


def test_registered_after_the_judgments() -> None:
    assert MODULES.index("bench.bench_faults") == MODULES.index("bench.bench_judgments") + 1


def test_a_scenario_not_shipped_is_a_row_that_says_so() -> None:
    missing = "no-such-scenario-yet"
    (row,) = bench_faults.measure(table=((missing, "a class nobody wrote yet"),))
    assert row.what == "a class nobody wrote yet: scenario missing"
    assert math.isnan(row.value) and row.within_budget is None and missing in row.note


def test_overrides_name_what_is_not_shipped_defaults_at_2_5_s() -> None:
    assert bench_faults.overrides(load_scenario("job-slowdown")) == []
    sc = load_scenario("job-slowdown").model_copy(update={
        "report_interval_seconds": 10.0, "gate": {"breaker_max_share": 0.5},
        "aggregator": {"detectors": {"straggler": {"z_threshold": 5}}}})
    assert bench_faults.overrides(sc) == ["reports every 10 s", "aggregator overrides detectors.straggler.z_threshold",
                                          "gate overrides breaker_max_share"]
