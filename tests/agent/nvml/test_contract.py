"""The backend's field checks against real NVML: runs under the `gpu` marker on a node with an
NVIDIA driver and skips elsewhere. The same checks hold over FakeNvml (tests/agent/nvml/test_backend.py)."""

from __future__ import annotations

import re

import pynvml
import pytest

from vigil.agent.nvml.backend import PynvmlBackend

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVIDIA driver: nvmlInit failed ({exc})")
    pynvml.nvmlShutdown()
    b = PynvmlBackend(pynvml)
    b.init()
    yield b
    b.shutdown()


def test_identity_fields(backend):
    assert backend.device_count() >= 1
    ident = backend.identity(0)
    assert ident.uuid.startswith(("GPU-", "MIG-"))
    assert ident.name
    assert len(ident.pci_bus_id.split(":")) == 3
    assert ident.driver_version and ident.cuda_driver_version
    assert ident.memory_total_bytes and ident.memory_total_bytes > 1024**3
    assert ident.sm_clock_max_hertz and ident.sm_clock_max_hertz > 1e8


def test_read_fields_have_base_units(backend):
    backend.identity(0)
    r = backend.read(0)
    assert r.health == "ok"
    if r.utilization_gpu_ratio is not None:
        assert 0.0 <= r.utilization_gpu_ratio <= 1.0
    assert r.memory_total_bytes and 0 <= (r.memory_used_bytes or 0) <= r.memory_total_bytes
    if r.temperature_celsius is not None:
        assert 0 < r.temperature_celsius < 120
    if r.power_watts is not None:
        assert 0 < r.power_watts < 2000  # W, not mW
    if r.energy_joules is not None:
        assert r.energy_joules > 0
    if r.sm_clock_hertz is not None:
        assert 1e7 < r.sm_clock_hertz < 5e9
    for link in r.nvlinks:
        assert link.active in (True, False, None)


def test_xid_event_wait_times_out_cleanly(backend):
    registered = backend.open_events([0])
    try:
        event = backend.wait_xid(10) if registered else None
        assert event is None or (0 <= event.index < backend.device_count() and event.code > 0)
    finally:
        backend.close_events()


def test_gpm_pair_gives_ratios_on_hopper(backend):
    """GPM (Hopper and later): the first read takes a sample, the next one has values over the pair."""
    import time

    ident = backend.identity(0)
    if not any(model in ident.name for model in ("H100", "H200", "H20", "GH200", "B200", "B100")):
        pytest.skip(f"{ident.name}: GPM is Hopper and later")
    backend.read(0, slow=False)
    time.sleep(1.0)
    r = backend.read(0, slow=False)
    for name in ("sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio", "dram_active_ratio"):
        value = getattr(r, name)
        assert value is not None, name
        assert 0.0 <= value <= 1.0, (name, value)
    # PCIe from the pair too (the backend skips NVML's blocking 20 ms sample on GPM devices).
    assert r.pcie_tx_bytes_per_second is not None and r.pcie_tx_bytes_per_second >= 0.0


def test_running_processes_are_listed(backend):
    pids = backend.running_pids(0)
    assert pids is not None  # a healthy GPU always answers, an idle one with []
    assert all(pid > 0 for pid in pids)


def test_mig_mode_and_devices_as_nvml_says(backend):
    """The MIG fields against NVML itself: the mode as nvmlDeviceGetMigMode answers (absent where it
    is NotSupported), and in MIG mode one device per occupied slot, each named and profiled."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        current = pending = None
    r = backend.read(0, slow=True)
    want = (None, None) if current is None else (bool(current), bool(pending))
    assert (r.mig_mode_current, r.mig_mode_pending) == want
    if not current:
        assert r.mig_devices == ()
        return
    assert r.mig_devices and len({m.device.uuid for m in r.mig_devices}) == len(r.mig_devices)
    for m in r.mig_devices:
        assert m.device.uuid.startswith("MIG-") and re.fullmatch(r"\d+g\.\d+gb(\+\w+)?", m.device.profile)
        assert m.memory_total_bytes and 0 <= (m.memory_used_bytes or 0) <= m.memory_total_bytes


def test_memory_v2_matches_v1_with_the_reserve_apart(backend):
    """The backend reads memory info v2 (R510+) and reports `used` as v1 defines it (allocated plus
    reserved): on a GPU nobody is allocating on, it equals what NVML's v1 call answers, and the
    reserve is a real share of the memory, not zero and not all of it."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    if backend.running_pids(0):
        pytest.skip("GPU 0 is in use: its allocations move between the two reads")
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    r = backend.read(0, slow=False)
    assert r.memory_total_bytes == v1.total
    if r.memory_reserved_bytes is None:  # a driver before R510 refuses v2: the backend fell back to v1
        assert r.memory_used_bytes == v1.used
        return
    assert 0 < r.memory_reserved_bytes < r.memory_total_bytes // 10
    assert r.memory_used_bytes is not None and abs(r.memory_used_bytes - v1.used) <= 64 * 2**20


def test_video_engines_are_ratios_or_absent(backend):
    """nvmlDeviceGetEncoderUtilization / DecoderUtilization answer [percent, sampling period]: the
    backend reports a 0..1 ratio, or nothing where the GPU has no such engine."""
    r = backend.read(0, slow=False)
    for name in ("encoder_utilization_ratio", "decoder_utilization_ratio"):
        value = getattr(r, name)
        assert value is None or 0.0 <= value <= 1.0, (name, value)


def test_config_facts_as_nvml_says(backend):
    """Issue 44: each configuration fact in our units, or absent (NotSupported), never an error on a
    healthy GPU. Over FakeNvml: tests/agent/nvml/test_config_facts.py."""
    facts = backend.config_facts(0)
    assert facts.health == "ok" and facts.errors == (), facts.errors
    assert facts.driver_version == backend.identity(0).driver_version
    assert facts.vbios_version == backend.identity(0).vbios_version
    assert facts.inforom_image_version is None or re.fullmatch(r"[A-Z0-9.]+", facts.inforom_image_version)
    for flag in (facts.ecc_mode_current, facts.persistence_mode, facts.mig_mode_current):
        assert flag in (True, False, None)
    if facts.power_limit_watts is not None:
        assert 10 < facts.power_limit_watts < 2000  # W, not mW
    for hertz in (facts.application_sm_clock_hertz, facts.application_memory_clock_hertz):
        assert hertz is None or 1e8 < hertz < 1e10  # Hz, not MHz


def test_fabric_pcie_link_and_recovery_action_as_nvml_says(backend):
    """Issue 44: the fabric state is one of ours or absent (no NVSwitch), the PCIe link current at
    most its maximum, the recovery action one of the wire's words or absent (a driver before it)."""
    backend.identity(0)
    r = backend.read(0)
    assert r.health == "ok" and r.errors == [], r.errors
    assert r.fabric_state in (None, "not_started", "in_progress", "completed")
    assert set(r.fabric_health) <= {"degraded_bandwidth", "route_recovery", "route_unhealthy",
                                    "access_timeout_recovery"}
    assert r.pcie_link_generation_max in (1, 2, 3, 4, 5, 6) and r.pcie_link_width_max in (1, 2, 4, 8, 16, 32)
    assert r.pcie_link_generation is not None and 1 <= r.pcie_link_generation <= r.pcie_link_generation_max
    assert r.pcie_link_width is not None and 1 <= r.pcie_link_width <= r.pcie_link_width_max
    assert r.recovery_action in (None, "none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")
