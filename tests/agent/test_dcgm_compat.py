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
from vigil.agent.dcgm_compat import LABELS, MIG_LABELS, NVLINK_BANDWIDTH, NVLINK_BANDWIDTH_HELP, DcgmCompatCollector
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
        # The recorded scrape predates dcgm-exporter's `Hostname` -> `hostname` rename (PR #655).
        real_labels = {"hostname" if k == "Hostname" else k for k in real.samples[0][0]} - POD_LABELS
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
    reserved = value(ours["DCGM_FI_DEV_FB_RESERVED"], "3")
    # DCGM reads memory info v2: used leaves the reserve out, and used + free + reserved = total, as in
    # the recorded dcgm-exporter scrape (1 + 20015 + 457 MiB on an RTX 4000 Ada). vigil's used keeps it in.
    assert reserved == vigil("vigil_gpu_memory_reserved_bytes", "3") / 2**20 == 551
    assert used == pytest.approx(vigil("vigil_gpu_memory_used_bytes", "3") / 2**20 - reserved)
    assert used + free + reserved == pytest.approx(vigil("vigil_gpu_memory_total_bytes", "3") / 2**20)  # 81559
    assert value(ours["DCGM_FI_DEV_ENC_UTIL"], "3") == 100 * vigil("vigil_gpu_encoder_utilization_ratio", "3") == 0
    assert value(ours["DCGM_FI_DEV_DEC_UTIL"], "3") == 100 * vigil("vigil_gpu_decoder_utilization_ratio", "3") == 0
    assert value(ours["DCGM_FI_DEV_GPU_TEMP"], "3") == vigil("vigil_gpu_temperature_celsius", "3")


def test_identity_labels_come_from_gpu_info(gpu_samples) -> None:
    _clock, gpu = gpu_samples
    samples = gpu.collect(0.0).samples
    info = next(s for s in samples if s.name == "vigil_gpu_info" and s.label("gpu") == "3")
    family = scrape(DcgmCompatCollector(lambda: samples, hostname="node-17"))["DCGM_FI_DEV_GPU_TEMP"]
    labels = next(labels for labels, _ in family.samples if labels["gpu"] == "3")
    assert labels == {"gpu": "3", "UUID": info.label("uuid"), "pci_bus_id": info.label("pci_bus_id"),
                      "device": "nvidia3", "modelName": info.label("name"), "hostname": "node-17",
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
    assert set(ours) == {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS", "DCGM_EXP_XID_ERRORS_COUNT"}
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
                                          "xid": off, "pcie": off, "node_config": off}})
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
    assert ('hostname="node-17"' in text) is enabled


# --- coverage of dcgm-exporter's default counter list ----------------------------------------------

# Default-enabled fields vigil cannot serve, and why. A field missing from the scrape that is not named
# here fails the coverage test; a field named here that starts being served fails it too.
NOT_SERVED: dict[str, str] = {
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "hardware/driver-impossible: a vGPU licence exists only inside a vGPU "
                                       "guest (GRID driver); on bare-metal data-centre GPUs DCGM reports blank",
}
HARDWARE_IMPOSSIBLE = {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"}


def default_counters() -> list[tuple[str, str]]:
    """(field, type) of every default-enabled, non-label line of dcgm-exporter's counters file."""
    out = []
    for line in (FIXTURES / "default-counters.csv").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, kind = (part.strip() for part in line.split(",")[:2])
            if kind != "label":
                out.append((name, kind))
    return out


def collected(scenario: str, *at: float) -> tuple[FakeNvml, list[Sample]]:
    """The real GPU collector over FakeNvml running the node ``scenario``, collected at each time
    of ``at`` in turn: the fake and the last collection's samples."""
    clock = Clock()
    fake = FakeNvml(load_node_scenario(scenario), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    gpu = GpuCollector(GpuConfig(xid_events=False), backend, clock)
    try:
        for t in at:
            clock.t = t
            samples = gpu.collect(t).samples
    finally:
        gpu.close()
    return fake, samples


def test_default_counter_coverage_on_an_h100(capsys) -> None:
    _, samples = collected("healthy-h100", 0.0, 5.0)  # the GPM profiling values need a pair of samples
    ours = scrape(DcgmCompatCollector(lambda: samples, hostname="node-17"))
    fields = [name for name, _ in default_counters()]
    assert len(fields) == 25
    served = [f for f in fields if f in ours]
    assert len(served) == 24
    missing = sorted(set(fields) - set(served))
    with capsys.disabled():
        print(f"\n{len(served)}/{len(fields)} default counters served (H100, fake NVML); not served: "
              + "; ".join(f"{f} ({NOT_SERVED.get(f, 'REGRESSED')})" for f in missing)
              + f"; hardware-impossible: {', '.join(sorted(HARDWARE_IMPOSSIBLE))}")
    assert missing == sorted(NOT_SERVED), "a servable default counter is missing, or a NOT_SERVED one is now served"
    assert set(NOT_SERVED) >= HARDWARE_IMPOSSIBLE
    for name in served:
        assert len(ours[name].samples) == 8, name
    # The exporter's own series vigil has data for.
    assert {"DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_CLOCK_EVENTS_COUNT"} <= set(ours)


def test_xid_err_msg_and_windowed_xid_count() -> None:
    clock = Clock()
    base = [Sample("vigil_gpu_info", 1.0, (("gpu", "0"), ("uuid", "GPU-0"), ("name", "H100"))),
            Sample("vigil_gpu_temperature_celsius", 40.0, (("gpu", "0"), ("uuid", "GPU-0")))]
    current: list[Sample] = list(base)
    compat = DcgmCompatCollector(lambda: current, clock=clock, window_ms=300_000)
    first = scrape(compat)["DCGM_EXP_XID_ERRORS_COUNT"]
    assert [(labels.get("xid"), labels["window_size_in_ms"], v) for labels, v in first.samples] == [
        (None, "300000", 0.0)]
    clock.t = 10.0
    current = [*base, Sample.of(XID_ERRORS, 2, gpu=0, uuid="GPU-0", code=79)]
    after = scrape(compat)
    assert [(labels["xid"], v) for labels, v in after["DCGM_EXP_XID_ERRORS_COUNT"].samples] == [("79", 2.0)]
    (labels, v), = after["DCGM_FI_DEV_XID_ERRORS"].samples
    assert (v, labels["err_code"], labels["err_msg"]) == (79.0, "79", "GPU has fallen off the bus")
    clock.t = 400.0  # past the window: the two Xids drop out of the count, the last-Xid gauge stays
    later = scrape(compat)
    assert [(labels.get("xid"), v) for labels, v in later["DCGM_EXP_XID_ERRORS_COUNT"].samples] == [(None, 0.0)]
    assert later["DCGM_FI_DEV_XID_ERRORS"].samples[0][1] == 79.0


def test_clock_events_count_and_pod_labels_hook() -> None:
    clock = Clock()
    ident = (("gpu", "0"), ("uuid", "GPU-0"))
    current = [Sample("vigil_gpu_temperature_celsius", 40.0, ident),
               Sample("vigil_gpu_clock_event_active", 1.0, (*ident, ("reason", "sw_power_cap"))),
               Sample("vigil_gpu_clock_event_active", 0.0, (*ident, ("reason", "hw_slowdown")))]
    pods = {"GPU-0": {"pod": "trainer-0", "namespace": "ml", "container": "pytorch"}}
    compat = DcgmCompatCollector(lambda: current, clock=clock, pod_labels=lambda: pods)
    for t in (0.0, 1.0, 2.0):
        clock.t = t
        ours = scrape(compat)
    (labels, v), = ours["DCGM_EXP_CLOCK_EVENTS_COUNT"].samples
    assert (labels["clock_event"], v) == ("power_cap", 3.0)
    for family in ours.values():
        for labels, _ in family.samples:
            assert (labels["pod"], labels["namespace"], labels["container"]) == ("trainer-0", "ml", "pytorch")
    pods.clear()  # no attribution: no pod labels at all (never empty strings)
    assert all("pod" not in labels for family in scrape(compat).values() for labels, _ in family.samples)


def _nvlink_gpu(total_bytes: float, gpu: str = "0") -> list[Sample]:
    ident = (("gpu", gpu), ("uuid", f"GPU-{gpu}"))
    return [Sample("vigil_gpu_info", 1.0, (*ident, ("name", "H100"))),
            Sample("vigil_gpu_nvlink_data_bytes_total", total_bytes * 0.4, (*ident, ("direction", "tx"))),
            Sample("vigil_gpu_nvlink_data_bytes_total", total_bytes * 0.6, (*ident, ("direction", "rx")))]


def test_nvlink_bandwidth_is_dcgms_rate_not_a_counter() -> None:
    """DCGM differences tx + rx payload KiB between samples, per second, divided by 1000 (its
    DcgmCacheManager::ReadAndCacheNvLinkBandwidth): a GPU moving 100 GB/s of payload reads
    100e9 / 1024 / 1000 = 97,656, whatever the counters' absolute value; 0 at the first sample."""
    clock = Clock()
    current = _nvlink_gpu(7e15)
    compat = DcgmCompatCollector(lambda: current, clock=clock)
    first = scrape(compat)[NVLINK_BANDWIDTH]
    assert first.type == "untyped" and first.help == NVLINK_BANDWIDTH_HELP
    assert value(first, "0") == 0.0
    for step in range(1, 9):  # scraped every 15 s; the counter moves by 100 GB/s
        clock.t = 15.0 * step
        current = _nvlink_gpu(7e15 + 100e9 * clock.t)
        got = value(scrape(compat)[NVLINK_BANDWIDTH], "0")
        assert got == pytest.approx(100e9 / 1024 / 1000)
    clock.t += 15.0  # an idle minute reads 0 once the window has passed over it
    for _ in range(5):
        clock.t += 15.0
        got = value(scrape(compat)[NVLINK_BANDWIDTH], "0")
    assert got == 0.0
    clock.t += 15.0
    current = _nvlink_gpu(1e9)  # driver reload: the counters restart, the rate starts over
    assert value(scrape(compat)[NVLINK_BANDWIDTH], "0") == 0.0


def test_nvlink_bandwidth_over_the_slow_cadence_stays_close() -> None:
    """vigil reads the counters every 10 s (gpu.nvlink_interval_seconds) and holds them between; a
    15 s scrape sees them move in steps. Over the 60 s window the rate is within a sixth of the truth."""
    clock = Clock()
    read_at = 0.0
    current = _nvlink_gpu(0.0)
    compat = DcgmCompatCollector(lambda: current, clock=clock)
    truth = 50e9 / 1024 / 1000
    seen = []
    for step in range(1, 40):
        clock.t = 15.0 * step + 3.0
        read_at = clock.t - clock.t % 10.0  # the last slow read before this scrape
        current = _nvlink_gpu(50e9 * read_at)
        seen.append(value(scrape(compat)[NVLINK_BANDWIDTH], "0"))
    assert all(abs(v - truth) <= truth / 6 for v in seen[4:])


def test_nvlink_bandwidth_from_the_gpu_collector_is_absent_without_nvlink(gpu_samples) -> None:
    _clock, gpu = gpu_samples
    samples = gpu.collect(0.0).samples
    ours = scrape(DcgmCompatCollector(lambda: samples))
    assert len(ours[NVLINK_BANDWIDTH].samples) == 8  # 18 NVLinks per H100
    without = [s for s in samples if s.name != "vigil_gpu_nvlink_data_bytes_total"]
    assert NVLINK_BANDWIDTH not in scrape(DcgmCompatCollector(lambda: without))


def test_mig_instances_get_their_own_framebuffer_series() -> None:
    """On the mig-a100 node each MIG GPU instance is served DCGM_FI_DEV_FB_USED/_FREE with
    dcgm-exporter's GPU_I_PROFILE and GPU_I_ID labels beside its parent's gpu and UUID, in MiB of the
    instance's own memory; the whole GPUs keep their series without them."""
    fake, samples = collected("mig-a100", 0.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DcgmCompatCollector(lambda: samples, hostname="node-17"))
    text = generate_latest(registry).decode()
    families = parse(text)
    used = [(labels, v) for labels, v in families["DCGM_FI_DEV_FB_USED"].samples if "GPU_I_ID" in labels]
    free = {(labels["gpu"], labels["GPU_I_ID"]): v for labels, v in families["DCGM_FI_DEV_FB_FREE"].samples
            if "GPU_I_ID" in labels}
    assert [(labels["gpu"], labels["GPU_I_PROFILE"], labels["GPU_I_ID"]) for labels, _ in used] == [
        *[("0", "1g.10gb", str(gi)) for gi in range(7, 14)], ("1", "3g.40gb", "1"), ("1", "2g.20gb", "3"),
        ("1", "2g.20gb", "4")]
    labels, mib = used[-1]
    assert labels["UUID"] == fake.handles[1].uuid and labels["modelName"] == "NVIDIA A100-SXM4-80GB"
    assert mib > 0 and mib + free[("1", "4")] == 19.5 * 1024  # the 2g.20gb instance's MiB, not the GPU's
    assert set(labels) == {*LABELS, *MIG_LABELS}
    whole = [labels for labels, _ in families["DCGM_FI_DEV_FB_USED"].samples if "GPU_I_ID" not in labels]
    assert [labels["gpu"] for labels in whole] == [str(i) for i in range(8)]
