import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.aggregator.conftest import FakeNode, set_training
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.straggler import StragglerConfig, StragglerDetector
from vigil.aggregator.fleet import Fleet

DETECTOR = StragglerDetector(StragglerConfig())


def run(nodes, *, slow=None, scale=1.0, seconds=40.0, noise=0.0, seed=0, until_first=False):
    """Feed a synchronous job on ``nodes`` through a fleet; return the flagged nodes per evaluation."""
    rng = random.Random(seed)
    fleet = Fleet()
    flagged: list[tuple[float, list[str]]] = []
    t = 0.0
    while t <= seconds:
        set_training(nodes, "job", t, slow=slow, scale=scale, noise=lambda: rng.gauss(0.0, noise))
        for n in nodes:
            fleet.ingest(n.report(t), t)
        found = DETECTOR.evaluate(fleet.view(), t)
        flagged.append((t, sorted(f.node for f in found)))
        if until_first and found:
            break
        t += 2.5
    return flagged


def nodes_(n):
    return [FakeNode(f"n{i:04d}", gpus=0, ports=0) for i in range(n)]


def test_slow_node_is_flagged_within_30_seconds_and_alone():
    flagged = run(nodes_(32), slow={"n0007": 1.10}, noise=0.01)
    first = next(t for t, f in flagged if f)
    assert first <= 30.0
    assert {n for _, f in flagged for n in f} == {"n0007"}


def test_finding_names_the_signal_and_the_rank():
    nodes = nodes_(16)
    fleet = Fleet()
    for i in range(12):
        t = i * 2.5
        set_training(nodes, "job", t, slow={"n0003": 1.2})
        for n in nodes:
            fleet.ingest(n.report(t), t)
    [f] = DETECTOR.evaluate(fleet.view(), 30.0)
    assert f.action is Action.DRAIN and f.job == "job" and f.node == "n0003"
    assert f.evidence["signal"] == "compute_seconds_p50"
    assert f.evidence["ranks"] == 8  # the node speaks through its ranks, not one of them
    assert abs(f.evidence["excess_ratio"] - 0.2) < 1e-6


def test_whole_job_slowdown_drains_nobody():
    # Every rank 40% slower (a data-loader stall): the median moves, nobody stands out.
    flagged = run(nodes_(32), scale=1.4, noise=0.01)
    assert all(not f for _, f in flagged)


def test_slow_compute_without_short_collective_wait_is_not_a_straggler():
    nodes = nodes_(16)
    fleet = Fleet()
    for i in range(12):
        t = i * 2.5
        set_training(nodes, "job", t, slow={"n0003": 1.2})
        for r in nodes[3].ranks:  # it computes longer AND waits longest: it is being waited on, not slow
            r.comm_seconds_p50 = 5.0
        for n in nodes:
            fleet.ingest(n.report(t), t)
    assert DETECTOR.evaluate(fleet.view(), 30.0) == []


def test_one_slow_window_is_not_enough():
    nodes = nodes_(16)
    fleet = Fleet()
    for i in range(12):
        t = i * 2.5
        set_training(nodes, "job", t, slow={"n0003": 1.5} if i == 6 else None)
        for n in nodes:
            fleet.ingest(n.report(t), t)
        assert DETECTOR.evaluate(fleet.view(), t) == []


def test_too_many_outliers_is_a_job_wide_effect():
    nodes = nodes_(20)
    slow = {f"n{i:04d}": 1.3 for i in range(4)}  # 20% of the job
    flagged = run(nodes, slow=slow)
    assert all(not f for _, f in flagged)


def test_healthy_noisy_job_over_half_an_hour_flags_nothing():
    flagged = run(nodes_(16), noise=0.02, seconds=1800.0, seed=7)
    assert all(not f for _, f in flagged)


# Properties ------------------------------------------------------------------------------------

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(n=st.integers(min_value=8, max_value=40))
def test_identical_nodes_never_produce_a_finding(n):
    assert all(not f for _, f in run(nodes_(n), seconds=25.0))


@SETTINGS
@given(k=st.floats(min_value=0.01, max_value=100.0), seed=st.integers(0, 1000),
       slow=st.sampled_from([None, 1.08, 1.25]))
def test_scaling_every_step_time_by_k_changes_nothing(k, seed, slow):
    plan = {"n0005": slow} if slow else None
    base = run(nodes_(16), slow=plan, noise=0.01, seed=seed, seconds=25.0)
    scaled = run(nodes_(16), slow=plan, noise=0.01, seed=seed, seconds=25.0, scale=k)
    assert base == scaled


@SETTINGS
@given(seed=st.integers(0, 1000), extra=st.integers(1, 4))
def test_adding_healthy_nodes_never_flags_another(seed, extra):
    base = run(nodes_(16), slow={"n0002": 1.3}, noise=0.01, seed=seed, seconds=25.0)
    more = run(nodes_(16 + extra), slow={"n0002": 1.3}, noise=0.01, seed=seed, seconds=25.0)
    assert {n for _, f in more for n in f} <= {n for _, f in base for n in f} | {"n0002"}
    assert {n for _, f in more for n in f} <= {"n0002"}


@SETTINGS
@given(n=st.integers(min_value=8, max_value=48), culprit=st.integers(0, 47), factor=st.floats(1.15, 3.0))
def test_one_clear_outlier_is_flagged_and_is_the_only_one(n, culprit, factor):
    name = f"n{culprit % n:04d}"
    flagged = run(nodes_(n), slow={name: factor}, seconds=25.0)
    assert {x for _, f in flagged for x in f} == {name}
    assert any(f == [name] for _, f in flagged)


def test_a_late_report_neither_breaks_nor_fakes_persistence():
    nodes = nodes_(16)
    fleet = Fleet()
    found = []
    for i in range(16):
        t = i * 2.5
        set_training(nodes, "job", t, slow={"n0003": 1.2})
        for n in nodes:
            if n.name == "n0003" and t in (15.0, 17.5):  # one whole 5 s window without its data
                continue
            fleet.ingest(n.report(t), t)
        found.append((t, [f.node for f in DETECTOR.evaluate(fleet.view(), t)]))
    first = next(t for t, f in found if f)
    assert first <= 30.0
    assert {n for _, f in found for n in f} == {"n0003"}
    # three flagged windows are needed (these summaries carry no window end, so the windows
    # ending at 0, 5 and 10 s by arrival), judged once every rank has reported the last one
    assert all(not f for t, f in found if t < 10.0)
