"""NVML GPM through the real backend over FakeNvml: Hopper answers, older GPUs are absent (never 0),
the first read of a pair has no values, every sample allocated is freed, and the scenario's
workload and faults (memory-bound, power cap) move the values as a profiler would see them."""

from __future__ import annotations

import pynvml
import pytest

from vigil.agent.collectors.gpu import GpuCollector, GpuConfig
from vigil.agent.nvml.scenario import ScenarioError, parse_node_scenario

# PCIe throughput comes from the pair too on Hopper, from NVML's 20 ms sample before it.
GPM_ONLY = ("graphics_active_ratio", "sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio",
            "dram_active_ratio", "fp16_active_ratio", "fp32_active_ratio", "fp64_active_ratio",
            "nvlink_tx_bytes_per_second", "nvlink_rx_bytes_per_second")
GPM_FIELDS = (*GPM_ONLY, "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second")


@pytest.mark.parametrize("scenario", ["healthy-h100", "healthy-h200"])
def test_hopper_gpm_values_after_a_pair_of_samples(make_backend, clock, scenario) -> None:
    fake, backend = make_backend(scenario)
    first = backend.read(0)
    assert all(getattr(first, f) is None for f in GPM_FIELDS)  # one sample: no interval yet
    assert len(fake.gpm_samples) == 1  # kept for the next pair
    clock.t += 5.0
    second = backend.read(0)
    assert second.errors == []
    for f in GPM_FIELDS:
        assert getattr(second, f) is not None, f
    assert 0.8 < second.sm_active_ratio <= 1.0  # busy training: SMs nearly always active
    assert 0.35 < second.tensor_active_ratio < 0.7
    assert 0.2 < second.dram_active_ratio < 0.6
    assert second.fp64_active_ratio == 0.0
    # H100: 18 NVLink 4 links at 25 GB/s per direction; a training job uses a share of it.
    assert 1e10 < second.nvlink_tx_bytes_per_second < 18 * 25e9
    assert 1e8 < second.pcie_tx_bytes_per_second < 64e9
    assert len(fake.gpm_samples) == 1  # the older sample of the pair was freed
    backend.shutdown()
    assert fake.gpm_samples == {}


@pytest.mark.parametrize("scenario", ["healthy-a100", "healthy-v100"])
def test_pre_hopper_gpm_is_absent_never_zero(make_backend, clock, scenario) -> None:
    fake, backend = make_backend(scenario)
    for _ in range(3):
        reading = backend.read(0)
        clock.t += 1.0
        assert reading.errors == []
        assert all(getattr(reading, f) is None for f in GPM_ONLY)
        assert reading.utilization_gpu_ratio is not None  # the rest of the GPU still reads
        assert reading.pcie_tx_bytes_per_second is not None  # from the 20 ms sample
    assert fake.gpm_samples == {}  # support is asked first: nothing allocated


def test_the_fake_refuses_gpm_like_nvml_on_an_a100(make_backend) -> None:
    fake, _backend = make_backend("healthy-a100")
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice == 0
    sample = fake.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlGpmSampleGet(handle, sample)
    fake.nvmlGpmSampleFree(sample)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # freed twice
        fake.nvmlGpmSampleFree(sample)


def test_a_lost_gpu_drops_its_pending_sample_and_starts_a_new_pair(make_backend, clock) -> None:
    sc = parse_node_scenario({"load": {"utilization": 0.9},
                              "faults": [{"kind": "gpu_lost", "gpu": 0, "at_seconds": 10}]})
    fake, backend = make_backend(sc)
    backend.read(0)
    assert len(fake.gpm_samples) == 1
    clock.t = 11.0
    assert backend.read(0).health == "lost"
    assert fake.gpm_samples == {}


def test_memory_bound_workload_saturates_dram_with_tensor_idle(make_backend, clock) -> None:
    _fake, backend = make_backend("memory-bound-h100")
    backend.read(3)
    clock.t += 2.0
    r = backend.read(3)
    assert r.dram_active_ratio == pytest.approx(0.93)
    assert r.tensor_active_ratio is not None and r.tensor_active_ratio < 0.1
    assert r.sm_active_ratio is not None and r.sm_active_ratio > 0.8  # busy, but waiting on memory


def test_power_cap_and_memory_bound_faults_on_single_gpus(make_backend, clock) -> None:
    _fake, backend = make_backend("capped-vs-memory-bound-h100")
    for i in range(8):
        backend.identity(i)
        backend.read(i)
    clock.t += 2.0
    readings = [backend.read(i) for i in range(8)]
    capped, memory_bound, healthy = readings[1], readings[5], readings[0]
    assert memory_bound.dram_active_ratio == pytest.approx(0.95)
    assert memory_bound.tensor_active_ratio is not None and memory_bound.tensor_active_ratio < 0.1
    assert capped.sm_clock_hertz == pytest.approx(int(1980 * 0.55) * 1e6)
    assert "sw_power_cap" in backend.reason_names(capped.clock_event_reasons or 0)
    # A capped GPU's cycles stay busy, but it moves less data per second than a healthy one.
    assert capped.sm_active_ratio is not None and capped.sm_active_ratio > 0.8
    assert capped.dram_active_ratio is not None and healthy.dram_active_ratio is not None
    assert capped.dram_active_ratio < healthy.dram_active_ratio * 0.7


def test_collector_exports_gpm_in_base_units_only_once_a_pair_exists(make_backend, clock) -> None:
    _fake, backend = make_backend("memory-bound-h100")
    collector = GpuCollector(GpuConfig(xid_events=False), backend, clock)
    first = collector.collect(clock.t)
    assert not [s for s in first.samples if s.name == "vigil_gpu_dram_active_ratio"]
    assert first.report["gpus"][0].dram_active_ratio is None
    clock.t += 1.0
    second = collector.collect(clock.t)
    dram = [s for s in second.samples if s.name == "vigil_gpu_dram_active_ratio"]
    assert len(dram) == 8 and all(s.value == pytest.approx(0.93) for s in dram)
    nvlink = [s.value for s in second.samples if s.name == "vigil_gpu_nvlink_tx_bytes_per_second"]
    assert len(nvlink) == 8 and all(v > 1e9 for v in nvlink)  # bytes per second, not MiB/s
    state = second.report["gpus"][0]
    assert state.dram_active_ratio == pytest.approx(0.93) and state.tensor_active_ratio < 0.1
    assert state.pcie_tx_bytes_per_second is not None and state.pcie_tx_bytes_per_second > 1e8
    collector.close()


def test_collector_exports_no_gpm_series_for_an_a100(make_backend, clock) -> None:
    _fake, backend = make_backend("healthy-a100")
    collector = GpuCollector(GpuConfig(xid_events=False), backend, clock)
    collector.collect(clock.t)
    clock.t += 1.0
    out = collector.collect(clock.t)
    gpm = {"vigil_gpu_sm_active_ratio", "vigil_gpu_tensor_active_ratio", "vigil_gpu_dram_active_ratio",
           "vigil_gpu_nvlink_rx_bytes_per_second"}
    assert not [s for s in out.samples if s.name in gpm]
    assert [s for s in out.samples if s.name == "vigil_gpu_utilization_ratio"]
    # PCIe throughput from NVML's 20 ms sample instead: both directions of every GPU.
    assert len([s for s in out.samples if s.name == "vigil_gpu_pcie_throughput_bytes_per_second"]) == 16
    collector.close()


@pytest.mark.parametrize(("data", "message"), [
    ({"load": {"workload": "compute_bound"}}, "load.workload:"),
    ({"faults": [{"kind": "memory_bound", "gpu": 0, "at_seconds": 0, "dram_active_ratio": 1.5}]},
     "faults.0.memory_bound.dram_active_ratio:"),
    ({"faults": [{"kind": "power_cap", "gpu": 0, "at_seconds": 0, "clock_ratio": 0}]},
     "faults.0.power_cap.clock_ratio:"),
    ({"faults": [{"kind": "power_cap", "gpu": 8, "at_seconds": 0}]}, "faults.0.gpu: 8 but the node has 8 GPUs"),
])
def test_gpm_scenario_options_are_validated(data, message) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_node_scenario(data)


@pytest.mark.parametrize(("scenario", "sampled"), [("healthy-h100", False), ("healthy-a100", True)])
def test_pcie_throughput_call_only_without_gpm(clock, scenario, sampled) -> None:
    """nvmlDeviceGetPcieThroughput blocks for its 20 ms sample (21 ms a call on a real H100,
    tests/fixtures/nvml-real/costs-before-pcie-fix.json): a GPU with GPM gets PCIe from the pair
    of samples instead, and the backend never calls it there."""
    from vigil.agent.nvml.backend import PynvmlBackend
    from vigil.agent.nvml.fake import FakeNvml
    from vigil.agent.nvml.recording import RecordingNvml
    from vigil.agent.nvml.scenario import load_node_scenario

    nvml = RecordingNvml(FakeNvml(load_node_scenario(scenario), clock, start=0.0))
    # RecordingNvml stands in for the pynvml module (through __getattr__), which
    # PynvmlBackend's annotation (ModuleType | FakeNvml) does not name.
    backend = PynvmlBackend(nvml)  # type: ignore[arg-type]  # duck-typed pynvml module
    backend.init()
    backend.identity(0)
    backend.read(0)
    clock.t += 2.0
    reading = backend.read(0)
    called = {c["call"] for c in nvml.calls}
    assert ("nvmlDeviceGetPcieThroughput" in called) is sampled
    assert reading.pcie_tx_bytes_per_second is not None and reading.pcie_tx_bytes_per_second > 0
    assert reading.pcie_rx_bytes_per_second is not None and reading.pcie_rx_bytes_per_second > 0
    backend.shutdown()
