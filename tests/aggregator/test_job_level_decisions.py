"""Job-level decisions (issue 38): a job stopped everywhere with no culprit is decided about the job,
``node`` null. No node is blamed, counted or acted on for it: the gate admits it past any node's
hold, cooldown or budget and records nothing against a node; the store keys it by its job (SQLite
and PostgreSQL); Slurm requeues the job excluding nobody, only where it runs on a node that
reported it; Alertmanager gets no ``node`` label. A decision that would take a node needs one."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from tests.aggregator.actuators.test_slurm import FakeScontrol
from tests.aggregator.test_store import Takes
from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.actuators.alertmanager import alert_for
from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig
from vigil.aggregator.decision import WHOLE_JOB, Action, Decision, Finding
from vigil.aggregator.gate import Gate, GateConfig, GateState
from vigil.aggregator.ledger import Ledger

T0 = 1_700_000_000.0


def job_level(action: Action = Action.RESTART_JOB, job: str = "12", id: str = "restart-12",
              nodes: list[str] | None = None) -> Decision:
    return Decision(id=id, ts=T0, node=None, job=job, action=action, reason="every rank stopped", detector="hang",
                    evidence={"job_nodes": ["gpu-6", "gpu-7"] if nodes is None else nodes}, dry_run=False)


def node_level(node: str, action: Action, id: str) -> Decision:
    return Decision(id=id, ts=T0, node=node, action=action, reason="r", detector="xid", dry_run=False)


@pytest.mark.parametrize("action", [Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE,
                                    Action.RESUME])
def test_a_decision_that_acts_on_a_node_must_name_it(action: Action) -> None:
    with pytest.raises(ValidationError, match="must name a job"):
        Decision(id="x", ts=T0, node=None, job="12", action=action, reason="r", detector="hang")
    with pytest.raises(ValidationError, match="must name a job"):
        Finding(detector="hang", node=WHOLE_JOB, job="12", action=action, reason="r", since=T0)


def test_a_job_level_decision_must_name_its_job() -> None:
    with pytest.raises(ValidationError, match="must name a job"):
        Decision(id="x", ts=T0, node=None, action=Action.RESTART_JOB, reason="r", detector="hang")
    finding = Finding(detector="hang", node=WHOLE_JOB, job="12", action=Action.ALERT, reason="r", since=T0)
    decision = Decision.from_finding(finding, T0, dry_run=False)
    assert (decision.node, decision.job, decision.subject) == (None, "12", "job:12")


def test_the_gate_counts_a_job_level_restart_against_no_node() -> None:
    cfg = GateConfig(dry_run=False, opt_out_nodes=["gpu-6"], restart_job_budget=2, dedup_seconds=600)
    gate, state = Gate(cfg), GateState()
    state.holds["gpu-7"] = (T0 - 10, "repair")  # the job's nodes held or opted out: not this decision's
    verdict = gate.judge(job_level(), T0, 100, state)
    assert verdict.admitted and verdict.decision.node is None
    state.apply(verdict, T0)
    assert state.nodes == {} and state.removals == [] and state.history == {}
    assert state.restarts == [(T0, "12")]
    # The same job's restart again is a duplicate; another job's is its own (not one node's "duplicate").
    assert gate.judge(job_level(id="again"), T0 + 1, 100, state).reason == "duplicate"
    other = gate.judge(job_level(job="13", id="restart-13"), T0 + 1, 100, state)
    assert other.admitted
    state.apply(other, T0 + 1)
    assert gate.judge(job_level(job="14", id="restart-14"), T0 + 2, 100, state).reason == "restart_budget"
    # ... and a drain of one of its nodes is judged on its own, untouched by the restarts.
    assert gate.judge(node_level("gpu-8", Action.DRAIN, "drain-8"), T0 + 3, 100, state).admitted


def test_the_store_keys_a_job_level_decision_by_its_job_and_keeps_it_out_of_node_histories(open_store) -> None:
    store = open_store()
    sink = Ledger(Gate(GateConfig(dry_run=False, dedup_seconds=600)), store, {"slurm": Takes("slurm")})
    [admitted] = sink.submit([job_level()], T0, 100)
    assert admitted.node is None
    sink.submit([node_level("gpu-7", Action.DRAIN, "drain-7")], T0 + 1, 100)
    assert [d.id for _, d in store.due(T0 + 2)] == ["restart-12", "drain-7"]  # neither waits on the other
    store.mark("restart-12", "slurm", "delivered", T0 + 3)
    assert store.node_events("job:12") == [] and store.node_events("gpu-7") == []  # no node's history
    assert [r.decision.id for r in store.decisions(node="gpu-7")] == ["drain-7"]  # the job's is not gpu-7's
    store.close()

    store = open_store()  # a restart: the job's dedup survives it, keyed by the job
    sink = Ledger(Gate(GateConfig(dry_run=False, dedup_seconds=600)), store, {"slurm": Takes("slurm")})
    assert sink.submit([job_level(id="restart-12-b")], T0 + 5, 100) == []
    assert sink.verdicts["duplicate"] == 1
    [stored] = [r for r in store.decisions() if r.decision.id == "restart-12"]
    assert stored.decision.node is None and stored.decision.job == "12"
    store.close()


def test_slurm_requeues_a_job_level_restart_excluding_nobody_only_where_it_was_reported() -> None:
    run = FakeScontrol({}, jobs={"12": "RUNNING|gpu-6,gpu-7|", "13": "RUNNING|gpu-8|", "14": "PENDING||"})
    act = SlurmActuator(SlurmConfig(), run=run)
    assert act.handles(job_level())
    assert act.deliver(job_level()) == "requeued job 12 (a job-level restart: no node excluded)"
    assert [c[1:] for c in run.calls if c[0] == "scontrol" and c[1] != "show"] == [["requeue", "12"]]
    # Job 13 runs on none of the nodes that reported it: someone else's job, not requeued.
    with pytest.raises(DeliveryError, match="none of the nodes that reported it") as info:
        act.deliver(job_level(job="13", id="restart-13"))
    assert info.value.retryable is False and act.refusals["job_not_on_node"] == 1
    # Requeued already (a redelivery) or not running: nothing to do, nothing done.
    assert "nothing requeued" in act.deliver(job_level(job="14", id="restart-14"))
    # No node named at all, or a name that is a hostlist: refused before Slurm is asked.
    calls = len(run.calls)
    for nodes in ([], ["gpu[1-8]"]):
        with pytest.raises(DeliveryError) as info:
            act.deliver(job_level(nodes=nodes))
        assert info.value.retryable is False
    assert len(run.calls) == calls
    assert act.refusals == Counter({**dict.fromkeys(act.refusals, 0), "job_not_on_node": 3})


def test_alertmanager_gets_a_job_level_alert_without_a_node_label() -> None:
    alert = alert_for(job_level(Action.ALERT, id="alert-12"), 3600.0)
    assert "node" not in alert["labels"] and alert["labels"]["job"] == "12"
    assert alert_for(node_level("gpu-7", Action.DRAIN, "d"), 3600.0)["labels"]["node"] == "gpu-7"
