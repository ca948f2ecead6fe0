"""The application-signal detector: NaN loss is a job alert at once and, reproduced after a restart, a
hold (no node named); AMP's non-finite gradient norms and a NaN window the job trains past are not
acted on; a loss spike is a job alert; log lines naming a peer go to that node, the rest to the job."""

from __future__ import annotations

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import WHOLE_JOB, Action
from vigil.aggregator.detectors.app_signals import AppSignalsConfig, AppSignalsDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import Event, RankSummary

INTERVAL = 5.0  # one report per agent window, so each report carries a new window


def window(job: str, rank: int, *, pid: int, step: int, end: float, loss: float | None = 2.0, nonfinite: int = 0,
           state: str = "running", nan_loss: int = 0) -> RankSummary:
    return RankSummary(job=job, rank=rank, pid=pid, state=state, window_seconds=5.0, window_end_ts=end,  # type: ignore[arg-type]
                       steps=5 if state == "running" else 0, last_step=step, last_progress_ts=end, first_step=step - 4,
                       loss_p50=loss, loss_last=loss, nonfinite_steps=nonfinite,
                       nonfinite_first_step=step - nonfinite + 1 if nonfinite else None, nonfinite_loss_steps=nan_loss)


class Trainer:
    """A 2-node job, 1 rank a node; each call is one window for every rank."""

    def __init__(self, job: str = "77") -> None:
        self.job = job
        self.nodes = [FakeNode(f"n{i}", gpus=0, ports=0, interval=INTERVAL) for i in range(2)]
        self.fleet = Fleet()
        self.detector = AppSignalsDetector(AppSignalsConfig())
        self.t = 0.0
        self.pid = 100
        self.found: list = []

    def window(self, step: int, *, loss: float | None = 2.0, nonfinite: int = 0, state: str = "running",
               events: dict[str, list[Event]] | None = None, nan_loss: int = 0) -> list:
        self.t += INTERVAL
        for i, node in enumerate(self.nodes):
            node.ranks = [window(self.job, i, pid=self.pid + i, step=step, end=self.t, loss=loss, nonfinite=nonfinite,
                                 state=state, nan_loss=nan_loss)]
            self.fleet.ingest(node.report(self.t, events=(events or {}).get(node.name)), self.t)
        found = self.detector.evaluate(self.fleet.view(), self.t)
        self.found.extend(found)
        return found

    def restart(self) -> None:
        self.pid += 10


def test_nan_loss_is_a_job_alert_at_once_naming_the_first_step_and_no_node():
    tr = Trainer()
    for k in range(5):
        assert tr.window(5 * (k + 1)) == []
    found = tr.window(30, loss=None, nonfinite=5)
    assert [(f.action, f.node, f.job) for f in found] == [(Action.ALERT, WHOLE_JOB, "77")]
    assert found[0].evidence["signal"] == "nonfinite_loss" and found[0].evidence["first_step"] == 26


def test_nan_loss_again_after_a_restart_holds_the_job_and_removes_no_node():
    tr = Trainer()
    for k in range(5):
        tr.window(5 * (k + 1))
    tr.window(30, loss=None, nonfinite=5)
    tr.window(30, state="exited", loss=None)
    tr.restart()  # resumes from the checkpoint at step 20 and diverges again at step 26
    tr.window(25)
    found = tr.window(30, loss=None, nonfinite=5)
    hold = [f for f in found if f.action is Action.HOLD_JOB]
    assert [(f.node, f.job, f.detector) for f in hold] == [(WHOLE_JOB, "77", "app_signals")]
    assert hold[0].evidence["signal"] == "nonfinite_loss" and hold[0].evidence["restarts"] == 1
    assert hold[0].evidence["nonfinite_first_steps"] == [[0, 26], [1, 26]]
    # The same episode while it lasts (one decision id); no node is ever named.
    again = [f for f in tr.window(30, loss=None, nonfinite=5) if f.action is Action.HOLD_JOB]
    assert again and again[0].since == hold[0].since
    assert all(f.node == WHOLE_JOB for f in tr.found)


def test_a_nan_loss_after_finite_steps_in_one_window_is_seen_by_its_loss_count():
    # The job diverges at step 29 and crashes within the same window: the window's finite losses
    # (steps 26-28) do not hide it, since the agent counts non-finite losses on their own.
    tr = Trainer()
    for k in range(5):
        tr.window(5 * (k + 1))
    found = tr.window(30, loss=2.0, nonfinite=2, nan_loss=2)
    assert [(f.action, f.node) for f in found] == [(Action.ALERT, WHOLE_JOB)]
    assert found[0].evidence["first_step"] == 29


def test_nonfinite_gradient_norms_with_a_finite_loss_are_not_acted_on():
    # AMP's GradScaler: an overflowing step's gradient norm is inf and the step is skipped; its loss
    # is finite (torch.amp docs, "Gradient Scaling"). Restarts in between change nothing.
    tr = Trainer()
    for k in range(40):
        if k % 10 == 9:
            tr.restart()
        tr.window(5 * (k + 1), nonfinite=1 if k % 3 == 0 else 0)
    assert tr.found == []


def test_a_nan_window_the_job_trains_past_is_an_alert_only_and_it_ends():
    tr = Trainer()
    for k in range(5):
        tr.window(5 * (k + 1))
    assert [f.action for f in tr.window(30, loss=None, nonfinite=5)] == [Action.ALERT]
    for k in range(6):
        assert tr.window(35 + 5 * k) == []
    # Restarted later, it never diverges again where it did: no hold.
    tr.restart()
    for k in range(6):
        assert tr.window(60 + 5 * k) == []
    assert not [f for f in tr.found if f.action is Action.HOLD_JOB]


def test_a_loss_spike_against_the_jobs_own_history_is_a_job_alert_after_two_windows():
    tr = Trainer()
    for k in range(20):
        assert tr.window(5 * (k + 1), loss=2.0 + 0.01 * (k % 3)) == []
    assert tr.window(105, loss=3.5) == []  # one window: not yet
    [spike] = tr.window(110, loss=3.6)
    assert (spike.action, spike.node, spike.key, spike.evidence["signal"]) == (Action.ALERT, WHOLE_JOB, "loss_spike",
                                                                                 "loss_spike")
    assert tr.window(115, loss=2.0) == []  # back to its level: over
    # Falling loss (training) is never a spike.
    tr2 = Trainer()
    for k in range(40):
        assert tr2.window(5 * (k + 1), loss=10.0 / (k + 1)) == []


def nccl(kind: str, *, peer: str | None = None, message: str = "x", job: str | None = "77") -> Event:
    return Event(kind=kind, ts=0.0, job=job, rank=1, peer=peer, message=message, source="log")


def test_log_lines_naming_a_known_peer_alert_that_node_and_the_rest_alert_the_job():
    tr = Trainer()
    tr.window(5)
    e = nccl("nccl_warn", peer="n1.cluster.example:43121", message="NET/IB : Got completion from peer with error 12")
    found = tr.window(10, events={"n0": [Event(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "ts": 10.0})]})
    assert [(f.action, f.node, f.job, f.evidence["peer"]) for f in found] == \
        [(Action.ALERT, "n1", "77", "n1.cluster.example:43121")]
    # An address the fleet does not know, and a timeout naming nobody: the job's.
    tr = Trainer()
    tr.window(5)
    events = [Event(kind="nccl_warn", ts=10.0, job="77", rank=0, peer="10.0.0.7", message="peer 10.0.0.7 closed"),
              Event(kind="nccl_timeout", ts=10.0, job="77", rank=0, message="Watchdog caught collective timeout")]
    found = tr.window(10, events={"n0": events})
    assert sorted((f.action, f.node, f.key) for f in found) == [(Action.ALERT, WHOLE_JOB, "log:nccl_timeout"),
                                                                (Action.ALERT, WHOLE_JOB, "log:nccl_warn")]
    # The same lines again within the episode: the same finding (since), counted.
    found = tr.window(15, events={"n1": [Event(kind="nccl_timeout", ts=15.0, job="77", rank=1, message="timeout")]})
    timeout = [f for f in found if f.key == "log:nccl_timeout"]
    assert timeout[0].since == 10.0 and timeout[0].evidence["lines"] == 2
    assert timeout[0].evidence["reported_by"] == ["n0", "n1"]


def test_a_peer_address_one_node_lists_is_that_node_and_one_two_nodes_claim_is_nobody():
    # NCCL prints peers by address (RAS: "on node 10.4.109.13"); an agent's operator lists its
    # node's addresses under topology "addresses" (aggregator/nccl_peers.py).
    tr = Trainer()
    tr.nodes[1].topology = {"addresses": "10.1.0.2, fe80::966d:ae03:8b:df54"}
    tr.window(5)
    events = [Event(kind="nccl_ras", ts=10.0, job="77", rank=1, peer="10.1.0.2", message="NCCL RAS: no data"),
              Event(kind="nccl_warn", ts=10.0, job="77", peer="fe80::966d:ae03:8b:df54%ib0", message="peer closed")]
    found = tr.window(10, events={"n0": events})
    assert sorted((f.action, f.node, f.key) for f in found) == [(Action.ALERT, "n1", "log:nccl_ras:peer"),
                                                                (Action.ALERT, "n1", "log:nccl_warn:peer")]
    tr = Trainer()
    for node in tr.nodes:
        node.topology = {"addresses": "10.1.0.2"}  # a node lying about an address makes it no one's
    tr.window(5)
    found = tr.window(10, events={"n0": events[:1]})
    assert [(f.action, f.node, f.key) for f in found] == [(Action.ALERT, WHOLE_JOB, "log:nccl_ras")]


def test_an_uncorrectable_ecc_cuda_error_alerts_the_node_that_logged_it_and_never_removes_it():
    tr = Trainer()
    tr.window(5)
    ev = Event(kind="cuda_error", ts=10.0, job="77", rank=1,
               message="CUDA error: uncorrectable ECC error encountered")
    found = tr.window(10, events={"n1": [ev]})
    assert [(f.action, f.node, f.key) for f in found] == [(Action.ALERT, "n1", "log:cuda_error:hardware")]
    other = Event(kind="cuda_error", ts=15.0, job="77", rank=1, message="CUDA error: an illegal memory access")
    found = tr.window(15, events={"n1": [other]})
    assert sorted((f.node, f.key) for f in found) == [(WHOLE_JOB, "log:cuda_error"), ("n1", "log:cuda_error:hardware")]
