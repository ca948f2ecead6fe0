"""run_probes through the real NodeActionRunner: allowed only when node_actions.allow lists it;
refused ``busy`` while a compute process holds a GPU unless every probe named is non-intrusive and
in probes.allow_with_job; the probes run in the table's order within probes.run_timeout_seconds
(an overrunning probe is reported timed out and the rest skipped); a probe that raises is an error,
not a crash; the result is signed, bound to the request, node and boot; a probe the wire does not
know cannot even be named."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from vigil.agent.config import parse_config
from vigil.agent.node_action_runner import NodeActionRunner, NodeActionsConfig, ProbeWorld
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import NodeScenario
from vigil.agent.probes import PROBES, ProbeSpec
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.contract.node_actions import node_key, result_signature_ok, sign
from vigil.contract.validation import ConfigError
from vigil.contract.wire import NodeActionRequest, ProbeResult, convert, replace

START = 1_700_000_000.0
NODE = "gpu-node-7"
BOOT = "0123456789abcdef-00c0ffee"
KEY = node_key(b"site node-action master key 0123456789", NODE)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Probe:
    """A probe function the test controls: records its context, returns a pass (or raises, or
    blocks until released)."""

    def __init__(self, name: str, *, raises: BaseException | None = None, block: bool = False) -> None:
        self.name, self.raises, self.block = name, raises, block
        self.contexts: list[ProbeContext] = []
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, ctx: ProbeContext) -> list[ProbeResult]:
        self.contexts.append(ctx)
        self.entered.set()
        if self.block:
            self.release.wait(30)
        if self.raises is not None:
            raise self.raises
        return [ProbeResult(probe=self.name, status="pass", reason="ok", value=1.0, unit="u")]  # type: ignore[arg-type]


class World:
    """A node of 4 fake GPUs, a runner with run_probes allowed and a probe table of fakes
    (``gpu_memory`` made non-intrusive here to stand for a non-intrusive probe)."""

    def __init__(self, tmp_path: Path, *, allow_with_job: Sequence[str] = (), timeout: float = 60.0,
                 engine: object = "engine", **probes: Probe) -> None:
        self.clock = Clock(START)
        self.fake = FakeNvml(NodeScenario.model_validate({"gpus": 4}), self.clock, start=START)
        self.backend = PynvmlBackend(self.fake)  # type: ignore[arg-type]
        self.backend.init()
        key_file = tmp_path / "node.key"
        key_file.write_text(KEY.hex())
        self.probes = {name: Probe(name) for name in PROBES} | probes
        table = {name: ProbeSpec(spec.description, name != "gpu_memory", spec.needs_group, spec.quick, spec.unit,
                                 self.probes[name]) for name, spec in PROBES.items()}
        world = ProbeWorld(config=ProbesConfig(run_timeout_seconds=timeout, allow_with_job=list(allow_with_job)),
                           engine=engine, table=table)  # type: ignore[arg-type]
        self.runner = NodeActionRunner(NodeActionsConfig(allow=["run_probes"], key_file=str(key_file)), node=NODE,
                                       boot_id=BOOT, nvml=self.backend, clock=self.clock, probes=world)

    def request(self, probes: Sequence[str], key: bytes = KEY, **changes: object) -> NodeActionRequest:
        base: dict[str, object] = {"id": "p-1", "action": "run_probes", "node": NODE, "boot_id": BOOT,
                                   "issued_at": START - 5, "expires_at": START + 300, "probes": list(probes)}
        return sign(convert({**base, **changes}, NodeActionRequest), key)

    def count(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.runner.samples()
                   if s.name == name and all(s.label(k) == v for k, v in labels.items()))


def test_probes_run_in_the_tables_order_and_the_result_is_signed_and_bound(tmp_path: Path) -> None:
    world = World(tmp_path)
    result = world.runner.handle(world.request(["gpu_memory", "gpu_compute"], quick=True))
    assert (result.outcome, result.reason, result.node, result.boot_id, result.id) == \
        ("done", "done", NODE, BOOT, "p-1")
    assert [r.probe for r in result.probes] == ["gpu_compute", "gpu_memory"]  # PROBES' order, not the request's
    assert result_signature_ok(result, KEY)
    assert not result_signature_ok(replace(result, probes=[msgspec.structs.replace(result.probes[0], value=99.0)]), KEY)
    assert not result_signature_ok(replace(result, id="p-2"), KEY)  # bound to the request id
    assert not result_signature_ok(result, node_key(b"another master key", NODE))
    ctx = world.probes["gpu_compute"].contexts[0]
    assert (ctx.gpus, ctx.quick, ctx.engine) == ([0, 1, 2, 3], True, "engine")
    assert world.probes["dcgm_diag"].contexts == []  # not asked for: not run
    assert world.count("vigil_agent_probe_runs_total", probe="gpu_compute", status="pass") == 1
    assert world.count("vigil_agent_probe_seconds", probe="gpu_compute") >= 0


def test_an_intrusive_probe_is_refused_busy_while_a_job_holds_any_gpu(tmp_path: Path) -> None:
    world = World(tmp_path, allow_with_job=["gpu_memory"])
    world.fake.running_pids[3] = [4242]
    result = world.runner.handle(world.request(["gpu_compute", "gpu_memory"]))
    assert (result.outcome, result.reason) == ("refused", "busy")
    assert "gpu_compute" in result.detail and "4242" in result.detail
    assert world.probes["gpu_compute"].contexts == [] and world.probes["gpu_memory"].contexts == []
    assert result_signature_ok(result, KEY)  # a refusal is signed too: the aggregator can trust the reason
    # Transient: the same request runs once the job has ended.
    world.fake.running_pids.pop(3)
    assert world.runner.handle(world.request(["gpu_compute", "gpu_memory"])).outcome == "done"


def test_a_non_intrusive_probe_runs_beside_a_job_only_where_allow_with_job_lists_it(tmp_path: Path) -> None:
    listed = World(tmp_path, allow_with_job=["gpu_memory"])
    listed.fake.running_pids[0] = [77]
    assert listed.runner.handle(listed.request(["gpu_memory"])).outcome == "done"
    unlisted = World(tmp_path)  # the lookalike: the same non-intrusive probe, not listed
    unlisted.fake.running_pids[0] = [77]
    result = unlisted.runner.handle(unlisted.request(["gpu_memory"]))
    assert (result.outcome, result.reason) == ("refused", "busy")
    assert unlisted.probes["gpu_memory"].contexts == []


def test_an_overrunning_probe_is_timed_out_and_the_rest_skipped_and_no_new_run_starts_while_it_lives(
        tmp_path: Path) -> None:
    stuck = Probe("gpu_memory", block=True)
    world = World(tmp_path, timeout=0.2, gpu_memory=stuck)
    result = world.runner.handle(world.request(["gpu_memory", "gpu_p2p", "dcgm_diag"]))
    assert result.outcome == "done"
    assert [(r.probe, r.status, r.reason) for r in result.probes] == [
        ("gpu_memory", "error", "timeout"), ("gpu_p2p", "skipped", "run_timeout"),
        ("dcgm_diag", "skipped", "run_timeout")]
    assert world.probes["gpu_p2p"].contexts == []
    assert world.count("vigil_agent_probe_runs_total", probe="gpu_memory", status="error") == 1
    busy = world.runner.handle(world.request(["gpu_p2p"], id="p-2"))
    assert (busy.outcome, busy.reason) == ("refused", "probe_running")
    stuck.release.set()
    for thread in threading.enumerate():
        if thread.name == "vigil-probe-gpu_memory":
            thread.join(10)
    assert world.runner.handle(world.request(["gpu_p2p"], id="p-2")).outcome == "done"


def test_a_probe_that_raises_is_an_error_with_its_text_and_the_run_goes_on(tmp_path: Path) -> None:
    crash = RuntimeError("CUDA error: an illegal memory access")
    world = World(tmp_path, gpu_compute=Probe("gpu_compute", raises=crash))
    result = world.runner.handle(world.request(["gpu_compute", "gpu_memory"]))
    assert [(r.probe, r.status, r.reason) for r in result.probes] == [
        ("gpu_compute", "error", "crashed"), ("gpu_memory", "pass", "ok")]
    assert "illegal memory access" in result.probes[0].detail


def test_without_an_engine_the_gpu_probes_are_skipped_no_engine(tmp_path: Path) -> None:
    world = World(tmp_path, engine=None)
    result = world.runner.handle(world.request(["gpu_compute", "dcgm_diag"]))
    assert [(r.probe, r.status, r.reason) for r in result.probes] == [
        ("gpu_compute", "skipped", "no_engine"), ("dcgm_diag", "pass", "ok")]
    assert world.probes["gpu_compute"].contexts == []


def test_a_result_outside_the_wires_bounds_is_reported_invalid_not_sent(tmp_path: Path) -> None:
    class TooMany(Probe):
        def __call__(self, ctx: ProbeContext) -> list[ProbeResult]:
            return [ProbeResult(probe="gpu_p2p", status="pass", metrics={f"m{i}": 1.0 for i in range(40)})]

    world = World(tmp_path, gpu_p2p=TooMany("gpu_p2p"))
    [result] = world.runner.handle(world.request(["gpu_p2p"])).probes
    assert (result.status, result.reason) == ("error", "invalid_result")


def test_a_group_probe_without_a_group_and_an_empty_list_are_refused(tmp_path: Path) -> None:
    world = World(tmp_path)
    assert world.runner.handle(world.request(["collective"])).reason == "bad_request"
    assert world.runner.handle(world.request([], id="p-3")).reason == "bad_request"
    assert world.probes["collective"].contexts == []


def test_run_probes_is_refused_unless_allowed_and_a_forged_request_runs_nothing(tmp_path: Path) -> None:
    world = World(tmp_path)
    forged = world.runner.handle(world.request(["gpu_compute"], key=node_key(b"not the site's key", NODE)))
    assert (forged.outcome, forged.reason, forged.signature) == ("refused", "bad_signature", "")
    off = NodeActionRunner(NodeActionsConfig(allow=["reset_gpu"], key_file=str(tmp_path / "node.key")), node=NODE,
                           boot_id=BOOT, nvml=world.backend, clock=world.clock)
    assert off.handle(world.request(["gpu_compute"])).reason == "not_allowed"
    assert world.probes["gpu_compute"].contexts == []


def test_a_probe_the_wire_does_not_know_cannot_be_named() -> None:
    body = {"id": "p-1", "action": "run_probes", "node": NODE, "boot_id": BOOT, "issued_at": START,
            "expires_at": START + 60, "probes": ["rm_rf"]}
    with pytest.raises(msgspec.ValidationError, match="probes"):
        convert(body, NodeActionRequest)
    with pytest.raises(msgspec.ValidationError):
        convert({**body, "probes": ["gpu_compute", "gpu_compute"]}, NodeActionRequest)


def test_the_probes_config_section() -> None:
    config = parse_config({"probes": {"run_timeout_seconds": 120, "rdma_min_line_rate_ratio": 0.85}})
    assert (config.probes.run_timeout_seconds, config.probes.rdma_min_line_rate_ratio) == (120, 0.85)
    assert parse_config({}).probes.allow_with_job == []
    with pytest.raises(ConfigError, match="gpu_compute is intrusive"):
        parse_config({"probes": {"allow_with_job": ["gpu_compute"]}})
    with pytest.raises(ConfigError, match=r"probes\.run_timeout_seconds"):
        parse_config({"probes": {"run_timeout_seconds": 0}})
    with pytest.raises(ConfigError, match=r"probes\.burn_pases"):
        parse_config({"probes": {"burn_pases": 3}})
