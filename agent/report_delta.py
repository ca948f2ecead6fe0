"""The compact report (wire.DELTA_VERSION): what changed since the report the aggregator accepted last.

It reads two reports as JSON-ready dicts (the one the aggregator accepted and the one to send
now, both without events) and emits the version-2 body: every GPU, port and rank with its
required fields (its identity) and the fields whose default is not None as they are, plus the
optional fields that changed to a value (a port's counters: only those that moved; a field that
became absent is named in ``cleared``), the report's own fields whole. Told to hold telemetry
back (wire.GPU_TELEMETRY_FIELDS and wire.PORT_TRAFFIC_COUNTERS), it leaves out what of it
moved and puts the base's values back into the current state, which is then what the aggregator
holds once it accepts the body. It decides nothing about when to send it (agent/reporter.py
negotiates the version, keeps the base and says when telemetry goes out) and sends nothing.
"""

from __future__ import annotations

from typing import Any

from vigil.agent.wire import CLEARABLE, DELTA_VERSION, GPU_TELEMETRY_FIELDS, PORT_TRAFFIC_COUNTERS, Report, to_builtins

# What names an entry of each section: the same names in the same order, or the report goes whole.
IDENTITY = {"gpus": ("index", "uuid"), "ports": ("device", "port"), "ranks": ("job", "rank")}

# Report fields that say "unchanged" by being left out (the aggregator keeps the last it had).
_KEPT_WHEN_ABSENT = ("topology", "host")
# Port fields for a reader of one report, never sent in version 2: the aggregator derives its
# own increases from the raw counters over its window.
V2_PORT_EXCLUDE = frozenset({"deltas", "rates_per_second"})
# A held-back field the base did not have (taken out of the current state again).
_ABSENT = object()


def whole(report: Report) -> dict[str, Any]:
    """``report`` as a whole version-2 state (JSON-ready, without events): the base of the next
    compact report, and what is sent when there is no base."""
    state: dict[str, Any] = to_builtins(report)
    state.pop("events", None)
    for port in state.get("ports", ()):
        for name in V2_PORT_EXCLUDE:
            port.pop(name, None)
    state["version"] = DELTA_VERSION
    return state


def delta(base: dict[str, Any], current: dict[str, Any], *, telemetry: bool = True) -> dict[str, Any] | None:
    """``current`` relative to ``base``; None when their structure differs (other GPUs, ports or
    ranks, in another order, a port's counter names, a host that went away): send it whole.
    ``telemetry`` False: the telemetry that moved is left out, and ``current`` gets the base's
    values of it back (only when a body is returned), so it stays what the aggregator holds."""
    # (entry dict, field, the base's value or _ABSENT): what to put back once the body is sure.
    held: list[tuple[dict[str, Any], str, Any]] = []
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
        # Only the optional fields (default None, wire.CLEARABLE) may be left out as unchanged: the
        # others are carried as they are (absent, they read as their default), so each entry of
        # a compact report is a valid instance of its model.
        optional = CLEARABLE[section]
        for i, (b, c) in enumerate(zip(before, now, strict=True)):
            if b[first] != c[first] or b[second] != c[second]:
                return None
            # One comprehension over the entry's fields (this runs for ~700 fields a report on
            # the agent: bench_agent prints its cost per report).
            get = b.get
            entry = {k: v for k, v in c.items() if k not in optional or get(k) != v}
            if not telemetry and section == "gpus" and not GPU_TELEMETRY_FIELDS.isdisjoint(entry):
                for name in GPU_TELEMETRY_FIELDS.intersection(entry):
                    del entry[name]
                    held.append((c, name, get(name, _ABSENT)))
            if b.keys() != c.keys():
                # Absent now: an optional field became None (named in ``cleared``); any other
                # field is at its default, which its absence says.
                cleared.extend([section, i, k] for k in sorted(b.keys() - c.keys()) if k in optional)
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

