"""The marking GPU completer (Fleet.ingest's compact GPU entries): for any base state and any
compact entry it completes the base exactly as the plain completer does, and the marks it returns
are those the fleet's change markers tested field by field before (a fault flag: faults; the
hardware class's fields: class; the job: job), so markers move on the same reports."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.aggregator.test_fleet_compact_property import values
from vigil.aggregator.fleet.completion import complete_gpu, marking_completer
from vigil.aggregator.fleet.ingest import _GPU_CLASS, _GPU_FAULTS, _GPU_JOB, _GPU_RECOVERY, complete_gpu_marked
from vigil.contract.wire import GpuState, convert

GPU = values(mi.type_info(GpuState))


def _expected_marks(sent: GpuState) -> int:
    """The tests Fleet.ingest made of a compact GPU entry before its completer told them."""
    marks = 0
    if (sent.remap_pending is not None or sent.remap_failure is not None or sent.retired_pages_pending is not None
            or sent.retired_pages_sbe is not None or sent.retired_pages_dbe is not None
            or sent.pcie_link_generation_max is not None or sent.pcie_link_width_max is not None):
        marks |= _GPU_FAULTS
    if sent.name is not None or sent.sm_clock_max_hertz is not None or sent.power_limit_watts is not None:
        marks |= _GPU_CLASS
    if sent.job is not None:
        marks |= _GPU_JOB
    if sent.recovery_action is not None:
        marks |= _GPU_RECOVERY
    return marks


@settings(max_examples=300, deadline=None)
@given(base=GPU, sent=GPU, sparse=st.booleans())
def test_marks_and_completion_match_the_field_by_field_tests(base: dict[str, Any], sent: dict[str, Any],
                                                           sparse: bool) -> None:
    if sparse:  # the usual compact entry: its identity and a field or two
        sent = {k: v for k, v in sent.items() if k in ("index", "uuid", "power_watts", "job", "remap_pending")}
    sent = {**sent, "index": base["index"], "uuid": base["uuid"]}  # the fleet completes the base it found by these
    held, entry = convert(base, GpuState), convert(sent, GpuState)
    plain = complete_gpu(msgspec.structs.replace(held), entry)
    own = msgspec.structs.replace(held)
    marks = complete_gpu_marked(own, entry)
    assert own == plain
    assert marks == _expected_marks(entry)


def test_a_mark_on_a_field_the_model_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="no_such_field"):
        marking_completer(GpuState, {"no_such_field": 1})
