"""GPU peer detector: within a job, the GPU clocked or capped below its peers is the likely
straggler, found with no per-rank timing at all; noise, idle GPUs, job-wide differences and
other jobs are not."""

import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.aggregator.conftest import FakeNode, rank_summary
from vigil.aggregator.decision import WHOLE_JOB, Action
from vigil.aggregator.detectors.gpu_peer import GpuPeerConfig, GpuPeerDetector, _ClockWindow
from vigil.aggregator.fleet import Fleet, GpuHistory
from vigil.contract.wire import GpuState

DETECTOR = GpuPeerDetector(GpuPeerConfig())


def drive(nodes, seconds, *, jobs=None, step_only_ranks=False, mutate=None, seed=3):
    """Every node reports every 2.5 s for ``seconds``; GPUs carry their job (attribution) unless
    ``jobs`` is False, then only the ranks' heartbeats (local GPU index) say it."""
    rng = random.Random(seed)
    fleet = Fleet()
    t = 0.0
    while t <= seconds:
        for ni, n in enumerate(nodes):
            for g in n.gpus.values():
                g["sm_clock_hertz"] = 1.98e9 * (1 + rng.uniform(-0.03, 0.0))  # under SwPowerCap, +-3%
                g["power_limit_watts"] = 700.0
                if jobs is not False:
                    g["job"] = "llm"
            if mutate is not None:
                mutate(n, t)
            n.ranks = []
            if step_only_ranks or jobs is False:
                for local in n.gpus:
                    r = rank_summary("llm", ni * 8 + local, compute=1.0, comm=0.1, ts=t, gpu=local, step=int(t))
                    if step_only_ranks:
                        r.compute_seconds_p50 = r.comm_seconds_p50 = None
                    n.ranks.append(r)
            fleet.ingest(n.report(t), t)
        t += 2.5
    return fleet, t - 2.5


def nodes_(n=4):
    return [FakeNode(f"n{i}", ports=0) for i in range(n)]


def capped(node_name, *, clock=None, limit=None, reasons=("sw_power_cap",), since=0.0):
    def mutate(n, t):
        if n.name == node_name and t >= since:
            for g in n.gpus.values():
                if clock is not None:
                    g["sm_clock_hertz"] = clock
                if limit is not None:
                    g["power_limit_watts"] = limit
                g["clock_event_reasons"] = list(reasons)
    return mutate


def test_healthy_noisy_job_flags_nobody():
    for seed in range(5):
        fleet, now = drive(nodes_(), 300.0, seed=seed)
        assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is not Action.OBSERVE] == []


def test_power_capped_node_is_the_likely_straggler_with_evidence():
    fleet, now = drive(nodes_(), 120.0, mutate=capped("n2", clock=1.6e9, limit=500.0))
    found = [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is Action.ALERT]
    assert [(f.node, f.job, f.detector) for f in found] == [("n2", "llm", "gpu_peer")]
    ev = found[0].evidence
    assert ev["signal"] == "power_limit_watts" and ev["gpus"] == list(range(8))
    assert ev["power_limit_watts"] == 500.0 and ev["job_median_power_limit_watts"] == 700.0
    assert "sw_power_cap" in ev["clock_event_reasons"]


def test_clock_capped_gpu_found_through_step_only_heartbeats():
    # No attribution: the ranks' heartbeats (hb.step(n) only, local GPU index) place GPUs in the job.
    def mutate(n, t):
        if n.name == "n1":
            n.gpus[5]["sm_clock_hertz"] = 1.41e9
            n.gpus[5]["clock_event_reasons"] = ["hw_slowdown"]
    fleet, now = drive(nodes_(), 120.0, jobs=False, step_only_ranks=True, mutate=mutate)
    found = DETECTOR.evaluate(fleet.view(), now)
    alerts = [f for f in found if f.action is Action.ALERT]
    assert [(f.node, f.gpu) for f in alerts] == [("n1", 5)]
    assert alerts[0].evidence["signal"] == "sm_clock_hertz" and alerts[0].evidence["sm_clock_ratio"] < 0.75
    observe = [f for f in found if f.action is Action.OBSERVE]
    assert len(observe) == 1 and "no per-rank timing" in observe[0].reason


def test_a_brief_dip_is_not_persistent():
    fleet, now = drive(nodes_(), 120.0, mutate=capped("n2", clock=1.4e9, since=100.0))
    assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is Action.ALERT] == []


def test_job_wide_difference_flags_nobody():
    # Half the job on power-capped nodes: a site policy or a mixed fleet, not one straggler.
    def mutate(n, t):
        if n.name in ("n0", "n1"):
            capped(n.name, clock=1.6e9, limit=500.0)(n, t)
    fleet, now = drive(nodes_(), 120.0, mutate=mutate)
    assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is Action.ALERT] == []


def test_idle_gpus_and_gpus_of_no_job_are_not_compared():
    def mutate(n, t):
        if n.name == "n3":
            for g in n.gpus.values():
                g["utilization_gpu_ratio"] = 0.0
                g["sm_clock_hertz"] = 0.345e9  # idle clocks
    fleet, now = drive(nodes_(), 120.0, mutate=mutate)
    assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is Action.ALERT] == []
    fleet, now = drive(nodes_(), 120.0, jobs=None, mutate=lambda n, t: n.gpus[0].update(job=None))
    assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is Action.ALERT] == []


def test_drain_by_policy():
    detector = GpuPeerDetector(GpuPeerConfig(action=Action.DRAIN))
    fleet, now = drive(nodes_(), 120.0, mutate=capped("n0", limit=450.0))
    assert [(f.node, f.action) for f in detector.evaluate(fleet.view(), now)] == [("n0", Action.DRAIN)]


def test_timed_job_gets_no_untimed_observation():
    nodes = nodes_()
    fleet, now = drive(nodes, 30.0, jobs=False)  # ranks with compute and comm times
    assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is Action.OBSERVE] == []


def test_gpus_of_an_ended_job_are_not_placed_in_it_by_its_old_heartbeats():
    nodes = nodes_()
    def mutate(n, t):
        if n.name == "n2":
            capped("n2", clock=1.5e9)(n, t)
    fleet, now = drive(nodes, 60.0, jobs=False, step_only_ranks=True)
    # The job ends (its ranks are no longer reported); the GPUs run something else, n2 slower.
    t = now
    for _ in range(40):
        t += 2.5
        for n in nodes:
            n.ranks = []
            mutate(n, t)
            fleet.ingest(n.report(t), t)
    assert [f for f in DETECTOR.evaluate(fleet.view(), t) if f.action is Action.ALERT] == []


def test_untimed_job_seen_partially_first_is_said_once_for_the_job_when_rank_0_reports():
    nodes = nodes_()
    fleet = Fleet()
    for i, t in enumerate((0.0, 2.5, 5.0, 7.5)):
        for ni, n in enumerate(nodes):
            n.ranks = [rank_summary("llm", ni * 8 + g, compute=1.0, comm=0.1, ts=t, gpu=g) for g in range(8)]
            for r in n.ranks:
                r.compute_seconds_p50 = r.comm_seconds_p50 = None
            if i < 2 and ni != 3:
                continue  # only n3's agent has reported the job so far
            fleet.ingest(n.report(t), t)
        found = [f for f in DETECTOR.evaluate(fleet.view(), t) if f.action is Action.OBSERVE]
        assert [(f.node, f.job) for f in found] == ([] if i < 2 else [(WHOLE_JOB, "llm")])


# A GPU's window carried from pass to pass reads as the whole history does, whatever the reports'
# timing (bursts that overflow the ring, gaps past the window, the clock going backwards), the
# samples (no clock, no utilization, idle) and the passes' times (backwards too), and when the
# GPU's history is replaced (a new GPU at that index).
# Mostly the usual (a busy GPU reporting every 2.5 s), so that windows often hold a clock.
REPORT_GAPS = st.sampled_from([2.5] * 12 + [0.0, 0.5, 1.0, 7.0, 30.0, -3.0])
SAMPLE_VALUES = st.tuples(st.sampled_from([0.9] * 12 + [None, 0.2, 0.5]),
                          st.sampled_from([1.98e9] * 4 + [1.4e9, 1.7e9] * 4 + [None]))
STEPS = st.lists(st.tuples(st.sampled_from(["report"] * 6 + ["pass"] * 3 + ["new_gpu"]),
                           REPORT_GAPS, st.sampled_from([0.0, 1.0, 2.5, 2.5, -2.0]), SAMPLE_VALUES),
                 min_size=10, max_size=80)


@settings(max_examples=300, deadline=None)
@given(STEPS)
def test_the_carried_window_reads_as_the_whole_history(steps):
    config = GpuPeerConfig(persistence_seconds=10.0, min_reports=3)
    detector = GpuPeerDetector(config)
    windows: dict[tuple[str, int], _ClockWindow] = {}

    def state(utilization, clock):
        return GpuState(index=0, uuid="GPU-0", utilization_gpu_ratio=utilization, sm_clock_hertz=clock)

    # A ring of 4 samples, shorter than the 10 s window at 2.5 s: samples leave the ring while
    # still inside the window.
    hist = GpuHistory(state(0.9, 1.98e9), 0.0, 16, 4)
    t = 0.0
    for kind, gap, pass_after, values in steps:
        if kind == "report":
            t += gap
            hist.observe(state(*values), t)
        elif kind == "pass":
            now = t + pass_after
            before = detector._windows.get(("n1", 0))
            windows = {}  # as a pass does: the windows it kept become the detector's
            carried = detector._carried_window_clock(windows, ("n1", 0), hist, now)
            detector._windows = windows
            assert carried == detector.window_clock(hist, now)
            event("a clock" if carried is not None else "no clock")
            event("carried" if before is not None and windows.get(("n1", 0)) is before else "rebuilt")
        else:
            hist = GpuHistory(state(0.9, 1.98e9), t, 16, 4)


# Peers by hardware class ---------------------------------------------------------------------

def mixed(h100_nodes, *, then=None):
    """H200 nodes, and the named ones H100s that run 20% lower clocks under the same load (by design)."""
    def mutate(n, t):
        for g in n.gpus.values():
            g["name"] = "NVIDIA H100 80GB HBM3" if n.name in h100_nodes else "NVIDIA H200"
            if n.name in h100_nodes:
                g["sm_clock_hertz"] *= 0.8
        if then is not None:
            then(n, t)
    return mutate


def test_a_node_of_another_gpu_model_is_not_a_straggler():
    # One H100 node among six H200 nodes: 8 of 56 GPUs at 80% of the job's median clock. Compared
    # with the whole job it was flagged; compared with its own class (its 8 GPUs) nothing differs.
    fleet, now = drive(nodes_(7), 120.0, mutate=mixed({"n3"}))
    assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is not Action.OBSERVE] == []
    whole_job = GpuPeerDetector(GpuPeerConfig(by_hardware_class=False))
    fleet, now = drive(nodes_(7), 120.0, mutate=mixed({"n3"}))
    assert [f.node for f in whole_job.evaluate(fleet.view(), now) if f.action is Action.ALERT] == ["n3"]


def test_a_capped_gpu_is_still_found_among_its_own_model_in_a_mixed_job():
    # The power limit is not part of this detector's class: a capped H200 stays an H200's peer.
    fleet, now = drive(nodes_(7), 120.0, mutate=mixed({"n3"}, then=capped("n5", clock=1.6e9, limit=500.0)))
    found = [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is Action.ALERT]
    assert [f.node for f in found] == ["n5"]
    assert found[0].evidence["hardware_class"] == "NVIDIA H200, 1980 MHz"
    assert found[0].evidence["job_gpus"] == 48  # its class's GPUs, the H100 node's 8 left out


def test_a_class_too_small_to_compare_is_not_judged():
    # A 3-GPU node of another model: fewer busy GPUs than min_gpus, no median of its own, and
    # never compared with the other model's.
    nodes = nodes_(5)
    nodes.append(FakeNode("odd", gpus=3, ports=0))
    fleet, now = drive(nodes, 120.0, mutate=mixed({"odd"}))
    assert [f for f in DETECTOR.evaluate(fleet.view(), now) if f.action is not Action.OBSERVE] == []
