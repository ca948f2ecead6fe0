"""The metric catalog is honest: every series the agent emits is declared, and every declared
metric is emitted on some shipped scenario or recorded input (so dashboards and rules built on the
declarations have something to show)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vigil.agent.amdsmi.backend import AmdSmiBackend
from vigil.agent.amdsmi.fake import FakeAmdSmi
from vigil.agent.attribution import IN_PROCESS
from vigil.agent.config import parse_config
from vigil.agent.daemon import Agent
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import ALL_PROFILES, SCENARIO_DIR, load_node_scenario
from vigil.agent.runner import collect_once
from vigil.contract.seams import Seams

FIXTURES = Path(__file__).parent.parent / "fixtures"
START = 1_700_000_000.0
# Declared metrics that no shipped scenario can produce, each with why and where it is tested.
NOT_ON_ANY_SCENARIO = {
    # Every profiled board (H100/H200/A100 SXM, V100 SXM2) is passively cooled: NVML raises
    # NotSupported for the fan, as nvidia-smi's "Fan Speed: N/A". tests/agent/collectors/test_gpu.py.
    "vigil_gpu_fan_speed_ratio",
    # MI300X, the one AMD board profiled, has no edge sensor (amd-smi "EDGE: N/A"). tests/agent/amdsmi/.
    "vigil_gpu_edge_temperature_celsius",
    # An OS read error of the kernel log itself. tests/agent/collectors/test_xid.py.
    "vigil_kernel_log_read_errors_total",
    # Needs an aggregator that accepts a report. tests/agent/test_reporter.py.
    "vigil_agent_last_report_success_timestamp_seconds",
    # Needs an aggregator token file (the scenarios' agents report nowhere). tests/vigil/test_credential_files.py.
    "vigil_agent_credential_file_exposed",
    # Counted by the runner's loop (these scenarios collect directly). tests/agent/test_kmsg_missing.py.
    "vigil_collector_failures_total",
}
# Kernel-log inputs that carry Xid, SXid, fallen-off-the-bus and mlx5 lines between them.
KERNEL_LOGS = (sorted((FIXTURES / "kernel-log").glob("*.log")) + sorted((FIXTURES / "kernel-log").glob("*.txt"))
               + sorted((FIXTURES / "kernel-log" / "amdgpu").glob("*.log")))


class Clock:
    def __init__(self) -> None:
        self.t = START

    def __call__(self) -> float:
        return self.t


def _truncate(path: Path) -> None:
    path.write_text("")


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def _names_emitted(agent: Agent, clock: Clock, times: list[float],
                   feed: list[tuple[float, Callable[..., object]]]) -> set[str]:
    names: set[str] = set()
    pending = sorted(feed, key=lambda f: f[0])
    for t in times:
        clock.t = START + t
        while pending and pending[0][0] <= t:
            _, action = pending.pop(0)
            action()
        for c in agent.collectors:
            agent.snapshot.put(c.name, collect_once(c, clock.t))
        for source in (agent.snapshot.samples, agent.runner.self_samples, agent.reporter.samples,
                       agent.heartbeats.samples, agent.connections.samples, agent.node_actions.samples):
            names.update(s.name for s in source())
    # NVML's Xid event worker waits in real time while this clock is fake: give it real time,
    # collecting again until nothing new has appeared for longer than its 0.5 s wait (bounded at 5 s).
    deadline = time.monotonic() + 5
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < 0.6:
        time.sleep(0.1)
        before = len(names)
        for c in agent.collectors:
            agent.snapshot.put(c.name, collect_once(c, clock.t))
        names.update(s.name for s in agent.snapshot.samples())
        if len(names) > before:
            quiet_since = time.monotonic()
    return names


@pytest.fixture(scope="module")
def emitted_and_declared(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], set[str]]:
    emitted: set[str] = set()
    declared: set[str] = set()
    scenarios = sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
    sysfs_trees = [FIXTURES / "sysfs" / "h100", FIXTURES / "sysfs" / "roce",
                   FIXTURES / "sysfs" / "node-exporter-infiniband", FIXTURES / "sysfs" / "hgx"]
    ethtool = (FIXTURES / "sysfs" / "ethtool-S-mlx5-ens1f0np0.txt").read_text()
    for i, scenario in enumerate(scenarios):
        tmp = tmp_path_factory.mktemp(scenario)
        kmsg = tmp / "kern.log"
        kmsg.write_text("")
        sysfs = tmp / "sys"
        shutil.copytree(sysfs_trees[i % len(sysfs_trees)], sysfs)
        megatron = tmp / "megatron.log"
        megatron.write_text("")
        config = parse_config({
            "node": "n1", "nvml": {"backend": "fake", "scenario": scenario},
            "collectors": {"gpu": {"xid_events": True, "nvlink_interval_seconds": 1},
                           "training": {"log_files": [{"path": str(megatron), "format": "megatron",
                                                       "job": "llm", "rank": 0}]}},
        })
        clock = Clock()
        backend: PynvmlBackend | AmdSmiBackend | None
        node = load_node_scenario(scenario)
        if ALL_PROFILES[node.profile].vendor == "amd":  # issue 46: an AMD board's scenario runs FakeAmdSmi
            backend = AmdSmiBackend(FakeAmdSmi(node, clock, start=START))
        else:
            backend = PynvmlBackend(FakeNvml(node, clock, start=START))
        try:
            backend.init()
        except Exception:  # noqa: BLE001 - the nvml-unavailable scenario: the agent runs without NVML
            backend = None
        seams = Seams(nvml=backend, clock=clock, kmsg=str(kmsg), sysfs_root=sysfs, state_dir=tmp,
                      run=lambda argv, timeout: ethtool, extra={"pid_alive": lambda pid: False})
        agent = Agent(config, seams)
        declared.update(agent.exporter.specs)
        training = next(c for c in agent.collectors if c.name == "training")
        feed: list[tuple[float, Callable[..., object]]] = [
            (2.0, lambda k=kmsg: k.write_text("".join(p.read_text() for p in KERNEL_LOGS))),
            (3.0, lambda m=megatron: m.write_text((FIXTURES / "training-logs" / "megatron.log").read_text())),
            (3.0, lambda t=training: t.ingest(b"not json", START + 3, IN_PROCESS)),  # counted as rejected
            # A truncated sysfs counter and a mangled NVRM line: counted under a reason, never fatal.
            (4.0, lambda root=sysfs: _truncate(next(root.glob("class/infiniband/*/ports/1/counters/symbol_error")))),
            # A truncated AER file and OFED version (hgx): counted by the pcie and node_config collectors.
            (4.0, lambda root=sysfs: [_truncate(p) for p in (*root.glob("bus/pci/devices/*/aer_dev_fatal"),
                                                              *root.glob("module/mlx5_core/version"))]),
            (4.0, lambda k=kmsg: _append(k, "NVRM: Xid (PCI:0000:zz:00): banana\n")),
        ]
        for step in range(5):
            hb = {"job": "llm", "rank": 1, "step": step, "step_seconds": 1.0, "compute_seconds": 0.7,
                  "comm_seconds": 0.25, "data_seconds": 0.05, "gpu": 1, "pid": 999_999,
                  "loss": 2.5 - step * 0.1, "grad_norm": "nan" if step == 3 else 0.8}
            feed.append((1.0 + step * 0.1,
                         lambda t=training, h=hb: t.ingest(json.dumps(h).encode(), START + 1, IN_PROCESS)))
        # An announced checkpoint of step 4, and the return to training that ends it.
        for at, phase in ((1.6, "checkpointing"), (1.8, "training")):
            hb = {"job": "llm", "rank": 1, "step": 4, "step_seconds": 0, "gpu": 1, "pid": 999_999, "phase": phase}
            feed.append((at, lambda t=training, h=hb, a=at: t.ingest(json.dumps(h).encode(), START + a, IN_PROCESS)))
        try:
            # 5: the training window [START, START + 5) holding the heartbeats is complete
            emitted |= _names_emitted(agent, clock, [0, 1, 2, 4, 5, 15, 45, 70, 100, 400, 1300], feed)
        finally:
            for c in agent.collectors:
                c.close()
    return emitted, declared


def test_every_emitted_metric_is_declared(emitted_and_declared: tuple[set[str], set[str]]) -> None:
    emitted, declared = emitted_and_declared
    assert emitted - declared == set()


def test_every_declared_metric_is_emitted_somewhere(emitted_and_declared: tuple[set[str], set[str]]) -> None:
    emitted, declared = emitted_and_declared
    assert declared - emitted == NOT_ON_ANY_SCENARIO
