"""agent/node_action_runner.py: each check refuses with its reason and runs nothing; a GPU reset
goes through the real backend to the fake's nvidia-smi and leaves the fake GPU healthy; a reboot
request writes the sentinel; a repeated id gets its first result without running again."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from vigil.agent.config import parse_config
from vigil.agent.node_action_runner import CLOCK_SKEW_SECONDS, NodeActionRunner, NodeActionsConfig, read_node_key
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import NodeScenario
from vigil.contract.node_actions import node_key, sign
from vigil.contract.validation import ConfigError
from vigil.contract.wire import NodeActionRequest, convert

START = 1_700_000_000.0
NODE = "gpu-node-7"
BOOT = "0123456789abcdef-00c0ffee"
MASTER = b"site node-action master key 0123456789"
KEY = node_key(MASTER, NODE)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class World:
    """A node of 4 fake H100s (GPU 2 needs a reset from t=10 s) and its runner."""

    def __init__(self, tmp_path: Path, *, allow: Sequence[str] = ("reset_gpu", "request_reboot"),
                 key: bytes | None = KEY, run: object = None) -> None:
        self.clock = Clock(START)
        scenario = NodeScenario.model_validate(
            {"gpus": 4, "faults": [{"kind": "reset_required", "gpu": 2, "at_seconds": 10}]})
        self.fake = FakeNvml(scenario, self.clock, start=START)
        self.backend = PynvmlBackend(self.fake, run=run)  # type: ignore[arg-type]
        self.backend.init()
        for index in range(4):
            self.backend.identity(index)  # as the GPU collector does at start
        key_file = None
        if key is not None:
            key_file = tmp_path / "node.key"
            key_file.write_text(key.hex() + "\n")
        self.sentinel = tmp_path / "reboot-required"
        self.config = NodeActionsConfig(allow=list(allow), key_file=str(key_file) if key_file else None,
                                        reboot_sentinel_path=str(self.sentinel))
        self.runner = NodeActionRunner(self.config, node=NODE, boot_id=BOOT, nvml=self.backend, clock=self.clock)

    def request(self, key: bytes = KEY, **changes: object) -> NodeActionRequest:
        base: dict[str, object] = {"id": "d-1", "action": "reset_gpu", "node": NODE, "boot_id": BOOT, "gpu": 2,
                                   "gpu_uuid": self.fake.handles[2].uuid, "issued_at": self.clock.t - 5,
                                   "expires_at": self.clock.t + 300, "reason": "xid 79"}
        return sign(convert({**base, **changes}, NodeActionRequest), key)

    def count(self, **labels: str) -> float:
        return sum(s.value for s in self.runner.samples() if all(s.label(k) == v for k, v in labels.items()))


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_reset_of_an_idle_gpu_is_done_and_the_gpu_healthy_again(world: World) -> None:
    world.clock.t = START + 20
    assert world.backend.read(2).health == "reset_required"
    result = world.runner.handle(world.request())
    assert (result.outcome, result.reason, result.gpu, result.id) == ("done", "done", 2, "d-1")
    assert "successfully reset" in result.detail
    assert world.fake.resets == [(2, 20.0)]
    assert world.backend.read(2).health == "ok"
    assert world.count(action="reset_gpu", outcome="done", reason="done") == 1


def test_a_busy_gpu_is_refused_with_its_pids_and_not_reset(world: World) -> None:
    world.fake.running_pids[1] = [4242, 77]
    result = world.runner.handle(world.request(gpu=1, gpu_uuid=world.fake.handles[1].uuid))
    assert (result.outcome, result.reason) == ("refused", "busy")
    assert "77, 4242" in result.detail
    assert world.fake.resets == [] and world.fake.running_pids[1] == [4242, 77]
    assert world.count(action="reset_gpu", outcome="refused", reason="busy") == 1


def test_a_busy_refusal_is_not_remembered_so_the_same_request_runs_once_the_gpu_is_free(world: World) -> None:
    world.fake.running_pids[1] = [4242]
    request = world.request(gpu=1, gpu_uuid=world.fake.handles[1].uuid)
    assert world.runner.handle(request).reason == "busy"
    assert world.runner.handle(request).reason == "busy"  # still busy: checked again, not replayed
    world.fake.running_pids.pop(1)
    assert (world.runner.handle(request).outcome, world.fake.resets) == ("done", [(1, 0.0)])
    assert world.runner.handle(request).outcome == "done"  # now final: replayed, not reset twice
    assert len(world.fake.resets) == 1
    assert world.count(action="reset_gpu", outcome="refused", reason="busy") == 2


def test_a_faulted_gpu_nvml_cannot_list_is_left_to_nvidia_smi_which_refuses_a_held_one(world: World) -> None:
    world.clock.t = START + 20
    world.fake.running_pids[2] = [999]  # NVML cannot say (reset required); nvidia-smi can
    result = world.runner.handle(world.request())
    assert (result.outcome, result.reason) == ("refused", "busy")  # transient: asked again later
    assert "in use by another process" in result.detail
    assert world.fake.resets == []


def test_request_reboot_writes_the_sentinel(world: World) -> None:
    result = world.runner.handle(world.request(action="request_reboot", gpu=None, gpu_uuid=None, id="d-9"))
    assert (result.outcome, result.reason) == ("done", "done")
    assert world.sentinel.read_text().startswith("vigil node action d-9: xid 79")
    assert [p.name for p in world.sentinel.parent.iterdir() if p.name.startswith(".reboot")] == []


def test_a_sentinel_that_cannot_be_written_is_a_failure(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.config = w.config.model_copy(update={"reboot_sentinel_path": str(tmp_path / "missing-dir" / "x")})
    runner = NodeActionRunner(w.config, node=NODE, boot_id=BOOT, nvml=w.backend, clock=w.clock)
    result = runner.handle(w.request(action="request_reboot", gpu=None, gpu_uuid=None))
    assert (result.outcome, result.reason) == ("failed", "write_failed")


def test_a_repeated_id_gets_its_first_result_and_nothing_runs_again(world: World) -> None:
    world.clock.t = START + 20
    first = world.runner.handle(world.request())
    world.clock.t = START + 400  # expired by now: the repeat is answered from memory, not re-checked
    world.fake.handles[2].reset_required_at = START  # would need a reset again
    again = world.runner.handle(world.request())
    assert again == first and len(world.fake.resets) == 1
    assert world.count(action="reset_gpu", outcome="repeat", reason="done") == 1


def test_a_forged_request_cannot_claim_an_id(world: World) -> None:
    forged = world.runner.handle(world.request(key=b"x" * 32))
    assert forged.reason == "bad_signature"
    world.clock.t = START + 20
    assert world.runner.handle(world.request()).outcome == "done"


@pytest.mark.parametrize(("change", "reason"), [
    ({"action": "request_reboot", "gpu": None, "gpu_uuid": None}, "not_allowed"),
    ({"node": "gpu-node-8"}, "wrong_node"),
    ({"boot_id": "ffffffffffffffff-00000000"}, "stale_boot"),
    ({"expires_at": START - 1}, "expired"),
    ({"issued_at": START + 20 + CLOCK_SKEW_SECONDS + 1}, "expired"),  # issued too far ahead
    ({"key": node_key(MASTER, "gpu-node-8")}, "bad_signature"),
    ({"gpu": 7, "gpu_uuid": "GPU-x"}, "unknown_gpu"),
    ({"gpu_uuid": "GPU-00000000-0000-0000-0000-000000000000"}, "unknown_gpu"),
    ({"gpu": None, "gpu_uuid": None}, "unknown_gpu"),
])
def test_each_check_refuses_with_its_reason_and_runs_nothing(tmp_path: Path, change: dict[str, object],
                                                             reason: str) -> None:
    w = World(tmp_path, allow=("reset_gpu",))
    w.clock.t = START + 20
    change = dict(change)
    key = change.pop("key", KEY)
    result = w.runner.handle(w.request(key=key, **change))  # type: ignore[arg-type]
    assert (result.outcome, result.reason) == ("refused", reason), result.detail
    assert w.fake.resets == [] and not w.sentinel.exists()
    assert w.count(outcome="refused", reason=reason) == 1


def test_skew_tolerance_admits_a_request_issued_just_ahead(world: World) -> None:
    assert world.runner.handle(world.request(issued_at=START + CLOCK_SKEW_SECONDS - 1)).reason != "expired"


def test_without_a_key_nothing_is_allowed(tmp_path: Path) -> None:
    w = World(tmp_path, key=None, allow=())
    w.runner = NodeActionRunner(NodeActionsConfig.model_construct(allow=["reset_gpu"], key_file=None,
                                                                  reset_timeout_seconds=60.0,
                                                                  reboot_sentinel_path=str(w.sentinel)),
                                node=NODE, boot_id=BOOT, nvml=w.backend, clock=w.clock)
    result = w.runner.handle(w.request())
    assert (result.outcome, result.reason) == ("refused", "not_allowed") and "key_file" in result.detail


def test_a_failing_reset_command_is_reported_with_its_error(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def run(argv: Sequence[str], timeout_seconds: float) -> str:
        calls.append([*argv, str(timeout_seconds)])
        raise subprocess.CalledProcessError(3, list(argv), output="", stderr="Insufficient Permissions")

    w = World(tmp_path, run=run)
    result = w.runner.handle(w.request(gpu=0, gpu_uuid=w.fake.handles[0].uuid))
    assert (result.outcome, result.reason) == ("failed", "command_failed")
    assert "Insufficient Permissions" in result.detail
    assert calls == [["nvidia-smi", "--gpu-reset", "-i", w.fake.handles[0].pci_bus_id, "60.0"]]
    assert w.count(action="reset_gpu", outcome="failed", reason="command_failed") == 1


def test_a_reset_that_times_out_is_a_failure(tmp_path: Path) -> None:
    def run(argv: Sequence[str], timeout_seconds: float) -> str:
        raise subprocess.TimeoutExpired(list(argv), timeout_seconds)

    w = World(tmp_path, run=run)
    result = w.runner.handle(w.request(gpu=0, gpu_uuid=w.fake.handles[0].uuid))
    assert result.outcome == "failed" and "did not finish in 60.0 s" in result.detail


def test_config_is_off_by_default_and_allow_needs_a_key(tmp_path: Path) -> None:
    assert parse_config({}).node_actions.allow == []
    with pytest.raises(ConfigError, match="key_file"):
        parse_config({"node_actions": {"allow": ["reset_gpu"]}})
    with pytest.raises(ConfigError, match=r"node_actions\.allow"):
        parse_config({"node_actions": {"allow": ["format_disk"], "key_file": "/k"}})
    with pytest.raises(ConfigError, match="absolute"):
        parse_config({"node_actions": {"reboot_sentinel_path": "reboot-required"}})
    bad = tmp_path / "bad.key"
    bad.write_text("not hex")
    with pytest.raises(ValueError, match="64 hex characters"):
        read_node_key(bad)
