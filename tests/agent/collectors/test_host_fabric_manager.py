"""The host collector's Fabric Manager liveness: asked of systemd through Seams.run only where Fabric
Manager must run (NVSwitches on the PCI bus, or the setting), on its own cadence and deadline; a read
that fails is "unknown" and counted, never "failed"."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.host import FABRIC_MANAGER_COMMAND, HostCollector, HostConfig
from vigil.agent.config import parse_config
from vigil.agent.metric import Sample
from vigil.contract.seams import Seams
from vigil.contract.validation import ConfigError
from vigil.sim import fabric

HGX = Path(__file__).parent.parent.parent / "fixtures" / "sysfs" / "hgx"
NVSWITCH = "0000:05:00.0"


class FakePs:
    """The psutil calls the host collector makes, answering fixed values."""

    def cpu_percent(self, interval: Any) -> float:
        return 12.5

    def getloadavg(self) -> tuple[float, float, float]:
        return (1.0, 1.0, 1.0)

    def virtual_memory(self) -> Any:
        return SimpleNamespace(total=100, available=60)

    def swap_memory(self) -> Any:
        return SimpleNamespace(used=0)

    def boot_time(self) -> float:
        return 0.0

    def cpu_count(self) -> int:
        return 4

    def disk_usage(self, path: str) -> Any:
        return SimpleNamespace(free=1, total=2)


class FakeSystemctl:
    """``Seams.run``: answers the Fabric Manager's state, or raises what the real runner raises."""

    def __init__(self, answer: str | BaseException = "active\n") -> None:
        self.answer = answer
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        self.calls.append((list(argv), timeout_seconds))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


@pytest.fixture
def hgx(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(HGX, root, symlinks=True)
    return root


def _collect(run: FakeSystemctl, sysfs: Path, now: float = 100.0, **config: Any) -> tuple[str | None, dict[str, float],
                                                                                           list[Sample]]:
    out = HostCollector(HostConfig(**config), ps=FakePs(), run=run, sysfs_root=sysfs).collect(now)
    states = {s.label("state") or "": s.value for s in out.samples if s.name == "vigil_fabric_manager_state"}
    return out.report["host"].fabric_manager_state, states, out.samples


def _read_errors(samples: list[Sample]) -> dict[str | None, float]:
    return {s.label("reason"): s.value for s in samples if s.name == "vigil_fabric_manager_read_errors_total"}


@pytest.mark.parametrize("state", ["active", "failed", "inactive", "activating", "deactivating"])
def test_nvswitch_node_reports_the_units_state(hgx: Path, state: str) -> None:
    run = FakeSystemctl(state + "\n")
    reported, states, samples = _collect(run, hgx)
    assert reported == state
    assert states == {s: float(s == state) for s in ("active", "activating", "deactivating", "inactive", "failed")}
    assert run.calls == [(list(FABRIC_MANAGER_COMMAND), 2.0)]  # the total deadline is the setting's
    assert _read_errors(samples) == {}


def test_without_nvswitches_fabric_manager_is_not_expected_and_not_asked(hgx: Path) -> None:
    # A PCIe-GPU node (no NVSwitch on its bus) has no Fabric Manager: a stopped unit there is no fault.
    shutil.rmtree(hgx / "bus/pci/devices" / NVSWITCH)
    run = FakeSystemctl("inactive\n")
    reported, states, _ = _collect(run, hgx)
    assert (reported, states, run.calls) == (None, {}, [])


def test_the_setting_overrides_auto(hgx: Path, tmp_path: Path) -> None:
    run = FakeSystemctl("failed\n")
    assert _collect(run, hgx, fabric_manager=False)[:2] == (None, {})
    assert run.calls == []
    assert _collect(run, tmp_path / "empty", fabric_manager=True)[0] == "failed"


@pytest.mark.parametrize(("error", "reason"), [
    (subprocess.TimeoutExpired(list(FABRIC_MANAGER_COMMAND), 2.0), "timeout"),
    (subprocess.CalledProcessError(1, list(FABRIC_MANAGER_COMMAND)), "exit_status"),  # no systemd in a container
    (FileNotFoundError(2, "No such file or directory", "systemctl"), "not_found"),
    (PermissionError(13, "Permission denied"), "unreadable"),
    ("System has not been booted with systemd\n", "malformed"),
    ("", "malformed"),
])
def test_a_read_that_fails_is_unknown_and_counted_never_failed(hgx: Path, error: Any, reason: str) -> None:
    reported, states, samples = _collect(FakeSystemctl(error), hgx)
    assert reported == "unknown"
    assert states == dict.fromkeys(("active", "activating", "deactivating", "inactive", "failed"), 0.0)
    assert _read_errors(samples) == {reason: 1}


def test_systemd_states_outside_the_five_are_reported_as_systemd_names_them(hgx: Path) -> None:
    reported, states, samples = _collect(FakeSystemctl("reloading\n"), hgx)
    assert reported == "reloading" and set(states.values()) == {0.0} and _read_errors(samples) == {}


def test_asked_once_per_interval_and_the_state_kept_between(hgx: Path) -> None:
    run = FakeSystemctl("active\n")
    collector = HostCollector(HostConfig(), ps=FakePs(), run=run, sysfs_root=hgx)
    assert collector.collect(100.0).report["host"].fabric_manager_state == "active"
    run.answer = "failed\n"
    assert collector.collect(105.0).report["host"].fabric_manager_state == "active"
    assert len(run.calls) == 1
    assert collector.collect(130.0).report["host"].fabric_manager_state == "failed"
    assert len(run.calls) == 2


def test_nvswitches_found_later_make_it_expected(hgx: Path) -> None:
    # Early in boot sysfs may not show the switches yet: auto looks again at each check until it does.
    moved = hgx.parent / "nvswitch"
    shutil.move(hgx / "bus/pci/devices" / NVSWITCH, moved)
    run = FakeSystemctl("active\n")
    collector = HostCollector(HostConfig(), ps=FakePs(), run=run, sysfs_root=hgx)
    assert collector.collect(100.0).report["host"].fabric_manager_state is None
    shutil.move(moved, hgx / "bus/pci/devices" / NVSWITCH)
    assert collector.collect(130.0).report["host"].fabric_manager_state == "active"


def test_deadline_must_fit_inside_the_cycle() -> None:
    with pytest.raises(ConfigError, match="fabric_manager_timeout_seconds"):
        parse_config({"collectors": {"host": {"fabric_manager_timeout_seconds": 5}}})
    assert parse_config({"collectors": {"host": {"fabric_manager": True}}}).collectors.host.fabric_manager is True


def test_no_kernel_in_host_facts_or_host_series(hgx: Path) -> None:
    # The kernel is NodeConfig's (vigil_node_config_info): one owner.
    _, _, samples = _collect(FakeSystemctl(), hgx)
    assert not any(s.name == "vigil_host_info" for s in samples)


def test_the_simulators_commands_drive_the_state(tmp_path: Path) -> None:
    root = fabric.build_tree(tmp_path / "sys", 2, gpu_bus_ids=("00000000:19:00.0",), nvswitches=4)
    node = fabric.NodeFabric(root, gpu_bus_ids=("00000000:19:00.0",), nvswitches=4)
    collector = REGISTRY["host"](parse_config({}), Seams(sysfs_root=root, run=fabric.Ethtool(node, 2)))
    assert collector.collect(100.0).report["host"].fabric_manager_state == "active"
    node.set_fabric_manager("failed")
    assert collector.collect(200.0).report["host"].fabric_manager_state == "failed"
    node.reset(2, "InfiniBand")  # a reboot starts it again
    assert collector.collect(300.0).report["host"].fabric_manager_state == "active"
    # A node without NVSwitches in the simulator: not expected, nothing asked.
    plain = fabric.build_tree(tmp_path / "plain", 2, gpu_bus_ids=("00000000:19:00.0",))
    collector = REGISTRY["host"](parse_config({}), Seams(sysfs_root=plain, run=fabric.Ethtool(None, 2)))
    assert collector.collect(100.0).report["host"].fabric_manager_state is None
