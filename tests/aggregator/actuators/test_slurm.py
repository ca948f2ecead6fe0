"""Slurm actuator: the commands it runs (fake runner), then the real thing on a loopback cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig
from vigil.aggregator.decision import Action, Decision

T0 = 1_700_000_000.0


def dec(
    node: str,
    action: Action,
    id: str = "d0123456789abcdef012",
    job: str | None = None,
    reason: str = "Xid 79: GPU has fallen off the bus",
) -> Decision:
    return Decision(id=id, ts=T0, node=node, action=action, reason=reason, detector="xid", job=job, dry_run=False)


class FakeScontrol:
    """Answers ``scontrol show node`` from a table and records every command."""

    def __init__(self, nodes: dict[str, str], fail: str | None = None, return_to_service: int = 1) -> None:
        self.nodes = nodes
        self.fail = fail
        self.return_to_service = return_to_service
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        self.calls.append(list(argv))
        if self.fail:
            raise subprocess.CalledProcessError(1, list(argv), "", self.fail)
        if argv[1:3] == ["show", "node"]:
            return f"NodeName={argv[-1]} Arch=x86_64 {self.nodes[argv[-1]]}\n"
        if argv[1:3] == ["show", "config"]:
            return f"RebootProgram           = /sbin/reboot\nReturnToService         = {self.return_to_service}\n"
        return ""


def test_drain_runs_scontrol_update_with_a_reason_naming_the_decision() -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE ThreadsPerCore=1"})
    out = SlurmActuator(SlurmConfig(), run=run).deliver(dec("gpu-7", Action.DRAIN))
    assert run.calls[-1] == [
        "scontrol",
        "update",
        "NodeName=gpu-7",
        "State=DRAIN",
        "Reason=vigil: Xid 79: GPU has fallen off the bus d0123456789abcdef012",
    ]
    assert "drained gpu-7" in out


def test_reason_is_one_bounded_line_and_names_escalated_actions() -> None:
    reason = SlurmActuator.reason_for(dec("n", Action.REBOOT_NODE, reason="a\nb " + "x" * 500))
    assert reason.startswith("vigil: reboot_node: a b xxx") and reason.endswith(" d0123456789abcdef012")
    assert len(reason) <= 200 and "\n" not in reason


def test_resume_refuses_a_node_someone_else_drained() -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE+DRAIN Reason=bad fan [ops@2024-01-01T00:00:00]"})
    with pytest.raises(DeliveryError, match="not drained by vigil") as info:
        SlurmActuator(SlurmConfig(), run=run).deliver(dec("gpu-7", Action.RESUME))
    assert info.value.retryable is False
    assert not any("State=RESUME" in c for call in run.calls for c in call)


def test_unknown_node_is_a_permanent_error_and_an_outage_is_retryable() -> None:
    bad = SlurmActuator(SlurmConfig(), run=FakeScontrol({}, fail="slurm_update error: Invalid node name specified"))
    with pytest.raises(DeliveryError) as info:
        bad.deliver(dec("nope", Action.DRAIN))
    assert info.value.retryable is False
    down = SlurmActuator(SlurmConfig(), run=FakeScontrol({}, fail="Unable to contact slurm controller"))
    with pytest.raises(DeliveryError) as info:
        down.deliver(dec("n1", Action.DRAIN))
    assert info.value.retryable is True


def test_handles_removing_actions_resume_and_restart_with_a_job_only() -> None:
    act = SlurmActuator(SlurmConfig(), run=FakeScontrol({}))
    assert act.handles(dec("n", Action.INSPECT_HARDWARE)) and act.handles(dec("n", Action.RESUME))
    assert act.handles(dec("n", Action.RESTART_JOB, job="42")) and not act.handles(dec("n", Action.RESTART_JOB))
    assert not act.handles(dec("n", Action.ALERT)) and not act.handles(dec("n", Action.OBSERVE))


@pytest.mark.external
def test_real_slurm_drain_is_idempotent_and_resume_undrains(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    c = slurm_cluster
    c.reset()
    act = SlurmActuator(SlurmConfig(scontrol=c.scontrol), run=c.run)
    act.deliver(dec("vnode2", Action.DRAIN, id="abc123"))
    assert c.sinfo_state("vnode2") == "drained"
    assert c.reason("vnode2") == "vigil: Xid 79: GPU has fallen off the bus abc123"
    assert "already drained" in act.deliver(dec("vnode2", Action.DRAIN, id="abc123"))
    assert c.sinfo_state("vnode1") == "idle"
    act.deliver(dec("vnode2", Action.RESUME, id="res1"))
    c.wait_for("vnode2 back in service", lambda: "drain" not in c.sinfo_state("vnode2"))
    with pytest.raises(DeliveryError) as info:
        act.deliver(dec("vnode9", Action.DRAIN))
    assert info.value.retryable is False


@pytest.mark.external
def test_real_slurm_leaves_a_node_drained_by_someone_else(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    c = slurm_cluster
    c.reset()
    c.run([c.scontrol, "update", "NodeName=vnode3", "State=DRAIN", "Reason=fan replacement"])
    with pytest.raises(DeliveryError, match="not drained by vigil"):
        SlurmActuator(SlurmConfig(scontrol=c.scontrol), run=c.run).deliver(dec("vnode3", Action.RESUME))
    assert c.sinfo_state("vnode3") == "drained" and c.reason("vnode3") == "fan replacement"
    c.reset()


@pytest.mark.external
def test_real_slurm_restart_job_requeues_it_without_the_bad_node(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    c = slurm_cluster
    c.reset()
    job = c.submit("sleep 300")
    c.wait_for("the job running", lambda: c.job(job).get("JobState") == "RUNNING")
    bad = c.job(job)["NodeList"]
    act = SlurmActuator(SlurmConfig(scontrol=c.scontrol), run=c.run)
    out = act.deliver(dec(bad, Action.RESTART_JOB, id="rj1", job=job))
    assert out == f"requeued job {job} excluding {bad}"
    info = c.job(job)
    assert info["ExcNodeList"] == bad and info["Restarts"] == "1"
    c.wait_for("the job back in the queue", lambda: c.job(job).get("JobState") == "PENDING")
    # Released, not held: Slurm starts a requeued batch job again after its BeginTime delay.
    assert "Held" not in c.job(job)["Reason"]
    # Delivered again after a crash: the node is already excluded, the job is not requeued twice.
    act.deliver(dec(bad, Action.RESTART_JOB, id="rj1", job=job))
    again = c.job(job)
    assert (again["Restarts"], again["ExcNodeList"], again["JobState"]) == ("1", bad, "PENDING")
    c.reset()


@pytest.mark.parametrize("expression", ["vnode[1-5]", "vnode1,vnode2", "vnode1 vnode2", "ALL", "vnode1\n", ""])
def test_a_hostlist_expression_never_reaches_scontrol(expression: str) -> None:
    run = FakeScontrol({"vnode1": "State=IDLE"})
    act = SlurmActuator(SlurmConfig(), run=run)
    for action in (Action.DRAIN, Action.RESUME):
        if expression == "ALL":  # a valid hostname (Slurm reads it as a node named ALL, not all nodes)
            continue
        with pytest.raises(DeliveryError) as info:
            act.deliver(dec(expression, action))
        assert info.value.retryable is False
    assert run.calls == []
