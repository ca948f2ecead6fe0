"""PynvmlBackend.config_facts over FakeNvml: each configuration fact as the recorded boards report it,
each error path, and the config_drift scenario fault (a node with another driver, a staged roll-out)."""

from __future__ import annotations

import pynvml
import pytest

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import ScenarioError, parse_node_scenario


def _backend(clock, scenario: dict, fake_class: type[FakeNvml] = FakeNvml) -> tuple[FakeNvml, PynvmlBackend]:
    fake = fake_class(parse_node_scenario(scenario), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    return fake, backend


def test_h100_facts_are_the_recorded_nvidia_smi_q(clock):
    # tests/fixtures/nvidia-smi/nvidia-smi-q-8xH100-535.161.08.txt: driver 535.161.08, CUDA 12.2 (lines
    # 5-6), persistence on (15), MIG off (18), VBIOS 96.00.74.00.0D (28), image G520.0200.00.05 (36),
    # ECC on (124), application clocks 1980/2619 MHz (189-191); the enforced limit 700 W is the board's.
    _, backend = _backend(clock, {"profile": "h100-sxm-80gb"})
    facts = backend.config_facts(0)
    assert facts.health == "ok" and facts.errors == ()
    assert (facts.driver_version, facts.cuda_driver_version) == ("535.161.08", "12.2")
    assert (facts.vbios_version, facts.inforom_image_version) == ("96.00.74.00.0D", "G520.0200.00.05")
    assert facts.ecc_mode_current is True and facts.persistence_mode is True and facts.mig_mode_current is False
    assert facts.power_limit_watts == 700.0
    assert (facts.application_sm_clock_hertz, facts.application_memory_clock_hertz) == (1980e6, 2619e6)


def test_h200_facts_are_its_recording(clock):
    # tests/fixtures/nvml-real-h200/nvidia-smi-q.txt: driver 580.159.04 (7), VBIOS 96.00.A5.00.1A (32),
    # image G520.0282.02.02 (47), application clocks 1980/3201 MHz (225-227).
    _, backend = _backend(clock, {"profile": "h200-sxm-141gb"})
    facts = backend.config_facts(3)
    assert (facts.driver_version, facts.cuda_driver_version) == ("580.159.04", "13.0")
    assert (facts.vbios_version, facts.inforom_image_version) == ("96.00.A5.00.1A", "G520.0282.02.02")
    assert (facts.application_sm_clock_hertz, facts.application_memory_clock_hertz) == (1980e6, 3201e6)


def test_mig_mode_is_none_where_the_board_has_no_mig(clock):
    _, backend = _backend(clock, {"profile": "v100-sxm2-32gb"})
    facts = backend.config_facts(0)
    assert facts.mig_mode_current is None and facts.errors == ()  # NotSupported: absent, not an error
    assert facts.ecc_mode_current is True


def test_a_node_with_another_driver(clock):
    _, backend = _backend(clock, {"faults": [{"kind": "config_drift", "at_seconds": 0, "driver_version": "550.90.07",
                                              "cuda_driver_version": "12.4"}]})
    facts = [backend.config_facts(i) for i in range(8)]
    assert {(f.driver_version, f.cuda_driver_version) for f in facts} == {("550.90.07", "12.4")}
    assert backend.identity(0).driver_version == "550.90.07"


def test_a_staged_rollout_changes_the_facts_at_its_time(clock):
    _, backend = _backend(clock, {"faults": [
        {"kind": "config_drift", "at_seconds": 100, "driver_version": "550.90.07", "cuda_driver_version": "12.4"},
        {"kind": "config_drift", "at_seconds": 200, "driver_version": "550.127.05"}]})
    clock.t = 99.0
    assert backend.config_facts(0).driver_version == "535.161.08"
    clock.t = 100.0
    facts = backend.config_facts(0)
    assert (facts.driver_version, facts.cuda_driver_version) == ("550.90.07", "12.4")
    clock.t = 250.0  # a later drift overrides only what it sets
    facts = backend.config_facts(0)
    assert (facts.driver_version, facts.cuda_driver_version) == ("550.127.05", "12.4")


def test_one_gpu_drifted_leaves_the_others(clock):
    _, backend = _backend(clock, {"faults": [{
        "kind": "config_drift", "at_seconds": 0, "gpu": 5, "vbios_version": "96.00.99.00.01", "ecc_mode": "disabled",
        "persistence_mode": "disabled", "power_limit_watts": 500, "application_sm_clock_mhz": 1755,
        "application_memory_clock_mhz": 2619, "inforom_image_version": "G520.0200.00.03"}]})
    drifted, other = backend.config_facts(5), backend.config_facts(4)
    assert drifted.vbios_version == "96.00.99.00.01" and other.vbios_version == "96.00.74.00.0D"
    assert drifted.inforom_image_version == "G520.0200.00.03"
    assert drifted.ecc_mode_current is False and other.ecc_mode_current is True
    assert drifted.persistence_mode is False and other.persistence_mode is True
    assert drifted.power_limit_watts == 500.0 and other.power_limit_watts == 700.0
    assert drifted.application_sm_clock_hertz == 1755e6
    backend.identity(5)
    reading = backend.read(5)
    assert reading.power_limit_watts == 500.0 and reading.power_watts is not None and reading.power_watts <= 500.0


@pytest.mark.parametrize("fault, message", [
    ({"kind": "config_drift", "at_seconds": 0}, "changes nothing"),
    ({"kind": "config_drift", "gpu": 1, "driver_version": "550.90.07"}, "the node's"),
    ({"kind": "config_drift", "driver_version": "latest"}, "driver_version"),
    ({"kind": "config_drift", "cuda_driver_version": "12"}, "cuda_driver_version"),
    ({"kind": "config_drift", "gpu": 9, "ecc_mode": "disabled"}, "node has 8 GPUs"),
    ({"kind": "config_drift", "ecc_mode": "off"}, "ecc_mode"),
])
def test_config_drift_is_validated(fault, message):
    with pytest.raises(ScenarioError, match=message):
        parse_node_scenario({"faults": [fault]})


def test_a_failing_call_is_counted_and_its_fact_absent(clock):
    class FlakyNvml(FakeNvml):
        def nvmlDeviceGetInforomImageVersion(self, handle):
            raise pynvml.NVMLError_CorruptedInforom()

    _, backend = _backend(clock, {}, FlakyNvml)
    facts = backend.config_facts(0)
    assert facts.inforom_image_version is None and facts.errors == (("nvmlDeviceGetInforomImageVersion",
                                                                     "corrupted_inforom"),)
    assert facts.vbios_version == "96.00.74.00.0D"
    assert backend.config_facts(0).errors  # not a capability: asked again


def test_not_supported_is_absent_and_not_asked_again(clock):
    calls = []

    class NoAppClocks(FakeNvml):
        def nvmlDeviceGetApplicationsClock(self, handle, clock_type):
            calls.append(clock_type)
            raise pynvml.NVMLError_NotSupported()

    _, backend = _backend(clock, {}, NoAppClocks)
    for _ in range(2):
        facts = backend.config_facts(0)
        assert facts.application_sm_clock_hertz is None and facts.application_memory_clock_hertz is None
        assert facts.errors == ()
    assert calls == [pynvml.NVML_CLOCK_SM]


def test_a_driver_without_the_function_is_not_supported_not_an_error(clock):
    # pynvml: nvmlDeviceGetApplicationsClock is deprecated, "will be removed in CUDA 14.0"; a driver
    # without the symbol makes pynvml raise FunctionNotFound.
    calls = []

    class Cuda14(FakeNvml):
        def nvmlDeviceGetApplicationsClock(self, handle, clock_type):
            calls.append(clock_type)
            raise pynvml.NVMLError_FunctionNotFound()

    _, backend = _backend(clock, {}, Cuda14)
    for _ in range(2):
        facts = backend.config_facts(0)
        assert facts.application_sm_clock_hertz is None and facts.errors == ()
    assert len(calls) == 1


def test_a_lost_gpu_has_health_and_no_facts(clock):
    _, backend = _backend(clock, {"faults": [{"kind": "gpu_lost", "gpu": 2, "at_seconds": 10}]})
    clock.t = 11.0
    facts = backend.config_facts(2)
    assert facts.health == "lost" and facts.vbios_version is None and facts.errors == (("device", "gpu_is_lost"),)
    assert backend.config_facts(1).health == "ok"


def test_nvml_gone_is_unavailable(clock):
    _, backend = _backend(clock, {"faults": [{"kind": "nvml_unavailable", "at_seconds": 10}]})
    backend.config_facts(0)
    clock.t = 10.0
    assert backend.config_facts(0).health == "unavailable"


def test_every_config_call_is_one_the_fake_was_taught(clock):
    fake, _ = _backend(clock, {})
    for name in ("nvmlDeviceGetInforomImageVersion", "nvmlDeviceGetEccMode", "nvmlDeviceGetPersistenceMode",
                 "nvmlDeviceGetApplicationsClock", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetMigMode"):
        assert callable(getattr(fake, name))
    with pytest.raises(AttributeError, match="does not implement"):
        fake.nvmlDeviceGetDefaultApplicationsClock  # noqa: B018
