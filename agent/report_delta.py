"""The compact report (wire.DELTA_VERSION): what changed since the report the aggregator accepted last.

It reads two reports as JSON-ready dicts (the one the aggregator accepted and the one to send
now, both without events) and emits the version-2 body: every GPU, port and rank with its
required fields (its identity) and the fields whose default is not None as they are, plus the
optional fields that changed to a value (a port's counters: only those that moved; a field that
became absent is named in ``cleared``), the report's own fields whole. It decides nothing about
when to send it (agent/reporter.py negotiates the version and keeps the base) and sends nothing.
"""

from __future__ import annotations

from typing import Any

from vigil.agent.wire import CLEARABLE, DELTA_VERSION, Report, to_builtins

# What names an entry of each section: the same names in the same order, or the report goes whole.
IDENTITY = {"gpus": ("index", "uuid"), "ports": ("device", "port"), "ranks": ("job", "rank")}

# Report fields that say "unchanged" by being left out (the aggregator keeps the last it had).
_KEPT_WHEN_ABSENT = ("topology", "host")
# Port fields for a reader of one report, never sent in version 2: the aggregator derives its
# own increases from the raw counters over its window.
V2_PORT_EXCLUDE = frozenset({"deltas", "rates_per_second"})


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


def delta(base: dict[str, Any], current: dict[str, Any]) -> dict[str, Any] | None:
    """``current`` relative to ``base``; None when their structure differs (other GPUs, ports or
    ranks, in another order, a port's counter names, a host that went away): send it whole."""
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
            if b.keys() != c.keys():
                # Absent now: an optional field became None (named in ``cleared``); any other
                # field is at its default, which its absence says.
                cleared.extend([section, i, k] for k in sorted(b.keys() - c.keys()) if k in optional)
            if section == "ports":
                counters, was = c.get("counters", {}), b.get("counters", {})
                if counters.keys() != was.keys():
                    return None
                moved = {name: value for name, value in counters.items() if was[name] != value}
                entry.pop("counters", None)
                if moved:
                    entry["counters"] = moved
            entries.append(entry)
        out[section] = entries
    if cleared:
        out["cleared"] = cleared
    return out
