from aggregator.decision import Action
from aggregator.detectors.hang import HangConfig, HangDetector
from aggregator.fleet import Fleet
from tests.aggregator.conftest import FakeNode, set_training

DETECTOR = HangDetector(HangConfig(stall_seconds=60.0))


def run(nodes, until, *, stop_at=None, culprit=None, culprit_state=None, silent=None):
    """Train until ``stop_at`` (everyone's progress stops; ``culprit`` stops 40 s earlier)."""
    fleet = Fleet()
    t = 0.0
    while t <= until:
        step = int(t)
        set_training(nodes, "job", t, ranks_per_node=2, step=step)
        for n in nodes:
            stop = stop_at
            if culprit is not None and n.name == culprit and stop_at is not None:
                stop = stop_at - 40.0
            if stop is not None and t >= stop:
                for r in n.ranks:
                    r.last_progress_ts = stop
                    r.last_step = int(stop)
                    if culprit_state and n.name == culprit:
                        r.state = culprit_state
            if silent is not None and n.name == silent and t >= stop_at:
                continue
            fleet.ingest(n.report(t), t)
        t += 2.5
    return fleet


def nodes_(n=6):
    return [FakeNode(f"n{i}", gpus=0, ports=0) for i in range(n)]


def test_progressing_job_is_not_hung():
    assert DETECTOR.evaluate(run(nodes_(), 200.0).view(), 200.0) == []


def test_whole_job_stall_restarts_the_job_and_drains_nobody():
    fleet = run(nodes_(), 200.0, stop_at=100.0)
    assert DETECTOR.evaluate(fleet.view(), 150.0) == []  # 50 s: below the 60 s threshold
    found = DETECTOR.evaluate(fleet.view(), 200.0)
    assert [(f.action, f.job) for f in found] == [(Action.RESTART_JOB, "job")]
    assert found[0].evidence["signal"] == "step_progress"


def test_one_node_stopping_first_is_drained_and_the_job_restarted():
    fleet = run(nodes_(), 200.0, stop_at=100.0, culprit="n3")
    found = DETECTOR.evaluate(fleet.view(), 200.0)
    assert sorted((f.action, f.node) for f in found if f.action is Action.DRAIN) == [(Action.DRAIN, "n3")]
    assert [f.action for f in found].count(Action.RESTART_JOB) == 1


def test_exited_rank_blames_its_node():
    fleet = run(nodes_(), 200.0, stop_at=100.0, culprit="n2", culprit_state="exited")
    drains = [f.node for f in DETECTOR.evaluate(fleet.view(), 200.0) if f.action is Action.DRAIN]
    assert drains == ["n2"]


def test_node_gone_silent_while_job_stalls_is_the_culprit():
    fleet = run(nodes_(), 200.0, stop_at=100.0, silent="n4")
    found = DETECTOR.evaluate(fleet.view(), 200.0)
    assert [f.node for f in found if f.action is Action.DRAIN] == ["n4"]


def test_finished_job_is_not_a_hang():
    nodes = nodes_()
    fleet = run(nodes, 100.0)
    t = 102.5
    for n in nodes:
        n.ranks = []  # the job ended: the agents no longer report its ranks
    while t < 400:
        for n in nodes:
            fleet.ingest(n.report(t), t)
        t += 2.5
    assert DETECTOR.evaluate(fleet.view(), t) == []


def test_silent_node_whose_peers_progress_is_not_a_hang():
    nodes = nodes_()
    fleet = run(nodes, 100.0)
    t = 102.5
    while t < 200:
        set_training(nodes, "job", t, ranks_per_node=2, step=int(t))
        for n in nodes[1:]:  # n0's agent stopped reporting; the job still steps
            fleet.ingest(n.report(t), t)
        t += 2.5
    assert DETECTOR.evaluate(fleet.view(), t) == []
