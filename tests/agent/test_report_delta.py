"""report_delta.delta with telemetry held back: what moved of wire.GPU_TELEMETRY_FIELDS and
wire.PORT_TRAFFIC_COUNTERS is left out and the base's values go back into the current state
(what the aggregator holds once it accepts the body); everything else is sent as before; a
report that must go whole leaves the current state untouched."""

from __future__ import annotations

import copy
from typing import Any

from vigil.agent.report_delta import delta


def _state(sm_active: float | None, xmit: int, temperature: float, symbol_errors: int) -> dict[str, Any]:
    gpu: dict[str, Any] = {"index": 0, "uuid": "GPU-0", "temperature_celsius": temperature, "power_watts": 400.0}
    if sm_active is not None:
        gpu["sm_active_ratio"] = sm_active
    return {"node": "n1", "boot_id": "b", "seq": 1, "ts": 1.0, "interval_seconds": 2.5, "version": 3,
            "gpus": [gpu],
            "ports": [{"device": "mlx5_0", "port": 1, "state": "4: ACTIVE",
                       "counters": {"port_xmit_data": xmit, "symbol_error": symbol_errors}}],
            "ranks": []}


def test_moved_telemetry_is_left_out_and_the_bases_values_go_back_into_the_state() -> None:
    base = _state(0.1, 1000, 40.0, 0)
    now = _state(0.9, 5000, 55.0, 2)
    body = delta(base, now, telemetry=False)
    assert body is not None
    assert body["gpus"] == [{"index": 0, "uuid": "GPU-0", "temperature_celsius": 55.0}]
    assert body["ports"] == [{"device": "mlx5_0", "port": 1, "counters": {"symbol_error": 2}}]
    assert now["gpus"][0]["sm_active_ratio"] == 0.1 and now["ports"][0]["counters"]["port_xmit_data"] == 1000
    assert now["gpus"][0]["temperature_celsius"] == 55.0 and now["ports"][0]["counters"]["symbol_error"] == 2


def test_with_telemetry_everything_that_moved_is_sent_and_the_state_is_untouched() -> None:
    base, now = _state(0.1, 1000, 40.0, 0), _state(0.9, 5000, 40.0, 0)
    before = copy.deepcopy(now)
    body = delta(base, now, telemetry=True)
    assert body is not None and now == before
    assert body["gpus"][0]["sm_active_ratio"] == 0.9 and body["ports"][0]["counters"] == {"port_xmit_data": 5000}


def test_telemetry_that_appears_is_held_back_and_telemetry_that_goes_away_is_cleared() -> None:
    appeared = _state(0.9, 1000, 40.0, 0)
    body = delta(_state(None, 1000, 40.0, 0), appeared, telemetry=False)
    assert body is not None and "sm_active_ratio" not in body["gpus"][0]
    assert "sm_active_ratio" not in appeared["gpus"][0]
    # Gone (the GPU stopped answering GPM): the aggregator must not keep a value the agent no longer has.
    body = delta(_state(0.9, 1000, 40.0, 0), _state(None, 1000, 40.0, 0), telemetry=False)
    assert body is not None and body["cleared"] == [["gpus", 0, "sm_active_ratio"]]


def test_a_report_that_goes_whole_leaves_the_state_as_it_was() -> None:
    base = _state(0.1, 1000, 40.0, 0)
    now = _state(0.9, 5000, 40.0, 0)
    now["ports"][0]["counters"]["link_downed"] = 0  # another counter set: the structure changed
    before = copy.deepcopy(now)
    assert delta(base, now, telemetry=False) is None
    assert now == before


def _training_gpu(reasons: list[str], health: str | None = None) -> dict[str, Any]:
    """A GPU as report_delta.whole has it: a field at its default is left out."""
    gpu: dict[str, Any] = {"index": 0, "uuid": "GPU-0", "power_watts": 490.0, "processes": [{"pid": 4000}]}
    if reasons:
        gpu["clock_event_reasons"] = reasons
    if health is not None:
        gpu["health"] = health
    return gpu


def _v(version: int, gpu: dict[str, Any], flags: dict[str, str]) -> dict[str, Any]:
    port: dict[str, Any] = {"device": "mlx5_0", "port": 1, "counters": {"port_xmit_wait": 7}}
    if flags:
        port["flags"] = flags
    return {"node": "n1", "boot_id": "b", "seq": 1, "ts": 1.0, "interval_seconds": 2.5, "version": version,
            "gpus": [gpu], "ports": [port], "ranks": []}


def test_a_compact_report_leaves_unchanged_fields_with_a_default_out_and_clears_them_back_to_it() -> None:
    flags = {"excessive_buffer_overrun_errors": "saturated"}
    base = _v(3, _training_gpu(["sw_power_cap"]), flags)
    same = _v(3, _training_gpu(["sw_power_cap"]), flags)
    assert delta(base, same) == {**same, "gpus": [{"index": 0, "uuid": "GPU-0"}],
                                 "ports": [{"device": "mlx5_0", "port": 1}]}
    # Back to the default (no throttle reason, healthy again, no flag): named in cleared.
    sick = _v(3, _training_gpu(["sw_power_cap", "hw_slowdown"], "reset_required"), flags)
    well = _v(3, _training_gpu([]), {})
    body = delta(sick, well)
    assert body is not None and body["gpus"] == [{"index": 0, "uuid": "GPU-0"}]
    assert body["cleared"] == [["gpus", 0, "clock_event_reasons"], ["gpus", 0, "health"], ["ports", 0, "flags"]]
    # A change is sent whole (the list, the dict).
    body = delta(well, sick)
    assert body is not None and body["gpus"][0]["clock_event_reasons"] == ["sw_power_cap", "hw_slowdown"]
    assert body["ports"][0]["flags"] == flags and "cleared" not in body


def test_a_state_of_another_version_is_never_a_base() -> None:
    flags: dict[str, str] = {}
    assert delta(_v(2, _training_gpu([]), flags), _v(3, _training_gpu([]), flags)) is None
    assert delta(_v(3, _training_gpu([]), flags), _v(1, _training_gpu([]), flags)) is None
