"""The backend's NVLink fabric, PCIe link and recovery-action reads over FakeNvml: each field, each
error path, and the scenario faults that change them (fabric_manager_down, fabric_degraded,
pcie_link_degraded, recovery_action)."""

from __future__ import annotations

import uuid

import pynvml
import pytest

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import ScenarioError, parse_node_scenario


def _backend(clock, scenario: dict, fake_class: type[FakeNvml] = FakeNvml) -> tuple[FakeNvml, PynvmlBackend]:
    fake = fake_class(parse_node_scenario(scenario), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    for i in range(fake.scenario.gpus):
        backend.identity(i)
    return fake, backend


class CountingNvml(FakeNvml):
    """FakeNvml that counts the calls made to it by name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts: dict[str, int] = {}

    def __getattribute__(self, name: str):
        if name.startswith("nvmlDevice"):
            counts = object.__getattribute__(self, "counts")
            counts[name] = counts.get(name, 0) + 1
        return object.__getattribute__(self, name)


# --- fabric ----------------------------------------------------------------------------------


def test_h200_fabric_is_registered_and_healthy_through_the_v_call(clock):
    _, backend = _backend(clock, {"profile": "h200-sxm-141gb"})
    r = backend.read(0)
    assert (r.fabric_state, r.fabric_status, r.fabric_health) == ("completed", None, ())
    assert r.fabric_clique_id is None and r.fabric_cluster_uuid is None and r.errors == []


def test_h100_driver_535_falls_back_to_the_v1_call_once(clock):
    fake, backend = _backend(clock, {"profile": "h100-sxm-80gb"}, CountingNvml)
    for _ in range(3):
        r = backend.read(0)
        assert r.fabric_state == "completed" and r.fabric_health == () and r.errors == []
    assert isinstance(fake, CountingNvml)
    assert fake.counts["nvmlDeviceGetGpuFabricInfoV"] == 1  # FunctionNotFound: never asked again
    assert fake.counts["nvmlDeviceGetGpuFabricInfo"] == 3


@pytest.mark.parametrize("profile", ["a100-sxm-80gb", "v100-sxm2-32gb"])
def test_no_fabric_is_absent_and_not_asked_again(clock, profile):
    # A100: state NOT_SUPPORTED in a successful answer; V100: NVMLError_NotSupported.
    fake, backend = _backend(clock, {"profile": profile}, CountingNvml)
    for _ in range(3):
        r = backend.read(0)
        assert r.fabric_state is None and r.errors == []
    assert isinstance(fake, CountingNvml)
    assert fake.counts.get("nvmlDeviceGetGpuFabricInfo", 0) == 1


def test_v_struct_refused_falls_back_to_v1(clock):
    class OldV(FakeNvml):
        def nvmlDeviceGetGpuFabricInfoV(self, handle, info_ref):
            raise pynvml.NVMLError_ArgumentVersionMismatch()

    _, backend = _backend(clock, {"profile": "h200-sxm-141gb"}, OldV)
    r = backend.read(0)
    assert r.fabric_state == "completed" and r.errors == []


def test_fabric_manager_down_on_every_gpu_from_its_time(clock):
    _, backend = _backend(clock, {"profile": "h100-sxm-80gb", "faults": [
        {"kind": "fabric_manager_down", "at_seconds": 60}]})
    clock.t = 59.0
    assert {backend.read(i).fabric_state for i in range(8)} == {"completed"}
    clock.t = 60.0
    readings = [backend.read(i) for i in range(8)]
    assert {r.fabric_state for r in readings} == {"not_started"}
    assert {r.health for r in readings} == {"ok"} and all(r.temperature_celsius for r in readings)  # NVML answers
    assert {r.fabric_status for r in readings} == {None}


@pytest.mark.parametrize("conditions", [
    ["degraded_bandwidth"], ["route_recovery"], ["route_unhealthy"], ["access_timeout_recovery"],
    ["degraded_bandwidth", "route_unhealthy"],
])
def test_fabric_health_conditions_decode_from_the_mask(clock, conditions):
    _, backend = _backend(clock, {"profile": "h200-sxm-141gb", "faults": [
        {"kind": "fabric_degraded", "at_seconds": 10, "gpu": 2, "conditions": conditions}]})
    assert backend.read(2).fabric_health == ()
    clock.t = 10.0
    r = backend.read(2)
    assert r.fabric_state == "completed" and set(r.fabric_health) == set(conditions)
    assert backend.read(1).fabric_health == ()


def test_a_registration_that_failed_names_its_error_and_a_cluster_is_a_uuid(clock):
    cluster = uuid.UUID("6b8f0e3c-0f7e-4d8a-9a47-3c1f2b4e5d6a")

    class Gb200(FakeNvml):
        def nvmlDeviceGetGpuFabricInfoV(self, handle, info_ref):
            super().nvmlDeviceGetGpuFabricInfoV(handle, info_ref)
            info = info_ref._obj
            info.clusterUuid[:] = list(cluster.bytes)
            info.cliqueId = 32766
            if handle.index == 1:
                info.status = pynvml.NVML_ERROR_TIMEOUT
            return pynvml.NVML_SUCCESS

    _, backend = _backend(clock, {"profile": "h200-sxm-141gb"}, Gb200)
    ok, failed = backend.read(0), backend.read(1)
    assert (ok.fabric_cluster_uuid, ok.fabric_clique_id, ok.fabric_status) == (str(cluster), 32766, None)
    assert (failed.fabric_state, failed.fabric_status) == ("completed", "NVML_ERROR_TIMEOUT")


def test_an_unknown_fabric_state_or_a_failing_call_is_counted_and_asked_again(clock):
    class Odd(FakeNvml):
        def nvmlDeviceGetGpuFabricInfoV(self, handle, info_ref):
            if handle.index == 0:
                raise pynvml.NVMLError_Unknown()
            info_ref._obj.state = 7
            return pynvml.NVML_SUCCESS

    _, backend = _backend(clock, {"profile": "h200-sxm-141gb"}, Odd)
    for _ in range(2):
        failing, odd = backend.read(0), backend.read(1)
        assert failing.fabric_state is None and failing.errors == [("nvmlDeviceGetGpuFabricInfoV", "unknown")]
        assert odd.fabric_state is None and odd.errors == [("nvmlDeviceGetGpuFabricInfo", "fabric_state_7")]


def test_the_fabric_is_read_on_the_slow_cadence_only(clock):
    _, backend = _backend(clock, {"profile": "h200-sxm-141gb"})
    r = backend.read(0, slow=False)
    assert r.fabric_state is None and r.pcie_link_width is None
    assert r.recovery_action == "none"  # every read: it rides in the HBM temperature's field call


# --- PCIe link -------------------------------------------------------------------------------


def test_pcie_link_of_each_board(clock):
    for profile, generation in (("h100-sxm-80gb", 5), ("a100-sxm-80gb", 4), ("v100-sxm2-32gb", 3)):
        _, backend = _backend(clock, {"profile": profile, "load": {"utilization": 0.9}})
        r = backend.read(0)
        assert (r.pcie_link_generation, r.pcie_link_generation_max) == (generation, generation)
        assert (r.pcie_link_width, r.pcie_link_width_max) == (16, 16)


def test_recorded_boards_hold_their_link_at_idle(clock):
    """Every recorded HGX board (persistence on, P0) held Gen5 x16 at 0 % utilization (profiles.py,
    scenario.Load.pcie_idle_link_generation): the fake's default does too."""
    _, backend = _backend(clock, {"profile": "h100-sxm-80gb", "load": {"utilization": 0.0}})
    r = backend.read(0)
    assert r.utilization_gpu_ratio == 0.0 and (r.pcie_link_generation, r.pcie_link_width) == (5, 16)


def test_idle_downclock_lowers_the_generation_only_while_idle(clock):
    fake, backend = _backend(clock, {"load": {"utilization": 0.0, "pcie_idle_link_generation": 1}})
    idle = backend.read(0)
    assert (idle.pcie_link_generation, idle.pcie_link_generation_max, idle.pcie_link_width) == (1, 5, 16)
    fake.set_utilization([0], 0.5)
    busy = backend.read(0)
    assert (busy.pcie_link_generation, busy.pcie_link_width) == (5, 16)


def test_pcie_link_degraded_whatever_the_load(clock):
    _, backend = _backend(clock, {"load": {"utilization": 0.9}, "faults": [
        {"kind": "pcie_link_degraded", "at_seconds": 30, "gpu": 6, "width": 8, "generation": 3,
         "duration_seconds": 60}]})
    assert (backend.read(6).pcie_link_generation, backend.read(6).pcie_link_width) == (5, 16)
    clock.t = 30.0
    r = backend.read(6)
    assert (r.pcie_link_generation, r.pcie_link_width) == (3, 8)
    assert (r.pcie_link_generation_max, r.pcie_link_width_max) == (5, 16)
    assert backend.read(5).pcie_link_width == 16
    clock.t = 90.0  # retrained (the duration over)
    assert backend.read(6).pcie_link_width == 16


def test_pcie_link_errors_are_counted_and_not_supported_is_absent(clock):
    class Flaky(FakeNvml):
        def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
            raise pynvml.NVMLError_Unknown()

        def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
            raise pynvml.NVMLError_NotSupported()

    _, backend = _backend(clock, {}, Flaky)
    r = backend.read(0)
    assert r.pcie_link_width is None and r.pcie_link_width_max is None
    assert r.errors == [("nvmlDeviceGetCurrPcieLinkWidth", "unknown")]
    assert r.pcie_link_generation == 5


# --- recovery action -------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"])
def test_recovery_action_words(clock, action):
    _, backend = _backend(clock, {"profile": "h200-sxm-141gb", "faults": [
        {"kind": "recovery_action", "at_seconds": 5, "gpu": 1, "action": action}]})
    assert backend.read(1).recovery_action == "none"
    clock.t = 5.0
    assert backend.read(1).recovery_action == action and backend.read(0).recovery_action == "none"


def test_recovery_action_lasts_its_duration(clock):
    _, backend = _backend(clock, {"profile": "h200-sxm-141gb", "faults": [
        {"kind": "recovery_action", "at_seconds": 5, "gpu": 1, "action": "node_reboot", "duration_seconds": 10}]})
    clock.t = 14.0
    assert backend.read(1).recovery_action == "node_reboot"
    clock.t = 15.0
    assert backend.read(1).recovery_action == "none"


def test_a_driver_before_the_field_leaves_it_absent_and_unasked(clock):
    _, backend = _backend(clock, {"profile": "h100-sxm-80gb"})
    for _ in range(2):
        r = backend.read(0)
        assert r.recovery_action is None and r.errors == [] and r.memory_temperature_celsius is not None


def test_a_scripted_fault_brings_the_driver_that_shows_it(clock):
    """On the H100 profile (driver 535: no recovery field, no V call) a recovery_action or
    fabric_degraded fault says the node runs a driver that has them: answered on every GPU."""
    _, backend = _backend(clock, {"profile": "h100-sxm-80gb", "faults": [
        {"kind": "recovery_action", "at_seconds": 5, "gpu": 1, "action": "drain_and_reset"},
        {"kind": "fabric_degraded", "at_seconds": 5, "gpu": 2, "conditions": ["route_unhealthy"]}]})
    assert {backend.read(i).recovery_action for i in range(8)} == {"none"}
    clock.t = 5.0
    assert backend.read(1).recovery_action == "drain_and_reset"
    assert backend.read(2).fabric_health == ("route_unhealthy",) and backend.read(3).fabric_health == ()


def test_a_recovery_action_the_wire_has_no_word_for_is_counted(clock):
    class Newer(FakeNvml):
        def nvmlDeviceGetFieldValues(self, handle, field_ids):
            values = super().nvmlDeviceGetFieldValues(handle, field_ids)
            for v in values:
                if v.fieldId == 230:
                    v.value.uiVal = pynvml.NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT  # 7, newer drivers
            return values

    _, backend = _backend(clock, {"profile": "h200-sxm-141gb"}, Newer)
    r = backend.read(0)
    assert r.recovery_action is None and r.errors == [("nvmlDeviceGetFieldValues", "recovery_action_7")]


# --- scenario validation, and the untaught call --------------------------------------------------


@pytest.mark.parametrize("profile, fault, message", [
    ("a100-sxm-80gb", {"kind": "fabric_manager_down"}, "needs an NVSwitch fabric"),
    ("h100-sxm-80gb", {"kind": "pcie_link_degraded", "at_seconds": 0, "gpu": 0, "width": 32}, "at most x16"),
    ("a100-sxm-80gb", {"kind": "pcie_link_degraded", "at_seconds": 0, "gpu": 0, "generation": 5},
     "at most generation 4"),
    ("h100-sxm-80gb", {"kind": "pcie_link_degraded", "at_seconds": 0, "gpu": 0}, "changes nothing"),
    ("h200-sxm-141gb", {"kind": "fabric_degraded", "at_seconds": 0, "gpu": 0, "conditions": []}, "conditions"),
    ("h200-sxm-141gb", {"kind": "fabric_manager_down", "state": "completed"}, "state"),
    ("h200-sxm-141gb", {"kind": "recovery_action", "at_seconds": 0, "gpu": 0, "action": "reboot"}, "action"),
])
def test_faults_the_board_cannot_show_are_refused(profile, fault, message):
    with pytest.raises(ScenarioError, match=message):
        parse_node_scenario({"profile": profile, "faults": [fault]})


def test_a_fabric_struct_passed_by_value_is_refused(clock):
    """pynvml hands the struct to libnvidia-ml as given: a bare struct would go by value (garbage on
    a real driver), so the fake refuses it; the backend passes ctypes.byref."""
    fake, _ = _backend(clock, {"profile": "h200-sxm-141gb"})
    with pytest.raises(TypeError, match="byref"):
        fake.nvmlDeviceGetGpuFabricInfoV(fake.nvmlDeviceGetHandleByIndex(0), pynvml.c_nvmlGpuFabricInfo_v2_t())


def test_a_fabric_call_the_fake_was_not_taught_fails_loudly(clock):
    fake, _ = _backend(clock, {})
    with pytest.raises(AttributeError, match=r"does not implement pynvml\.nvmlDeviceGetGpuFabricInfo_v4"):
        fake.nvmlDeviceGetGpuFabricInfo_v4  # noqa: B018
