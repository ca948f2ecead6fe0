"""The NVML readings behind dcgm-exporter's last default counters: video engine utilisation, the
driver's memory reserve (memory info v2, v1 on older drivers) and the NVLink payload counters (slow
cadence, all links through scopeId UINT_MAX), through the real backend over FakeNvml."""

from __future__ import annotations

from typing import Any

import pynvml

from vigil.agent.nvml.backend import NVLINK_ALL_LINKS, PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.profiles import H100_SXM_80GB, MIB
from vigil.agent.nvml.scenario import NodeScenario, load_node_scenario


def test_encoder_and_decoder_utilization_are_ratios(make_backend, clock) -> None:
    _, backend = make_backend("healthy-h100")
    backend.identity(0)
    clock.t = 50.0
    r = backend.read(0)
    # The H100 has NVDEC but no NVENC; real NVML answers 0 % for both under training, not NotSupported.
    assert (r.encoder_utilization_ratio, r.decoder_utilization_ratio) == (0.0, 0.0)
    assert r.errors == []


def test_memory_reserve_is_apart_and_used_counts_it(make_backend, clock) -> None:
    fake, backend = make_backend("healthy-h100")
    backend.identity(0)
    clock.t = 50.0
    r = backend.read(0)
    assert r.memory_reserved_bytes == H100_SXM_80GB.memory_reserved_bytes == 551 * MIB
    v1 = fake.nvmlDeviceGetMemoryInfo(fake.handles[0])
    v2 = fake.nvmlDeviceGetMemoryInfo(fake.handles[0], pynvml.nvmlMemory_v2)
    # v1's used is allocated + reserved (nvmlMemory_t); the backend keeps that meaning.
    assert v1.used == v2.used + v2.reserved and v1.free == v2.free
    assert r.memory_used_bytes == v1.used and r.memory_total_bytes == v1.total
    assert v2.total == v2.used + v2.reserved + v2.free


def test_an_idle_gpu_uses_only_its_reserve(make_backend, clock) -> None:
    _, backend = make_backend(NodeScenario(profile="h100-sxm-80gb", gpus=1))  # load utilization 0
    backend.identity(0)
    r = backend.read(0)
    assert r.memory_used_bytes == r.memory_reserved_bytes == 551 * MIB  # the recorded H100: 480 == 480


class _DriverBeforeR510(FakeNvml):
    """A driver without nvmlDeviceGetMemoryInfo_v2: pynvml raises FunctionNotFound for it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.v2_calls = 0

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        if version:
            self.v2_calls += 1
            raise pynvml.NVMLError_FunctionNotFound()
        return super().nvmlDeviceGetMemoryInfo(handle)


def test_a_driver_without_memory_info_v2_falls_back_to_v1_for_good(clock) -> None:
    fake = _DriverBeforeR510(load_node_scenario("healthy-h100"), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    backend.identity(0)
    for t in (10.0, 20.0, 30.0):
        clock.t = t
        r = backend.read(0)
        assert r.errors == []  # a missing v2 is not an error to count
        assert r.memory_reserved_bytes is None  # absent, never 0
        assert r.memory_used_bytes is not None and r.memory_total_bytes == H100_SXM_80GB.memory_total_bytes
    assert fake.v2_calls == 1


def test_nvlink_data_counters_on_the_slow_cadence_in_bytes(make_backend, clock) -> None:
    fake, backend = make_backend("healthy-h100")
    backend.identity(0)
    clock.t = 100.0
    first = backend.read(0, slow=True)
    assert first.nvlink_data_tx_bytes is not None and first.nvlink_data_rx_bytes is not None
    handle = fake.handles[0]
    assert first.nvlink_data_tx_bytes == handle.nvlink_data_kib(100.0) * 1024  # NVML's KiB -> bytes
    clock.t = 105.0
    fast = backend.read(0, slow=False)
    assert (fast.nvlink_data_tx_bytes, fast.nvlink_data_rx_bytes) == (None, None)  # not read between
    clock.t = 110.0
    second = backend.read(0, slow=True)
    rate = (second.nvlink_data_tx_bytes - first.nvlink_data_tx_bytes) / 10.0
    # 18 links x 25 GB/s x the training share (0.30) x the scenario's mean utilisation
    expected = 18 * 25e9 * 0.30 * handle.load.utilization
    assert abs(rate - expected) <= 0.001 * expected


def test_nvlink_data_scope_is_all_links_or_one(make_backend) -> None:
    fake, _ = make_backend("healthy-h100")
    fake.nvmlInit()
    h = fake.handles[0]
    tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    total, link0, bad = fake.nvmlDeviceGetFieldValues(h, [(tx, NVLINK_ALL_LINKS), (tx, 0), (tx, 18)])
    assert (total.nvmlReturn, link0.nvmlReturn) == (pynvml.NVML_SUCCESS, pynvml.NVML_SUCCESS)
    assert total.scopeId == NVLINK_ALL_LINKS and link0.value.ullVal == total.value.ullVal // 18
    assert bad.nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT


class _NoHbmSensor(FakeNvml):
    """A board whose memory-temperature field answers NotSupported (no HBM sensor)."""

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: Any) -> Any:
        values = super().nvmlDeviceGetFieldValues(handle, field_ids)
        for v in values:
            if v.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values


def test_one_unsupported_field_does_not_hide_the_others(clock) -> None:
    fake = _NoHbmSensor(load_node_scenario("healthy-h100"), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    backend.identity(0)
    for t in (10.0, 20.0):
        clock.t = t
        r = backend.read(0, slow=True)
        assert r.memory_temperature_celsius is None and r.errors == []
        assert r.nvlink_data_tx_bytes is not None


def test_a_gpu_without_nvlink_has_no_nvlink_counters(make_backend, clock) -> None:
    # The recorded real H100 (a VM, no NVLink) is the other case: backend-ops.json, test_replay.py.
    fake, backend = make_backend("healthy-h100")
    fake.handles[0].nvlink_count = 0
    backend.identity(0)
    r = backend.read(0, slow=True)
    assert (r.nvlink_data_tx_bytes, r.nvlink_data_rx_bytes) == (None, None) and r.errors == []
