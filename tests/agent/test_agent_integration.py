"""The whole agent in one process on a fake clock: every collector over its real code path (NVML
through PynvmlBackend over FakeNvml, the kernel log from a file, sysfs from the recorded H100
tree), rendered by the real exporter. What an operator checks in /metrics is asserted here."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vigil.agent.config import parse_config
from vigil.agent.daemon import Agent
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.agent.runner import collect_once
from vigil.contract.seams import Seams

FIXTURES = Path(__file__).parent.parent / "fixtures"
GOLDEN = FIXTURES / "golden" / "healthy-h100.prom"
START = 1_700_000_000.0


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_agent(tmp_path: Path, scenario: str, clock: FakeClock, sysfs: Path | None = None) -> Agent:
    kmsg = tmp_path / "kmsg.log"
    kmsg.touch()
    config = parse_config({
        "node": "gpu-node-17",
        "nvml": {"backend": "fake", "scenario": scenario},
        "collectors": {"gpu": {"xid_events": False}},
    })
    backend = PynvmlBackend(FakeNvml(load_node_scenario(scenario), clock, start=START))
    backend.init()
    seams = Seams(nvml=backend, clock=clock, kmsg=str(kmsg), sysfs_root=sysfs or tmp_path / "no-sysfs",
                  state_dir=tmp_path)
    return Agent(config, seams)


def scrape(agent: Agent, now: float) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    for c in agent.collectors:
        agent.snapshot.put(c.name, collect_once(c, now))
    text = agent.render_metrics().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict, name: str, **labels: str) -> float | None:
    want = set(labels.items())
    found = [v for (n, ls), v in metrics.items() if n == name and want <= set(ls)]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} series"
    return found[0] if found else None


@pytest.fixture
def agent_faults(tmp_path: Path) -> Iterator[tuple[Agent, FakeClock]]:
    clock = FakeClock(START)
    agent = make_agent(tmp_path, "faults-h100", clock)
    yield agent, clock
    for c in agent.collectors:
        c.close()


def test_faults_show_in_metrics_at_their_scripted_times(agent_faults: tuple[Agent, FakeClock]) -> None:
    agent, clock = agent_faults
    before = scrape(agent, clock.t + 5)
    clock.t = START + 5
    before = scrape(agent, clock.t)
    assert value(before, "vigil_gpu_ecc_errors_total", gpu="1", error_type="corrected", counter="volatile") == 0
    assert value(before, "vigil_gpu_health", gpu="7", state="ok") == 1
    assert value(before, "vigil_gpu_row_remap_pending", gpu="4") == 0
    thermal_before = value(before, "vigil_gpu_clock_event_active", gpu="2", reason="hw_thermal_slowdown")
    assert thermal_before == 0

    clock.t = START + 35
    mid = scrape(agent, clock.t)
    assert (value(mid, "vigil_gpu_ecc_errors_total", gpu="1", error_type="corrected", counter="volatile") or 0) > 0
    assert value(mid, "vigil_gpu_clock_event_active", gpu="2", reason="hw_thermal_slowdown") == 1
    sm2 = value(mid, "vigil_gpu_sm_clock_hertz", gpu="2")
    sm0 = value(mid, "vigil_gpu_sm_clock_hertz", gpu="0")
    assert sm2 is not None and sm0 is not None and sm2 < sm0  # throttled GPU runs slower
    assert (value(mid, "vigil_gpu_nvlink_errors_total", gpu="3", link="4", error_type="crc") or 0) > 0

    clock.t = START + 100
    late = scrape(agent, clock.t)
    assert value(late, "vigil_gpu_row_remap_pending", gpu="4") == 1
    assert value(late, "vigil_gpu_nvlink_state", gpu="6", link="9") == 0
    # GPU 7 fell off the bus: it says so, and the other seven keep reporting.
    assert value(late, "vigil_gpu_health", gpu="7", state="lost") == 1
    assert value(late, "vigil_gpu_health", gpu="7", state="ok") == 0
    for g in range(7):
        assert value(late, "vigil_gpu_health", gpu=str(g), state="ok") == 1
        assert value(late, "vigil_gpu_temperature_celsius", gpu=str(g)) is not None
    assert value(late, "vigil_gpu_temperature_celsius", gpu="7") is None  # absent, never 0
    report = agent.reporter.next_report()[0]
    lost = [g for g in report.gpus if g.health == "lost"]
    assert [g.index for g in lost] == [7]


def test_kernel_log_line_moves_the_xid_counter(agent_faults: tuple[Agent, FakeClock], tmp_path: Path) -> None:
    agent, clock = agent_faults
    before = scrape(agent, clock.t)
    zeros = {ls: v for (n, ls), v in before.items() if n == "vigil_gpu_xid_errors_total"}
    assert len(zeros) == 8 * 32 and set(zeros.values()) == {0.0}  # the paged codes start at 0 per GPU
    with open(tmp_path / "kmsg.log", "a") as f:
        f.write("[ 1234.567890] NVRM: Xid (PCI:0000:19:00): 79, pid='<unknown>', name=<unknown>, "
                "GPU has fallen off the bus.\n")
    clock.t += 1
    m = scrape(agent, clock.t)
    hits = {ls: v for (n, ls), v in m.items() if n == "vigil_gpu_xid_errors_total" and v}
    assert list(hits.values()) == [1.0]
    assert hits.keys() <= zeros.keys()  # the series that was at 0: increase() reads 1
    labels = dict(next(iter(hits)))
    assert labels["code"] == "79" and labels["gpu"] == "0"  # 0000:19:00 is GPU 0 of the H100 profile


def _render_normalised(agent: Agent, now: float) -> str:
    """The exposition minus what varies by machine or run (host facts, timings)."""
    for c in agent.collectors:
        agent.snapshot.put(c.name, collect_once(c, now))
    keep = []
    for line in agent.render_metrics().decode().splitlines():
        # build_info: per release; node_config_info: the machine's kernel and rdma-core.
        if re.search(r"vigil_host_|vigil_collector_duration_seconds|vigil_build_info|vigil_node_config_info", line):
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def test_golden_exposition_of_a_healthy_h100_node(tmp_path: Path) -> None:
    clock = FakeClock(START + 30)
    agent = make_agent(tmp_path, "healthy-h100", clock, sysfs=FIXTURES / "sysfs" / "h100")
    try:
        _render_normalised(agent, clock.t)  # first cycle: counters get their baselines
        clock.t += 1
        text = _render_normalised(agent, clock.t)
    finally:
        for c in agent.collectors:
            c.close()
    if os.environ.get("VIGIL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "exposition changed: review, then rerun with VIGIL_UPDATE_GOLDEN=1"
    for family in ("vigil_gpu_info", "vigil_gpu_power_watts", "vigil_gpu_clock_event_active",
                   "vigil_gpu_ecc_errors_total", "vigil_gpu_remapped_rows_total", "vigil_gpu_nvlink_errors_total",
                   "vigil_gpu_pcie_replay_total", "vigil_gpu_energy_joules_total", "vigil_rdma_port_state"):
        assert f"\n{family}" in text, family


@pytest.mark.external
def test_golden_exposition_passes_promtool() -> None:
    if not any((Path(d) / "promtool").exists() for d in os.environ.get("PATH", "").split(":")):
        pytest.skip("promtool not installed (Debian package prometheus)")
    done = subprocess.run(["promtool", "check", "metrics"], input=GOLDEN.read_text(), capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
