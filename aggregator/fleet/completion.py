"""Completing a compact report's entries: each GPU, port and rank a report sent relative to a base
(wire.REPORT_VERSION, ``base_seq``) carries only what changed, and is completed here from the
state its base left, so what is stored and judged is what a whole report would have given.

It reads the held state and the sent entry and returns the completed state; it decides nothing
about whether a report has a base (Fleet.refusal and Fleet.ingest do) and keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from copy import copy
from typing import Any, TypeVar

import msgspec

from vigil.contract.wire import GpuState, PortState, RankSummary, field_defaults

_M = TypeVar("_M", GpuState, PortState, RankSummary)


def completer(model: type[_M], merged: str | None = None, *, in_place: bool = False,
              matched: Collection[str] = ()) -> Callable[[_M, _M], _M]:
    """See ``_generate``: a completer returning the completed state. ``matched``: the fields by which
    the caller found the base (its identity: equal in both), not tested again."""
    complete: Callable[[_M, _M], _M] = _generate(model, merged, in_place=in_place, marks=None, matched=matched)
    return complete


def marking_completer(model: type[_M], marks: Mapping[str, int],
                      matched: Collection[str] = ()) -> Callable[[_M, _M], int]:
    """An in-place completer (``_generate``) that returns, instead of the state (its base, completed),
    the bits of ``marks`` of the fields the entry carried (OR-ed): what the fleet's change markers need
    to know of a compact entry, found by the tests completing it makes anyway. ``matched``: the
    fields by which the caller found the base (its identity: equal in both), not tested again. With
    both, a compact GPU entry's completion and marks take 6.6k instructions where the plain completer
    and the fleet's own tests of the marked fields took 7.7k (callgrind, an agent-built entry)."""
    unknown = set(marks) - {f.name for f in msgspec.structs.fields(model)}
    if unknown:
        raise ValueError(f"marks name fields {model.__name__} does not have: {sorted(unknown)}")
    complete: Callable[[_M, _M], int] = _generate(model, None, in_place=True, marks=marks, matched=matched)
    return complete


def _generate(model: type[_M], merged: str | None, *, in_place: bool, marks: Mapping[str, int] | None,
              matched: Collection[str] = ()) -> Any:
    """How a compact entry of ``model`` completes its base: every field it has away from its
    default changed (a required field may or may not have), so the new state is the base with
    each of them set from ``sent`` as decoded (tuples, Structs): a copy of the base, or with
    ``in_place`` the base itself, which must then be a state the fleet made and owns (``copy_struct``).
    ``merged``: a field merged into the base's own already, which the copy keeps (a port's
    counters, ``complete_port``).

    This runs for every GPU and rank of every report, so it is code generated from the model's
    fields (a field added to the model is completed with no change here): a test of each field read
    by name, where the interpreter's slot reads and ``is not None`` are cheap (docs/reports.md,
    "Compact reports": what this costs against building the state from keywords)."""
    lines = ["def complete(base, sent):", "    new = base" if in_place else "    new = copy_struct(base)"]
    if marks is not None:
        lines.append("    marked = 0")
    constants: dict[str, Any] = {"copy_struct": msgspec.structs.replace}  # with no changes: a copy
    defaults = field_defaults(model)  # a mutable default ({}) as the value it starts at, compared only
    for f in msgspec.structs.fields(model):
        if f.name == merged or f.name in matched:
            continue
        if not f.name.isidentifier():  # pragma: no cover - a Struct's field names are identifiers
            raise ValueError(f"{model.__name__}.{f.name} is not an identifier")
        if f.required:
            changed = f"sent.{f.name} != new.{f.name}"
        elif defaults[f.name] is None:
            changed = f"sent.{f.name} is not None"
        else:
            constants[f"default_{f.name}"] = defaults[f.name]
            changed = f"sent.{f.name} != default_{f.name}"
        # Most fields are absent: one read and one test each; a field present is read again.
        lines += [f"    if {changed}:", f"        new.{f.name} = sent.{f.name}"]
        if marks is not None and f.name in marks:
            lines.append(f"        marked |= {int(marks[f.name])}")
    lines.append("    return marked" if marks is not None else "    return new")
    exec("\n".join(lines), constants)  # the source is built above from the model's field names only
    complete = constants["complete"]
    complete.__qualname__ = complete.__name__ = f"complete_{model.__name__}"
    return complete


# The GPU and rank completers update their base, which the fleet must own (``copy_struct``).
complete_gpu = completer(GpuState, in_place=True)
# The fleet finds a rank's history by (job, rank): those two need no test.
complete_rank = completer(RankSummary, in_place=True, matched=("job", "rank"))
_complete_port_fields = completer(PortState, merged="counters")


def complete_port(base: PortState, sent: PortState) -> PortState:
    """A compact port entry completes its base: its counters (those that moved) merge into the
    base's dict, and the usual entry, which carries nothing else but its identity (its link
    state, rate and flags did not change), is the base itself. The fields are read by name: an
    attribute read in the interpreter costs a tenth of one through ``attrgetter`` or
    ``to_builtins``, and this runs for every port of every report (a test sets each of
    PortState's other fields in turn). Any other change makes a new state: PortHistory tells an
    entry that moved only counters by its state being the last one."""
    base.counters.update(sent.counters)
    if (sent.state is None and sent.phys_state is None and sent.rate_bits_per_second is None
            and sent.link_layer is None and sent.netdev is None and not sent.deltas
            and not sent.rates_per_second and not sent.flags):
        return base
    return _complete_port_fields(base, sent)


# With no changes: a copy. The fleet completes in place only a copy of its own: a state taken
# whole from a report is the report's (the simulator's agent, a test, keep theirs), so it is copied
# once, the first time a compact entry completes it (GpuHistory.owned, RankHistory.owned, and
# PortHistory.owned, whose counters are merged into); from then on each compact entry updates
# that copy, which nothing outside the fleet holds (detectors read the fleet while no report is
# ingested).
copy_struct = msgspec.structs.replace


# What a field named in ``cleared`` becomes.
_DEFAULTS: dict[type[Any], dict[str, Any]] = {model: field_defaults(model)
                                              for model in (GpuState, PortState, RankSummary)}


def complete_cleared(complete: Callable[[_M, _M], _M], base: _M, sent: _M, cleared: Collection[str]) -> _M:
    """``complete(base, sent)`` with ``sent``'s ``cleared`` fields at their defaults: the fields
    that went back to their defaults (rare; a report lists them in ``cleared``)."""
    return with_cleared(complete(base, sent), cleared)


def with_cleared(state: _M, cleared: Collection[str]) -> _M:
    """``state`` with its ``cleared`` fields at their defaults (a new state; ``state`` itself when
    none is named). A mutable default is a fresh copy for each state."""
    if not cleared:
        return state
    defaults = _DEFAULTS[type(state)]
    return msgspec.structs.replace(state, **{name: copy(defaults[name]) for name in cleared})
