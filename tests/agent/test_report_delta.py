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
    return {"node": "n1", "boot_id": "b", "seq": 1, "ts": 1.0, "interval_seconds": 2.5, "version": 2,
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
