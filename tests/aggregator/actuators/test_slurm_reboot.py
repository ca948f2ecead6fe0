"""Slurm reboots (``actuators.slurm.reboot``): `scontrol reboot ASAP nextstate=DOWN`, and the
resume of a node vigil rebooted. The fake runner first, then the real slurmctld on loopback (its
slurmd never really reboots, so only the request and the states Slurm shows are checked)."""

from __future__ import annotations

import pytest

from tests.aggregator.actuators.test_slurm import FakeScontrol, dec
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig
from vigil.aggregator.decision import Action

ID = "d0123456789abcdef012"


def test_reboot_is_off_by_default_and_reboot_node_only_drains() -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE"})
    SlurmActuator(SlurmConfig(), run=run).deliver(dec("gpu-7", Action.REBOOT_NODE))
    assert run.calls[-1][:4] == ["scontrol", "update", "NodeName=gpu-7", "State=DRAIN"]
    assert not any("reboot" in call for call in run.calls)


def test_reboot_runs_scontrol_reboot_asap_with_next_state_down() -> None:
    run = FakeScontrol({"gpu-7": "State=ALLOCATED"})
    out = SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", Action.REBOOT_NODE))
    assert run.calls[-1] == [
        "scontrol", "reboot", "ASAP", "nextstate=DOWN",
        f"reason=vigil: reboot_node: Xid 79: GPU has fallen off the bus {ID}", "gpu-7",
    ]
    assert "reboot requested for gpu-7" in out


def test_with_return_to_service_2_a_reboot_would_skip_verification_so_it_only_drains() -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE"}, return_to_service=2)
    out = SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", Action.REBOOT_NODE))
    assert not any(call[1] == "reboot" for call in run.calls)
    assert run.calls[-1][:4] == ["scontrol", "update", "NodeName=gpu-7", "State=DRAIN"]
    assert "ReturnToService=2" in out


def test_reboot_is_idempotent_per_decision() -> None:
    for state in ("IDLE+DRAIN+REBOOT_REQUESTED", "DOWN+DRAIN+REBOOT_ISSUED", "DOWN"):
        run = FakeScontrol({"gpu-7": f"State={state} Reason=vigil: reboot_node: Xid 79 {ID} : reboot issued "
                                     "[root@2026-01-01T00:00:00]"})
        out = SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", Action.REBOOT_NODE))
        assert "already requested" in out
        assert [c[:2] for c in run.calls] == [["sinfo", "--json"]]  # read only, nothing changed


def test_a_node_someone_else_took_out_is_not_rebooted() -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE+DRAIN Reason=fan replacement [ops@2026-01-01T00:00:00]"})
    with pytest.raises(DeliveryError, match="out for someone else") as info:
        SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", Action.REBOOT_NODE))
    assert info.value.retryable is False
    assert [c[:2] for c in run.calls] == [["sinfo", "--json"]]  # read only, nothing changed


def test_a_node_vigil_drained_before_can_be_rebooted() -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE+DRAIN Reason=vigil: GPU 3 missing aaaa [root@2026-01-01T00:00:00]"})
    SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", Action.REBOOT_NODE))
    assert run.calls[-1][1:4] == ["reboot", "ASAP", "nextstate=DOWN"]


def test_other_removing_actions_still_drain_with_reboot_on() -> None:
    for action in (Action.DRAIN, Action.RESET_GPU, Action.INSPECT_HARDWARE):
        run = FakeScontrol({"gpu-7": "State=IDLE"})
        SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", action))
        assert run.calls[-1][1:4] == ["update", "NodeName=gpu-7", "State=DRAIN"]


def test_resume_undrains_a_node_down_after_vigils_reboot() -> None:
    run = FakeScontrol({"gpu-7": f"State=DOWN Reason=vigil: reboot_node: Xid 79 {ID} : reboot issued "
                                 "[root@2026-01-01T00:00:00]"})
    out = SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", Action.RESUME, id="res1"))
    assert run.calls[-1] == ["scontrol", "update", "NodeName=gpu-7", "State=RESUME"]
    assert out == "resumed gpu-7"


def test_resume_leaves_a_node_down_for_someone_else() -> None:
    run = FakeScontrol({"gpu-7": "State=DOWN Reason=Not responding [slurm@2026-01-01T00:00:00]"})
    with pytest.raises(DeliveryError, match="not drained by vigil"):
        SlurmActuator(SlurmConfig(reboot=True), run=run).deliver(dec("gpu-7", Action.RESUME, id="res1"))
    assert not any("State=RESUME" in c for call in run.calls for c in call)


@pytest.mark.external
def test_real_slurm_accepts_reboot_asap_nextstate_down(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    c = slurm_cluster
    c.reset()
    # The harness' slurm.conf has no RebootProgram (scontrol reboot is refused without one): add a
    # harmless one. slurmd never reboots, so the request is what is checked, not its completion.
    conf = c.root / "slurm.conf"
    if "RebootProgram" not in conf.read_text():
        conf.write_text(conf.read_text() + "\nRebootProgram=/bin/true\n")
        c.run([c.scontrol, "reconfigure"])
    job = c.submit("sleep 300")
    c.wait_for("the job running", lambda: c.job(job).get("JobState") == "RUNNING")
    busy = c.job(job)["NodeList"]
    act = SlurmActuator(SlurmConfig(scontrol=c.scontrol, reboot=True), run=c.run)
    # The harness runs ReturnToService=2, under which a rebooted node would come back unverified:
    # the actuator reads it from the real slurmctld and only drains.
    assert "ReturnToService=2" in conf.read_text()
    out = act.deliver(dec(busy, Action.REBOOT_NODE, id="rb0"))
    assert "not rebooted" in out and "REBOOT" not in c.run([c.scontrol, "show", "node", "-o", busy])
    c.run([c.scontrol, "update", f"NodeName={busy}", "State=RESUME"])
    conf.write_text(conf.read_text().replace("ReturnToService=2", "ReturnToService=1"))
    c.run([c.scontrol, "reconfigure"])
    try:
        out = act.deliver(dec(busy, Action.REBOOT_NODE, id="rb1"))
    finally:
        conf.write_text(conf.read_text().replace("ReturnToService=1", "ReturnToService=2"))
    assert "reboot requested" in out
    # ASAP: drained at once (no new jobs) while the running job goes on; rebooted once idle.
    line = c.run([c.scontrol, "show", "node", "-o", busy])
    assert "DRAIN" in line and "REBOOT_REQUESTED" in line, line
    assert c.sinfo_state(busy).startswith("draining")
    assert c.reason(busy) == "vigil: reboot_node: Xid 79: GPU has fallen off the bus rb1"
    assert "already requested" in act.deliver(dec(busy, Action.REBOOT_NODE, id="rb1"))
    # Tidy up for the other tests while the reboot is only requested (once issued it cannot be
    # cancelled, and this slurmd never comes back with a new boot time): cancel it, give it back.
    c.run([c.scontrol, "update", f"NodeName={busy}", "State=CANCEL_REBOOT"])
    assert "REBOOT" not in c.run([c.scontrol, "show", "node", "-o", busy])
    c.run([c.scontrol, "reconfigure"])  # back to the harness' ReturnToService=2
    c.reset()  # undrains it if still drained, cancels the job
    c.wait_for("the node back", lambda: c.sinfo_state(busy) == "idle", 40)
