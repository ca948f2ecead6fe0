"""AmdSmiBackend over FakeAmdSmi: every amdsmi call the backend makes, units and mapping per field,
errors to health, the faults an AMD board shows (and the healthy GPUs beside them that must not)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vigil.agent.amdsmi import backend as backend_module
from vigil.agent.amdsmi.backend import AmdSmiBackend
from vigil.agent.amdsmi.fake import AMDSMI_STATUS_BUSY, DEFAULT_AMD_SCENARIO, AmdSmiLibraryException, FakeAmdSmi
from vigil.agent.amdsmi.profiles import MI300X_OAM_192GB
from vigil.agent.gpu_backend import GpuNotification
from vigil.agent.nvml.scenario import ScenarioError, load_node_scenario, parse_node_scenario

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "amdsmi"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _backend(scenario=DEFAULT_AMD_SCENARIO, t: float = 0.0) -> tuple[AmdSmiBackend, FakeAmdSmi, Clock]:
    clock = Clock()
    fake = FakeAmdSmi(scenario, clock, start=0.0)
    backend = AmdSmiBackend(fake)
    backend.init()
    clock.t = t
    return backend, fake, clock


def test_the_backend_makes_every_call_it_names_and_the_fake_answers_each():
    """Every amdsmi name the backend's source calls is called over the fake in a full round: identity,
    a slow read, configuration, processes, events, reset, shutdown."""
    # Called by name (_call's strings) or as self._m.amdsmi_...(): every amdsmi_ word of the source.
    source = Path(backend_module.__file__).read_text()
    named = {a or b for a, b in re.findall(r'"(amdsmi_\w+)"|\._m\.(amdsmi_\w+)\(', source)} | {"AmdSmiEventReader"}
    backend, fake, clock = _backend(load_node_scenario("faults-mi300x"))
    clock.t = 100.0
    for index in range(backend.device_count()):
        backend.identity(index) if index != 7 else None
        backend.read(index, slow=True)
    backend.config_facts(0)
    backend.running_processes(0)
    assert backend.open_events([0, 1]) == [0, 1]
    backend.wait_xid(10)
    backend.reset_gpu(1, timeout_seconds=5)
    backend.shutdown()
    assert named - fake.calls == set()
    assert fake.calls - named == set()  # the fake answered nothing the backend does not call


def test_a_call_the_fake_was_not_taught_fails_loudly():
    fake = FakeAmdSmi(DEFAULT_AMD_SCENARIO, Clock())
    with pytest.raises(AttributeError, match=r"amdsmi\.amdsmi_get_gpu_fan_speed.*teach agent/amdsmi/fake\.py"):
        fake.amdsmi_get_gpu_fan_speed  # noqa: B018 - the attribute access itself must fail


def test_the_fake_checks_argument_types_as_amdsmi_does():
    _, fake, _ = _backend()
    handle = fake.amdsmi_get_processor_handles()[0]
    with pytest.raises(fake.AmdSmiParameterException):
        fake.amdsmi_get_clock_info(handle, 0)  # a bare int, not AmdSmiClkType
    with pytest.raises(fake.AmdSmiParameterException):
        fake.amdsmi_get_gpu_activity("gpu0")


def test_units_and_mapping_of_a_busy_mi300x():
    backend, fake, _ = _backend(t=5.0)
    ident = backend.identity(0)
    assert (ident.vendor, ident.name, ident.nvlinks) == ("amd", "AMD Instinct MI300X", tuple(range(7)))
    assert ident.memory_total_bytes == 196592 * 1024 * 1024  # amdsmi_get_gpu_memory_total: bytes
    assert ident.sm_clock_max_hertz == 2100e6 and ident.memory_clock_max_hertz == 1300e6  # MHz
    assert ident.cuda_driver_version is None and ident.pci_bus_id == "0000:05:00.0"
    r = backend.read(0, slow=True)
    assert r.health == "ok" and r.errors == []
    assert 0.8 <= r.utilization_gpu_ratio <= 1.0  # gfx_activity percent
    assert r.power_limit_watts == 750.0  # power_cap uW
    assert 100 < r.power_watts <= 750  # current_socket_power W
    assert r.temperature_celsius is not None and r.edge_temperature_celsius is None  # MI300X: no edge sensor
    assert (r.pcie_link_generation, r.pcie_link_width, r.pcie_link_generation_max) == (5, 16, 5)  # 32000 MT/s
    energy = fake.amdsmi_get_energy_count(fake.handles[0])
    assert r.energy_joules == pytest.approx(energy["energy_accumulator"] * 15.259 / 1e6)
    assert backend.read(0, slow=False).energy_joules is None  # the slow cadence's
    assert r.clock_event_reasons == 0 and backend.reason_names(0) == []
    assert r.ecc_corrected_volatile == r.ecc_uncorrected_volatile == 0 and r.retired_pages_dbe == 0
    assert [link.active for link in r.nvlinks] == [True] * 7


def test_the_profile_matches_the_public_recording():
    text = (FIXTURES / "rocm-smi-concise-8xMI300X.txt").read_text()
    rows = re.findall(r"\[0x([0-9a-f]{4}) : 0x00\]\s+([\d.]+)°C\s+([\d.]+)W\s+\S+ \S+\s+(\d+)Mhz\s+(\d+)Mhz"
                      r".*?([\d.]+)W", text)
    assert len(rows) == 8
    d = MI300X_OAM_192GB.device
    for device_id, junction, power, sclk, mclk, cap in rows:
        assert int(device_id, 16) == MI300X_OAM_192GB.device_id
        assert abs(float(junction) - d.temperature_idle_celsius) <= 3
        assert abs(float(power) * 1000 - d.power_idle_mw) <= 5000
        assert int(sclk) == d.sm_clock_idle_mhz and float(cap) * 1000 == d.power_limit_mw
        assert int(mclk) == 900


def test_amd_faults_reach_the_same_fields_and_healthy_gpus_stay_clean():
    backend, _, clock = _backend(load_node_scenario("faults-mi300x"))
    for i in range(8):
        backend.identity(i)
    clock.t = 100.0
    r = {i: backend.read(i, slow=True) for i in range(8)}
    assert r[0].ecc_corrected_volatile == 0 and r[0].clock_event_reasons == 0 and not r[0].retired_pages_pending
    assert r[1].ecc_corrected_volatile == 450  # 5/s from 10 s
    assert r[2].ecc_uncorrected_volatile == 1 and r[2].retired_pages_dbe == 1 and r[2].retired_pages_pending
    assert ("umc", 0, 1) in r[2].ecc_blocks
    assert r[3].xgmi_corrected_errors == 1400 and r[3].xgmi_uncorrected_errors == 0
    assert [link.link for link in r[4].nvlinks if link.active is False] == [5]
    assert backend.reason_names(r[5].clock_event_reasons or 0) == ["hw_thermal_slowdown"]
    assert r[6].pcie_replay_total is not None and r[6].pcie_replay_total >= 80
    assert (r[7].health, r[7].errors) == ("lost", [("device", "not_found")])


def test_errors_map_to_health_and_are_counted_by_reason():
    backend, _, _ = _backend()
    assert backend.health_of(AmdSmiLibraryException(31)) == "lost"
    assert backend.health_of(AmdSmiLibraryException(54)) == "reset_required"
    assert backend.health_of(AmdSmiLibraryException(34)) == "unavailable"
    assert backend.health_of(AmdSmiLibraryException(AMDSMI_STATUS_BUSY)) is None
    assert backend.error_reason(AmdSmiLibraryException(AMDSMI_STATUS_BUSY)) == "busy"
    backend2, _, clock = _backend(parse_node_scenario({"profile": "mi300x-oam-192gb",
                                                       "faults": [{"kind": "reset_required", "at_seconds": 1, "gpu": 2},
                                                                  {"kind": "nvml_unavailable", "at_seconds": 50}]}))
    clock.t = 2.0
    assert backend2.read(2).health == "reset_required" and backend2.read(1).health == "ok"
    clock.t = 60.0
    assert backend2.read(1).health == "unavailable"


def test_a_hung_gpu_is_notified_as_a_ring_hang_and_a_reset_clears_it():
    backend, fake, clock = _backend(load_node_scenario("faults-mi300x"))
    backend.identity(7)
    assert backend.open_events(list(range(8))) == list(range(8))
    clock.t = 95.0
    got = [backend.wait_xid(10) for _ in range(3)]
    assert got == [GpuNotification(5, "thermal_throttle", "fake amdgpu: thermal_throttle on 0000:a6:00.0"),
                   GpuNotification(7, "ring_hang", "fake amdgpu: ring_hang on 0000:e5:00.0"), None]
    assert backend.read(7).health == "lost"
    assert "Successfully reset" in backend.reset_gpu(7, timeout_seconds=5)
    assert backend.read(7).health == "ok" and fake.resets == [(7, 95.0)]
    after = [backend.wait_xid(10) for _ in range(2)]
    assert [(e.index, e.kind) for e in after if isinstance(e, GpuNotification)] == [
        (7, "gpu_pre_reset"), (7, "gpu_post_reset")]


def test_scenarios_refuse_the_other_vendors_faults():
    with pytest.raises(ScenarioError, match="xid is an NVIDIA fault"):
        parse_node_scenario({"profile": "mi300x-oam-192gb", "faults": [{"kind": "xid", "code": 79, "at_seconds": 1,
                                                                         "gpu": 0}]})
    with pytest.raises(ScenarioError, match="bad_pages is an AMD fault"):
        parse_node_scenario({"faults": [{"kind": "bad_pages", "at_seconds": 1, "gpu": 0}]})
    with pytest.raises(ValueError, match="needs an AMD profile"):
        FakeAmdSmi(load_node_scenario("healthy-h100"), Clock())
