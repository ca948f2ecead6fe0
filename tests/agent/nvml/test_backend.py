"""PynvmlBackend over FakeNvml: every field, its unit conversion, NotSupported and health mapping."""

from __future__ import annotations

import logging

import pynvml
import pytest

from vigil.agent.config import NvmlConfig
from vigil.agent.nvml.backend import PynvmlBackend, error_reason, open_backend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.profiles import H100_SXM_80GB, V100_SXM2_32GB
from vigil.agent.nvml.scenario import DEFAULT_SCENARIO, NodeScenario


def test_identity_of_every_h100(make_backend):
    _, backend = make_backend("healthy-h100")
    assert backend.device_count() == 8
    idents = [backend.identity(i) for i in range(8)]
    assert [i.pci_bus_id for i in idents] == list(H100_SXM_80GB.pcie_bus_ids)
    assert len({i.uuid for i in idents}) == 8
    first = idents[0]
    assert first.uuid.startswith("GPU-") and len(first.uuid) == 40
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.vbios_version == "96.00.74.00.0D"
    assert first.driver_version == "535.161.08"
    assert first.cuda_driver_version == "12.2"
    assert first.serial is not None and first.serial.isdigit()
    assert first.memory_total_bytes == 81559 * 1024 * 1024
    assert first.sm_clock_max_hertz == 1980e6
    assert first.memory_clock_max_hertz == 2619e6
    assert (first.slowdown_temperature_celsius, first.shutdown_temperature_celsius) == (87.0, 93.0)
    assert first.gpu_max_temperature_celsius == 85.0
    assert first.memory_max_temperature_celsius == 95.0
    assert first.nvlinks == tuple(range(18))


def test_uuids_differ_between_seeds_and_repeat_for_one(make_backend):
    _, a = make_backend("healthy-h100", seed=1)
    _, b = make_backend("healthy-h100", seed=2)
    _, c = make_backend("healthy-h100", seed=1)
    assert a.identity(0).uuid != b.identity(0).uuid
    assert a.identity(0).uuid == c.identity(0).uuid


def test_read_converts_every_field_to_base_units(make_backend, clock):
    _, backend = make_backend("healthy-h100")
    backend.identity(0)
    clock.t = 100.0
    r = backend.read(0)
    assert r.health == "ok" and r.errors == []
    assert 0.8 <= r.utilization_gpu_ratio <= 1.0
    assert 0.0 < r.utilization_memory_ratio < 1.0
    assert r.memory_total_bytes == 81559 * 1024 * 1024
    assert 0.8 * r.memory_total_bytes <= r.memory_used_bytes <= 0.9 * r.memory_total_bytes
    assert r.sm_clock_hertz == 1980e6 and r.memory_clock_hertz == 2619e6
    assert 30 <= r.temperature_celsius <= 70
    assert 30 <= r.memory_temperature_celsius <= 70
    assert 400 <= r.power_watts <= 700  # NVML's mW / 1000
    assert r.power_limit_watts == 700.0
    assert r.energy_joules is not None and r.energy_joules > 0
    assert r.performance_state == 0
    assert r.clock_event_reasons == 0
    assert (r.ecc_corrected_volatile, r.ecc_uncorrected_volatile) == (0, 0)
    assert (r.ecc_corrected_aggregate, r.ecc_uncorrected_aggregate) == (0, 0)
    assert (r.remapped_rows_correctable, r.remapped_rows_uncorrectable) == (0, 0)
    assert (r.remap_pending, r.remap_failure) == (False, False)
    assert r.pcie_replay_total is not None and r.pcie_replay_total >= 0
    # Hopper: PCIe throughput comes from the GPM pair, so the first read has none, the next has it.
    assert r.pcie_tx_bytes_per_second is None and r.pcie_rx_bytes_per_second is None
    clock.t += 2.0
    r = backend.read(0)
    assert r.pcie_tx_bytes_per_second > 0 and r.pcie_rx_bytes_per_second > 0
    assert len(r.nvlinks) == 18
    assert all(link.active and link.crc_errors == 0 and link.replay_errors == 0 and link.recovery_errors == 0
               for link in r.nvlinks)


def test_not_supported_fields_are_absent_and_not_asked_again(make_backend, clock):
    _, backend = make_backend("healthy-h100")
    backend.identity(0)
    r = backend.read(0)
    # SXM boards: no fan, no page retirement (nvidia-smi -q prints N/A for both).
    assert r.fan_speed_ratio is None
    assert (r.retired_pages_sbe, r.retired_pages_dbe, r.retired_pages_pending) == (None, None, None)
    assert r.errors == []
    assert "nvmlDeviceGetFanSpeed" in backend._unsupported[0]


def test_v100_reports_retired_pages_but_not_remapped_rows(make_backend):
    _, backend = make_backend("healthy-v100")
    ident = backend.identity(0)
    assert ident.name == V100_SXM2_32GB.name and len(ident.nvlinks) == 6
    r = backend.read(0)
    assert (r.retired_pages_sbe, r.retired_pages_dbe, r.retired_pages_pending) == (0, 0, False)
    assert r.remapped_rows_uncorrectable is None and r.remap_pending is None


def test_read_without_nvlinks_leaves_them_out(make_backend):
    _, backend = make_backend("healthy-h100")
    backend.identity(0)
    assert backend.read(0, slow=False).nvlinks == ()


def test_gpu_lost_is_a_health_state_for_that_gpu_only(make_backend, clock):
    _, backend = make_backend("gpu-lost")
    for i in range(8):
        backend.identity(i)
    clock.t = 61.0
    lost = backend.read(7)
    assert lost.health == "lost"
    assert lost.temperature_celsius is None and lost.power_watts is None
    assert lost.errors == [("device", "gpu_is_lost")]
    assert all(backend.read(i).health == "ok" for i in range(7))


def test_reset_required_and_unavailable(make_backend, clock):
    _, backend = make_backend("reset-required")
    backend.identity(2)
    clock.t = 60.0
    assert backend.read(2).health == "reset_required"
    clock.t = 0.0
    _, backend = make_backend("nvml-unavailable")
    backend.identity(0)
    clock.t = 60.0  # the driver goes away
    assert backend.read(0).health == "unavailable"
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        backend.device_count()


def test_identity_of_a_lost_gpu_raises_the_nvml_error(make_backend, clock):
    _, backend = make_backend("gpu-lost")
    clock.t = 61.0
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        backend.identity(7)


def test_other_nvml_errors_are_recorded_not_raised(clock):
    class FlakyNvml(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle):
            raise pynvml.NVMLError_Unknown()

    backend = PynvmlBackend(FlakyNvml(DEFAULT_SCENARIO, clock, start=0.0))
    backend.init()
    backend.identity(0)
    r = backend.read(0)
    assert r.health == "ok" and r.power_watts is None
    assert r.errors == [("nvmlDeviceGetPowerUsage", "unknown")]
    assert r.temperature_celsius is not None


def test_untaught_call_fails_loudly(clock):
    fake = FakeNvml(DEFAULT_SCENARIO, clock)
    with pytest.raises(AttributeError, match=r"does not implement pynvml\.nvmlDeviceGetBoardId"):
        fake.nvmlDeviceGetBoardId  # noqa: B018
    # Constants and exception classes are pynvml's own.
    assert fake.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert fake.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost


def test_calls_before_init_raise_uninitialized(clock):
    fake = FakeNvml(DEFAULT_SCENARIO, clock)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_xid_events_arrive_at_their_time(make_backend, clock):
    _, backend = make_backend("xid")
    assert backend.open_events(list(range(8))) == list(range(8))
    assert backend.wait_xid(0) is None  # scenario time 0: nothing yet
    clock.t = 60.0
    event = backend.wait_xid(0)
    assert event is not None and (event.index, event.code) == (4, 79)
    assert backend.wait_xid(0) is None  # delivered once
    backend.close_events()


def test_error_reason_is_snake_case():
    assert error_reason(pynvml.NVMLError_GpuIsLost()) == "gpu_is_lost"
    assert error_reason(pynvml.NVMLError_DriverNotLoaded()) == "driver_not_loaded"


def test_open_backend_fake_uses_default_or_named_scenario(clock):
    backend = open_backend(NvmlConfig(backend="fake"), clock)
    assert backend is not None and backend.device_count() == 8
    backend = open_backend(NvmlConfig(backend="fake", scenario="healthy-a100"), clock)
    assert backend is not None and backend.identity(0).name == "NVIDIA A100-SXM4-80GB"


def test_open_backend_logs_one_error_and_returns_none_when_init_fails(caplog, clock):
    clock.t = 0.0
    sc = NodeScenario.model_validate({"faults": [{"kind": "nvml_unavailable", "at_seconds": 0}]})
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        PynvmlBackend(FakeNvml(sc, clock)).init()
    with caplog.at_level(logging.ERROR):
        real = open_backend(NvmlConfig(backend="nvml"), clock)
    if real is not None:  # a machine with a driver
        real.shutdown()
        pytest.skip("NVML is available here; the failure path needs a machine without a driver")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "NVML unavailable" in errors[0].getMessage()
    assert "nvmlInit failed" in errors[0].getMessage()
