"""Detection quality and simulator speed, measured with ``vigil sim`` against DESIGN.md section 9.

Runs shipped scenarios (trimmed where a full run would take minutes) through the real agent and
aggregator code and reports: the simulator's wall time for 1,000 nodes x 1 simulated hour
(extrapolated from a slice), the slow-node detection latency in a 1,024-node job, precision and
recall of slow-node detection over several seeds, false drains of a healthy noisy fleet per
1,000 node-days, and the fatal-Xid-to-decision latency in simulated time.
"""

from __future__ import annotations

import time

from bench.measure import Measurement
from sim.run import run_scenario
from sim.scenario import Scenario, load_scenario, parse_scenario, shortened
from sim.score import score

SEEDS = (1, 2, 3)


def _fleet_hour(slice_seconds: float = 960.0) -> tuple[Measurement, Measurement]:
    sc = shortened(load_scenario("healthy-1000x24h"), slice_seconds)
    ticks: list[tuple[float, float]] = []
    wall0 = time.perf_counter()
    result = run_scenario(sc, progress=lambda done, total: ticks.append((done, time.perf_counter())))
    wall = time.perf_counter() - wall0
    # Start-up (1,000 FakeNvml, collectors, sysfs) once, then the per-simulated-second rate; the
    # slice spans one round of the quiet nodes' 900 s GPU collection, so the rate carries its share.
    (t_first, w_first), (t_last, w_last) = ticks[0], ticks[-1]
    rate = (w_last - w_first) / (t_last - t_first)
    hour = (w_first - wall0) + rate * (3600.0 - t_first)
    s = score(result)
    node_days = sc.fleet.nodes * sc.duration_seconds / 86400.0
    drains = len(s.false_drains) * 1000.0 / node_days
    return (
        Measurement("fleet simulation, 1,000 nodes x 1 simulated hour", round(hour, 1), "s", 60.0,
                    note=f"extrapolated from a {slice_seconds:g} s slice ({wall:.1f} s wall) of healthy-1000x24h "
                         f"at its 60 s report interval"),
        Measurement("healthy noisy fleet: drains per 1,000 node-days", drains, "drains", 0.0,
                    note=f"{len(s.false_drains)} drains in {node_days:.1f} node-days (1,000 nodes x "
                         f"{slice_seconds:g} s); the full 24 h is `vigil sim --scenario healthy-1000x24h`"),
    )


def _slow_node(nodes: int, seed: int, fault_at: float = 20.0) -> Scenario:
    data = load_scenario("slow-node-1024").model_dump()
    data["fleet"]["nodes"] = nodes
    culprit = f"node-{(seed * 7919) % nodes:04d}"
    data["faults"] = [{"kind": "slow_node", "node": culprit, "at_seconds": fault_at, "factor": 1.1}]
    data["expect"] = [{"node": culprit, "action": "drain", "within_seconds": 30}]
    data["duration_seconds"] = fault_at + 35.0
    data["seed"] = seed
    return parse_scenario(data, f"slow-node-{nodes}-seed{seed}")


def _slow_node_quality() -> list[Measurement]:
    big = score(run_scenario(_slow_node(1024, 7)))
    latency = big.latencies[0] if big.latencies else float("inf")
    flagged = false = expected = 0
    for seed in SEEDS:
        s = score(run_scenario(_slow_node(256, seed)))
        expected += len(s.expectations)
        flagged += s.met
        false += len(s.false_drains)
    precision = flagged / (flagged + false) if flagged + false else 0.0
    recall = flagged / expected
    seeds = ", ".join(map(str, SEEDS))
    return [
        Measurement("10% slow node in a 1,024-node job: flagged after", latency, "s", 30.0,
                    note="simulated seconds from the slowdown to the drain decision (2.5 s reports)"),
        Measurement("10% slow node: precision", round(precision, 3), "", 0.99, higher_is_better=True,
                    note=f"256-node jobs, seeds {seeds}: {flagged} flagged, {false} false drains"),
        Measurement("10% slow node: recall", round(recall, 3), "", 0.95, higher_is_better=True,
                    note=f"256-node jobs, seeds {seeds}: {flagged} of {expected} slow nodes flagged in 30 s"),
    ]


def _fatal_xid() -> Measurement:
    # Off the report grid (90 s is a tick): the line lands 1 s after a report was built.
    data = load_scenario("kernel-xid-79").model_dump()
    data["faults"][0]["at_seconds"] = 91.0
    sc = shortened(parse_scenario(data, "kernel-xid-79-off-grid"), 120)
    s = score(run_scenario(sc))
    latency = s.latencies[0] if s.latencies else float("inf")
    return Measurement("fatal Xid in the kernel log -> decision (simulated time)", latency, "s", None,
                       note=f"bounded by the simulator's {sc.report_interval_seconds:g} s tick (the agent's xid "
                            "collector runs every 0.5 s and pushes at once); the 2 s p95 budget is a real-time "
                            "figure for the demo and the actuators")


def measure() -> list[Measurement]:
    return [*_fleet_hour(), *_slow_node_quality(), _fatal_xid()]


if __name__ == "__main__":
    for m in measure():
        ok = {True: "ok", False: "OVER", None: "-"}[m.within_budget]
        print(f"{m.what:55s} {m.value:>10g} {m.unit:6s} budget {m.budget}  {ok}  {m.note}")
