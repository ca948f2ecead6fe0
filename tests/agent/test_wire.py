"""The wire contract itself (contract/wire.py): what the strict decoder refuses and keeps, and that a
Struct built in Python is checked before it can reach a report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vigil.agent.collectors.collector import Collection
from vigil.agent.metric import MetricSpec
from vigil.agent.runner import collect_once
from vigil.contract.wire import (
    MAX_COUNT,
    MAX_COUNTER,
    MAX_TEXT_CHARS,
    REPORT_VERSION,
    REPORT_VERSIONS,
    Event,
    GpuProcess,
    GpuState,
    PortState,
    Report,
    SchemaError,
    WireError,
    check,
    check_node_name,
    decode,
    decode_report,
    encode,
    to_builtins,
    to_readable,
)

BASE: dict[str, Any] = {"node": "gpu-001", "boot_id": "b1", "seq": 1, "ts": 1.7e9, "interval_seconds": 2.5}


def body(**fields: Any) -> bytes:
    return json.dumps({**BASE, **fields}).encode()


def refused(raw: bytes) -> str:
    with pytest.raises(WireError) as caught:
        decode_report(raw)
    return str(caught.value)


def name_ok(name: str) -> bool:
    try:
        check_node_name(name)
    except ValueError:
        return False
    return True


def decoder_takes_name(name: str) -> bool:
    try:
        decode_report(body(node=name))
    except SchemaError:
        return False
    return True


@pytest.mark.parametrize("name", ["gpu-001", "a", "node.rack-1.example.com", "x" * 63, ".".join(["a" * 63] * 4)[:253],
                                  "", "-a", "a-", "a_b", "vnode[1-5]", "a,b", "a b", "a\n", "x" * 64,
                                  ".".join(["a" * 50] * 6), "a..b", "é"])
def test_the_decoder_applies_the_one_node_name_rule(name: str) -> None:
    assert decoder_takes_name(name) is name_ok(name)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab9-.[],_ \n"), max_size=70))
def test_the_decoder_and_check_node_name_agree_on_any_name(name: str) -> None:
    assert decoder_takes_name(name) is name_ok(name)


@pytest.mark.parametrize("raw, where", [
    (body(seq=True), "$.seq"),                      # no 1 for a bool, nor a bool for an int
    (body(seq=1.0), "$.seq"),                       # no float for an int
    (body(ts="1700000000"), "$.ts"),                # no string for a number
    (body(urgent=1), "$.urgent"),
    (body(seq=-1), "$.seq"),
    (body(seq=MAX_COUNT + 1), "$.seq"),
    (body(ts=1e19), "$.ts"),
    (body(gpus=[{"index": 0, "uuid": "GPU-1", "utilization_gpu_ratio": 1.5}]), "$.gpus[0].utilization_gpu_ratio"),
    (body(gpus=[{"index": 0, "uuid": "GPU-1", "health": "fine"}]), "$.gpus[0].health"),
    (body(gpus=[{"index": 0, "uuid": "GPU-1", "temprature_celsius": 50}]), "$.gpus[0]"),
    (body(colour="blue"), "colour"),
    (body(interval_seconds=0), "$.interval_seconds"),
])
def test_wrong_shapes_are_refused_with_where(raw: bytes, where: str) -> None:
    with pytest.raises(SchemaError) as caught:
        decode_report(raw)
    assert where in str(caught.value)


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_refused(number: bytes) -> None:
    raw = body().replace(b'"ts": 1700000000.0', b'"ts": ' + number)
    assert raw != body()
    refused(raw)


def test_a_number_too_large_for_a_float_is_refused_not_crashing() -> None:
    # An int of hundreds of digits would overflow float() in the fleet's counter arithmetic.
    raw = body(ports=[{"device": "mlx5_0", "port": 1, "counters": {"symbol_error": 0}}]).replace(
        b'"symbol_error": 0', b'"symbol_error": ' + b"9" * 400)
    assert "at most" in refused(raw)


def test_a_port_counter_may_hold_a_64_bit_saturated_value_and_no_more() -> None:
    port = {"device": "mlx5_0", "port": 1, "counters": {"port_xmit_data": MAX_COUNTER}}
    assert decode_report(body(ports=[port])).ports[0].counters["port_xmit_data"] == MAX_COUNTER
    refused(body(ports=[{**port, "counters": {"port_xmit_data": MAX_COUNTER + 1}}]))
    refused(body(ports=[{**port, "deltas": {"port_xmit_data": MAX_COUNTER + 1}}]))


def test_a_long_kernel_line_is_cut_not_refused() -> None:
    event = {"kind": "xid", "ts": 1.7e9, "message": "x" * (MAX_TEXT_CHARS + 100)}
    got = decode_report(body(events=[event])).events[0]
    assert got.message == "x" * MAX_TEXT_CHARS


def test_cleared_belongs_to_a_compact_report() -> None:
    gpu = {"index": 0, "uuid": "GPU-1"}
    assert "cleared is only valid" in refused(body(gpus=[gpu], cleared=[["gpus", 0, "power_watts"]]))
    assert "the report has 1" in refused(body(base_seq=0, gpus=[gpu], cleared=[["gpus", 1, "power_watts"]]))
    refused(body(base_seq=0, gpus=[gpu], cleared=[["disks", 0, "power_watts"]]))
    ok = decode_report(body(base_seq=0, gpus=[gpu], cleared=[["gpus", 0, "power_watts"]]))
    assert ok.cleared == [("gpus", 0, "power_watts")]


def test_a_report_without_a_version_is_of_the_one_version_and_another_number_is_kept_for_the_intake() -> None:
    """An absent version reads as wire.REPORT_VERSION (whole without base_seq); 1, 2 or 4 decode as
    sent, so that the intake refuses them by name (Fleet.refusal: unsupported_report_version)."""
    assert decode_report(body()).version == REPORT_VERSION == 3 and REPORT_VERSIONS == (3,)
    assert decode_report(body(version=2, base_seq=0)).version == 2
    assert "$.version" in refused(body(version=-1))


def test_a_compact_report_may_clear_a_field_with_a_default_but_never_a_ports_counters() -> None:
    gpu, port = {"index": 0, "uuid": "GPU-1"}, {"device": "mlx5_0", "port": 1}
    ok = decode_report(body(version=3, base_seq=0, gpus=[gpu], ports=[port],
                            cleared=[["gpus", 0, "health"], ["gpus", 0, "processes"], ["ports", 0, "flags"],
                                     ["gpus", 0, "power_watts"]]))
    assert ok.cleared == [("gpus", 0, "health"), ("gpus", 0, "processes"), ("ports", 0, "flags"),
                          ("gpus", 0, "power_watts")]
    assert "not a field of ports that may be left out" in refused(
        body(version=3, base_seq=0, ports=[port], cleared=[["ports", 0, "counters"]]))
    assert "not a field of gpus that may be left out" in refused(
        body(version=3, base_seq=0, gpus=[gpu], cleared=[["gpus", 0, "uuid"]]))


def test_what_the_agent_encodes_decodes_to_the_same_report() -> None:
    report = Report(node="gpu-001", boot_id="b1", seq=3, ts=1.7e9, interval_seconds=2.5,
                    gpus=[GpuState(index=0, uuid="GPU-1", health="lost", temperature_celsius=81.0)],
                    ports=[PortState(device="mlx5_0", port=1, counters={"symbol_error": 2})],
                    events=[Event(kind="xid", ts=1.7e9, code=79, gpu=0)])
    assert decode_report(encode(report)) == report
    # Defaults are left out of the JSON: a reader takes them.
    assert b'"urgent"' not in encode(report) and b'"health":"lost"' in encode(report)


def test_building_a_struct_checks_nothing_but_check_does() -> None:
    bad = GpuState(index=0, uuid="GPU-1", utilization_gpu_ratio=2.0)  # accepted: construction checks nothing
    with pytest.raises(SchemaError, match="utilization_gpu_ratio"):
        check(bad)
    good = GpuState(index=0, uuid="GPU-1", utilization_gpu_ratio=0.5)
    assert check(good) == good
    with pytest.raises(SchemaError, match="at most"):
        check(PortState(device="mlx5_0", port=1, counters={"x": MAX_COUNTER + 1}))
    assert decode(encode(good), GpuState) == good


class _OutOfBounds:
    """A collector whose state breaks the wire contract (a ratio above 1)."""

    name = "gpu"
    specs: Sequence[MetricSpec] = ()

    def collect(self, now: float) -> Collection:
        return Collection(report={"gpus": [GpuState(index=0, uuid="GPU-1", utilization_gpu_ratio=1.2)]})

    def close(self) -> None:
        pass


def test_a_collector_whose_output_breaks_the_contract_fails_its_cycle() -> None:
    # Sent, it would make the aggregator refuse the node's whole report; failed, the report names
    # the collector in failed_collectors and carries the rest.
    result = collect_once(_OutOfBounds(), 1.0, timer=lambda: 0.0)
    assert not result.success
    assert result.error is not None and "utilization_gpu_ratio" in result.error
    assert result.collection.report == {}


def test_a_state_for_a_person_shows_its_defaults_and_leaves_out_only_absent_fields() -> None:
    gpu = GpuState(index=0, uuid="GPU-1", processes=(GpuProcess(pid=7),))
    assert to_readable(gpu) == {"index": 0, "uuid": "GPU-1", "health": "ok", "clock_event_reasons": [],
                                "nvlink_links_down": [], "fabric_health": [], "processes": [{"pid": 7}]}
    assert to_readable([gpu])[0]["health"] == "ok"
    assert "health" not in to_builtins(gpu)  # the wire form leaves defaults out
