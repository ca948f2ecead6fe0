"""Node scenarios: validation with key paths, the shipped files, and each fault kind at its time."""

from __future__ import annotations

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import (
    FAULT_KINDS,
    ScenarioError,
    load_node_scenario,
    parse_node_scenario,
    shipped_scenarios,
)


def test_every_shipped_scenario_loads_and_every_fault_kind_is_shipped():
    kinds = set()
    for name in shipped_scenarios():
        kinds |= {f.kind for f in load_node_scenario(name).faults}
    assert kinds == set(FAULT_KINDS)
    assert "healthy-h100" in shipped_scenarios() and "faults-h100" in shipped_scenarios()


@pytest.mark.parametrize(("data", "message"), [
    ({"gpus": 8, "lod": {}}, "lod: unknown key"),
    ({"gpus": "eight"}, "gpus:"),
    ({"profile": "h900"}, "profile 'h900' is not one of"),
    ({"faults": [{"at_seconds": 1, "gpu": 0, "kind": "xid"}]}, "faults.0.xid.code: Field required"),
    ({"faults": [{"at_seconds": 1, "gpu": 0, "kind": "meltdown"}]}, "faults.0: Input tag 'meltdown'"),
    ({"faults": [{"at_seconds": 1, "gpu": 9, "kind": "gpu_lost"}]}, "faults.0.gpu: 9 but the node has 8 GPUs"),
    ({"faults": [{"at_seconds": 1, "gpu": 0, "kind": "nvlink_down", "link": 12, }], "profile": "a100-sxm-80gb"},
     "faults.0.link: 12 but a100-sxm-80gb has 12 NVLinks"),
    ({"load": {"utilization": 1.5}}, "load.utilization:"),
    ({"faults": [{"at_seconds": -1, "gpu": 0, "kind": "gpu_lost"}]}, "faults.0.gpu_lost.at_seconds:"),
])
def test_bad_scenarios_name_the_key_path(data, message):
    with pytest.raises(ScenarioError, match="invalid node scenario") as err:
        parse_node_scenario(data)
    assert message in str(err.value)


def test_unknown_scenario_name_lists_the_shipped_ones():
    with pytest.raises(ScenarioError, match="healthy-h100"):
        load_node_scenario("no-such-scenario")


def test_scenario_from_a_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("profile: h200-sxm-141gb\ngpus: 4\n")
    assert load_node_scenario(str(path)).gpus == 4
    path.write_text("gpus: [\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_node_scenario(path)


def _backend(name, clock):
    fake = FakeNvml(load_node_scenario(name), clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    for i in range(fake.scenario.gpus):
        backend.identity(i)
    return backend


def _before_and_after(name, gpu, clock, at=60.0, after=80.0):
    backend = _backend(name, clock)
    clock.t = at - 1.0
    before = backend.read(gpu)
    clock.t = after
    return before, backend.read(gpu)


def test_ecc_corrected_growth(clock):
    before, after = _before_and_after("ecc-corrected-growth", 2, clock)
    assert before.ecc_corrected_volatile == 0
    assert after.ecc_corrected_volatile == after.ecc_corrected_aggregate == 100  # 5/s for 20 s


def test_ecc_uncorrectable(clock):
    before, after = _before_and_after("ecc-uncorrectable", 5, clock)
    assert before.ecc_uncorrected_volatile == 0
    assert after.ecc_uncorrected_volatile == after.ecc_uncorrected_aggregate == 1
    assert after.ecc_corrected_volatile == 0


def test_row_remap_pending_and_failure(clock):
    before, after = _before_and_after("row-remap-pending", 1, clock)
    assert (before.remap_pending, before.remapped_rows_uncorrectable) == (False, 0)
    assert (after.remap_pending, after.remap_failure, after.remapped_rows_uncorrectable) == (True, False, 1)
    clock.t = 0.0
    before, after = _before_and_after("row-remap-failure", 6, clock)
    assert before.remap_failure is False and after.remap_failure is True


def test_thermal_throttle_sets_reasons_drops_clock_and_heats(clock, make_backend):
    backend = _backend("thermal-throttle", clock)
    clock.t = 59.0
    before = backend.read(3)
    clock.t = 100.0
    during = backend.read(3)
    clock.t = 181.0
    after = backend.read(3)
    names = backend.reason_names(during.clock_event_reasons)
    assert set(names) == {"hw_slowdown", "hw_thermal_slowdown"}
    assert during.sm_clock_hertz == 990e6 < before.sm_clock_hertz
    assert during.temperature_celsius > before.temperature_celsius
    assert during.temperature_celsius >= backend.identity(3).slowdown_temperature_celsius
    assert backend.reason_names(after.clock_event_reasons) == [] and after.sm_clock_hertz == 1980e6


def test_power_brake(clock):
    before, during = _before_and_after("power-brake", 0, clock, after=70.0)
    backend_names = set(PynvmlBackend(pynvml).reason_names(during.clock_event_reasons))
    assert backend_names == {"hw_slowdown", "hw_power_brake_slowdown"}
    assert during.power_watts < before.power_watts
    assert during.sm_clock_hertz < before.sm_clock_hertz


def test_gpu_lost_and_xid(clock):
    backend = _backend("gpu-lost", clock)
    backend.open_events(list(range(8)))
    clock.t = 59.0
    assert backend.read(7).health == "ok" and backend.wait_xid(0) is None
    clock.t = 60.0
    assert backend.read(7).health == "lost"
    event = backend.wait_xid(0)
    assert event is not None and (event.index, event.code) == (7, 79)
    backend.close_events()


def test_nvlink_errors_and_down(clock):
    before, after = _before_and_after("nvlink-errors", 1, clock, after=130.0)
    link4 = after.nvlinks[4]
    assert before.nvlinks[4].crc_errors == 0
    assert (link4.crc_errors, link4.replay_errors, link4.recovery_errors) == (1400, 80, 1)
    assert all(link.crc_errors == 0 for link in after.nvlinks if link.link != 4)
    clock.t = 0.0
    before, after = _before_and_after("nvlink-down", 6, clock)
    assert before.nvlinks[9].active is True
    assert after.nvlinks[9].active is False
    assert sum(1 for link in after.nvlinks if link.active) == 17


def test_nvml_unavailable(clock):
    backend = _backend("nvml-unavailable", clock)
    clock.t = 60.0
    assert all(backend.read(i).health == "unavailable" for i in range(8))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        backend.init()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), times=st.lists(st.floats(0, 10_000), min_size=2, max_size=8))
def test_counters_never_decrease_for_any_seed(seed, times):
    clock = type("C", (), {"t": 0.0, "__call__": lambda self: self.t})()
    fake = FakeNvml(load_node_scenario("faults-h100"), clock, start=0.0, seed=seed)
    backend = PynvmlBackend(fake)
    backend.init()
    backend.identity(3)
    previous = None
    for t in sorted(times):
        clock.t = t
        r = backend.read(3)
        counters = (r.energy_joules, r.ecc_corrected_volatile, r.pcie_replay_total,
                    *(link.crc_errors for link in r.nvlinks))
        values = [v for v in counters if v is not None]
        assert len(values) == len(counters), counters  # every counter is read: None never compares
        if previous is not None:
            assert all(v >= p for v, p in zip(values, previous, strict=True))
        previous = values


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), t=st.floats(0, 10_000))
def test_same_seed_same_answers(seed, t):
    readings = []
    for _ in range(2):
        clock = type("C", (), {"t": t, "__call__": lambda self: self.t})()
        backend = PynvmlBackend(FakeNvml(load_node_scenario("healthy-h100"), clock, start=0.0, seed=seed))
        backend.init()
        backend.identity(0)
        readings.append(backend.read(0))
    assert readings[0] == readings[1]
