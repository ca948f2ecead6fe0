"""The prober: probe runs requested after the recovery detector's passive checks and for idle
suspects, signed and bounded by the fleet share; results verified before the fleet takes them;
resume only after a passing run, escalation after a failing one; a suspect drained only when its
probe fails. Fake agents (tests.aggregator.conftest) and signed results made here with the node key,
and once the agent's real runner (agent/node_action_runner.py) with probe functions this test
controls (a fault only load shows is a figure below its floor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.aggregator.conftest import FakeNode, rank_summary, set_training
from tests.aggregator.test_app_node_actions import MASTER, SECRET, _cluster
from vigil.agent.node_action_runner import NodeActionRunner, ProbeWorld
from vigil.agent.node_action_runner import NodeActionsConfig as AgentNodeActionsConfig
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import NodeScenario
from vigil.agent.probes import PROBES as PROBE_TABLE
from vigil.agent.probes import ProbeSpec
from vigil.agent.probes.context import ProbeContext
from vigil.aggregator.app import EVALUATE_KEY, PROBER_KEY
from vigil.aggregator.auth import node_token
from vigil.aggregator.config import ConfigError, parse_config
from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.probe_verdict import (
    ProbeVerdictConfig,
    ProbeVerdictDetector,
    probe_request_id,
    trigger_of,
)
from vigil.aggregator.detectors.recovery import RecoveryConfig, RecoveryDetector
from vigil.aggregator.detectors.straggler import StragglerConfig, StragglerDetector
from vigil.aggregator.fleet import Fleet, Removal
from vigil.aggregator.group_testing import GroupIsolation
from vigil.aggregator.outbox import NodeActionsConfig, Outbox
from vigil.aggregator.prober import IsolationRefused, Prober, ProbesConfig, SuspectTrigger
from vigil.contract.node_actions import node_key, sign_result, signature_ok
from vigil.contract.probe_baselines import Baseline, ProbeBaselines
from vigil.contract.wire import Event, NodeActionRequest, NodeActionResult, ProbeResult, convert, encode, to_builtins

H100 = "NVIDIA H100 80GB HBM3"
BASELINES = ProbeBaselines(default={"gpu_compute": Baseline(min_value=600.0),
                                    "gpu_memory": Baseline(min_value=2000.0)})
PROBES = ProbesConfig(enabled=True, baselines=BASELINES)
RECOVERY = RecoveryDetector(RecoveryConfig(enabled=True, follow_actions=[Action.REBOOT_NODE, Action.RESET_GPU]))
REMOVED_AT = 100.0
REBOOT = Removal(Action.REBOOT_NODE, REMOVED_AT, "dec-reboot", None, held=False)
GOOD = {"gpu_compute": 700.0, "gpu_memory": 2600.0}


def named(node: FakeNode) -> FakeNode:
    for g in node.gpus.values():
        g["name"] = H100
    return node


class Setup:
    """A fleet of ``n`` reporting nodes, the outbox holding the master key, the prober."""

    def __init__(self, n: int = 1, config: ProbesConfig = PROBES) -> None:
        self.fleet = Fleet()
        self.nodes = [named(FakeNode(f"n{i}")) for i in range(n)]
        self.outbox = Outbox(MASTER, NodeActionsConfig(), self.fleet, follow=())
        self.prober = Prober(config, self.outbox, self.fleet)
        self.t = 0.0

    def run(self, seconds: float) -> float:
        end = self.t + seconds
        while self.t < end:
            self.t += 2.5
            for node in self.nodes:
                self.fleet.ingest(node.report(self.t), self.t)
        return self.t

    def reboot(self, *names: str, clean_seconds: float = 65.0) -> None:
        """Removed at REMOVED_AT, down 120 s, back in a new boot, clean for ``clean_seconds``."""
        self.run(REMOVED_AT - self.t)
        for node in self.nodes:
            if node.name in names:
                node.reboot()
        self.t += 120.0
        self.run(clean_seconds)

    def evaluate(self, removed: dict[str, Removal], extra: list[Finding] | None = None,
                 ) -> tuple[list[Finding], list[NodeActionRequest]]:
        view = self.fleet.view(removed)
        findings = RECOVERY.evaluate(view, self.t) + (extra or [])
        return findings, self.prober.plan(self.fleet.view(removed), findings, self.t)

    def answer(self, request: NodeActionRequest, values: dict[str, float] | None = None, *,
               key: bytes | None = None, boot_id: str | None = None, status: str = "pass",
               outcome: str = "done") -> list[NodeActionResult]:
        """The agent's signed result for ``request``: every requested probe on each of 8 GPUs
        (``values``: per probe; a probe not in it is skipped), recorded through the outbox."""
        values = values if values is not None else GOOD
        probes = [ProbeResult(probe=p, gpu=gpu, status=status if p in values else "skipped",  # type: ignore[arg-type]
                              value=values.get(p), unit="tflops" if p == "gpu_compute" else "gb_per_s")
                  for p in request.probes for gpu in range(8)]
        result = NodeActionResult(id=request.id, action="run_probes", outcome=outcome, reason=outcome,  # type: ignore[arg-type]
                                  ts=self.t, probes=probes, node=request.node,
                                  boot_id=boot_id or request.boot_id)
        signed = sign_result(result, key or node_key(MASTER, request.node))
        return self.outbox.record(request.node, [signed], self.t)


def probing(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.evidence.get("signal") == "probing"]


def test_a_node_that_passed_its_passive_checks_is_probed_and_resumed_only_after_the_probes_pass() -> None:
    s = Setup()
    s.reboot("n0")
    findings, [request] = s.evaluate({"n0": REBOOT})
    [f] = findings
    assert (f.action, f.key) == (Action.OBSERVE, "probing")
    assert "clean for" in f.reason and "probing" in f.reason
    assert request.action == "run_probes" and request.probes == ["gpu_compute", "gpu_memory", "gpu_p2p", "dcgm_diag"]
    assert request.id == probe_request_id("recovery", "dec-reboot", 0) and trigger_of(request.id) == "recovery"
    assert request.boot_id == s.nodes[0].boot_id and request.expires_at == s.t + PROBES.run_timeout_seconds
    assert signature_ok(request, node_key(MASTER, "n0")) and not signature_ok(request, node_key(MASTER, "n1"))
    assert [r.id for r in s.outbox.due("n0", s.t, s.nodes[0].boot_id)] == [request.id]
    s.run(60.0)
    findings, again = s.evaluate({"n0": REBOOT})
    assert again == [] and [f.key for f in findings] == ["probing"]  # waiting: never resumed on passive alone
    assert s.prober.in_flight()["recovery"] == 1
    assert s.answer(request)  # skipped gpu_p2p and dcgm_diag do not count against it
    findings, _ = s.evaluate({"n0": REBOOT})
    [resume] = findings
    assert (resume.action, resume.key) == (Action.RESUME, "verified") and "passed its probes" in resume.reason
    assert s.prober.runs[("recovery", "pass")] == 1 and s.prober.in_flight()["recovery"] == 0


def test_the_probes_run_while_the_passive_window_fills_and_a_pass_waits_for_the_window() -> None:
    # Requested from the new boot's first clean reports, not after the 60 s window: a probe run
    # shorter than the window costs no time; resume still needs the whole window clean.
    s = Setup()
    s.reboot("n0", clean_seconds=10.0)
    findings, [request] = s.evaluate({"n0": REBOOT})
    assert [(f.action, f.key) for f in findings] == [(Action.OBSERVE, "probing")]
    s.run(30.0)
    assert s.answer(request)
    findings, _ = s.evaluate({"n0": REBOOT})
    assert findings == []  # probes passed 40 s in: waiting for the passive window, no resume yet
    s.run(25.0)
    [resume] = s.evaluate({"n0": REBOOT})[0]
    assert (resume.action, resume.key) == (Action.RESUME, "verified")


def test_a_probe_that_fails_inside_the_passive_window_escalates_at_once() -> None:
    s = Setup()
    s.reboot("n0", clean_seconds=10.0)
    _, [request] = s.evaluate({"n0": REBOOT})
    s.run(20.0)
    assert s.answer(request, {"gpu_compute": 300.0, "gpu_memory": 2600.0})
    [failed] = s.evaluate({"n0": REBOOT})[0]
    assert (failed.action, failed.key) == (Action.INSPECT_HARDWARE, "probe_failed")


def test_a_failing_probe_is_not_resumed_and_climbs_the_ladder_with_the_failed_values_as_evidence() -> None:
    s = Setup()
    s.reboot("n0")
    _, [request] = s.evaluate({"n0": REBOOT})
    s.answer(request, {"gpu_compute": 450.0, "gpu_memory": 2600.0})  # under load, below the floor
    [f] = s.evaluate({"n0": REBOOT})[0]
    assert (f.action, f.key) == (Action.INSPECT_HARDWARE, "probe_failed")
    failed = f.evidence["failed"]
    assert {(x["probe"], x["value"], x["floor"]) for x in failed} == {("gpu_compute", 450.0, 600.0)}
    assert len(failed) == 8 and s.prober.runs[("recovery", "fail")] == 1
    # After a GPU reset the next rung is a reboot.
    reset = Removal(Action.RESET_GPU, REMOVED_AT, "dec-reset", 3, held=False)
    s2 = Setup()
    s2.run(REMOVED_AT + 65.0)
    _, [request] = s2.evaluate({"n0": reset})
    s2.answer(request, {"gpu_compute": 700.0, "gpu_memory": 2600.0}, status="fail")  # the agent's own fail
    [f] = s2.evaluate({"n0": reset})[0]
    assert (f.action, f.key, f.gpu) == (Action.REBOOT_NODE, "probe_failed", 3)


def test_a_forged_or_misbound_result_is_refused_counted_and_changes_nothing() -> None:
    s = Setup(2)
    s.reboot("n0")
    _, [request] = s.evaluate({"n0": REBOOT})
    assert s.answer(request, key=b"\x00" * 32) == []  # not the node key: anyone could have made it up
    assert s.answer(request, key=node_key(MASTER, "n1")) == []  # another node's key
    assert s.answer(request, boot_id="boot-n0-1") == []  # signed, but for the old boot
    unsigned = NodeActionResult(id=request.id, action="run_probes", outcome="done", reason="done", ts=s.t,
                                node="n0", boot_id=request.boot_id,
                                probes=[ProbeResult(probe="gpu_compute", status="pass", value=999.0)])
    assert s.outbox.record("n0", [unsigned], s.t) == []
    assert s.outbox.refused == {("run_probes", "bad_signature"): 3, ("run_probes", "boot_mismatch"): 1}
    assert request.id not in s.fleet.view().nodes["n0"].action_results
    assert s.outbox.queued("n0", request.id)  # the real result can still come
    findings, _ = s.evaluate({"n0": REBOOT})
    assert [f.key for f in findings] == ["probing"]
    metrics = "".join(str(m) for m in s.outbox.collector().collect())
    assert "vigil_aggregator_node_action_results_refused" in metrics


def test_an_erroring_or_silent_run_is_retried_once_then_alerted() -> None:
    s = Setup()
    s.reboot("n0")
    _, [first] = s.evaluate({"n0": REBOOT})
    s.answer(first, {"gpu_compute": 700.0}, status="error")
    findings, [second] = s.evaluate({"n0": REBOOT})
    assert [f.key for f in findings] == ["probing:retry"] and "again" in findings[0].reason
    assert second.id == probe_request_id("recovery", "dec-reboot", 1)
    s.run(PROBES.run_timeout_seconds)  # no result at all
    findings, none = s.evaluate({"n0": REBOOT})
    assert none == []
    [alert] = findings
    assert (alert.action, alert.key) == (Action.ALERT, "probe_error") and "no probe result" in alert.reason
    assert s.prober.runs[("recovery", "error")] == 1 and s.prober.runs[("recovery", "timeout")] == 1


def test_a_refusal_the_agent_lifts_itself_keeps_the_run_waiting_not_retried() -> None:
    s = Setup()
    s.reboot("n0")
    _, [request] = s.evaluate({"n0": REBOOT})
    for reason in ("busy", "processes_unknown", "probe_running"):
        refusal = sign_result(NodeActionResult(id=request.id, action="run_probes", outcome="refused", reason=reason,
                                               ts=s.t, node="n0", boot_id=request.boot_id), node_key(MASTER, "n0"))
        assert s.outbox.record("n0", [refusal], s.t)
        findings, again = s.evaluate({"n0": REBOOT})
        assert again == [] and [f.key for f in findings] == ["probing"] and s.outbox.queued("n0", request.id)
    assert s.prober.in_flight()["recovery"] == 1 and sum(s.prober.runs.values()) == 0
    s.answer(request, outcome="refused")  # a final refusal (e.g. not_allowed): retried once
    assert [f.key for f in s.evaluate({"n0": REBOOT})[0]] == ["probing:retry"]


def _agent_runs(tmp_path: Path, s: Setup, request: NodeActionRequest, compute_tflops: float) -> NodeActionResult:
    """The node's real agent-side runner (agent/node_action_runner.py) takes the offer as the wire
    carries it and runs the probes through its probe table, each probe a function this test controls
    (the compute burn reads ``compute_tflops`` per GPU: a fault only load shows, or none); its result
    comes back through the wire's JSON."""
    clock = lambda: s.t  # noqa: E731  (the node's clock is the aggregator's here)
    fake = FakeNvml(NodeScenario.model_validate({"gpus": 8}), clock, start=0.0)
    backend = PynvmlBackend(fake)  # type: ignore[arg-type]
    backend.init()
    key_file = tmp_path / "node.key"
    key_file.write_text(node_key(MASTER, request.node).hex())

    def measured(name: str, value: float | None, unit: str) -> object:
        def run(ctx: ProbeContext) -> list[ProbeResult]:
            if value is None:
                return [ProbeResult(probe=name, status="skipped", reason="not_installed")]  # type: ignore[arg-type]
            return [ProbeResult(probe=name, gpu=g, status="pass", reason="ok", value=value, unit=unit)  # type: ignore[arg-type]
                    for g in range(8)]
        return run

    values = {"gpu_compute": (compute_tflops, "tflops"), "gpu_memory": (2600.0, "gb_per_s")}
    table = {name: ProbeSpec(spec.description, spec.intrusive, spec.needs_group, spec.quick, spec.unit,
                             measured(name, *values.get(name, (None, "")))) for name, spec in PROBE_TABLE.items()}  # type: ignore[arg-type]
    runner = NodeActionRunner(AgentNodeActionsConfig(allow=["run_probes"], key_file=str(key_file)), node=request.node,
                              boot_id=request.boot_id, nvml=backend, clock=clock,
                              probes=ProbeWorld(table=table, engine="engine"))  # type: ignore[arg-type]  # the probes here need none
    [offer] = s.outbox.due(request.node, s.t, request.boot_id)
    result = runner.handle(convert(json.loads(encode(offer)), NodeActionRequest))
    return convert(json.loads(encode(result)), NodeActionResult)


@pytest.mark.parametrize(("tflops", "expected"), [(450.0, (Action.INSPECT_HARDWARE, "probe_failed")),
                                                  (700.0, (Action.RESUME, "verified"))])
def test_the_agents_real_runner_answers_the_prober_and_its_signed_result_is_judged(
        tmp_path: Path, tflops: float, expected: tuple[Action, str]) -> None:
    s = Setup()
    s.reboot("n0")
    _, [request] = s.evaluate({"n0": REBOOT})
    result = _agent_runs(tmp_path, s, request, tflops)
    assert result.outcome == "done" and result.signature and result.node == "n0"
    assert s.outbox.record("n0", [result], s.t) == [result] and not s.outbox.refused
    [f] = s.evaluate({"n0": REBOOT})[0]
    assert (f.action, f.key) == expected


def test_the_fleet_share_caps_the_runs_in_flight_and_one_node_never_has_two() -> None:
    s = Setup(100)  # 2% of 100 reporting nodes: 2 at once
    names = ("n0", "n1", "n2")
    s.reboot(*names)
    removed = {n: REBOOT._replace(decision=f"dec-{n}") for n in names}
    findings, requests = s.evaluate(removed)
    assert len(probing(findings)) == 3 and sorted(r.node for r in requests) == ["n0", "n1"]
    assert s.prober.deferred["share_cap"] == 1
    assert s.evaluate(removed)[1] == []  # still full; n0 and n1 are not asked twice
    s.answer(requests[0])
    _, [third] = s.evaluate(removed)
    assert third.node == "n2"
    few = Setup(10)  # 2% of 10 is 0.2: still one node
    few.reboot("n0", "n1")
    assert len(few.evaluate({n: REBOOT._replace(decision=f"dec-{n}") for n in ("n0", "n1")})[1]) == 1


def suspect(node: str, job: str = "train-1") -> Finding:
    return Finding(detector="straggler", node=node, job=job, action=Action.ALERT, since=1.0,
                   key=f"{job}:intermittent", reason=f"job {job}: intermittent straggler")


def test_a_suspect_with_a_job_is_probed_only_once_idle_and_drained_only_if_the_probe_fails() -> None:
    s = Setup(3)
    busy = s.nodes[1]
    busy.ranks = [rank_summary("train-1", r, compute=0.8, comm=0.1, ts=0.0, gpu=r) for r in range(8)]
    s.run(10.0)
    _, requests = s.evaluate({}, [suspect("n1")])
    assert requests == [] and s.prober.suspects() == ["n1"] and s.prober.deferred["busy"] == 1
    busy.ranks = [rank_summary("train-1", r, compute=0.8, comm=0.1, ts=s.t, gpu=r, state="exited")
                  for r in range(8)]
    s.run(5.0)
    _, [request] = s.evaluate({})  # the finding is gone with the job; the suspicion is remembered
    assert request.node == "n1" and request.probes == ["gpu_compute", "gpu_memory"]
    assert trigger_of(request.id) == "suspect" and s.prober.suspects() == []
    verdict = ProbeVerdictDetector(ProbeVerdictConfig(enabled=True))
    assert verdict.evaluate(s.fleet.view(), s.t) == []  # no result yet: nothing
    s.answer(request, {"gpu_compute": 500.0, "gpu_memory": 2600.0})
    [drain] = verdict.evaluate(s.fleet.view(), s.t)
    assert (drain.node, drain.action, drain.detector) == ("n1", Action.DRAIN, "probe_verdict")
    assert {x["value"] for x in drain.evidence["failed"]} == {500.0}
    # Cooldown: named again at once, it is not probed again.
    assert s.evaluate({}, [suspect("n1")])[1] == []


def test_a_suspect_that_passes_is_cleared_and_a_whole_job_slowdown_is_no_suspect() -> None:
    s = Setup(2)
    s.run(10.0)
    whole_job = Finding(detector="straggler", node=WHOLE_JOB, job="train-1", action=Action.OBSERVE, since=1.0,
                        key="train-1:class:NVIDIA H100", reason="the whole class is slower")
    drain = Finding(detector="straggler", node="n0", job="train-1", action=Action.DRAIN, since=1.0,
                    key="train-1", reason="a persistent straggler: removed, not probed")
    assert s.evaluate({}, [whole_job, drain])[1] == [] and s.prober.suspects() == []
    _, [request] = s.evaluate({}, [suspect("n0")])
    s.answer(request)
    verdict = ProbeVerdictDetector(ProbeVerdictConfig(enabled=True))
    assert verdict.evaluate(s.fleet.view(), s.t) == []
    s.evaluate({})
    assert s.prober.runs[("suspect", "pass")] == 1


def _straggler_run(slow: dict[str, float]) -> tuple[Setup, list[Finding]]:
    """16 nodes, 4 of them A100s (slower as a class, by design), on the real straggler detector,
    the whole job 40% slower from 100 s on (a data-loader stall); every trigger finding of the
    straggler, whatever its action, makes a suspect. Returns the setup and every finding."""
    broad = ProbesConfig(enabled=True, baselines=BASELINES, suspect_triggers=[
        SuspectTrigger(detector="straggler", actions=[Action.OBSERVE, Action.ALERT, Action.DRAIN])])
    s = Setup(16, broad)
    for node in s.nodes[12:]:
        for g in node.gpus.values():
            g["name"] = "NVIDIA A100-SXM4-80GB"
    straggler = StragglerDetector(StragglerConfig())
    findings: list[Finding] = []
    for _ in range(80):
        factors = {n.name: 1.5 for n in s.nodes[12:]} | slow
        set_training(s.nodes, "train-1", s.t, scale=1.0 if s.t < 100.0 else 1.4, slow=factors)
        s.run(2.5)
        found = straggler.evaluate(s.fleet.view(), s.t)
        findings.extend(found)
        s.prober.plan(s.fleet.view(), found, s.t)
    return s, findings


def test_a_whole_job_slowdown_through_the_real_straggler_detector_makes_no_suspect() -> None:
    s, findings = _straggler_run({})
    assert findings and all(f.node == WHOLE_JOB for f in findings)  # the A100 class: about the job
    assert s.prober.suspects() == [] and s.outbox.pending() == 0
    # The control: one H100 node 20% slower is named, and becomes a suspect (busy: not probed yet).
    s, findings = _straggler_run({"n3": 1.2})
    assert "n3" in {f.node for f in findings} and s.prober.suspects() == ["n3"] and s.outbox.pending() == 0


def test_learned_figures_judge_a_class_without_configured_baselines() -> None:
    s = Setup(3, ProbesConfig(enabled=True))  # no configured min_value
    s.run(10.0)
    for name in ("n0", "n1"):
        _, [request] = s.evaluate({}, [suspect(name)])
        s.answer(request, {"gpu_compute": 700.0, "gpu_memory": 2600.0})
    s.evaluate({})
    learned = dict(s.fleet.learned_probes)
    [compute_key] = [k for k in learned if k[1] == "gpu_compute"]
    assert H100 in compute_key[0] and learned[compute_key] == (700.0, 16)  # 2 nodes x 8 GPUs
    _, [request] = s.evaluate({}, [suspect("n2")])
    s.answer(request, {"gpu_compute": 600.0, "gpu_memory": 2600.0})  # 14% below the learned median
    [drain] = ProbeVerdictDetector(ProbeVerdictConfig(enabled=True)).evaluate(s.fleet.view(), s.t)
    assert [x["floor"] for x in drain.evidence["failed"]] == [pytest.approx(630.0)] * 8


def test_a_group_isolation_runs_collectives_with_one_rendezvous_and_names_the_node_whose_collective_fails(
        ) -> None:
    """aggregator/group_testing.py's GroupIsolation driven by the prober: each test's members get one
    ProbeGroup; a member with a job holds the test back; the outcome of each test goes back to it."""
    s = Setup(10, PROBES.model_copy(update={"max_fleet_share": 1.0}))
    s.nodes[3].ranks = [rank_summary("train-1", 0, compute=0.8, comm=0.1, ts=0.0, gpu=0)]
    s.run(10.0)
    iso = GroupIsolation([f"n{i}" for i in range(8)], ["n8", "n9"], d_hint=1)
    nodes = [f"n{i}" for i in range(8)]
    assert s.prober.isolate("repaired-8", iso, s.t, nodes=nodes, d_hint=1).state == "running"
    with pytest.raises(IsolationRefused, match="repaired-8 is running"):
        s.prober.isolate("another", iso, s.t, nodes=nodes, d_hint=1)
    assert s.evaluate({})[1] == [] and s.prober.deferred["busy"] == 1  # n3 runs a job: the test waits
    s.nodes[3].ranks = []
    s.run(60.0)
    for _ in range(40):
        _, requests = s.evaluate({})
        by_group: dict[str, list[NodeActionRequest]] = {}
        for r in requests:
            assert r.probe_group is not None and r.probes == ["collective"]
            by_group.setdefault(r.probe_group.group, []).append(r)
        for members in by_group.values():
            groups = [r.probe_group for r in members if r.probe_group is not None]
            assert [g.rank for g in groups] == list(range(len(members)))
            assert {(g.world_size, g.rendezvous) for g in groups} == {
                (len(members), f"{members[0].node}:{PROBES.group_port}")}
        for members in by_group.values():
            broken = any(r.node == "n5" for r in members)  # one slow link fails the whole collective
            for r in members:
                s.answer(r, {"collective": 10.0 if broken else 90.0}, status="fail" if broken else "pass")
        if s.prober.isolations[-1].state != "running":
            break
    [done] = s.prober.isolations
    assert (done.name, done.state, done.faulty) == ("repaired-8", "done", ("n5",))
    assert done.tests_used == iso.tests_used == len(done.tests) == s.prober.isolation_tests
    assert s.fleet.view().isolations == (done,)


def test_probes_off_by_default_change_nothing_and_need_the_key_when_on() -> None:
    s = Setup(1, ProbesConfig())
    assert s.fleet.probes is None and not s.prober.enabled
    s.reboot("n0")
    findings, requests = s.evaluate({"n0": REBOOT})
    assert requests == [] and [(f.action, f.key) for f in findings] == [(Action.RESUME, "verified")]
    with pytest.raises(ConfigError, match=r"probes\.enabled needs node_actions\.key_file"):
        parse_config({"probes": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"probe_verdict\.enabled needs probes\.enabled"):
        parse_config({"detectors": {"probe_verdict": {"enabled": True}}})
    with pytest.raises(ConfigError, match="no detector 'stragler'"):
        parse_config({"probes": {"suspect_triggers": [{"detector": "stragler"}]}})
    with pytest.raises(ConfigError, match="collective need"):
        parse_config({"probes": {"recovery_probes": ["gpu_compute", "collective"]}})


async def test_over_http_xid79_reboot_passive_pass_then_a_failing_probe_escalates_instead_of_resuming(
        tmp_path: Path) -> None:
    key = tmp_path / "master.key"
    key.write_text(MASTER.hex() + "\n")
    config = parse_config({
        "dry_run": False, "evaluate_interval_seconds": 3600, "actuators": {"slurm": {"enabled": True}},
        "node_actions": {"key_file": str(key)}, "gate": {"min_removed_seconds": 0},
        "detectors": {"recovery": {"enabled": True}},
        "probes": {"enabled": True, "baselines": BASELINES.model_dump()}})
    async with _cluster(tmp_path, config) as c:
        named(c.node)
        evaluate = c.client.app[EVALUATE_KEY]

        async def post(results: list[NodeActionResult] | None = None) -> dict:
            c.clock.t += 2.5
            body = json.loads(encode(c.node.report(c.clock.t)))
            if results:
                body["action_results"] = [to_builtins(r) for r in results]
            resp = await c.client.post("/v1/reports", data=json.dumps(body), headers={
                "Authorization": f"Bearer {node_token(SECRET, c.node.name)}"})
            assert resp.status == 202
            return await resp.json()

        await post()
        c.clock.t += 2.5
        body = json.loads(encode(c.node.report(c.clock.t, events=[Event(kind="xid", ts=c.clock.t, code=79, gpu=2)])))
        await c.client.post("/v1/reports", data=json.dumps(body),
                            headers={"Authorization": f"Bearer {node_token(SECRET, c.node.name)}"})
        assert [d.action for d in evaluate()] == [Action.REBOOT_NODE]
        await c.dispatcher.run_once()
        c.node.reboot()
        c.clock.t += 120.0
        for _ in range(26):  # 65 s clean in the new boot
            answer = await post()
        [probing_decision] = evaluate()
        assert probing_decision.action is Action.OBSERVE and "probing" in probing_decision.reason
        answer = await post()
        [raw] = answer["requests"]
        request = convert(raw, NodeActionRequest)
        assert request.action == "run_probes" and signature_ok(request, node_key(MASTER, c.node.name))
        failing = sign_result(NodeActionResult(
            id=request.id, action="run_probes", outcome="done", reason="done", ts=c.clock.t, node=c.node.name,
            boot_id=request.boot_id, probes=[ProbeResult(probe="gpu_compute", gpu=0, status="pass", value=300.0),
                                             ProbeResult(probe="gpu_memory", gpu=0, status="pass", value=2600.0)]),
            node_key(MASTER, c.node.name))
        forged = sign_result(NodeActionResult(
            id=request.id, action="run_probes", outcome="done", reason="done", ts=c.clock.t, node=c.node.name,
            boot_id=request.boot_id, probes=[ProbeResult(probe="gpu_compute", gpu=0, status="pass", value=900.0),
                                             ProbeResult(probe="gpu_memory", gpu=0, status="pass", value=2600.0)]),
            node_key(MASTER, "another-node"))
        await post([forged])  # the report is taken; the made-up result is not
        assert [d.action for d in evaluate()] == []
        assert ('vigil_aggregator_node_action_results_refused_total{action="run_probes",reason="bad_signature"} 1.0'
                in await c.metrics())
        await post([failing])
        escalated = evaluate()
        assert [d.action for d in escalated] == [Action.INSPECT_HARDWARE]
        assert escalated[0].evidence["failed"][0]["value"] == 300.0
        metrics = await c.metrics()
        assert 'vigil_aggregator_probe_runs_total{outcome="fail",trigger="recovery"} 1.0' in metrics
        assert c.client.app[PROBER_KEY].in_flight()["recovery"] == 0


def _answer_groups(s: Setup, requests: list[NodeActionRequest], bad: str | None, outcome: str = "done") -> None:
    by_group: dict[str, list[NodeActionRequest]] = {}
    for r in requests:
        assert r.probe_group is not None
        by_group.setdefault(r.probe_group.group, []).append(r)
    for members in by_group.values():
        slow = any(r.node == bad for r in members)
        for r in members:
            s.answer(r, {"collective": 10.0 if slow else 90.0}, outcome=outcome)


GROUPED = PROBES.model_copy(update={"max_fleet_share": 1.0, "baselines": ProbeBaselines(
    default={**BASELINES.default, "collective": Baseline(min_value=40.0)})})


def test_four_idle_suspects_are_isolated_as_one_group_with_clean_idle_partners_and_the_bad_one_drained() -> None:
    s = Setup(8, GROUPED)
    s.nodes[7].ranks = [rank_summary("train-1", 0, compute=0.8, comm=0.1, ts=0.0, gpu=0)]  # busy: no partner
    s.run(10.0)
    s.nodes[7].ranks = [rank_summary("train-1", 0, compute=0.8, comm=0.1, ts=s.t, gpu=0)]
    s.run(2.5)
    three = [suspect(f"n{i}") for i in range(3)]
    _, requests = s.evaluate({}, three)  # below group_min_suspects (4): probed alone, one by one
    assert {r.probes[0] for r in requests} == {"gpu_compute"} and s.prober.isolations == []
    s2 = Setup(8, GROUPED)
    s2.nodes[7].ranks = list(s.nodes[7].ranks)
    s2.run(12.5)
    flagged = Finding(detector="xid", node="n6", action=Action.ALERT, reason="an Xid", since=s2.t, key="x")
    _, requests = s2.evaluate({}, [suspect(f"n{i}") for i in range(4)] + [flagged])
    [iso] = s2.prober.isolations
    assert (iso.source, iso.nodes, iso.d_hint) == ("auto", ("n0", "n1", "n2", "n3"), 1)
    assert s2.prober.suspects() == []  # taken into the isolation, not probed alone
    # Partners: idle, clean, reporting, not suspects: n4 and n5 (n6 is flagged, n7 runs a job).
    assert s2.prober.partners(s2.fleet.view(), set(iso.nodes), s2.t) == ["n4", "n5"]
    for _ in range(20):
        _answer_groups(s2, requests, "n2")
        s2.run(2.5)
        _, requests = s2.evaluate({})
        if s2.prober.isolations[-1].state != "running":
            break
    [done] = s2.prober.isolations
    assert done.faulty == ("n2",) and set(done.cleared) == {"n0", "n1", "n3"}
    assert all({*t.members, t.partner or "n0"} <= {"n0", "n1", "n2", "n3", "n4", "n5"} for t in done.tests)
    [drain] = ProbeVerdictDetector(ProbeVerdictConfig(enabled=True)).evaluate(s2.fleet.view(), s2.t)
    assert (drain.node, drain.action, drain.evidence["signal"]) == ("n2", Action.DRAIN, "isolation_faulty")


def test_a_group_test_that_only_errors_is_run_again_then_the_isolation_aborts_and_names_nobody() -> None:
    s = Setup(6, GROUPED)
    s.run(10.0)
    s.prober.start_isolation(["n0", "n1", "n2", "n3"], 1, s.fleet.view(), s.t, source="operator")
    _, requests = s.evaluate({})
    first = {r.node for r in requests}
    for _ in range(2):  # group_test_retries 1: the first try and one more
        assert {r.node for r in requests} == first and requests
        _answer_groups(s, requests, None, outcome="failed")
        s.run(2.5)
        _, requests = s.evaluate({})
    [aborted] = s.prober.isolations
    assert aborted.state == "aborted" and aborted.faulty == () and "did not complete" in aborted.detail
    assert ProbeVerdictDetector(ProbeVerdictConfig(enabled=True)).evaluate(s.fleet.view(), s.t) == []
    assert s.prober.isolations_finished["aborted"] == 1 and s.prober.isolation_tests == 0
