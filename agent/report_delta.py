"""Compact reports (wire.REPORT_VERSION): what changed since the report the aggregator accepted last.

It reads two reports as JSON-ready states (``whole``: the one the aggregator accepted and the one
to send now, both without events) and emits the compact body: every GPU, port and rank with its
identity and the fields that changed (a port's counters: only those that moved; one back at its
default named in ``cleared``), telemetry that moved held back when asked (the current state then
gets the base's values back, so it stays what the aggregator holds). It decides nothing about
when to send (agent/reporter.py keeps the base and says when telemetry goes out) and sends nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vigil.contract.wire import (
    CLEARABLE,
    GPU_TELEMETRY_FIELDS,
    PORT_TRAFFIC_COUNTERS,
    REPORT_VERSION,
    SECTIONS,
    Report,
    to_builtins,
)

# What names an entry of each section: the same names in the same order, or the report goes whole.
IDENTITY = {"gpus": ("index", "uuid"), "ports": ("device", "port"), "ranks": ("job", "rank")}

# Per section, the fields every entry carries whether or not they changed: its required ones (and a
# port's counters, which list those that moved).
CARRIED = {section: frozenset(f.name for f in msgspec.structs.fields(model)) - CLEARABLE[section]
           for section, model in SECTIONS.items()}

# Report fields that say "unchanged" by being left out (the aggregator keeps the last it had).
_KEPT_WHEN_ABSENT = ("topology", "host", "config", "pcie")
# Port fields for a reader of one report, never sent: the aggregator derives its own increases from
# the raw counters over its window.
PORT_EXCLUDE = frozenset({"deltas", "rates_per_second"})
# A held-back field the base did not have (taken out of the current state again).
_ABSENT = object()


def whole(report: Report) -> dict[str, Any]:
    """``report`` as a whole state (JSON-ready, without events): the base of the next compact
    report, and what is sent when there is no base."""
    state: dict[str, Any] = to_builtins(report)
    state.pop("events", None)
    for port in state.get("ports", ()):
        for name in PORT_EXCLUDE:
            port.pop(name, None)
    state["version"] = REPORT_VERSION
    return state


def delta(base: dict[str, Any], current: dict[str, Any], *, telemetry: bool = True) -> dict[str, Any] | None:
    """``current`` relative to ``base``, both states (``whole``); None when their structure
    differs (other GPUs, ports or ranks, in another order, a port's counter names, a host that
    went away) or either is not of wire.REPORT_VERSION: send it whole.
    ``telemetry`` False: the telemetry that moved is left out, and ``current`` gets the base's
    values of it back (only when a body is returned), so it stays what the aggregator holds."""
    # (entry dict, field, the base's value or _ABSENT): what to put back once the body is sure.
    held: list[tuple[dict[str, Any], str, Any]] = []
    if current.get("version") != REPORT_VERSION or base.get("version") != REPORT_VERSION:
        return None
    out = {k: v for k, v in current.items() if k not in IDENTITY and k not in _KEPT_WHEN_ABSENT}
    for key in _KEPT_WHEN_ABSENT:
        if key in base and key not in current:
            return None
        if key in current and current[key] != base.get(key):
            out[key] = current[key]
    cleared: list[list[Any]] = []
    for section, keys in IDENTITY.items():
        before, now = base.get(section, []), current.get(section, [])
        if len(before) != len(now):
            return None
        entries = []
        first, second = keys
        # Only the fields of wire.CLEARABLE (all with a default) may be left out as unchanged; the
        # others are carried as they are, so each entry of a compact report is a valid instance
        # of its model.
        carried, clearable = CARRIED[section], CLEARABLE[section]
        for i, (b, c) in enumerate(zip(before, now, strict=True)):
            if b[first] != c[first] or b[second] != c[second]:
                return None
            # One comprehension over the entry's fields (this runs for ~700 fields a report on
            # the agent: bench_agent prints its cost per report).
            get = b.get
            entry = {k: v for k, v in c.items() if k in carried or get(k) != v}
            if not telemetry and section == "gpus" and not GPU_TELEMETRY_FIELDS.isdisjoint(entry):
                for name in GPU_TELEMETRY_FIELDS.intersection(entry):
                    del entry[name]
                    held.append((c, name, get(name, _ABSENT)))
            if b.keys() != c.keys():
                # Absent now: a field went back to its default. Named in ``cleared``: its absence
                # would read "unchanged".
                cleared.extend([section, i, k] for k in sorted(b.keys() - c.keys()) if k in clearable)
            if section == "ports":
                counters, was = c.get("counters", {}), b.get("counters", {})
                if counters.keys() != was.keys():
                    return None
                moved = {name: value for name, value in counters.items() if was[name] != value}
                if not telemetry and not PORT_TRAFFIC_COUNTERS.isdisjoint(moved):
                    for name in PORT_TRAFFIC_COUNTERS.intersection(moved):
                        del moved[name]
                        held.append((counters, name, was[name]))
                entry.pop("counters", None)
                if moved:
                    entry["counters"] = moved
            entries.append(entry)
        out[section] = entries
    if cleared:
        out["cleared"] = cleared
    for into, name, value in held:
        if value is _ABSENT:
            del into[name]
        else:
            into[name] = value
    return out

