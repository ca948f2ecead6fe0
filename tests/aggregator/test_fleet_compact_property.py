"""Compact reports (versions 2 and 3) leave the fleet as the same reports sent whole, for any sequence of
valid reports: every field of every GPU, port and rank summary may take any value its wire type
allows, go absent and come back between two reports (optional fields, fields with a default,
lists, dicts, a port's counters moving, resetting or changing their names), entries may leave
the reports and come back, and so may the report's own fields (topology, host, NVML
availability, failed collectors).

The values come from the wire types themselves (``msgspec.inspect``), so a field added to a model
is covered without touching this test. The compact chain is what the agent sends
(agent/report_delta.py: relative to the previous report, whole when the structure changed); both
chains go through the strict decoder, as the service receives them.
"""

from __future__ import annotations

import json
import string
from itertools import pairwise
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.aggregator.conftest import FakeNode, assert_same_node, rank_summary
from vigil.agent.report_delta import IDENTITY, PORT_EXCLUDE, delta, whole
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import (
    REPORT_VERSIONS,
    GpuState,
    HostFacts,
    PortState,
    RankSummary,
    Report,
    decode_report,
    to_builtins,
)

MODELS: dict[str, type[msgspec.Struct]] = {"gpus": GpuState, "ports": PortState, "ranks": RankSummary}
# What the fields hold at most here: a few items are enough to go absent, change and come back.
MAX_ITEMS = 3
INT64_MAX = 2**63 - 1
TEXT = st.text(alphabet=string.ascii_letters + string.digits + "_-:. ", max_size=12)


def values(t: mi.Type) -> st.SearchStrategy[Any]:
    """Any JSON-ready value that wire type ``t`` accepts."""
    if isinstance(t, mi.UnionType):
        return st.one_of([values(x) for x in t.types])
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.IntType):
        low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -INT64_MAX)
        high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else INT64_MAX)
        # Small values too: a counter that moves by a few is the usual case.
        return st.one_of(st.integers(low, min(high, low + 50)), st.integers(low, high))
    if isinstance(t, mi.FloatType):
        return st.floats(min_value=t.ge if t.ge is not None else t.gt, max_value=t.le if t.le is not None else t.lt,
                         exclude_min=t.ge is None and t.gt is not None, exclude_max=t.le is None and t.lt is not None,
                         allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.StrType):
        assert t.pattern is None, "no field of an entry has a pattern yet: teach values() the pattern"
        return TEXT.filter(lambda s: len(s) >= (t.min_length or 0))
    if isinstance(t, mi.ListType | mi.VarTupleType):  # both a JSON array
        return st.lists(values(t.item_type), max_size=min(MAX_ITEMS, t.max_length or MAX_ITEMS))
    if isinstance(t, mi.DictType):
        return st.dictionaries(TEXT, values(t.value_type), max_size=min(MAX_ITEMS, t.max_length or MAX_ITEMS))
    if isinstance(t, mi.StructType):
        return st.fixed_dictionaries(
            {f.name: values(f.type) for f in t.fields if f.required},
            optional={f.name: values(f.type) for f in t.fields if not f.required})
    raise AssertionError(f"no strategy for {t!r}: teach values() this type")


def _fields(model: type[msgspec.Struct]) -> dict[str, mi.Field]:
    info = mi.type_info(model)
    assert isinstance(info, mi.StructType)
    return {f.name: f for f in info.fields}


# Fields a round may change: all but an entry's identity (a new identity makes the report whole,
# which the structural changes below cover) and the version-1-only port fields (a reader of one
# report; version 2 never sends them and the aggregator derives its own).
MUTABLE = {section: {name: f for name, f in _fields(model).items()
                     if name not in IDENTITY[section] and name not in PORT_EXCLUDE}
           for section, model in MODELS.items()}
HOST_FIELDS = _fields(HostFacts)


@st.composite
def changed_entry(draw: st.DrawFn, section: str, entry: dict[str, Any]) -> dict[str, Any]:
    out = dict(entry)
    fields = MUTABLE[section]
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        field = fields[name]
        if not field.required and draw(st.integers(0, 3)) == 0:
            out.pop(name, None)  # absent: None, or the field's default
        else:
            out[name] = draw(values(field.type))
    if section == "ports" and draw(st.booleans()):
        # The usual report: some counters move (up by a little, or back to zero: a reset).
        counters = dict(out.get("counters", {}))
        for name in draw(st.lists(st.sampled_from(sorted(counters)), max_size=3, unique=True)) if counters else ():
            counters[name] = 0 if draw(st.integers(0, 5)) == 0 else counters[name] + draw(st.integers(1, 9))
        out["counters"] = counters
    return out


@st.composite
def report_bodies(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Consecutive reports of one boot of one node, as JSON-ready bodies (version 1)."""
    node = FakeNode("n1", gpus=2, ports=2, topology={"leaf_switch": "leaf-1"})
    node.ranks = [rank_summary("j1", r, compute=0.4, comm=0.1, ts=0.0, gpu=r) for r in range(2)]
    body = to_builtins(node.report(0.0))
    out = [body]
    # Entries that left the reports (a GPU fell off the bus, a port's HCA vanished, a rank's job
    # ended) and may come back later: either way the report goes whole.
    gone: dict[str, list[dict[str, Any]]] = {section: [] for section in MODELS}
    for k in range(1, draw(st.integers(2, 7))):
        body = dict(body, seq=k + 1, ts=k * 2.5)
        for section in MODELS:
            entries = [draw(changed_entry(section, e)) for e in body.get(section, [])]
            change = draw(st.integers(0, 9))
            if change == 0 and entries:
                gone[section].append(entries.pop())
            elif change == 1 and gone[section]:
                entries.append(gone[section].pop())
            body[section] = entries
        if draw(st.integers(0, 3)) == 0:
            body["nvml_available"] = draw(st.booleans())
            body["failed_collectors"] = draw(st.lists(st.sampled_from(["gpu", "rdma", "training"]), unique=True))
        if draw(st.integers(0, 3)) == 0:
            body["host"] = draw(values(mi.type_info(HostFacts)))
        if draw(st.integers(0, 5)) == 0:
            body["topology"] = {"leaf_switch": draw(st.sampled_from(["leaf-1", "leaf-2"]))}
        out.append(body)
    return out


def _wire(body: dict[str, Any]) -> Report:
    return decode_report(json.dumps(body))  # as the service validates


def _compact(reports: list[Report], version: int) -> list[Report]:
    """What the agent sends: each report relative to the one before, whole where delta says so."""
    out = [_wire(whole(reports[0]))]
    for before, now in pairwise(reports):
        body = delta(whole(before), whole(now))
        out.append(_wire(whole(now) if body is None else {**body, "base_seq": before.seq}))
    return out


def _ingested(reports: list[Report]) -> Fleet:
    fleet = Fleet()
    for r in reports:
        assert fleet.refusal(r, r.ts) is None
        fleet.ingest(r, r.ts)
    return fleet


@pytest.mark.parametrize("version", REPORT_VERSIONS, ids=lambda v: f"v{v}")
@settings(max_examples=150, deadline=None)
@given(bodies=report_bodies())
def test_any_compact_chain_leaves_the_fleet_as_whole_reports_do(version: int, bodies: list[dict[str, Any]]) -> None:
    reports = [_wire(b) for b in bodies]
    compact = _compact(reports, version)
    sent_compact = sum(r.base_seq is not None for r in compact)
    share = "none" if not sent_compact else "all" if sent_compact == len(compact) - 1 else "some"
    event(f"compact reports after the first: {share}")
    assert_same_node(_ingested(reports).view().nodes["n1"], _ingested(compact).view().nodes["n1"])
