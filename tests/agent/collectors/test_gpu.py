"""GPU collector over PynvmlBackend over FakeNvml: the series, the report, events, isolation."""

from __future__ import annotations

import dataclasses
import time

import pytest

from vigil.agent.amdsmi.backend import AmdSmiBackend
from vigil.agent.amdsmi.fake import FakeAmdSmi
from vigil.agent.attribution import ProcessAttribution
from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.gpu import SPECS, GpuCollector, GpuConfig
from vigil.agent.collectors.xid import PAGED_XID_CODES
from vigil.agent.config import parse_config
from vigil.agent.metric import Sample
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import ALL_PROFILES, load_node_scenario, shipped_scenarios
from vigil.contract.seams import Seams
from vigil.contract.wire import Event, Report


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(clock):
    made: list[GpuCollector] = []

    def build(scenario: str = "healthy-h100", **config) -> GpuCollector:
        fake = FakeNvml(load_node_scenario(scenario), clock, start=0.0)
        backend = PynvmlBackend(fake)
        backend.init()
        config.setdefault("xid_events", False)
        collector = GpuCollector(GpuConfig(**config), backend, clock)
        made.append(collector)
        return collector

    yield build
    for c in made:
        c.close()


def series(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    return [s for s in samples if s.name == name and all(s.label(k) == v for k, v in labels.items())]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = series(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0].value


def test_healthy_h100_node(make, clock):
    collection = make().collect(0.0)
    s = collection.samples
    info = series(s, "vigil_gpu_info")
    assert len(info) == 8
    assert {i.label("name") for i in info} == {"NVIDIA H100 80GB HBM3"}
    assert info[3].label("pci_bus_id") == "00000000:5D:00.0"
    assert info[0].label("driver_version") == "535.161.08" and info[0].label("cuda_driver_version") == "12.2"
    uuid = info[0].label("uuid")
    assert uuid is not None
    assert value(s, "vigil_gpu_health", gpu="0", state="ok") == 1
    assert value(s, "vigil_gpu_health", gpu="0", state="lost") == 0
    assert value(s, "vigil_gpu_memory_total_bytes", gpu="0", uuid=uuid) == 81559 * 1024**2
    assert value(s, "vigil_gpu_sm_clock_max_hertz", gpu="0") == 1980e6
    assert value(s, "vigil_gpu_power_limit_watts", gpu="0") == 700.0
    assert value(s, "vigil_gpu_slowdown_temperature_celsius", gpu="0") == 87.0
    assert value(s, "vigil_gpu_ecc_errors_total", gpu="0", error_type="uncorrected", counter="aggregate") == 0
    assert value(s, "vigil_gpu_clock_event_active", gpu="0", reason="hw_thermal_slowdown") == 0
    assert len(series(s, "vigil_gpu_clock_event_active", gpu="0")) == 9
    assert len(series(s, "vigil_gpu_nvlink_state", gpu="0")) == 18
    assert len(series(s, "vigil_gpu_nvlink_errors_total", gpu="0")) == 54
    assert value(s, "vigil_gpu_nvml_available") == 1
    # Absent, never 0: SXM boards have no fan and no page retirement.
    assert series(s, "vigil_gpu_fan_speed_ratio") == []
    assert series(s, "vigil_gpu_retired_pages_total") == []
    # No host label, and every GPU series carries gpu and uuid.
    assert all(s_.label("host") is None for s_ in s)
    report = collection.report
    assert report["nvml_available"] is True
    gpus = report["gpus"]
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[0].uuid == uuid and gpus[0].health == "ok" and gpus[0].nvlink_links_active == 18
    assert gpus[0].nvlink_crc_errors_total == 0 and gpus[0].nvlink_links_down == ()
    assert collection.events == []


def test_report_section_validates_as_wire_report(make):
    collection = make("faults-h100").collect(0.0)
    report = Report(node="n1", boot_id="b", seq=0, ts=0.0, interval_seconds=1.0, **collection.report)
    assert len(report.gpus) == 8


def test_every_report_field_has_one_source_and_a_healthy_gpu_fills_them(make, clock):
    # The report's GpuState is derived from the field names it shares with GpuReading and GpuIdentity
    # (no hand copy): a field the reading or identity renames or drops leaves the report with a
    # field nothing fills, which this names.
    from vigil.agent.collectors import gpu as gpu_module
    from vigil.contract.wire import GpuState

    filled_elsewhere = {"job", "processes", "nvlink_crc_errors_total", "nvlink_replay_errors_total",
                        "nvlink_recovery_errors_total", "nvlink_links_active", "nvlink_links_down"}
    sources = (set(gpu_module._STATE_FROM_READING) | set(gpu_module._STATE_FROM_IDENTITY)
               | gpu_module._STATE_BUILT | filled_elsewhere)
    assert set(GpuState.__struct_fields__) - sources == set()
    collector = make("healthy-h100")
    collector.collect(0.0)
    clock.t = 20.0  # GPM's ratios need a pair of samples
    state = collector.collect(20.0).report["gpus"][0]
    assert all(getattr(state, name) is not None for name in gpu_module._STATE_FROM_IDENTITY)
    assert state.temperature_celsius is not None and state.memory_used_bytes is not None
    assert state.sm_active_ratio is not None and state.pcie_link_width_max is not None


def test_every_sample_is_declared_and_every_spec_is_emitted_on_some_scenario(clock, tmp_path):
    declared = {s.name: s for s in SPECS}
    emitted: set[str] = set()
    for name in shipped_scenarios():
        clock.t = 0.0
        scenario = load_node_scenario(name)
        fake: FakeNvml | FakeAmdSmi
        backend: PynvmlBackend | AmdSmiBackend
        if ALL_PROFILES[scenario.profile].vendor == "amd":  # issue 46: an AMD board's scenario
            fake = FakeAmdSmi(scenario, clock, start=0.0)
            backend = AmdSmiBackend(fake)
        else:
            fake = FakeNvml(scenario, clock, start=0.0)
            backend = PynvmlBackend(fake)
        backend.init()
        # An empty process table: NVML's pids are attributed to no job, and still listed.
        attribution = ProcessAttribution(backend, proc_root=tmp_path)
        collector = GpuCollector(GpuConfig(event_wait_ms=10), backend, clock, attribution)
        try:
            for t in (0.0, 100.0):
                clock.t = t
                for sample in collector.collect(t).samples:
                    spec = declared.get(sample.name)
                    assert spec is not None, f"{name}: {sample.name} is not declared"
                    assert tuple(k for k, _ in sample.labels) == spec.labels, sample
                    emitted.add(sample.name)
            amd = isinstance(fake, FakeAmdSmi)  # amdsmi notifies a hung GPU's ring timeout, NVML an Xid
            worker_metric = "vigil_gpu_device_events_total" if amd else "vigil_gpu_nvml_xid_events_total"
            if any(f.kind == ("gpu_lost" if amd else "xid") for f in fake.scenario.faults):
                deadline = time.monotonic() + 5.0  # the worker thread delivers within its wait
                while worker_metric not in emitted and time.monotonic() < deadline:
                    time.sleep(0.01)
                    emitted |= {s.name for s in collector.collect(100.0).samples}
        finally:
            collector.close()
    # Every shipped profile is a passively cooled data-centre board (nvidia-smi: "Fan Speed: N/A");
    # the fan series is covered by test_fan_speed_where_the_board_has_a_fan.
    # The AMD edge sensor: MI300X has none (amd-smi "EDGE: N/A"); tests/agent/amdsmi/test_backend.py.
    assert set(declared) - emitted == {"vigil_gpu_fan_speed_ratio", "vigil_gpu_edge_temperature_celsius"}


def test_fan_speed_where_the_board_has_a_fan(clock):
    fake = FakeNvml(load_node_scenario("healthy-h100"), clock, start=0.0)
    fake.handles[0].profile = dataclasses.replace(fake.profile, not_supported=frozenset())
    backend = PynvmlBackend(fake)
    backend.init()
    collector = GpuCollector(GpuConfig(xid_events=False), backend, clock)
    s = collector.collect(0.0).samples
    assert value(s, "vigil_gpu_fan_speed_ratio", gpu="0") == 0.4
    assert series(s, "vigil_gpu_fan_speed_ratio", gpu="1") == []
    assert value(s, "vigil_gpu_retired_pages_total", gpu="0", cause="dbe") == 0


def test_gpu_lost_isolates_that_gpu_and_fires_one_urgent_event(make, clock):
    collector = make("gpu-lost")
    collector.collect(0.0)
    clock.t = 60.0
    first = collector.collect(60.0)
    s = first.samples
    assert value(s, "vigil_gpu_health", gpu="7", state="lost") == 1
    assert value(s, "vigil_gpu_health", gpu="7", state="ok") == 0
    assert series(s, "vigil_gpu_temperature_celsius", gpu="7") == []
    assert len(series(s, "vigil_gpu_info", gpu="7")) == 1  # its identity stays visible
    for i in range(7):
        assert value(s, "vigil_gpu_health", gpu=str(i), state="ok") == 1
        assert len(series(s, "vigil_gpu_temperature_celsius", gpu=str(i))) == 1
    [event] = first.events
    assert (event.kind, event.gpu, event.urgent, event.source) == ("gpu_lost", 7, True, "nvml")
    assert event.pci_bus_id == "00000000:DB:00.0" and event.uuid
    assert first.report["gpus"][7].health == "lost" and first.report["nvml_available"] is True
    assert value(s, "vigil_gpu_nvml_errors_total", reason="gpu_is_lost") == 1
    clock.t = 61.0
    assert collector.collect(61.0).events == []  # once per transition


def test_faults_show_at_their_scripted_time(make, clock):
    collector = make("faults-h100", nvlink_interval_seconds=1.0)
    clock.t = 5.0
    early = collector.collect(5.0).samples
    clock.t = 100.0
    late_collection = collector.collect(100.0)
    late = late_collection.samples
    assert value(early, "vigil_gpu_ecc_errors_total", gpu="1", error_type="corrected", counter="volatile") == 0
    assert value(late, "vigil_gpu_ecc_errors_total", gpu="1", error_type="corrected", counter="volatile") == 450
    assert value(early, "vigil_gpu_clock_event_active", gpu="2", reason="hw_thermal_slowdown") == 0
    assert value(late, "vigil_gpu_clock_event_active", gpu="2", reason="hw_thermal_slowdown") == 1
    assert value(late, "vigil_gpu_clock_event_active", gpu="2", reason="hw_slowdown") == 1
    assert value(late, "vigil_gpu_sm_clock_hertz", gpu="2") == 990e6
    assert value(late, "vigil_gpu_nvlink_errors_total", gpu="3", link="4", error_type="crc") == 1400
    assert value(late, "vigil_gpu_row_remap_pending", gpu="4") == 1
    assert value(late, "vigil_gpu_clock_event_active", gpu="5", reason="hw_power_brake_slowdown") == 1
    assert value(late, "vigil_gpu_nvlink_state", gpu="6", link="9") == 0
    assert value(late, "vigil_gpu_health", gpu="7", state="lost") == 1
    gpus = late_collection.report["gpus"]
    assert gpus[2].clock_event_reasons == ("hw_slowdown", "hw_thermal_slowdown")
    assert gpus[3].nvlink_crc_errors_total == 1400
    assert gpus[6].nvlink_links_down == (9,) and gpus[6].nvlink_links_active == 17
    assert gpus[4].remap_pending is True


def test_nvlink_readings_are_reused_between_their_reads(make, clock):
    collector = make("nvlink-errors", nvlink_interval_seconds=10.0)
    collector.collect(0.0)
    clock.t = 65.0
    cached = collector.collect(5.0).samples  # due again only at 10 s
    assert value(cached, "vigil_gpu_nvlink_errors_total", gpu="1", link="4", error_type="crc") == 0
    fresh = collector.collect(10.0).samples
    assert value(fresh, "vigil_gpu_nvlink_errors_total", gpu="1", link="4", error_type="crc") == 100


def test_nvlink_payload_counters_are_held_between_their_reads(make, clock):
    collector = make("healthy-h100", nvlink_interval_seconds=10.0)
    clock.t = 100.0
    first = collector.collect(0.0).samples
    tx = value(first, "vigil_gpu_nvlink_data_bytes_total", gpu="2", direction="tx")
    assert value(first, "vigil_gpu_nvlink_data_bytes_total", gpu="2", direction="rx") > 0
    clock.t = 105.0
    held = collector.collect(5.0).samples  # not due: the last read's value, not a gap and not 0
    assert value(held, "vigil_gpu_nvlink_data_bytes_total", gpu="2", direction="tx") == tx
    clock.t = 110.0
    fresh = collector.collect(10.0).samples
    assert value(fresh, "vigil_gpu_nvlink_data_bytes_total", gpu="2", direction="tx") > tx
    # The other new per-GPU series, every cycle: the reserve in bytes, the video engines as ratios.
    assert value(held, "vigil_gpu_memory_reserved_bytes", gpu="2") == 551 * 2**20
    assert value(held, "vigil_gpu_encoder_utilization_ratio", gpu="2") == 0.0
    assert value(held, "vigil_gpu_decoder_utilization_ratio", gpu="2") == 0.0


def test_nvml_unavailable_reports_and_counts(make, clock):
    collector = make("nvml-unavailable")
    assert collector.collect(0.0).report["nvml_available"] is True
    clock.t = 60.0
    collection = collector.collect(60.0)
    assert collection.report["nvml_available"] is False
    assert [e.kind for e in collection.events] == ["nvml_unavailable"]
    s = collection.samples
    assert value(s, "vigil_gpu_nvml_available") == 0
    assert all(value(s, "vigil_gpu_health", gpu=str(i), state="unavailable") == 1 for i in range(8))
    assert series(s, "vigil_gpu_power_watts") == []
    assert value(s, "vigil_gpu_nvml_errors_total", reason="driver_not_loaded") == 8


def test_no_backend_means_no_gpu_samples_and_one_event(clock):
    collector = GpuCollector(GpuConfig(), None, clock)
    first = collector.collect(0.0)
    assert [s.name for s in first.samples] == ["vigil_gpu_nvml_available"]
    assert first.samples[0].value == 0
    assert first.report == {"gpus": [], "nvml_available": False}
    assert [e.kind for e in first.events] == ["nvml_unavailable"]
    assert collector.collect(1.0).events == []
    collector.close()


def test_xid_events_from_the_worker_thread(make, clock):
    collector = make("xid", xid_events=True, event_wait_ms=10)
    assert collector.collect(0.0).events == []
    clock.t = 60.0
    events: list[Event] = []
    deadline = time.monotonic() + 5.0
    while not events and time.monotonic() < deadline:  # the worker delivers within its wait
        events = collector.collect(60.0).events
        time.sleep(0.01)
    [event] = events
    assert (event.kind, event.code, event.gpu, event.urgent, event.source) == ("xid", 79, 4, True, "nvml")
    assert event.pci_bus_id == "00000000:9B:00.0"
    s = collector.collect(61.0).samples
    assert value(s, "vigil_gpu_nvml_xid_events_total", gpu="4", code="79") == 1
    # The paged codes of every listened GPU start at 0 (xid.PAGED_XID_CODES): increase() sees the first.
    nvml_xids = series(s, "vigil_gpu_nvml_xid_events_total")
    assert len(nvml_xids) == 8 * len(PAGED_XID_CODES)
    assert sum(x.value for x in nvml_xids) == 1
    assert series(s, "vigil_gpu_xid_errors_total") == []  # the kernel-log collector's name
    collector.close()
    assert collector._worker is None


def test_config_rejects_typos_with_key_path():
    from vigil.contract.validation import ConfigError

    with pytest.raises(ConfigError, match=r"collectors\.gpu\.nvlink_interval_secnds: unknown key"):
        parse_config({"collectors": {"gpu": {"nvlink_interval_secnds": 5}}})
    with pytest.raises(ConfigError, match=r"collectors\.gpu\.event_wait_ms"):
        parse_config({"collectors": {"gpu": {"event_wait_ms": "soon"}}})


def test_registry_builds_from_seams(clock):
    fake = FakeNvml(load_node_scenario("healthy-a100"), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    config = parse_config({"collectors": {"gpu": {"xid_events": False}}})
    collector = REGISTRY["gpu"](config, Seams(nvml=backend, clock=clock))
    try:
        s = collector.collect(0.0).samples
        assert len(series(s, "vigil_gpu_nvlink_state", gpu="0")) == 12
    finally:
        collector.close()


def test_energy_counter_is_read_on_the_slow_cadence_and_holds_its_value_between(clock):
    """nvmlDeviceGetTotalEnergyConsumption costs 3-12 ms a call on a real H100 (tests/fixtures/
    nvml-real/): read with NVLink every nvlink_interval_seconds, its last value exported between."""
    from vigil.agent.nvml.recording import RecordingNvml

    nvml = RecordingNvml(FakeNvml(load_node_scenario("healthy-h100"), clock, start=0.0))
    # RecordingNvml stands in for the pynvml module (through __getattr__), which
    # PynvmlBackend's annotation (ModuleType | FakeNvml) does not name.
    backend = PynvmlBackend(nvml)  # type: ignore[arg-type]  # duck-typed pynvml module
    backend.init()
    collector = GpuCollector(GpuConfig(xid_events=False, nvlink_interval_seconds=10.0), backend, clock)
    energies = []
    for t in range(0, 25):
        clock.t = float(t)
        out = collector.collect(clock.t)
        energy = [s.value for s in out.samples
                  if s.name == "vigil_gpu_energy_joules_total" and ("gpu", "0") in s.labels]
        assert len(energy) == 1, t  # exported every cycle
        assert out.report["gpus"][0].energy_joules == energy[0]
        energies.append(energy[0])
    collector.close()
    calls = [c for c in nvml.calls if c["call"] == "nvmlDeviceGetTotalEnergyConsumption"]
    assert len(calls) == 3 * 8  # at t = 0, 10 and 20, for each of the 8 GPUs
    assert energies[1:10] == [energies[0]] * 9 and energies[10] > energies[0] and energies[20] > energies[10]


def test_mig_devices_are_their_own_series_beside_their_parent(clock, tmp_path):
    """The shipped mig-a100 node: GPU 0 in 7x 1g.10gb, GPU 1 in 3g.40gb + 2x 2g.20gb, GPU 2 with MIG
    pending, the rest whole; each MIG device's info and memory carry the parent's gpu/uuid and the
    instance ids a process on it carries, so the two join."""
    fake = FakeNvml(load_node_scenario("mig-a100"), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    attribution = ProcessAttribution(backend, proc_root=tmp_path)
    collector = GpuCollector(GpuConfig(xid_events=False), backend, clock, attribution)
    try:
        samples = collector.collect(0.0).samples
    finally:
        collector.close()
    uuid1 = fake.handles[1].uuid
    info = series(samples, "vigil_gpu_mig_device_info", gpu="1")
    assert [(s.label("uuid"), s.label("profile"), s.label("gpu_instance_id"), s.label("compute_instance_id"))
            for s in info] == [(uuid1, "3g.40gb", "1", "0"), (uuid1, "2g.20gb", "3", "0"), (uuid1, "2g.20gb", "4", "0")]
    assert all((s.label("mig_uuid") or "").startswith("MIG-") for s in info)
    assert len(series(samples, "vigil_gpu_mig_device_info", gpu="0", profile="1g.10gb")) == 7
    assert series(samples, "vigil_gpu_mig_device_info", gpu="3") == []
    ids = {"gpu": "1", "gpu_instance_id": "3", "compute_instance_id": "0"}
    total = value(samples, "vigil_gpu_mig_memory_total_bytes", **ids)
    assert total == 19.5 * 1024**3  # the 2g.20gb instance's own memory, not the parent's
    assert 0 < value(samples, "vigil_gpu_mig_memory_used_bytes", **ids) <= 0.6 * total
    modes = [(g, value(samples, "vigil_gpu_mig_mode_enabled", gpu=g),
              value(samples, "vigil_gpu_mig_mode_pending_enabled", gpu=g)) for g in ("0", "2", "3")]
    assert modes == [("0", 1.0, 1.0), ("2", 0.0, 1.0), ("3", 0.0, 0.0)]
    # The process on GPU 1 runs in its first MIG device: its info joins to that device's.
    (process,) = series(samples, "vigil_gpu_process_info", gpu="1")
    assert (process.label("gpu_instance_id"), process.label("compute_instance_id")) == ("1", "0")
    assert series(samples, "vigil_gpu_mig_device_info", gpu="1", gpu_instance_id="1", compute_instance_id="0")


def test_no_mig_series_on_a_board_without_mig(make):
    samples = make("healthy-v100").collect(0.0).samples
    assert not [s for s in samples if s.name.startswith("vigil_gpu_mig_")]


@pytest.mark.parametrize("scenario", ["nvlink-down", "nvlink-errors", "healthy-h100"])
def test_links_read_as_before_reuse_their_samples_and_equal_a_fresh_build(make, clock, scenario) -> None:
    # Every cycle reads the links (nvlink_interval_seconds 1): unchanged links reuse what they made
    # last time, changed ones (a link down at 60 s, growing error counters) are built anew; the
    # reference forgets every GPU's remembered links before each cycle.
    inc, ref = make(scenario, nvlink_interval_seconds=1), make(scenario, nvlink_interval_seconds=1)
    reused = 0
    for t in range(0, 130, 2):
        clock.t = float(t)
        for gpu in ref._gpus or []:
            gpu.link_memo = None
        before = [g.link_memo for g in inc._gpus or []]
        got, want = inc.collect(clock.t), ref.collect(clock.t)
        assert got.samples == want.samples and got.report == want.report
        reused += sum(1 for g, m in zip(inc._gpus or [], before, strict=False) if m is not None and g.link_memo is m)
    assert reused > 0


# --- issue 44: NVLink fabric, PCIe link, the driver's recovery action --------------------------


def _collector_of(yaml_text: str, clock, tmp_path, **config) -> tuple[FakeNvml, GpuCollector]:
    """A collector (no Xid worker, NVLink/slow cadence 10 s unless given) over this node scenario."""
    scenario = tmp_path / "node.yaml"
    scenario.write_text(yaml_text)
    fake = FakeNvml(load_node_scenario(scenario), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    config = {"xid_events": False, "nvlink_interval_seconds": 10.0, **config}
    return fake, GpuCollector(GpuConfig(**config), backend, clock)


def test_fabric_pcie_and_recovery_series_of_a_healthy_node(make, clock):
    collection = make("healthy-h200").collect(0.0)
    s = collection.samples
    assert value(s, "vigil_gpu_fabric_state", gpu="0", state="completed") == 1
    assert value(s, "vigil_gpu_fabric_state", gpu="0", state="not_started") == 0
    assert len(series(s, "vigil_gpu_fabric_state")) == 8 * 3
    assert value(s, "vigil_gpu_pcie_link_generation", gpu="7") == 5
    assert value(s, "vigil_gpu_pcie_link_generation_max", gpu="7") == 5
    assert value(s, "vigil_gpu_pcie_link_width", gpu="7") == 16
    assert value(s, "vigil_gpu_pcie_link_width_max", gpu="7") == 16
    assert value(s, "vigil_gpu_recovery_action", gpu="3", action="none") == 1
    assert len(series(s, "vigil_gpu_recovery_action", gpu="3")) == 5
    gpu = collection.report["gpus"][0]
    assert (gpu.fabric_state, gpu.fabric_status, gpu.fabric_health) == ("completed", None, ())
    assert gpu.fabric_clique_id is None and gpu.fabric_cluster_uuid is None  # single-node NVSwitch
    assert (gpu.pcie_link_generation, gpu.pcie_link_width, gpu.recovery_action) == (5, 16, "none")


def test_no_fabric_no_recovery_action_series_where_nvml_has_no_answer(make):
    # A100: fabric state NOT_SUPPORTED; driver 535 predates the recovery action field.
    collection = make("healthy-a100").collect(0.0)
    s = collection.samples
    assert series(s, "vigil_gpu_fabric_state") == [] and series(s, "vigil_gpu_recovery_action") == []
    assert value(s, "vigil_gpu_pcie_link_generation_max", gpu="0") == 4
    gpu = collection.report["gpus"][0]
    assert gpu.fabric_state is None and gpu.recovery_action is None


def test_fabric_manager_down_and_back(clock, tmp_path):
    _, collector = _collector_of("faults: [{kind: fabric_manager_down, at_seconds: 30, duration_seconds: 60, "
                                 "state: in_progress}]\n", clock, tmp_path)
    states = {}
    for t in (0.0, 31.0, 45.0, 95.0):  # each past the 10 s cadence: a slow read
        clock.t = t
        c = collector.collect(t)
        states[t] = ({g.fabric_state for g in c.report["gpus"]},
                     value(c.samples, "vigil_gpu_fabric_state", gpu="4", state="in_progress"))
    assert states[0.0] == ({"completed"}, 0)
    assert states[31.0] == ({"in_progress"}, 1)  # every GPU of the node
    assert states[45.0] == ({"in_progress"}, 1)
    assert states[95.0] == ({"completed"}, 0)  # Fabric Manager back: registered again


def test_slow_reads_are_held_between_their_cadence(make, clock):
    """The fabric and link are read every nvlink_interval_seconds; a fast cycle reports the last."""
    collector = make("pcie-link-x8", nvlink_interval_seconds=10.0)
    first = collector.collect(0.0)
    clock.t = 5.0
    fast = collector.collect(5.0)
    assert value(fast.samples, "vigil_gpu_pcie_link_width", gpu="5") == 8
    assert fast.report["gpus"][5].pcie_link_width == 8
    assert fast.report["gpus"][5].pcie_link_width_max == 16
    keep = series(first.samples, "vigil_gpu_pcie_link_width", gpu="5")
    assert series(fast.samples, "vigil_gpu_pcie_link_width", gpu="5") == keep


def test_idle_downclock_is_seen_as_such_and_load_brings_the_link_back(clock, tmp_path):
    fake, collector = _collector_of("load: {utilization: 0.0, pcie_idle_link_generation: 1}\n"
                                    "faults: [{kind: pcie_link_degraded, at_seconds: 0, gpu: 5, width: 8}]\n",
                                    clock, tmp_path)
    idle = collector.collect(0.0).report["gpus"]
    assert [(g.pcie_link_generation, g.pcie_link_width) for g in idle] == [(1, 16)] * 5 + [(1, 8)] + [(1, 16)] * 2
    fake.set_utilization(range(8), 0.9)
    clock.t = 10.0
    busy = collector.collect(10.0).report["gpus"]
    # Under load the links train back to their maximum; the degraded width stays whatever the load.
    assert [(g.pcie_link_generation, g.pcie_link_width) for g in busy] == [(5, 16)] * 5 + [(5, 8)] + [(5, 16)] * 2
    assert {g.pcie_link_generation_max for g in busy} == {5}


def test_recovery_action_from_its_time_and_cleared_by_a_reset(make, clock):
    collector = make("recovery-action-h200")
    clock.t = 59.0
    before = collector.collect(59.0)
    assert before.report["gpus"][4].recovery_action == "none"
    clock.t = 61.0
    after = collector.collect(61.0)
    assert after.report["gpus"][4].recovery_action == "gpu_reset"
    assert {g.recovery_action for g in after.report["gpus"] if g.index != 4} == {"none"}
    assert value(after.samples, "vigil_gpu_recovery_action", gpu="4", action="gpu_reset") == 1
    assert value(after.samples, "vigil_gpu_recovery_action", gpu="4", action="none") == 0
    backend = collector._backend
    assert backend is not None
    backend.reset_gpu(4)
    clock.t = 62.0
    assert collector.collect(62.0).report["gpus"][4].recovery_action == "none"


def test_a_lost_gpu_keeps_no_fabric_or_link_state(clock, tmp_path):
    _, collector = _collector_of("faults: [{kind: gpu_lost, at_seconds: 5, gpu: 1}]\n", clock, tmp_path,
                                 nvlink_interval_seconds=100.0)
    collector.collect(0.0)
    clock.t = 6.0
    lost = collector.collect(6.0)
    gpu = lost.report["gpus"][1]
    assert gpu.health == "lost" and gpu.fabric_state is None and gpu.pcie_link_width is None
    assert series(lost.samples, "vigil_gpu_pcie_link_width", gpu="1") == []
    assert series(lost.samples, "vigil_gpu_fabric_state", gpu="1") == []
