"""MIG through the backend over FakeNvml: the mode (current and pending), the MIG devices with their
parent, profile and instance ids, empty slots, a layout changed by an administrator (seen on the
next slow read), a pending mode applied by a reset, and NotSupported before Ampere."""

from __future__ import annotations

import pynvml
import pytest

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeGpuHandle, FakeNvml
from vigil.agent.nvml.profiles import A100_SXM_80GB, H100_SXM_80GB
from vigil.agent.nvml.scenario import NodeScenario, ScenarioError, load_node_scenario, parse_node_scenario

GIB = 1024**3


def _scenario(profile: str, **mig: object) -> NodeScenario:
    return parse_node_scenario({"profile": profile, "gpus": 2, "load": {"utilization": 0.9, "memory_used_ratio": 0.5},
                                "mig": [{"gpu": 0, **mig}]})


def test_a100_in_three_instances(make_backend):
    _, backend = make_backend(_scenario("a100-sxm-80gb", instances=["3g.40gb", "2g.20gb", "2g.20gb"]))
    r = backend.read(0)
    assert r.errors == [] and r.mig_mode_current is True and r.mig_mode_pending is True
    devices = [m.device for m in r.mig_devices]
    assert [d.profile for d in devices] == ["3g.40gb", "2g.20gb", "2g.20gb"]
    assert [d.gpu_instance_id for d in devices] == [1, 3, 4]
    assert all(d.compute_instance_id == 0 and d.uuid.startswith("MIG-") for d in devices)
    assert len({d.uuid for d in devices}) == 3
    totals = [m.memory_total_bytes for m in r.mig_devices]
    assert totals == [A100_SXM_80GB.mig_memory_bytes("3g.40gb"), *[A100_SXM_80GB.mig_memory_bytes("2g.20gb")] * 2]
    assert totals[0] == int(39.25 * GIB)
    # The instance's own memory, half used by the load, not the parent's 80 GB.
    assert all(m.memory_used_bytes is not None and 0.45 * m.memory_total_bytes <= m.memory_used_bytes
               <= 0.5 * m.memory_total_bytes for m in r.mig_devices if m.memory_total_bytes)
    other = backend.read(1)  # MIG-capable, mode off: the mode is known, no devices
    assert other.mig_mode_current is False and other.mig_mode_pending is False and other.mig_devices == ()


def test_h100_in_seven_smallest_instances(make_backend):
    _, backend = make_backend(_scenario("h100-sxm-80gb", instances=["1g.10gb"] * 7))
    r = backend.read(0)
    assert [m.device.gpu_instance_id for m in r.mig_devices] == [7, 8, 9, 10, 11, 12, 13]
    assert {m.memory_total_bytes for m in r.mig_devices} == {H100_SXM_80GB.mig_memory_bytes("1g.10gb")}


def test_the_shipped_mig_scenario(make_backend):
    fake, backend = make_backend("mig-a100")
    r = backend.read(0)
    assert r.mig_mode_current and [m.device.profile for m in r.mig_devices] == ["1g.10gb"] * 7
    fake_name = fake.nvmlDeviceGetName(fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.handles[0], 0))
    assert fake_name == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"


def test_empty_slots_are_skipped(make_backend):
    fake, backend = make_backend(_scenario("a100-sxm-80gb", instances=["2g.20gb"]))
    fake.configure_mig(0, [None, "2g.20gb", None, "1g.10gb"])  # slots 0 and 2 destroyed
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.handles[0], 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.handles[0], 7)
    r = backend.read(0)
    assert r.errors == []  # NotFound is an empty slot, not an error
    assert [(m.device.slot, m.device.profile) for m in r.mig_devices] == [(1, "2g.20gb"), (3, "1g.10gb")]


def test_a_layout_change_is_seen_on_the_next_slow_read(make_backend, clock):
    fake, backend = make_backend(_scenario("h100-sxm-80gb", instances=["7g.80gb"]))
    assert [m.device.profile for m in backend.read(0).mig_devices] == ["7g.80gb"]
    fake.configure_mig(0, ["3g.40gb", "2g.20gb", "2g.20gb"])  # an admin re-partitions the GPU
    clock.t = 5.0
    fast = backend.read(0, slow=False)
    # Between slow reads the layout stands; the destroyed instance's handle is stale: counted, no memory.
    assert [m.device.profile for m in fast.mig_devices] == ["7g.80gb"]
    assert fast.mig_devices[0].memory_total_bytes is None
    assert fast.errors == [("nvmlDeviceGetMemoryInfo", "invalid_argument")]
    clock.t = 10.0
    slow = backend.read(0, slow=True)
    assert [m.device.profile for m in slow.mig_devices] == ["3g.40gb", "2g.20gb", "2g.20gb"] and slow.errors == []


def test_a_pending_mode_change_is_visible_until_a_reset_applies_it(make_backend):
    fake, backend = make_backend(_scenario("a100-sxm-80gb", enabled=False, pending=True))
    r = backend.read(0)
    assert (r.mig_mode_current, r.mig_mode_pending, r.mig_devices) == (False, True, ())
    assert fake.nvmlDeviceGetMaxMigDeviceCount(fake.handles[0]) == 0  # NVML: zero while MIG is off
    backend.reset_gpu(0)
    r = backend.read(0)
    assert (r.mig_mode_current, r.mig_mode_pending, r.mig_devices) == (True, True, ())
    assert fake.nvmlDeviceGetMaxMigDeviceCount(fake.handles[0]) == 7


def test_v100_has_no_mig(make_backend):
    fake, backend = make_backend("healthy-v100")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMigMode(fake.handles[0])
    assert fake.nvmlDeviceGetMaxMigDeviceCount(fake.handles[0]) == 0
    r = backend.read(0)
    assert r.errors == [] and r.mig_mode_current is None and r.mig_mode_pending is None and r.mig_devices == ()


def test_instance_ids_are_refused_on_a_physical_gpu(clock):
    fake = FakeNvml(load_node_scenario("healthy-a100"), clock, start=0.0)
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetGpuInstanceId(fake.handles[0])


def test_a_lost_gpu_is_lost_through_its_mig_devices(make_backend, clock):
    fake, backend = make_backend(_scenario("a100-sxm-80gb", instances=["1g.10gb"]))
    backend.read(0)
    fake.handles[0].lost_at = 1.0
    clock.t = 2.0
    r = backend.read(0, slow=False)
    assert r.health == "lost" and r.mig_devices == ()


def test_processes_on_a_mig_gpu_carry_its_instance_ids(make_backend):
    fake, _backend = make_backend(_scenario("a100-sxm-80gb", instances=["3g.40gb", "2g.20gb"]))
    fake.running_pids[0] = [100, 200]
    procs = fake.nvmlDeviceGetComputeRunningProcesses(fake.handles[0])
    assert [(p.gpuInstanceId, p.computeInstanceId) for p in procs] == [(1, 0), (3, 0)]


@pytest.mark.parametrize(("mig", "why"), [
    ({"gpu": 0, "instances": ["7g.80gb", "1g.10gb"]}, "8 compute slices"),
    ({"gpu": 0, "instances": ["1g.5gb"]}, "'1g.5gb' is not one of"),
    ({"gpu": 0, "enabled": False, "instances": ["1g.10gb"]}, "need enabled: true"),
    ({"gpu": 5, "instances": []}, "the node has 2 GPUs"),
])
def test_bad_mig_layouts_are_refused(mig, why):
    with pytest.raises(ScenarioError, match=why):
        parse_node_scenario({"profile": "a100-sxm-80gb", "gpus": 2, "mig": [mig]})
    with pytest.raises(ScenarioError, match="v100-sxm2-32gb has no MIG profiles"):
        parse_node_scenario({"profile": "v100-sxm2-32gb", "mig": [{"gpu": 0}]})


def test_utilization_is_absent_in_mig_mode_and_back_once_mig_is_off(make_backend, clock):
    """The GPU's utilisation is NotSupported in MIG mode; the backend remembers NotSupported per GPU,
    and forgets it when a reset changes the MIG mode, so the whole GPU's utilisation comes back."""
    fake, backend = make_backend(_scenario("a100-sxm-80gb", enabled=False, pending=True))
    assert backend.read(0).utilization_gpu_ratio is not None
    backend.reset_gpu(0)  # applies MIG mode
    in_mig = backend.read(0)
    assert in_mig.mig_mode_current is True and in_mig.utilization_gpu_ratio is None and in_mig.errors == []
    fake.configure_mig(0, [], enabled=True, pending=False)  # nvidia-smi -mig 0, then a reset
    backend.reset_gpu(0)
    clock.t = 10.0
    whole = backend.read(0)
    assert whole.mig_mode_current is False and whole.utilization_gpu_ratio is not None


class _FailingMigMode:
    """FakeNvml whose nvmlDeviceGetMigMode fails once with an NVML error other than NotSupported."""

    def __init__(self, fake: FakeNvml) -> None:
        self._fake = fake
        self.fail = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._fake, name)

    def nvmlDeviceGetMigMode(self, handle: FakeGpuHandle) -> list[int]:
        if self.fail:
            self.fail = False
            raise pynvml.NVMLError_Unknown()
        return self._fake.nvmlDeviceGetMigMode(handle)


def test_a_failed_mode_read_keeps_the_last_layout(clock):
    nvml = _FailingMigMode(FakeNvml(_scenario("h100-sxm-80gb", instances=["3g.40gb"]), clock, start=0.0))
    backend = PynvmlBackend(nvml)  # type: ignore[arg-type]  # FakeNvml's names, wrapped
    backend.init()
    assert len(backend.read(0).mig_devices) == 1
    nvml.fail = True
    r = backend.read(0, slow=True)
    assert r.errors == [("nvmlDeviceGetMigMode", "unknown")]
    assert r.mig_mode_current is True and [m.device.profile for m in r.mig_devices] == ["3g.40gb"]
    assert len(backend.read(0, slow=True).mig_devices) == 1
