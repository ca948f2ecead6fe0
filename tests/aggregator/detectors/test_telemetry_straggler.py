"""Telemetry straggler detector: in a job with no heartbeats, the node whose GPUs idle while its
peers busy-wait in the collective is alerted on (never drained) after its window; a whole-job
slowdown, a job phase, partial attribution, missing telemetry, mixed hardware, sampling noise and
an instrumented job are not."""

import random

from tests.aggregator.conftest import FakeNode, proposals_ledger, rank_summary
from vigil.aggregator.config import DetectorsConfig
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors import REGISTRY
from vigil.aggregator.detectors.telemetry_straggler import TelemetryStragglerConfig, TelemetryStragglerDetector
from vigil.aggregator.fleet import Fleet

INTERVAL = 10.0
# A healthy data-parallel step as NVML reads it: a kernel resident all the time (compute, then the
# collective's spin), utilization pinned near 1 (module docstring).
BUSY = {"utilization_gpu_ratio": 0.99}
# A host-starved node: no kernel while it waits for its batch.
STARVED = {"utilization_gpu_ratio": 0.70}


def drive(nodes, seconds, *, load=None, seed=5, detector=None, ranks=False, drop=None):
    """Every node reports every INTERVAL s for ``seconds``, its GPUs attributed to job "llm" with
    ``load(node, t) -> dict`` (default BUSY) under +-10% uniform noise per GPU and sample; the
    detector judges after each round. Returns every round's findings, by time."""
    rng = random.Random(seed)
    fleet = Fleet()
    detector = detector or TelemetryStragglerDetector(TelemetryStragglerConfig())
    found = {}
    t = 0.0
    while t <= seconds:
        for ni, n in enumerate(nodes):
            figures = (load or (lambda _n, _t: BUSY))(n, t)
            for g in n.gpus.values():
                if g.get("job", "llm") is not None:
                    g.setdefault("job", "llm")
                for key, value in figures.items():
                    g[key] = min(1.0, value * (1 + rng.uniform(-0.1, 0.1)))
            n.ranks = [rank_summary("llm", ni * 8 + i, compute=1.0, comm=0.1, ts=t, gpu=i, step=int(t))
                       for i in n.gpus] if ranks else []
            if drop is None or not drop(n, t):
                fleet.ingest(n.report(t), t)
        found[t] = detector.evaluate(fleet.view(), t)
        t += INTERVAL
    return found


def nodes_(n=6, **kw):
    return [FakeNode(f"n{i}", ports=0, interval=INTERVAL, **kw) for i in range(n)]


def starved(name, since=0.0, until=None, figures=STARVED):
    def load(n, t):
        return figures if n.name == name and t >= since and (until is None or t < until) else BUSY
    return load


def firing(found):
    return {t: f for t, f in found.items() if f}


def test_starved_node_is_alerted_after_its_window_and_only_it():
    found = drive(nodes_(), 900, load=starved("n3", since=100))
    fired = firing(found)
    assert fired, "the starved node was never alerted"
    first = min(fired)
    # The onset at 100 s, half the smoothing (3 reports of 6) to move the node's median, then ten
    # minutes of consecutive flagged evaluations.
    assert 700 <= first <= 760
    for findings in fired.values():
        assert [(f.node, f.job, f.action) for f in findings] == [("n3", "llm", Action.ALERT)]
    ev = fired[first][0].evidence
    assert ev["signal"] == "telemetry_straggler"
    assert ev["node_utilization"] < ev["job_median_utilization"] and ev["drop_ratio"] >= 0.15
    assert ev["peers_median_utilization"] >= 0.8 and ev["samples"] >= 10 and ev["window_seconds"] >= 600
    since = fired[first][0].since
    assert 100 <= since <= 160 and first - since >= 600
    assert {f.since for fs in fired.values() for f in fs} == {since}  # one episode


def test_a_node_whose_gpus_send_no_utilization_is_not_judged():
    # n1's GPUs report no utilization (NVML refused the query): no evidence, no alert.
    def load(n, t):
        return {} if n.name == "n1" else BUSY
    nodes = nodes_()
    for g in nodes[1].gpus.values():
        g.pop("utilization_gpu_ratio")
    assert not firing(drive(nodes, 800, load=load))


def test_a_short_slowdown_or_one_broken_by_a_phase_does_not_fire():
    # Slow for 9 minutes only.
    assert not firing(drive(nodes_(), 1500, load=starved("n2", since=100, until=640)))

    # Slow throughout, but the job checkpoints every 5 minutes (every GPU idle 30 s): each pause
    # ends the run before the window fills.
    def load(n, t):
        if t % 300 < 30:
            return {"utilization_gpu_ratio": 0.05}
        return starved("n2")(n, t)
    assert not firing(drive(nodes_(), 1500, load=load))


def test_whole_job_slowdown_and_job_phases_do_not_fire():
    # Every node equally low (a slow library, a fleet-wide cap).
    assert not firing(drive(nodes_(), 900, load=lambda n, t: STARVED))

    # An evaluation or data phase: every GPU mostly idle, one node idler still (its ranks' share of
    # the eval set is smaller): nobody waits in a collective, the job is not judged.
    def eval_phase(n, t):
        return {"utilization_gpu_ratio": 0.10 if n.name == "n0" else 0.30}
    assert not firing(drive(nodes_(), 900, load=eval_phase))


def test_partial_attribution_missing_telemetry_and_too_few_nodes_do_not_fire():
    # n5 has only 4 of its 8 GPUs in the job (the rest idle in another job): not judged.
    nodes = nodes_()
    for i in range(4, 8):
        nodes[5].gpus[i]["job"] = "other"
    assert not firing(drive(nodes, 900, load=starved("n5")))

    # The starved node's reports stop arriving for a while: stale telemetry ends its run.
    assert not firing(drive(nodes_(), 900, load=starved("n1"),
                            drop=lambda n, t: n.name == "n1" and 400 <= t < 460))

    # Three nodes: no baseline.
    assert not firing(drive(nodes_(3), 900, load=starved("n1")))


def test_heterogeneous_job_is_judged_within_each_hardware_class():
    # Four H100 nodes and four H200 nodes whose GPUs read differently by design (here the H200s
    # lower): within each class nobody stands out.
    nodes = nodes_(8)
    for n in nodes[4:]:
        for g in n.gpus.values():
            g["name"] = "NVIDIA H200"
    for n in nodes[:4]:
        for g in n.gpus.values():
            g["name"] = "NVIDIA H100 80GB HBM3"

    def load(n, t):
        return STARVED if n.name in ("n4", "n5", "n6", "n7") else BUSY
    assert not firing(drive(nodes, 900, load=load))

    # A starved H100 among the H100s is still found.
    def load2(n, t):
        return STARVED if n.name in ("n2", "n4", "n5", "n6", "n7") else BUSY
    # n2 is one of 4 H100s; the H200s all read STARVED alike (their class median).
    fired = firing(drive(nodes, 800, load=load2))
    assert {f.node for fs in fired.values() for f in fs} == {"n2"}


def test_sampling_noise_and_instrumented_jobs_do_not_fire():
    # Eight healthy nodes for two hours at +-10% per GPU and sample.
    assert not firing(drive(nodes_(8), 7200, seed=11))
    # A job with heartbeats is the heartbeat stragglers' (straggler.py, gpu_straggler.py).
    assert not firing(drive(nodes_(), 900, load=starved("n3"), ranks=True))


def test_bimodal_job_flags_nobody():
    # Two of six nodes low (pipeline stages of unequal work): more than a quarter, nobody flagged.
    def load(n, t):
        return STARVED if n.name in ("n0", "n1") else BUSY
    assert not firing(drive(nodes_(), 900, load=load))


def test_registered_and_on_by_default_as_alert_only():
    assert "telemetry_straggler" in REGISTRY
    assert DetectorsConfig().telemetry_straggler.enabled


def test_default_engine_alerts_on_the_starved_node_and_decides_nothing_else():
    """The shipped defaults end to end (every detector, the topology pass): one alert, on n3."""
    from vigil.aggregator.config import AggregatorConfig
    from vigil.aggregator.engine import Engine

    config = AggregatorConfig()
    sink = proposals_ledger()
    engine = Engine(config, sink)
    nodes = nodes_()
    rng = random.Random(7)
    load = starved("n3", since=100)
    decided = []
    t = 0.0
    while t <= 900:
        for n in nodes:
            for g in n.gpus.values():
                g["job"] = "llm"
                for key, value in load(n, t).items():
                    g[key] = min(1.0, value * (1 + rng.uniform(-0.1, 0.1)))
            engine.ingest(n.report(t), t)
        decided += engine.evaluate(t)
        t += INTERVAL
    assert [(d.node, d.action, d.detector) for d in decided] == [("n3", Action.ALERT, "telemetry_straggler")]
