"""The GPU peer detector passing over a job's GPUs on their watched band (GpuHistory.clock_watch)
finds exactly what a fresh detector reading every window whole finds, every pass, over a randomized
evolving fleet built to break the band's upkeep: GPUs that dip for a while (a real straggler) or
wander out of the band and back, a GPU that goes idle, GPUs that change job, model (a new hardware
class) or power limit, a GPU replaced (a new uuid at its index), a GPU unhealthy for a while, a GPU
missing from some reports, a node that leaves the fleet and comes back as a new node, passes whose
time goes backwards, and a second detector over the same fleet now and then (its watches replace
the first's on the GPUs they share). The run must pass over groups on their band (the short way
is taken) and still find the stragglers (the long way's findings are not empty)."""

from __future__ import annotations

import math
import random

import pytest

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.detectors.gpu_peer import GpuPeerConfig, GpuPeerDetector
from vigil.aggregator.fleet import Fleet
from vigil.aggregator.fleet.history import ClockWatch, GpuHistory
from vigil.contract.wire import GpuState

NODES = 10


def quiet_groups(detector: GpuPeerDetector, start: float) -> int:
    """The groups the detector's next pass at a window start of ``start`` passes over."""
    return sum(1 for group in detector._groups.values()
               if group.limits_quiet and group.watch is not None and group.watch.out_ts < start)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_group_passed_over_on_its_band_hides_no_finding(seed: int) -> None:
    rng = random.Random(seed)
    nodes = [FakeNode(f"n{i}", ports=0) for i in range(NODES)]
    for i, node in enumerate(nodes):
        for g in node.gpus.values():
            g["job"] = "a" if i < 6 else "b"
            g["power_limit_watts"] = 700.0
    fleet = Fleet()
    config = GpuPeerConfig()
    short, rival = GpuPeerDetector(config), GpuPeerDetector(config)
    dips: dict[tuple[int, int], float] = {}  # (node, gpu) -> until when its clock dips
    passed_over = found = 0
    uuids = 0
    t, last_pass = 0.0, 0.0
    gone: tuple[int, float] | None = None
    while t < 1500:
        t += 2.5
        for i, node in enumerate(nodes):
            for index, g in node.gpus.items():
                until = dips.get((i, index), -math.inf)
                g["sm_clock_hertz"] = 1.98e9 * (1 + rng.uniform(-0.03, 0.0)) * (0.7 if t < until else 1.0)
                g["utilization_gpu_ratio"] = 0.97
        event = rng.random()
        i, index = rng.randrange(NODES), rng.randrange(8)
        g = nodes[i].gpus[index]
        if event < 0.03:
            dips[(i, index)] = t + rng.choice([10.0, 90.0, 200.0])  # a short wander, or a straggler
        elif event < 0.05:
            g["utilization_gpu_ratio"] = 0.1  # idle for a report
        elif event < 0.07:
            g["sm_clock_hertz"] = 1.98e9 * 1.2  # a sample above the band
        elif event < 0.09:
            # Moves to another group; as often one that dips (it joins with its low clocks held).
            dipping = sorted(key for key, until in dips.items() if until > t)
            if dipping and rng.random() < 0.5:
                i, index = rng.choice(dipping)
                g = nodes[i].gpus[index]
            g["job"] = rng.choice(["a", "b", "c"])
        elif event < 0.10:
            for other in nodes[i].gpus.values():  # the node's GPUs: another model (another class)
                other["name"] = rng.choice(["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
        elif event < 0.12:
            g["power_limit_watts"] = rng.choice([700.0, 500.0])
        elif event < 0.13:
            uuids += 1
            g["uuid"] = f"GPU-new-{uuids}"  # replaced: a new history at its index
        elif event < 0.15:
            g["health"] = "reset_required" if g.get("health", "ok") == "ok" else "ok"
        elif event < 0.16 and gone is None:
            gone = (i, t)  # silent until forgotten, then back as a new node
        for k, node in enumerate(nodes):
            if gone is not None and gone[0] == k and t < gone[1] + 40:
                continue
            drop = (rng.randrange(8),) if rng.random() < 0.03 else ()
            fleet.ingest(node.report(t, drop_gpus=drop), t + rng.uniform(0, 0.5))
        fleet.forget_departed(t + 1.0, lambda n: 20.0)
        if gone is not None and t >= gone[1] + 40:
            gone = None
        if rng.random() < 0.2:
            continue  # no pass: the next one finds two samples a GPU
        # Now and then a pass earlier than the last one (the clock went backwards).
        now = last_pass - rng.uniform(0, 5) if rng.random() < 0.05 else t + rng.uniform(0.6, 2.0)
        last_pass = now
        view = fleet.view()
        passed_over += quiet_groups(short, now - config.persistence_seconds)
        findings = short.evaluate(view, now)
        assert findings == GpuPeerDetector(config).evaluate(view.without_markers(), now)
        found += len(findings)
        if rng.random() < 0.1:
            # Another detector on the same fleet: its bands replace this one's on the GPUs it watches.
            assert rival.evaluate(view, now) == findings
    assert passed_over > 100 and found > 10, (passed_over, found)


def test_a_watch_sees_the_samples_held_and_those_that_come_and_lets_go_when_replaced() -> None:
    node = FakeNode("n1", gpus=1, ports=0)
    hist: GpuHistory | None = None
    fleet = Fleet()
    for t in (0.0, 2.5, 5.0):
        node.gpus[0]["sm_clock_hertz"] = 1.0e9 if t == 2.5 else 1.9e9
        fleet.ingest(node.report(t), t)
    hist = fleet.view().nodes["n1"].gpus[0]
    watch = ClockWatch(1.8e9, 2.0e9, 0.5)
    hist.watch_clocks(watch)
    assert watch.out_ts == 2.5  # the held sample below the band
    node.gpus[0]["utilization_gpu_ratio"] = 0.1
    node.gpus[0]["sm_clock_hertz"] = 0.5e9
    fleet.ingest(node.report(7.5), 7.5)
    assert watch.out_ts == 2.5  # idle: it says nothing of the band (its window is not judged)
    node.gpus[0]["utilization_gpu_ratio"] = 0.9
    node.gpus[0]["sm_clock_hertz"] = 2.1e9
    fleet.ingest(node.report(10.0), 10.0)
    assert watch.out_ts == 10.0
    other = ClockWatch(1.0e9, 3.0e9, 0.5)
    hist.watch_clocks(other)
    assert watch.out_ts == math.inf and other.out_ts == -math.inf  # replaced: the first no longer holds
    hist.unwatch_clocks(watch)
    assert hist.clock_watch is other  # only the watch watched is let go
    hist.unwatch_clocks(other)
    assert hist.clock_watch is None
    state = GpuState(index=0, uuid="GPU-x", sm_clock_hertz=0.1e9, utilization_gpu_ratio=1.0)
    hist.observe(state, 12.5)
    assert other.out_ts == -math.inf  # not watched any more
