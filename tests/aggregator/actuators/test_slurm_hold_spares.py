"""Slurm actuator, issue 40: ``hold_job`` (requeue held, the identity checks of restart_job,
idempotent), the spare pool's read (idle nodes with the feature; a drained or busy one is no
spare) and its refill after a verified resume; with a fake runner, then the real slurmctld."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence

import pytest

from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig, nodes_from_sinfo_json, nodes_from_sinfo_text
from vigil.aggregator.decision import Action, Decision

T0 = 1_700_000_000.0


def hold(job: str, node: str | None = "vnode1", id: str = "h0123456789abcdef012",
         job_nodes: list[str] | None = None) -> Decision:
    return Decision(id=id, ts=T0, node=node, action=Action.HOLD_JOB, reason="crash loop without progress",
                    detector="crash_loop", job=job, dry_run=False,
                    evidence={"job_nodes": job_nodes} if job_nodes is not None else {})


def resume(node: str, detector: str = "recovery") -> Decision:
    return Decision(id="r0123456789abcdef012", ts=T0, node=node, action=Action.RESUME, reason="verified",
                    detector=detector, dry_run=False)


class FakeSlurm:
    """``squeue -j ID -o %i|%T|%N|%Q`` from a table ("STATE|NODES|PRIORITY"), ``sinfo --json`` from
    a node table (name -> (state, flags, features, active)), records every command."""

    def __init__(self, jobs: dict[str, str] | None = None,
                 nodes: dict[str, tuple[str, list[str], str, str]] | None = None, fail_update: bool = False,
                 reasons: dict[str, str] | None = None) -> None:
        self.jobs = jobs or {}
        self.reasons = reasons or {}
        self.nodes = nodes or {}
        self.fail_update = fail_update
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        self.calls.append(list(argv))
        if argv[0] == "squeue":
            job = argv[argv.index("-j") + 1]
            if job not in self.jobs:
                raise subprocess.CalledProcessError(1, list(argv), "", "Invalid job id specified")
            return f"{job}|{self.jobs[job]}\n" if self.jobs[job] else "\n"
        if argv[0] == "sinfo":
            return json.dumps({"nodes": [{"name": n, "state": s, "state_flags": f, "features": av,
                                          "active_features": ac, "reason": self.reasons.get(n, "")}
                                         for n, (s, f, av, ac) in self.nodes.items()]})
        if argv[1:3] == ["show", "hostnames"]:
            return "\n".join(argv[3].split(",")) + "\n"
        if argv[1] == "update" and self.fail_update and any(a.startswith("AvailableFeatures") for a in argv):
            raise subprocess.CalledProcessError(1, list(argv), "", "Access/permission denied")
        return ""

    def scontrol(self) -> list[list[str]]:
        return [c[1:] for c in self.calls if c[0] == "scontrol" and c[1:3] != ["show", "hostnames"]]


def test_hold_job_requeues_a_running_job_held_and_a_redelivery_changes_nothing() -> None:
    fake = FakeSlurm(jobs={"42": "RUNNING|vnode1,vnode2|100"})
    act = SlurmActuator(SlurmConfig(), run=fake)
    assert act.handles(hold("42")) and act.handles(hold("42", node=None, job_nodes=["vnode1"]))
    assert "requeued held" in act.deliver(hold("42", node=None, job_nodes=["vnode2"]))
    assert fake.scontrol() == [["requeuehold", "42"]]
    fake.jobs["42"] = "PENDING||0"  # requeued held: priority 0
    assert "is held" in act.deliver(hold("42", node=None, job_nodes=["vnode2"]))
    assert fake.scontrol() == [["requeuehold", "42"]]


def test_hold_job_refuses_a_name_and_a_job_on_other_nodes_and_waits_for_a_pending_one() -> None:
    fake = FakeSlurm(jobs={"42": "RUNNING|vnode3|100", "43": "PENDING||100"})
    act = SlurmActuator(SlurmConfig(), run=fake)
    with pytest.raises(DeliveryError) as name:
        act.deliver(hold("train,42"))
    assert not name.value.retryable
    with pytest.raises(DeliveryError) as other:
        act.deliver(hold("42", node="vnode1"))
    assert not other.value.retryable and "not held" in str(other.value)
    # Pending and not held: it runs on no node, no report vouches for it; retried until it runs.
    with pytest.raises(DeliveryError) as pending:
        act.deliver(hold("43"))
    assert pending.value.retryable
    assert fake.scontrol() == []
    assert act.refusals["job_not_numeric"] == 1 and act.refusals["job_not_on_node"] == 1


def test_an_empty_squeue_answer_between_two_states_is_retried_not_refused() -> None:
    # Right after a requeue slurmctld may list nothing for a job it knows (leaving COMPLETING):
    # the hold waits for the next try; an unknown id (squeue's error) is refused for good.
    fake = FakeSlurm(jobs={"42": ""})
    act = SlurmActuator(SlurmConfig(), run=fake)
    with pytest.raises(DeliveryError) as between:
        act.deliver(hold("42"))
    assert between.value.retryable and not +act.refusals
    fake.jobs["42"] = "RUNNING|vnode1|100"
    assert "requeued held" in act.deliver(hold("42"))
    with pytest.raises(DeliveryError) as unknown:
        act.deliver(hold("44"))
    assert not unknown.value.retryable and act.refusals["job_not_found"] == 1


def test_spare_nodes_are_the_idle_ones_with_the_feature_in_both_sinfo_shapes() -> None:
    fake = FakeSlurm(nodes={"vnode1": ("idle", [], "vigil_spare", "vigil_spare"),
                            "vnode2": ("idle", ["DRAIN"], "vigil_spare", "vigil_spare"),  # drained: no spare
                            "vnode3": ("allocated", [], "a,vigil_spare", "a,vigil_spare"),  # busy
                            "vnode4": ("idle", [], "vigil_spare_x", "vigil_spare_x"),  # another feature
                            "vnode5": ("idle", [], "vigil_spare", "")})  # available, not active
    act = SlurmActuator(SlurmConfig(), run=fake)
    assert act.spare_nodes("vigil_spare") == ["vnode1"]
    # 23.02+ writes lists; the text form for a sinfo without --json.
    listed = json.dumps({"nodes": [{"name": "n1", "state": ["IDLE"], "features": ["x", "vigil_spare"],
                                    "active_features": ["vigil_spare"]}]})
    assert nodes_from_sinfo_json(listed) == [("n1", "IDLE", ["x", "vigil_spare"], ["vigil_spare"])]
    assert nodes_from_sinfo_text("n1|idle|(null)|(null)\nn2|idle|vigil_spare|vigil_spare\nbad line\n") == [
        ("n1", "IDLE", [], []), ("n2", "IDLE", ["vigil_spare"], ["vigil_spare"])]


def test_a_verified_resume_refills_a_short_pool_and_nothing_else_does() -> None:
    nodes = {"vnode1": ("idle", ["DRAIN"], "a", "a")}
    fake = FakeSlurm(nodes=nodes, reasons={"vnode1": "vigil: drain x r0"})
    act = SlurmActuator(SlurmConfig(), run=fake)
    assert "spare" not in act.deliver(resume("vnode1"))  # the pool is not short: no feature
    act.spare_wanted = lambda: True
    assert "spare" not in act.deliver(resume("vnode1", detector="operator"))  # not verified by vigil
    assert not [c for c in fake.scontrol() if any(a.startswith("AvailableFeatures") for a in c)]
    assert "added to the spare pool" in act.deliver(resume("vnode1"))
    assert fake.scontrol()[-1] == ["update", "NodeName=vnode1", "AvailableFeatures=a,vigil_spare",
                                   "ActiveFeatures=a,vigil_spare"]
    fake.fail_update = True
    out = act.deliver(resume("vnode1", detector="probe_verdict"))
    assert out.startswith("resumed vnode1") and "not added" in out
    assert (act.spares_added, act.spares_add_failed) == (1, 1)


def test_real_slurm_hold_job_and_the_spare_pool(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    c = slurm_cluster
    c.reset()
    act = SlurmActuator(SlurmConfig(scontrol=c.scontrol, sinfo=c.sinfo, squeue=c.squeue), run=c.run)
    job = c.submit("sleep 300")
    c.wait_for("the job running", lambda: c.job(job).get("JobState") == "RUNNING")
    node = c.job(job)["NodeList"]
    other = next(n for n in c.nodes if n != node)
    with pytest.raises(DeliveryError):  # reported by a node it does not run on
        act.deliver(hold(job, node=other, id="h1"))
    assert c.job(job)["JobState"] == "RUNNING"
    act.deliver(hold(job, node=None, job_nodes=[node], id="h2"))
    c.wait_for("the job held", lambda: c.job(job).get("JobState") == "PENDING")
    assert c.job(job)["Priority"] == "0"
    assert "is held" in act.deliver(hold(job, node=None, job_nodes=[node], id="h2"))  # a redelivery
    c.run([c.scontrol, "release", job])
    assert c.job(job)["Priority"] != "0"
    c.reset()
    # The pool: a drained node vigil verified and resumed joins it while it is short.
    spare = c.nodes[-1]
    assert act.spare_nodes("vigil_spare") == []
    c.run([c.scontrol, "update", f"NodeName={spare}", "State=DRAIN", "Reason=vigil: drain test r0"])
    act.spare_wanted = lambda: True
    assert "added to the spare pool" in act.deliver(resume(spare))
    c.wait_for("the spare idle", lambda: c.sinfo_state(spare) == "idle")
    assert act.spare_nodes("vigil_spare") == [spare]
    c.run([c.scontrol, "update", f"NodeName={spare}", "AvailableFeatures=", "ActiveFeatures="])
