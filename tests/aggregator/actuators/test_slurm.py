"""Slurm actuator: the commands it runs (fake runner), then the real thing on a loopback cluster,
including the attacks: a job name that squeue would read as a list, a job id of a job on another
node, and a drain reason that says ``State=IDLE``."""

from __future__ import annotations

import json as json_module
import re
import subprocess
from collections import Counter
from collections.abc import Sequence

import pytest
from prometheus_client import generate_latest

from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.actuators.slurm import (
    NodeState,
    SlurmActuator,
    SlurmConfig,
    node_from_scontrol_text,
    node_from_sinfo_json,
)
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.metrics import ActingReadings, AggregatorMetrics
from vigil.contract.seams import CommandRunner

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
    """Answers ``sinfo --json`` (every node, as 22.05's sinfo does whatever ``-n`` says) and
    ``scontrol show node -o`` from a table of ``State=... Reason=...`` lines, ``squeue -j ID -o``
    from a table of jobs ("STATE|NODES|EXCLUDED"), and records every command. ``json=False``: an
    sinfo that predates --json."""

    def __init__(self, nodes: dict[str, str], fail: str | None = None, return_to_service: int = 1,
                 jobs: dict[str, str] | None = None, json: bool = True) -> None:
        self.nodes = nodes
        self.fail = fail
        self.return_to_service = return_to_service
        self.jobs = jobs or {}
        self.json = json
        self.calls: list[list[str]] = []

    def _sinfo_json(self) -> str:
        entries = []
        for name, line in self.nodes.items():
            # The table's own State= is its first; the reason is everything after " Reason=".
            state = re.search(r"State=(\S+)", line)
            words = (state.group(1) if state else "UNKNOWN").split("+")
            _, _, reason = line.partition(" Reason=")
            entries.append({"name": name, "state": words[0].lower(), "state_flags": words[1:],
                            "reason": re.sub(r" \[[^\]]*\]$", "", reason)})
        return json_module.dumps({"meta": {}, "errors": [], "nodes": entries})

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        self.calls.append(list(argv))
        if self.fail:
            raise subprocess.CalledProcessError(1, list(argv), "", self.fail)
        if argv[0] == "sinfo" and "--json" in argv:
            if not self.json:
                raise subprocess.CalledProcessError(1, list(argv), "", "sinfo: unrecognized option '--json'")
            return self._sinfo_json()
        if argv[0] == "squeue":
            job = argv[argv.index("-j") + 1]
            if job not in self.jobs:
                raise subprocess.CalledProcessError(1, list(argv), "",
                                                    "slurm_load_jobs error: Invalid job id specified")
            return f"{job}|{self.jobs[job]}\n"
        if argv[1:3] == ["show", "node"]:
            return f"NodeName={argv[-1]} Arch=x86_64 {self.nodes[argv[-1]]}\n"
        if argv[1:3] == ["show", "hostnames"]:
            return "\n".join(argv[3].split(",")) + "\n"
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


# --- Node state: a free-text reason never changes the state read ----------------------------------

HOSTILE_REASON = "vigil: Xid 79 State=IDLE Reason=ok d1 [root@2026-01-01T00:00:00]"


@pytest.mark.parametrize("json", [True, False], ids=["sinfo-json", "scontrol-text"])
def test_a_reason_that_says_state_idle_does_not_make_a_drained_node_read_as_in_service(json: bool) -> None:
    run = FakeScontrol({"gpu-7": f"State=IDLE+DRAIN ThreadsPerCore=1 Reason={HOSTILE_REASON}"}, json=json)
    out = SlurmActuator(SlurmConfig(), run=run).deliver(dec("gpu-7", Action.RESUME))
    assert out == "resumed gpu-7"  # not "already in service (IDLE)"
    assert run.calls[-1] == ["scontrol", "update", "NodeName=gpu-7", "State=RESUME"]


def test_the_text_parse_reads_fields_before_the_reason_and_the_first_state() -> None:
    got = node_from_scontrol_text(f"NodeName=n1 State=DOWN+DRAIN Weight=1 Reason={HOSTILE_REASON}\n")
    assert got == NodeState("DOWN+DRAIN", "vigil: Xid 79 State=IDLE Reason=ok d1")
    assert node_from_scontrol_text("NodeName=n1 State=IDLE Weight=1\n") == NodeState("IDLE", "")
    with pytest.raises(DeliveryError, match="no State="):
        node_from_scontrol_text("NodeName=n1 Reason=x State=IDLE\n")  # a State only inside the reason


def test_sinfo_json_is_read_by_exact_name_in_both_shapes() -> None:
    old = '{"nodes": [{"name": "n10", "state": "idle", "state_flags": []},' \
          ' {"name": "n1", "state": "down", "state_flags": ["DRAIN", "REBOOT_ISSUED"], "reason": "x State=IDLE"}]}'
    assert node_from_sinfo_json(old, "n1") == NodeState("DOWN+DRAIN+REBOOT_ISSUED", "x State=IDLE")
    new = '{"nodes": [{"name": "n1", "state": ["IDLE", "DRAIN"], "reason": "r"}]}'  # Slurm 23.02+
    assert node_from_sinfo_json(new, "n1") == NodeState("IDLE+DRAIN", "r")
    assert node_from_sinfo_json(new, "n2") is None
    for bad in ("not json", '{"nodes": 3}', '{"nodes": [{"name": "n1", "state": 7}]}'):
        with pytest.raises(DeliveryError):
            node_from_sinfo_json(bad, "n1")


def test_an_sinfo_without_json_falls_back_to_scontrol_once(caplog: pytest.LogCaptureFixture) -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE ThreadsPerCore=1"}, json=False)
    act = SlurmActuator(SlurmConfig(), run=run)
    act.deliver(dec("gpu-7", Action.DRAIN, id="a1"))
    act.deliver(dec("gpu-7", Action.DRAIN, id="a2"))
    assert [c[:2] for c in run.calls if c[0] == "sinfo"] == [["sinfo", "--json"]]  # asked once
    assert sum("has no --json" in r.getMessage() for r in caplog.records) == 1


def test_a_node_sinfo_does_not_list_is_refused_and_counted() -> None:
    run = FakeScontrol({"gpu-7": "State=IDLE"})
    act = SlurmActuator(SlurmConfig(), run=run)
    with pytest.raises(DeliveryError, match="does not list") as info:
        act.deliver(dec("gpu-9", Action.DRAIN))
    assert info.value.retryable is False and act.refusals == Counter({"node_not_found": 1})
    assert all(c[1] != "update" for c in run.calls)


# --- Jobs: only a numeric id, only on the decision's node ------------------------------------------

@pytest.mark.parametrize("job", ["teamA-pretrain,teamB-finetune", "llm-7b", "12,13", "12 13", "1-3", "12*",
                                 "\u0663", "0", "99999999999", "4294967295", "12\n"])
def test_restart_job_takes_only_a_numeric_slurm_job_id(job: str) -> None:
    run = FakeScontrol({"gpu-7": "State=ALLOCATED"}, jobs={"12": "RUNNING|gpu-7|"})
    act = SlurmActuator(SlurmConfig(), run=run)
    with pytest.raises(DeliveryError, match="not a Slurm job id") as info:
        act.deliver(dec("gpu-7", Action.RESTART_JOB, job=job))
    assert info.value.retryable is False and act.refusals == Counter({"job_not_numeric": 1})
    assert run.calls == []  # nothing asked of Slurm: no squeue -n, no scontrol


def test_restart_job_refuses_a_job_that_runs_on_another_node() -> None:
    run = FakeScontrol({}, jobs={"12": "RUNNING|gpu-8,gpu-9|", "13": "PENDING||"})
    act = SlurmActuator(SlurmConfig(), run=run)
    for job in ("12", "13"):
        with pytest.raises(DeliveryError, match="not on gpu-7") as info:
            act.deliver(dec("gpu-7", Action.RESTART_JOB, job=job))
        assert info.value.retryable is False
    assert act.refusals == Counter({"job_not_on_node": 2})
    assert not any(c[1] in ("requeuehold", "update", "release") for c in run.calls)


def test_restart_job_of_an_unknown_job_is_refused() -> None:
    act = SlurmActuator(SlurmConfig(), run=FakeScontrol({}))
    with pytest.raises(DeliveryError, match="no job 12") as info:
        act.deliver(dec("gpu-7", Action.RESTART_JOB, job="12"))
    assert info.value.retryable is False and act.refusals == Counter({"job_not_found": 1})


def test_restart_job_on_the_node_requeues_held_excludes_and_releases() -> None:
    run = FakeScontrol({}, jobs={"0012": "x", "12": "RUNNING|gpu-6,gpu-7|gpu-2"})
    out = SlurmActuator(SlurmConfig(), run=run).deliver(dec("gpu-7", Action.RESTART_JOB, job="0012"))
    assert out == "requeued job 12 excluding gpu-7"
    assert [c[1:] for c in run.calls if c[0] == "scontrol" and c[1] != "show"] == [
        ["requeuehold", "12"], ["update", "JobId=12", "ExcNodeList=gpu-2,gpu-7"], ["release", "12"]]


# --- The real thing: a job list, a job elsewhere, a hostile reason ----------------------------------

def _recording(c: SlurmCluster, calls: list[list[str]]) -> CommandRunner:
    def run(argv: Sequence[str], timeout_seconds: float) -> str:
        calls.append(list(argv))
        return c.run(argv, timeout_seconds)
    return run


@pytest.mark.external
def test_real_slurm_a_job_name_with_a_comma_never_reaches_squeue(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    """Three jobs, one node each: teams A and B, and an attacker whose job is named after both. A
    restart_job naming the attacker's job by name is refused before Slurm is asked anything; one
    naming team A's numeric id from the attacker's node is refused as not running there; both
    teams' jobs keep running, never requeued."""
    c = slurm_cluster
    c.reset()

    def sbatch(name: str) -> str:
        return c.run([c.sbatch, "--parsable", "--requeue", "-N1", "-J", name, "-o", "/dev/null",
                      "--wrap", "sleep 300"]).strip()

    team_a, team_b = sbatch("teamA-pretrain"), sbatch("teamB-finetune")
    attacker = sbatch("teamA-pretrain,teamB-finetune")
    jobs = (team_a, team_b, attacker)
    c.wait_for("three jobs running", lambda: all(c.job(j).get("JobState") == "RUNNING" for j in jobs))
    node = c.job(attacker)["NodeList"]
    assert node not in (c.job(team_a)["NodeList"], c.job(team_b)["NodeList"])
    calls: list[list[str]] = []
    act = SlurmActuator(SlurmConfig(scontrol=c.scontrol, squeue=c.squeue), run=_recording(c, calls))
    with pytest.raises(DeliveryError, match="not a Slurm job id") as named:
        act.deliver(dec(node, Action.RESTART_JOB, id="rj-name", job="teamA-pretrain,teamB-finetune"))
    assert calls == []  # squeue -n never ran
    with pytest.raises(DeliveryError, match=f"not on {node}") as elsewhere:
        act.deliver(dec(node, Action.RESTART_JOB, id="rj-id", job=team_a))
    assert named.value.retryable is False and elsewhere.value.retryable is False
    assert act.refusals == Counter({"job_not_numeric": 1, "job_not_on_node": 1})
    assert not any("-n" in call or call[1] in ("requeuehold", "update", "release") for call in calls)
    for j in jobs:
        info = c.job(j)
        assert (info["JobState"], info["Restarts"], info["ExcNodeList"]) == ("RUNNING", "0", "(null)"), j
    # The legitimate requeue on the same cluster still works: the attacker's own job, from its node.
    assert act.deliver(dec(node, Action.RESTART_JOB, id="rj-own", job=attacker)) == \
        f"requeued job {attacker} excluding {node}"
    assert c.job(attacker)["Restarts"] == "1" and c.job(team_a)["Restarts"] == "0"
    c.reset()


@pytest.mark.external
@pytest.mark.parametrize("json", [True, False], ids=["sinfo-json", "scontrol-text"])
def test_real_slurm_a_hostile_drain_reason_does_not_fake_a_resume(
        slurm_cluster: SlurmCluster, json: bool) -> None:  # noqa: F811
    """vigil drains with a reason carrying ` State=IDLE` (report text it quotes); the resume must
    see the node drained, undrain it, and Slurm must have it back in service, with sinfo's JSON and
    with the scontrol text parse an sinfo without --json falls back to."""
    c = slurm_cluster
    c.reset()

    def run(argv: Sequence[str], timeout_seconds: float) -> str:
        if not json and "--json" in argv:
            raise subprocess.CalledProcessError(1, list(argv), "", "sinfo: unrecognized option '--json'")
        return c.run(argv, timeout_seconds)

    c.wait_for("vnode1 idle (earlier tests' jobs gone)", lambda: c.sinfo_state("vnode1") == "idle")
    act = SlurmActuator(SlurmConfig(scontrol=c.scontrol), run=run)
    act.deliver(dec("vnode1", Action.DRAIN, id="hostile1", reason="job x State=IDLE Reason=fine [a@b]"))
    assert c.sinfo_state("vnode1") == "drained" and "State=IDLE" in c.reason("vnode1")
    assert act.deliver(dec("vnode1", Action.RESUME, id="res-hostile1")) == "resumed vnode1"
    c.wait_for("vnode1 back in service", lambda: c.sinfo_state("vnode1") == "idle")
    c.reset()


def test_refusals_are_exported_by_actuator_and_reason() -> None:
    act = SlurmActuator(SlurmConfig(), run=FakeScontrol({}))
    with pytest.raises(DeliveryError):
        act.deliver(dec("gpu-7", Action.RESTART_JOB, job="a,b"))
    readings = ActingReadings(actuator_refusals={("slurm", r): n for r, n in act.refusals.items()})
    text = generate_latest(AggregatorMetrics(dict, lambda: readings).registry).decode()
    assert 'vigil_aggregator_actuator_refusals_total{actuator="slurm",reason="job_not_numeric"} 1.0' in text
    assert 'vigil_aggregator_actuator_refusals_total{actuator="slurm",reason="job_not_on_node"} 0.0' in text
