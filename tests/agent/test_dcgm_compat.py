"""dcgm-exporter compatibility: the DCGM_FI_DEV_* series rendered from a real GPU collector run
(FakeNvml H100 scenarios) match dcgm-exporter's recorded scrape in names, types, help and labels,
and carry dcgm-exporter's units."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vigil.agent.collectors.gpu import GpuCollector, GpuConfig
from vigil.agent.collectors.xid import XID_ERRORS
from vigil.agent.dcgm_compat import LABELS, DcgmCompatCollector
from vigil.agent.metric import Sample
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter"
# Labels dcgm-exporter adds only with Kubernetes pod mapping on (the recorded scrape has it).
POD_LABELS = {"container", "namespace", "pod", "pod_uid"}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Family:
    type: str = "untyped"
    help: str = ""
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, Family]:
    """The text exposition as Prometheus reads it: series names exactly as written (prometheus-client's
    own parser renames counter series to `<name>_total`, which is not what Prometheus stores)."""
    out: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            out.setdefault(name, Family()).help = help_
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            out.setdefault(name, Family()).type = kind
        elif line and not line.startswith("#"):
            m = _SAMPLE_RE.match(line)
            assert m, line
            labels = dict(_LABEL_RE.findall(m.group(2) or ""))
            out.setdefault(m.group(1), Family()).samples.append((labels, float(m.group(3))))
    return {name: f for name, f in out.items() if f.samples}


def recorded() -> dict[str, Family]:
    return parse((FIXTURES / "metrics-rtx4000ada-k8s-default-counters.prom").read_text())


def scrape(collector: DcgmCompatCollector) -> dict[str, Family]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return parse(generate_latest(registry).decode())


@pytest.fixture
def gpu_samples() -> Iterator[tuple[Clock, GpuCollector]]:
    clock = Clock()
    fake = FakeNvml(load_node_scenario("row-remap-failure"), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    collector = GpuCollector(GpuConfig(xid_events=False), backend, clock)
    yield clock, collector
    collector.close()


def value(family: Family, gpu: str) -> float:
    found = [v for labels, v in family.samples if labels["gpu"] == gpu]
    assert len(found) == 1
    return found[0]


def test_names_types_help_and_labels_match_the_recorded_scrape(gpu_samples) -> None:
    _clock, gpu = gpu_samples
    samples = gpu.collect(0.0).samples
    ours = scrape(DcgmCompatCollector(lambda: samples, hostname="node-17"))
    theirs = recorded()
    # Every default-counter field vigil has a source for is served.
    expected = {"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_GPU_TEMP",
                "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_FB_FREE",
                "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE"}
    assert expected <= set(ours)
    for name in expected:
        mine, real = ours[name], theirs[name]
        # prometheus-client can only render a counter as `<name>_total`; dcgm-exporter's counters
        # lack the suffix, so they are served untyped under their exact name (agent/dcgm_compat.py).
        assert mine.type == (real.type if real.type != "counter" else "untyped"), name
        assert mine.help == real.help, name
        assert len(mine.samples) == 8, name
        real_labels = set(real.samples[0][0]) - POD_LABELS
        for labels, _ in mine.samples:
            assert set(labels) == real_labels, name
    # No series is served under a DCGM name the real exporter would not use.
    csv = (FIXTURES / "default-counters.csv").read_text()
    for name in ours:
        assert name in csv, name


def test_units_are_dcgm_exporters(gpu_samples) -> None:
    _clock, gpu = gpu_samples
    samples = gpu.collect(0.0).samples

    def vigil(name: str, index: str, **labels: str) -> float:
        found = [s.value for s in samples if s.name == name and s.label("gpu") == index
                 and all(s.label(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels)
        return found[0]

    ours = scrape(DcgmCompatCollector(lambda: samples))
    assert value(ours["DCGM_FI_DEV_SM_CLOCK"], "3") == pytest.approx(vigil("vigil_gpu_sm_clock_hertz", "3") / 1e6)
    assert 100 < value(ours["DCGM_FI_DEV_SM_CLOCK"], "3") < 3000  # MHz
    assert value(ours["DCGM_FI_DEV_POWER_USAGE"], "3") == pytest.approx(vigil("vigil_gpu_power_watts", "3"))
    assert value(ours["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"], "3") == pytest.approx(
        vigil("vigil_gpu_energy_joules_total", "3") * 1000)
    util = value(ours["DCGM_FI_DEV_GPU_UTIL"], "3")
    assert util == pytest.approx(vigil("vigil_gpu_utilization_ratio", "3") * 100) and 1 < util <= 100
    used = value(ours["DCGM_FI_DEV_FB_USED"], "3")
    free = value(ours["DCGM_FI_DEV_FB_FREE"], "3")
    assert used == pytest.approx(vigil("vigil_gpu_memory_used_bytes", "3") / 2**20)
    assert used + free == pytest.approx(vigil("vigil_gpu_memory_total_bytes", "3") / 2**20)  # ~81559 MiB on H100
    assert value(ours["DCGM_FI_DEV_GPU_TEMP"], "3") == vigil("vigil_gpu_temperature_celsius", "3")


def test_identity_labels_come_from_gpu_info(gpu_samples) -> None:
    _clock, gpu = gpu_samples
    samples = gpu.collect(0.0).samples
    info = next(s for s in samples if s.name == "vigil_gpu_info" and s.label("gpu") == "3")
    family = scrape(DcgmCompatCollector(lambda: samples, hostname="node-17"))["DCGM_FI_DEV_GPU_TEMP"]
    labels = next(labels for labels, _ in family.samples if labels["gpu"] == "3")
    assert labels == {"gpu": "3", "UUID": info.label("uuid"), "pci_bus_id": info.label("pci_bus_id"),
                      "device": "nvidia3", "modelName": info.label("name"), "Hostname": "node-17",
                      "DCGM_FI_DRIVER_VERSION": info.label("driver_version")}
    assert set(labels) == set(LABELS)


def test_row_remap_failure_and_newest_xid(gpu_samples) -> None:
    clock, gpu = gpu_samples
    current: list[Sample] = gpu.collect(0.0).samples
    compat = DcgmCompatCollector(lambda: current)
    before = scrape(compat)
    assert value(before["DCGM_FI_DEV_ROW_REMAP_FAILURE"], "6") == 0
    xid = before["DCGM_FI_DEV_XID_ERRORS"]
    assert {(labels["err_code"], labels["err_msg"], v) for labels, v in xid.samples} == {("0", "No Error", 0.0)}

    clock.t = 61.0  # the scenario fails GPU 6's row remap at 60 s
    uuid6 = next(s.label("uuid") for s in current if s.name == "vigil_gpu_info" and s.label("gpu") == "6")
    # The kernel-log Xid counter as the xid collector emits it: a code's series is born at its first line.
    current = [*gpu.collect(61.0).samples,
               Sample.of(XID_ERRORS, 1, gpu=6, uuid=uuid6, code=64)]
    after = scrape(compat)
    assert value(after["DCGM_FI_DEV_ROW_REMAP_FAILURE"], "6") == 1
    assert value(after["DCGM_FI_DEV_ROW_REMAP_FAILURE"], "5") == 0
    labels6, value6 = next((labels, v) for labels, v in after["DCGM_FI_DEV_XID_ERRORS"].samples if labels["gpu"] == "6")
    assert (value6, labels6["err_code"]) == (64.0, "64")
    assert value(after["DCGM_FI_DEV_XID_ERRORS"], "5") == 0

    # A later Xid 79 on the same GPU becomes the newest; an unchanged Xid 64 count does not win back.
    current = [*current, Sample.of(XID_ERRORS, 1, gpu=6, uuid=uuid6, code=79)]
    assert value(scrape(compat)["DCGM_FI_DEV_XID_ERRORS"], "6") == 79
    assert value(scrape(compat)["DCGM_FI_DEV_XID_ERRORS"], "6") == 79


def test_absent_values_stay_absent() -> None:
    # A GPU that reports only its temperature yields only DCGM_FI_DEV_GPU_TEMP (and the Xid gauge),
    # never zeros for the rest.
    samples = [Sample("vigil_gpu_temperature_celsius", 41.0, (("gpu", "0"), ("uuid", "GPU-0")))]
    ours = scrape(DcgmCompatCollector(lambda: samples))
    assert set(ours) == {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS"}
    assert ours["DCGM_FI_DEV_GPU_TEMP"].samples[0][0]["modelName"] == ""
    assert scrape(DcgmCompatCollector(lambda: [])) == {}


@pytest.mark.parametrize("enabled", [True, False])
def test_agent_serves_dcgm_series_only_when_configured(enabled: bool) -> None:
    from vigil.agent.config import parse_config
    from vigil.agent.daemon import Agent, make_seams
    from vigil.agent.snapshot import CollectorResult

    off = {"enabled": False}
    config = parse_config({"node": "node-17", "nvml": {"backend": "fake"}, "exporter": {"dcgm_compat": enabled},
                           "collectors": {"gpu": {"xid_events": False}, "host": off, "rdma": off, "training": off,
                                          "xid": off}})
    agent = Agent(config, make_seams(config))
    try:
        (gpu,) = agent.collectors
        agent.snapshot.put("gpu", CollectorResult(gpu.collect(0.0), True, 0.0, 0.0))
        text = agent.render_metrics().decode()
    finally:
        for c in agent.collectors:
            c.close()
    assert "vigil_gpu_temperature_celsius{" in text
    assert ('DCGM_FI_DEV_GPU_TEMP{' in text) is enabled
    assert ('Hostname="node-17"' in text) is enabled
