"""The hang detector: stopped ranks and jobs within seconds, announced checkpoints and evaluations
under their own limits, and the rank that stopped first named."""

from tests.aggregator.conftest import FakeNode, set_training
from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.hang import HangConfig, HangDetector
from vigil.aggregator.fleet import Fleet

INTERVAL = 2.5


def run(nodes, until, *, stop_at=None, culprit=None, culprit_state=None, silent=None, phase=None,
        phase_nodes=None, state=None, every=None, detector=None):
    """Train until ``stop_at`` (everyone's progress stops; ``culprit`` stops 40 s earlier). ``phase``
    is announced by ``phase_nodes`` (default all) from ``stop_at`` on; ``state`` is what the agents
    say of the stopped ranks; ``every``: progress shows only every that many seconds (a log line per
    N iterations). The detector evaluates after every round, as the aggregator does. Returns the
    first (time, findings) with a finding, and the findings of the last round."""
    detector = detector or HangDetector(HangConfig())
    fleet = Fleet()
    t = 0.0
    first = None
    found: list = []
    while t <= until:
        step = int(t) if every is None else int(t // every) * every
        set_training(nodes, "job", t, ranks_per_node=2, step=step,
                     progress_ts=None if every is None else float(step))
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
                    elif state:
                        r.state = state
                    if phase and (phase_nodes is None or n.name in phase_nodes):
                        r.phase = phase
            if silent is not None and n.name == silent and t >= stop_at:
                continue
            fleet.ingest(n.report(t), t)
        found = detector.evaluate(fleet.view(), t)
        if found and first is None:
            first = (t, found)
        t += INTERVAL
    return first, found


def nodes_(n=6):
    return [FakeNode(f"n{i}", gpus=0, ports=0) for i in range(n)]


def test_progressing_job_is_not_hung():
    assert run(nodes_(), 200.0) == (None, [])


def test_whole_job_stall_is_an_alert_in_seconds_and_a_restart_later_and_drains_nobody():
    assert run(nodes_(), 115.0, stop_at=100.0) == (None, [])  # 15 s: below the 20 s floor
    _, found = run(nodes_(), 125.0, stop_at=100.0)
    assert [(f.action, f.job) for f in found] == [(Action.ALERT, "job")]
    assert found[0].evidence["signal"] == "step_progress" and found[0].evidence["stall_seconds_threshold"] == 20.0
    _, found = run(nodes_(), 405.0, stop_at=100.0)
    # A job-level finding: it names the job and no node (rank 0's node is not to blame).
    assert [(f.action, f.node, f.job) for f in found] == [(Action.RESTART_JOB, WHOLE_JOB, "job")]
    assert found[0].evidence["job_nodes"] == [f"n{i}" for i in range(6)]


def test_2s_steps_a_stopped_job_is_detected_within_30s():
    first, _ = run(nodes_(), 200.0, stop_at=100.0)
    assert first is not None and first[0] - 100.0 <= 30.0


def test_one_node_stopping_first_is_drained_and_the_job_restarted_naming_the_first_rank():
    _, found = run(nodes_(), 200.0, stop_at=100.0, culprit="n3")
    assert sorted((f.action, f.node) for f in found if f.action is Action.DRAIN) == [(Action.DRAIN, "n3")]
    restart = [f for f in found if f.action is Action.RESTART_JOB]
    assert len(restart) == 1 and restart[0].evidence["first_stopped_rank"] in (6, 7)
    assert "rank 6 stopped first" in restart[0].reason


def test_exited_rank_blames_its_node():
    _, found = run(nodes_(), 200.0, stop_at=100.0, culprit="n2", culprit_state="exited")
    drains = [f.node for f in found if f.action is Action.DRAIN]
    assert drains == ["n2"]


def test_node_gone_silent_while_job_stalls_is_the_culprit():
    _, found = run(nodes_(), 200.0, stop_at=100.0, silent="n4")
    assert [f.node for f in found if f.action is Action.DRAIN] == ["n4"]


def test_five_minute_checkpoint_raises_nothing_and_its_own_limit_still_holds():
    # 305 s saving, and the agents (whose own limit is 300 s) even say "hung".
    assert run(nodes_(), 405.0, stop_at=100.0, phase="checkpointing", state="hung") == (None, [])
    first, found = run(nodes_(), 1922.5, stop_at=100.0, phase="checkpointing")
    assert first is not None and first[0] >= 1900.0
    assert [f.action for f in found] == [Action.RESTART_JOB] and found[0].evidence["phase"] == "checkpointing"


def test_one_rank_checkpointing_while_the_others_wait_at_the_barrier_is_not_a_hang():
    assert run(nodes_(), 405.0, stop_at=100.0, phase="checkpointing", phase_nodes={"n0"}) == (None, [])


def test_long_evaluation_raises_nothing():
    assert run(nodes_(), 700.0, stop_at=100.0, phase="evaluating") == (None, [])


def test_a_log_that_advances_every_100_s_is_judged_by_its_own_gap():
    # Megatron prints every log_interval iterations: progress moves every 100 s, never a hang.
    assert run(nodes_(), 600.0, every=100.0) == (None, [])
    # ... and stopping for three of its gaps is one.
    first, _ = run(nodes_(), 1200.0, every=100.0, stop_at=600.0)
    assert first is not None and 600.0 + 300.0 <= first[0] <= 600.0 + 330.0


def test_finished_job_is_not_a_hang():
    nodes = nodes_()
    fleet = Fleet()
    for t in (97.5, 100.0):
        set_training(nodes, "job", t, ranks_per_node=2, step=int(t))
        for n in nodes:
            fleet.ingest(n.report(t), t)
    t = 102.5
    for n in nodes:
        n.ranks = []  # the job ended: the agents no longer report its ranks
    while t < 400:
        for n in nodes:
            fleet.ingest(n.report(t), t)
        t += 2.5
    assert HangDetector(HangConfig()).evaluate(fleet.view(), t) == []


def test_silent_node_whose_peers_progress_is_not_a_hang():
    nodes = nodes_()
    fleet = Fleet()
    t = 102.5
    while t < 200:
        set_training(nodes, "job", t, ranks_per_node=2, step=int(t))
        for n in nodes[1:]:  # n0's agent stopped reporting; the job still steps
            fleet.ingest(n.report(t), t)
        t += 2.5
    assert HangDetector(HangConfig()).evaluate(fleet.view(), t) == []


def test_an_agent_restart_on_a_healthy_node_while_the_job_steps_is_not_a_hang():
    # The lookalike: n0's agent restarts (25 s without a report, under the 30 s silence limit)
    # while the job keeps stepping. The time since its last report is not its ranks' stall.
    nodes = nodes_()
    fleet = Fleet()
    detector = HangDetector(HangConfig())
    t = 0.0
    while t < 200:
        set_training(nodes, "job", t, ranks_per_node=2, step=int(t))
        for n in nodes:
            if n.name == "n0" and 100.0 <= t < 125.0:
                continue
            fleet.ingest(n.report(t), t)
        assert detector.evaluate(fleet.view(), t) == [], t
        t += INTERVAL


def test_a_node_whose_ranks_stopped_while_it_still_reports_is_found_while_peers_step():
    # The fault the rule above must not hide: n0 reports on time and says its ranks stopped.
    nodes = nodes_()
    fleet = Fleet()
    detector = HangDetector(HangConfig())
    t = 0.0
    found: list[Finding] = []
    while t < 200 and not found:
        set_training(nodes, "job", t, ranks_per_node=2, step=int(t))
        if t >= 100.0:
            for r in nodes[0].ranks:
                r.last_progress_ts, r.last_step = 100.0, 100
        for n in nodes:
            fleet.ingest(n.report(t), t)
        found = detector.evaluate(fleet.view(), t)
        t += INTERVAL
    assert {(f.node, f.action) for f in found} == {("n0", Action.DRAIN), (WHOLE_JOB, Action.RESTART_JOB)}
    assert t - 100.0 <= 30.0


def test_a_job_that_ends_with_its_exits_reported_a_report_apart_drains_nobody():
    # The job finishes at 100 s; n0's agent sees its processes gone one report before the others'
    # agents do. n0 is not a crashed rank the others progressed past: nobody progressed since.
    nodes = nodes_()
    fleet = Fleet()
    detector = HangDetector(HangConfig())
    t = 0.0
    while t < 400:
        set_training(nodes, "job", min(t, 100.0), ranks_per_node=2, step=int(min(t, 100.0)))
        for n in nodes:
            exited_at = 102.5 if n.name == "n0" else 105.0
            for r in n.ranks:
                r.last_progress_ts = min(t, 100.0)
                if t >= exited_at:
                    r.state = "exited"
            fleet.ingest(n.report(t), t)
        assert detector.evaluate(fleet.view(), t) == [], t
        t += INTERVAL


def test_a_rank_that_crashed_while_the_others_block_is_blamed_within_30_s():
    # The real fault beside it: n2's ranks exit at 100 s and the others block in the collective.
    nodes = nodes_()
    fleet = Fleet()
    detector = HangDetector(HangConfig())
    t = 0.0
    found: list[Finding] = []
    while t < 200 and not found:
        set_training(nodes, "job", min(t, 100.0), ranks_per_node=2, step=int(min(t, 100.0)))
        for n in nodes:
            for r in n.ranks:
                r.last_progress_ts = min(t, 100.0)
                if n.name == "n2" and t >= 100.0:
                    r.state = "exited"
            fleet.ingest(n.report(t), t)
        found = detector.evaluate(fleet.view(), t)
        t += INTERVAL
    assert {(f.node, f.action) for f in found} >= {("n2", Action.DRAIN)}
    assert t - 100.0 <= 30.0


def test_a_restarted_job_whose_ranks_come_back_at_different_moments_drains_nobody():
    # The lookalike of the crash above (issue 40): the whole job crashes at 100 s, and its restart
    # loop starts it again from its checkpoint (step 50) at 160 s; n5's rank processes come up 10 s
    # after the others', so for two reports its agent still says "exited" (the old run) while the
    # others step again, below the step the old run reached. Not a rank stopped while its peers
    # progressed: the job restarted. Nothing is decided.
    nodes = nodes_()
    fleet = Fleet()
    detector = HangDetector(HangConfig())
    t = 0.0
    while t < 260:
        for n in nodes:
            back = 170.0 if n.name == "n5" else 160.0
            if t < 100.0:
                set_training([n], "job", t, ranks_per_node=2, step=int(t))
            elif t < back:
                set_training([n], "job", 100.0, ranks_per_node=2, step=100)
                for r in n.ranks:
                    r.state = "exited"
            else:
                set_training([n], "job", t, ranks_per_node=2, step=50 + int(t - back))
            for r in n.ranks:  # set_training numbers each node's ranks from 0: make them the job's
                r.rank += 2 * nodes.index(n)
            fleet.ingest(n.report(t), t)
        assert detector.evaluate(fleet.view(), t) == [], t
        t += INTERVAL
