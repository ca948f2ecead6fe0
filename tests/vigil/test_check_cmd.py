"""``vigil check``: which probes run, how their results are judged against the shared baselines,
the exit codes a scheduler reads (0 healthy, 1 unhealthy, 2 cannot judge), and what ``--drain``
does to the Slurm node (drain on a failure, undrain only its own drain, never another reason).

The NVML side is the embedded FakeNvml (the agent's ``nvml: fake``); the compute side is a small
engine defined here and a probe table of test probes that measure through it, passed in through
``run_check``'s seams. Slurm is a recording ``scontrol`` stand-in here; the real one is in
tests/e2e/test_vigil_check_slurm.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from vigil.agent.config import NvmlConfig
from vigil.agent.nvml.backend import open_backend
from vigil.agent.probes import PROBES, ProbeSpec
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.cli import main
from vigil.cli.check_cmd import (
    DRAIN_REASON_PREFIX,
    EXIT_CANNOT_JUDGE,
    EXIT_HEALTHY,
    EXIT_UNHEALTHY,
    CheckOptions,
    CheckReport,
    CheckUsageError,
    apply_to_slurm,
    drain_reason,
    load_baselines,
    local_probes,
    run_check,
)
from vigil.contract.probe_baselines import Baseline, ProbeBaselines
from vigil.contract.wire import ProbeName, ProbeResult

H100 = "NVIDIA H100 80GB HBM3"  # what the fake's default h100-sxm-80gb board reports as its name


class SlowGpuEngine:
    """A ComputeEngine whose figures the test sets: ``tflops[gpu]``, and one device that never
    returns until ``release`` is set (a GPU stuck under load)."""

    kind = "cpu"

    def __init__(self, tflops: dict[int, float] | None = None, stuck_gpu: int | None = None) -> None:
        self.tflops = tflops or {}
        self.stuck_gpu = stuck_gpu
        self.release = threading.Event()
        self.calls: list[int] = []

    def matmul_tflops(self, device: int, seconds: float) -> float:
        self.calls.append(device)
        if device == self.stuck_gpu:
            self.release.wait(60)
        return self.tflops.get(device, 700.0)

    def copy_gb_per_s(self, device: int, nbytes: int) -> float:
        return 2000.0

    def pattern_errors(self, device: int, nbytes: int) -> int:
        return 0

    def p2p_gb_per_s(self, src: int, dst: int, nbytes: int) -> float:
        return 300.0


def _burn(ctx: ProbeContext) -> list[ProbeResult]:
    assert ctx.engine is not None
    return [ProbeResult(probe="gpu_compute", gpu=g, status="pass", unit="tflops",
                        value=ctx.engine.matmul_tflops(g, 0.01), metrics={"cv": 0.01}) for g in ctx.gpus]


def _crash(ctx: ProbeContext) -> list[ProbeResult]:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _skip(ctx: ProbeContext) -> list[ProbeResult]:
    return [ProbeResult(probe="dcgm_diag", status="skipped", reason="not_installed")]


def _table(**runs: Any) -> dict[ProbeName, ProbeSpec]:
    """PROBES with the named probes' ``run`` replaced (and everything else skipped)."""
    out: dict[ProbeName, ProbeSpec] = {}
    for name, spec in PROBES.items():
        run = runs.get(name, _skip if name == "dcgm_diag" else spec.run)
        out[name] = ProbeSpec(spec.description, spec.intrusive, spec.needs_group, spec.quick, spec.unit, run)
    return out


@pytest.fixture
def nvml() -> Iterator[Any]:
    backend = open_backend(NvmlConfig(backend="fake"), time.time)
    assert backend is not None
    yield backend
    backend.shutdown()


def _options(*probes: ProbeName, timeout: float = 30.0) -> CheckOptions:
    return CheckOptions(node="gpu-node-1", probes=probes, quick=True, timeout_seconds=timeout)


def _floor(value: float, hw: str = H100) -> ProbeBaselines:
    return ProbeBaselines(classes={hw: {"gpu_compute": Baseline(min_value=value, max_metrics={"cv": 0.05})}})


# --- which probes ---------------------------------------------------------------------------------

def test_the_local_set_is_every_probe_that_needs_no_other_node_in_table_order() -> None:
    assert local_probes(PROBES, quick=False) == ("gpu_compute", "gpu_memory", "gpu_p2p", "dcgm_diag")
    assert local_probes(PROBES, quick=True) == tuple(n for n, s in PROBES.items() if s.quick and not s.needs_group)
    assert local_probes(PROBES, quick=False, names=["dcgm_diag", "gpu_compute"]) == ("gpu_compute", "dcgm_diag")


@pytest.mark.parametrize("names, why", [
    (["gpu_burn"], "unknown probe 'gpu_burn'"),
    (["collective"], "needs other nodes"),
    (["gpu_compute", "rdma_bw"], "needs other nodes"),
])
def test_a_probe_that_cannot_run_alone_is_a_usage_error(names: list[str], why: str) -> None:
    with pytest.raises(CheckUsageError, match=why):
        local_probes(PROBES, quick=False, names=names)


# --- verdicts and exit codes ------------------------------------------------------------------------

def test_every_gpu_at_its_class_floor_is_healthy(nvml: Any) -> None:
    engine = SlowGpuEngine()
    report = run_check(_options("gpu_compute"), _floor(700.0), ProbesConfig(), nvml=nvml, engine=engine,
                       table=_table(gpu_compute=_burn))
    assert report.exit_code == EXIT_HEALTHY, report.failures()
    assert report.hardware_class == H100 and report.engine == "cpu"
    assert sorted(engine.calls) == list(range(8))  # every GPU NVML lists, through the engine
    assert [j.verdict.reason for j in report.judged] == ["ok"] * 8


def test_one_gpu_below_its_class_floor_fails_the_node_and_names_the_gpu(nvml: Any) -> None:
    report = run_check(_options("gpu_compute"), _floor(500.0), ProbesConfig(), nvml=nvml,
                       engine=SlowGpuEngine({3: 310.0}), table=_table(gpu_compute=_burn))
    assert report.exit_code == EXIT_UNHEALTHY
    [failed] = [j for j in report.judged if not j.verdict.passed]
    assert (failed.result.gpu, failed.verdict.reason, failed.verdict.floor) == (3, "below_baseline", 500.0)
    assert report.failures() == ["gpu_compute on GPU 3: 310 tflops below 500 (configured baseline)"]
    assert drain_reason(report) == f"{DRAIN_REASON_PREFIX} gpu_compute on GPU 3: 310 tflops below 500 " \
                                   "(configured baseline)"


def test_the_same_slow_gpu_under_another_classes_baseline_is_not_judged_by_it(nvml: Any) -> None:
    """Lookalike: the floor belongs to A100s; an H100 node with no floor of its own passes on its
    probes' own checks (no learned figure in vigil check)."""
    report = run_check(_options("gpu_compute"), _floor(500.0, hw="NVIDIA A100-SXM4-80GB"), ProbesConfig(),
                       nvml=nvml, engine=SlowGpuEngine({3: 310.0}), table=_table(gpu_compute=_burn))
    assert report.exit_code == EXIT_HEALTHY


def test_a_metric_above_its_bound_fails(nvml: Any) -> None:
    def wobbly(ctx: ProbeContext) -> list[ProbeResult]:
        return [ProbeResult(probe="gpu_compute", gpu=0, status="pass", unit="tflops", value=800.0,
                            metrics={"cv": 0.2})]

    report = run_check(_options("gpu_compute"), _floor(500.0), ProbesConfig(), nvml=nvml, engine=SlowGpuEngine(),
                       table=_table(gpu_compute=wobbly))
    assert report.exit_code == EXIT_UNHEALTHY
    assert [j.verdict.reason for j in report.judged] == ["cv_high"]


def test_a_probe_that_crashes_is_its_error_and_the_check_goes_on(nvml: Any) -> None:
    report = run_check(_options("gpu_compute", "dcgm_diag"), ProbeBaselines(), ProbesConfig(), nvml=nvml,
                       engine=SlowGpuEngine(), table=_table(gpu_compute=_crash))
    assert report.exit_code == EXIT_UNHEALTHY
    assert [(j.result.probe, j.result.status, j.result.reason) for j in report.judged] == [
        ("gpu_compute", "error", "exception"), ("dcgm_diag", "skipped", "not_installed")]
    assert "illegal memory access" in report.failures()[0]


def test_a_probe_stuck_past_the_timeout_is_reported_and_the_check_returns(nvml: Any) -> None:
    engine = SlowGpuEngine(stuck_gpu=5)
    try:
        report = run_check(_options("gpu_compute", "dcgm_diag", timeout=0.3), ProbeBaselines(), ProbesConfig(),
                           nvml=nvml, engine=engine, table=_table(gpu_compute=_burn))
    finally:
        engine.release.set()
    assert report.exit_code == EXIT_UNHEALTHY
    assert [(j.result.probe, j.result.reason) for j in report.judged] == [("gpu_compute", "timeout")]


def test_a_skipped_probe_passes_unless_the_baselines_demand_its_figure(nvml: Any) -> None:
    plain = run_check(_options("dcgm_diag"), ProbeBaselines(), ProbesConfig(), nvml=nvml, engine=None,
                      table=_table())
    assert plain.exit_code == EXIT_HEALTHY
    demanded = ProbeBaselines(default={"dcgm_diag": Baseline(max_metrics={"failures": 0})})
    report = run_check(_options("dcgm_diag"), demanded, ProbesConfig(), nvml=nvml, engine=None, table=_table())
    assert report.exit_code == EXIT_UNHEALTHY
    assert [j.verdict.reason for j in report.judged] == ["unverified"]


def test_no_nvml_is_an_unhealthy_node_and_no_probe_runs() -> None:
    engine = SlowGpuEngine()
    report = run_check(_options("gpu_compute"), ProbeBaselines(), ProbesConfig(), nvml=None, engine=engine,
                       table=_table(gpu_compute=_burn))
    assert report.exit_code == EXIT_UNHEALTHY
    assert report.failures() == ["nvml: unavailable (the driver or NVML library cannot be loaded)"]
    assert engine.calls == [] and report.judged == []


def _busy_nvml(tmp_path: Path) -> Any:
    scenario = tmp_path / "busy.yaml"
    scenario.write_text(yaml.safe_dump({"gpus": 2, "processes": [{"gpu": 1, "pid": 4242}]}))
    backend = open_backend(NvmlConfig(backend="fake", scenario=str(scenario)), time.time)
    assert backend is not None
    return backend


def test_gpus_held_by_a_job_are_not_probed_and_the_check_cannot_judge(tmp_path: Path) -> None:
    nvml = _busy_nvml(tmp_path)
    engine = SlowGpuEngine()
    try:
        report = run_check(_options("gpu_compute"), _floor(1e9), ProbesConfig(allow_with_job=["gpu_compute"]),
                           nvml=nvml, engine=engine, table=_table(gpu_compute=_burn))
    finally:
        nvml.shutdown()
    # Intrusive: never beside a job, even when allow_with_job names it; and a floor no GPU
    # reaches is not a failure of a node that was not measured.
    assert report.exit_code == EXIT_CANNOT_JUDGE and engine.calls == []
    assert report.cannot_judge == ["gpu_compute: not run, a job holds the GPUs (GPU 1: pids [4242])"]


def test_a_non_intrusive_probe_the_config_allows_runs_beside_a_job(tmp_path: Path) -> None:
    table = _table()
    spec = table["dcgm_diag"]
    table["dcgm_diag"] = ProbeSpec(spec.description, False, False, True, "", _skip)
    nvml = _busy_nvml(tmp_path)
    try:
        allowed = run_check(_options("dcgm_diag"), ProbeBaselines(), ProbesConfig(allow_with_job=["dcgm_diag"]),
                            nvml=nvml, engine=None, table=table)
        not_allowed = run_check(_options("dcgm_diag"), ProbeBaselines(), ProbesConfig(), nvml=nvml, engine=None,
                                table=table)
    finally:
        nvml.shutdown()
    assert allowed.exit_code == EXIT_HEALTHY and [j.result.probe for j in allowed.judged] == ["dcgm_diag"]
    assert not_allowed.exit_code == EXIT_CANNOT_JUDGE


# --- Slurm: drain and undrain -----------------------------------------------------------------------

class FakeScontrol:
    """``scontrol -o show node`` and ``scontrol update`` over one node's state and reason."""

    def __init__(self, state: str = "IDLE", reason: str = "", fail: BaseException | None = None) -> None:
        self.state, self.reason, self.fail = state, reason, fail
        self.calls: list[list[str]] = []
        self.timeouts: list[float] = []

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        self.calls.append(list(argv))
        self.timeouts.append(timeout_seconds)
        if self.fail is not None:
            raise self.fail
        if argv[1:3] == ["-o", "show"]:
            reason = f" Reason={self.reason} [root@2025-01-01T00:00:00]" if self.reason else ""
            return f"NodeName={argv[4]} Arch=x86_64 CoresPerSocket=1 State={self.state} ThreadsPerCore=1{reason}\n"
        fields = dict(a.split("=", 1) for a in argv[2:])
        if fields["State"] == "DRAIN":
            self.state, self.reason = self.state.split("+")[0] + "+DRAIN", fields["Reason"]
        elif fields["State"] == "UNDRAIN":
            self.state, self.reason = self.state.split("+")[0], ""
        return ""

    @property
    def updates(self) -> list[list[str]]:
        return [c for c in self.calls if c[1] == "update"]


def _report(exit_code: int, failure: str = "gpu_compute on GPU 3: 310 tflops below 500") -> CheckReport:
    report = CheckReport(node="gpu-node-1", hardware_class=H100, engine="cpu", quick=True, exit_code=exit_code)
    if exit_code == EXIT_UNHEALTHY:
        report.problems.append(failure)
    return report


def test_a_failure_drains_the_node_with_the_reason() -> None:
    scontrol = FakeScontrol()
    outcome = apply_to_slurm(_report(EXIT_UNHEALTHY), run=scontrol)
    assert outcome.action == "drained"
    assert scontrol.updates == [["scontrol", "update", "NodeName=gpu-node-1", "State=DRAIN",
                                 "Reason=vigil check: gpu_compute on GPU 3: 310 tflops below 500"]]
    assert scontrol.state == "IDLE+DRAIN"


def test_a_drain_of_our_own_is_renewed_and_a_pass_undrains_it() -> None:
    scontrol = FakeScontrol("IDLE+DRAIN", "vigil check: gpu_memory on GPU 1: 2 pattern errors")
    assert apply_to_slurm(_report(EXIT_UNHEALTHY), run=scontrol).action == "drained"
    assert scontrol.reason.startswith("vigil check: gpu_compute on GPU 3")
    outcome = apply_to_slurm(_report(EXIT_HEALTHY), run=scontrol)
    assert outcome.action == "undrained"
    assert scontrol.updates[-1] == ["scontrol", "update", "NodeName=gpu-node-1", "State=UNDRAIN"]
    assert scontrol.state == "IDLE" and scontrol.reason == ""


@pytest.mark.parametrize("state, reason", [
    ("IDLE+DRAIN", "hbm replacement ticket 4711"),  # an operator's drain
    ("DOWN+DRAIN", "vigil: xid 79 (fallen off the bus)"),  # the aggregator's own actuator
    ("DOWN", "Not responding"),
])
def test_another_reason_is_never_overwritten_nor_undrained(state: str, reason: str) -> None:
    scontrol = FakeScontrol(state, reason)
    assert apply_to_slurm(_report(EXIT_UNHEALTHY), run=scontrol).action == "left_alone"
    assert apply_to_slurm(_report(EXIT_HEALTHY), run=scontrol).action == "none"
    assert scontrol.updates == [] and (scontrol.state, scontrol.reason) == (state, reason)


def test_a_pass_on_a_node_in_service_changes_nothing() -> None:
    scontrol = FakeScontrol("ALLOCATED")
    assert apply_to_slurm(_report(EXIT_HEALTHY), run=scontrol).action == "none"
    assert scontrol.updates == []


def test_a_check_that_cannot_judge_never_calls_scontrol() -> None:
    scontrol = FakeScontrol("IDLE+DRAIN", "vigil check: old")
    assert apply_to_slurm(_report(EXIT_CANNOT_JUDGE), run=scontrol).action == "none"
    assert scontrol.calls == []


@pytest.mark.parametrize("error", [
    subprocess.CalledProcessError(1, ["scontrol", "-o", "show"], stderr="Invalid node name specified"),
    subprocess.TimeoutExpired(["scontrol"], 15.0),
    FileNotFoundError(2, "No such file or directory: 'scontrol'"),
])
def test_a_failing_scontrol_is_reported_never_raised(error: BaseException) -> None:
    outcome = apply_to_slurm(_report(EXIT_UNHEALTHY), run=FakeScontrol(fail=error))
    assert outcome.action == "failed" and outcome.detail


def test_scontrol_gets_what_is_left_of_one_total_deadline() -> None:
    now = [100.0]
    scontrol = FakeScontrol()

    def slow_show(argv: Sequence[str], timeout_seconds: float) -> str:
        out = scontrol(argv, timeout_seconds)
        now[0] += 12.0  # the show took 12 of the 15 seconds
        return out

    outcome = apply_to_slurm(_report(EXIT_UNHEALTHY), run=slow_show, clock=lambda: now[0], deadline_seconds=15.0)
    assert outcome.action == "drained" and scontrol.timeouts == [15.0, 3.0]
    now[0] += 100.0
    late = FakeScontrol()
    outcome = apply_to_slurm(_report(EXIT_UNHEALTHY), run=late, clock=iter([0.0, 20.0, 20.0]).__next__,
                             deadline_seconds=15.0)
    assert outcome.action == "failed" and late.calls == []


def test_a_long_reason_is_cut_to_one_short_line() -> None:
    reason = drain_reason(_report(EXIT_UNHEALTHY, "gpu_memory on GPU 0:\n" + "x=1 " * 100))
    assert reason.startswith("vigil check: gpu_memory on GPU 0: x:1") and reason.endswith("...")
    assert len(reason) <= 120 and "\n" not in reason and "=" not in reason


# --- the command line ---------------------------------------------------------------------------------

def test_baselines_come_alone_or_from_an_aggregator_config(tmp_path: Path) -> None:
    alone = tmp_path / "baselines.yaml"
    alone.write_text(yaml.safe_dump({"classes": {H100: {"gpu_compute": {"min_value": 600}}}}))
    inside = tmp_path / "aggregator.yaml"
    inside.write_text(yaml.safe_dump({"listen": ":9500", "probes": {"baselines": {
        "classes": {H100: {"gpu_compute": {"min_value": 600}}}}}}))
    (from_alone, digest), (from_inside, _) = load_baselines(str(alone)), load_baselines(str(inside))
    assert from_alone == from_inside
    assert from_alone.baseline(H100, "gpu_compute") == Baseline(min_value=600)
    assert digest == hashlib.sha256(alone.read_bytes()).hexdigest()
    assert load_baselines(None) == (ProbeBaselines(), None)


def _agent_yaml(tmp_path: Path, **extra: Any) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"node": "gpu-node-1", "nvml": {"backend": "fake"}, **extra}))
    return path


@pytest.mark.parametrize("args, why", [
    (["--probes", "collective"], "needs other nodes"),
    (["--probes", "nope"], "unknown probe"),
    (["--probes", ","], "no probe selected"),
    (["--node", "node[1-4]"], "a node name is a hostname"),
    (["--timeout", "0"], "--timeout 0"),
    (["--baselines", "/nonexistent/b.yaml"], "cannot read baselines /nonexistent/b.yaml"),
])
def test_usage_errors_exit_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             args: list[str], why: str) -> None:
    assert main(["check", "--config", str(_agent_yaml(tmp_path)), *args]) == EXIT_CANNOT_JUDGE
    err = capsys.readouterr().err
    assert err.startswith("vigil check: cannot judge:") and why in err


def test_a_bad_baselines_file_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "b.yaml"
    bad.write_text(yaml.safe_dump({"classes": {H100: {"gpu_compute": {"min_valu": 600}}}}))
    assert main(["check", "--config", str(_agent_yaml(tmp_path)), "--baselines", str(bad)]) == EXIT_CANNOT_JUDGE
    assert "min_valu" in capsys.readouterr().err


def test_the_command_prints_a_line_per_result_and_writes_the_report(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    demanded = tmp_path / "baselines.yaml"
    demanded.write_text(yaml.safe_dump({"default": {"dcgm_diag": {"max_metrics": {"failures": 0}}}}))
    out = tmp_path / "report.json"
    code = main(["check", "--config", str(_agent_yaml(tmp_path)), "--probes", "dcgm_diag",
                 "--baselines", str(demanded), "--json", str(out)])
    assert code == EXIT_UNHEALTHY
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL  dcgm_diag  unverified:")
    assert lines[-1].startswith("vigil check: gpu-node-1: unhealthy (1 result(s), 1 failure(s), class " + H100)
    report = json.loads(out.read_text())
    assert (report["outcome"], report["exit_code"], report["node"]) == ("unhealthy", 1, "gpu-node-1")
    assert report["results"][0]["verdict"]["reason"] == "unverified"
    assert report["drain"] is None and report["hardware_class"] == H100
    assert report["baselines_sha256"] == hashlib.sha256(demanded.read_bytes()).hexdigest()
    assert list(tmp_path.glob(".report.json.*")) == []  # written whole, by rename


def test_json_to_stdout_keeps_the_human_lines_on_stderr(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "vigil", "check", "--config", str(_agent_yaml(tmp_path)),
                           "--probes", "dcgm_diag", "--json", "-"], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_HEALTHY, done.stderr
    assert json.loads(done.stdout)["outcome"] == "healthy"
    assert "vigil check: gpu-node-1: healthy" in done.stderr
