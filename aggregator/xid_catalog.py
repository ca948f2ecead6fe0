"""NVIDIA's Xid catalog as data, and the judgement of one GPU's recent Xids against it.

Loads ``aggregator/data/xid_catalog.csv`` (every code of NVIDIA's catalog mapped to a vigil action,
with its source) and applies the rules the catalog alone cannot express: application-class Xids
escalate only when they repeat, Xid 154 overrides the Xid it accompanies, 63/64 defer to NVML's
remapped-rows state, sticky codes count once per window. Pure: no clock, no I/O but the data file.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from typing import TypeVar

from vigil.aggregator.decision import Action

DATA_FILE = "xid_catalog.csv"

# Application-class repeats: NVIDIA's WORKFLOW_XID_13/31 ("repeat ... to same GPU: RUN_DCGMEUD
# (possible HW issue)") — a diagnostic run needs the node out of the scheduler.
APP_REPEAT_ACTION = Action.DRAIN
# Lines of one fault arrive as a burst (16 Xid 13 lines within 2 ms in gpud's real dmesg log):
# occurrences closer together than this are one burst, and repeats are counted in bursts.
APP_BURST_SECONDS = 10.0
# A Xid 154 belongs to the Xid(s) logged just before it (NVIDIA catalog, bucket XID_154: "always
# expected to be seen with another Xid"); one logged later than this after the 154 is judged alone.
XID154_AFTER_SLACK_SECONDS = 5.0
# Xid 154 text: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)". The
# recovery actions of NVIDIA's Xid catalog (bucket XID_154) and nvidia-smi's "GPU Recovery Action".
_XID154_RE = re.compile(r"to 0x[0-9a-fA-F]+ \((?P<action>[^)]*)\)")
XID154_ACTIONS: Mapping[str, Action] = {
    "none": Action.OBSERVE,
    "gpu reset required": Action.RESET_GPU,
    "node reboot required": Action.REBOOT_NODE,
    "drain p2p": Action.DRAIN,
    "drain and reset": Action.RESET_GPU,
}
# NVLink5 Xids 144-150 carry their severity in the text ("RLW_REMAP Fatal ..."); NVIDIA's
# "Xid 144-150 Decode" sheet resolves every Fatal row to RESET_GPU and Non-fatal ones to IGNORE or
# XID_154_EVAL (nvsentinel/xid-144-150-nvlink5-decode.csv).
NVLINK5_CODES = frozenset(range(144, 151))
_NONFATAL_RE = re.compile(r"\bnon-?fatal\b", re.IGNORECASE)
# Row remapping events: 63 (a remap happened), 64 (a remap failed) — NVIDIA's GPU memory error
# management guide: a pending remap needs a GPU reset; a remap failure means the GPU should be
# inspected/replaced.
REMAP_CODES = frozenset({63, 64})
XID154 = 154

# Order of cost, for sorting verdicts and picking the strongest.
_RANK = {a: i for i, a in enumerate(Action)}


@dataclass(frozen=True)
class XidEntry:
    code: int
    name: str
    description: str
    action: Action
    category: str
    sticky: bool
    source: str


class XidCatalog:
    """Xid code -> entry. Unknown codes get a synthesized entry (category "unknown") whose action
    is ``unknown_action``: alert by default, so a new driver's code is seen but drains nothing."""

    def __init__(self, entries: Iterable[XidEntry], unknown_action: Action = Action.ALERT,
                 overridden: Iterable[int] = ()) -> None:
        self._entries = {e.code: e for e in entries}
        self._unknown_action = unknown_action
        # Codes whose action an operator configured: that action is final, no rule refines it.
        self.overridden = frozenset(overridden)

    @classmethod
    def default(cls, overrides: Mapping[int, Action] | None = None,
                unknown_action: Action = Action.ALERT) -> XidCatalog:
        entries = {e.code: e for e in load_entries()}
        for code, action in (overrides or {}).items():
            base = entries.get(code) or _unknown_entry(code, Action(action))
            entries[code] = replace(base, action=Action(action), source=f"configured override (was {base.action})")
        return cls(entries.values(), unknown_action, overridden=(overrides or {}).keys())

    def entry(self, code: int) -> XidEntry:
        found = self._entries.get(code)
        return found if found is not None else _unknown_entry(code, self._unknown_action)

    def codes(self) -> list[int]:
        return sorted(self._entries)


def _unknown_entry(code: int, action: Action) -> XidEntry:
    return XidEntry(code, "UNKNOWN", f"Xid {code} is not in NVIDIA's catalog as shipped", action, "unknown",
                    False, "vigil: unknown code")


def load_entries(text: str | None = None) -> list[XidEntry]:
    """Parse the packaged catalog (or ``text`` in the same CSV form). Comment lines start with #."""
    return _load_rows(DATA_FILE, text, lambda row: XidEntry(
        code=int(row["code"]),
        name=row["name"],
        description=row["description"],
        action=Action(row["action"]),
        category=row["category"],
        sticky=row["sticky"] == "yes",
        source=row["source"],
    ))


_Row = TypeVar("_Row")


def _load_rows(data_file: str, text: str | None, build: Callable[[dict[str, str]], _Row]) -> list[_Row]:
    """The rows of a packaged CSV data file (or ``text``), each built into an entry; a bad row
    raises ValueError naming the file and row."""
    if text is None:
        text = resources.files("vigil.aggregator.data").joinpath(data_file).read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    entries = []
    for n, row in enumerate(rows, start=1):
        try:
            entries.append(build(row))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{data_file} row {n}: {exc}") from None
    return entries


@dataclass(frozen=True)
class XidOccurrence:
    code: int
    ts: float
    count: int = 1
    message: str = ""


@dataclass(frozen=True)
class XidVerdict:
    action: Action
    codes: tuple[int, ...]
    reason: str
    since: float
    key: str


def recovery_action(message: str) -> Action | None:
    """The action a Xid 154 line asks for, or None when its text names no known recovery action."""
    m = _XID154_RE.search(message)
    if not m:
        return None
    return XID154_ACTIONS.get(m.group("action").strip().lower())


def occurrence_action(catalog: XidCatalog, code: int, message: str = "") -> Action:
    """One line on its own: the catalog's action, refined by what the line's text says (the
    recovery action of a Xid 154, the severity of an NVLink5 Xid). Used by ``vigil xid scan``."""
    entry = catalog.entry(code)
    if code == XID154:
        return recovery_action(message) or Action.ALERT
    if code in NVLINK5_CODES and entry.category != "unknown" and _NONFATAL_RE.search(message):
        return Action.OBSERVE
    return entry.action


# NVSwitch SXids are not in the Xid catalog. NVIDIA's Fabric Manager user guide: a fatal NVSwitch
# error needs the NVSwitches and their GPUs reset (on an HGX baseboard, in practice a node reboot);
# non-fatal ones are logged and training continues. The word on the line ("Fatal"/"Non-fatal") is
# the driver's verdict at the time and wins; a line without one (SOE errors, detail-only lines)
# is judged by the guide's class of its code (aggregator/data/sxid_catalog.csv).
SXID_FATAL_ACTION = Action.REBOOT_NODE
SXID_DATA_FILE = "sxid_catalog.csv"


@dataclass(frozen=True)
class SxidEntry:
    code: int
    name: str
    fm_class: str  # the guide's: non_fatal, potential_fatal, always_fatal, other_notable
    action: Action
    rule: str


class SxidCatalog:
    """SXid code -> entry, from NVIDIA's Fabric Manager user guide (appendix D). Unknown codes
    (and codes the guide lists without a verdict) alert: seen, never acted on."""

    def __init__(self, entries: Iterable[SxidEntry], unknown_action: Action = Action.ALERT) -> None:
        self._entries = {e.code: e for e in entries}
        self._unknown_action = unknown_action

    @classmethod
    def default(cls) -> SxidCatalog:
        return cls(load_sxid_entries())

    def entry(self, code: int) -> SxidEntry | None:
        return self._entries.get(code)

    def action(self, code: int, severity: str | None) -> Action:
        """The line's own severity word first, then the guide's class of the code."""
        if severity is not None:
            return SXID_FATAL_ACTION if severity.lower() == "fatal" else Action.OBSERVE
        found = self._entries.get(code)
        return found.action if found is not None else self._unknown_action

    def codes(self) -> list[int]:
        return sorted(self._entries)


def load_sxid_entries(text: str | None = None) -> list[SxidEntry]:
    """Parse the packaged SXid catalog (or ``text`` in the same CSV form). Comment lines start with #."""
    return _load_rows(SXID_DATA_FILE, text, lambda row: SxidEntry(
        int(row["code"]), row["name"], row["fm_class"], Action(row["action"]), row["rule"]))


def event_action(catalog: XidCatalog, kind: str, code: int | None, message: str = "",
                 severity: str | None = None, sxids: SxidCatalog | None = None) -> Action:
    """What one kernel-log event calls for on its own (``vigil xid scan``): Xids by the catalog,
    a GPU fallen off the bus as Xid 79, SXids by the line's severity or else the SXid catalog;
    mlx5 NIC errors alert (the network detectors judge links)."""
    if kind == "xid" and code is not None:
        return occurrence_action(catalog, code, message)
    if kind == "gpu_lost":
        return catalog.entry(79).action
    if kind == "sxid" and code is not None:
        return (sxids or SxidCatalog.default()).action(code, severity)
    return Action.ALERT


def judge_xids(catalog: XidCatalog, occurrences: Sequence[XidOccurrence], *, remap_pending: bool | None,
               remap_failure: bool | None, now: float, window_seconds: float, app_repeat_threshold: int,
               burst_seconds: float = APP_BURST_SECONDS) -> list[XidVerdict]:
    """Judge ONE GPU's Xids: one verdict per code with an occurrence in ``(now - window, now]``,
    strongest action first. ``since`` is the start of the code's episode (occurrences chained by
    gaps no longer than the window), so re-evaluating the same episode gives the same key/since."""
    by_code: dict[int, list[XidOccurrence]] = {}
    for occ in sorted(occurrences, key=lambda o: o.ts):
        if occ.ts <= now:
            by_code.setdefault(occ.code, []).append(occ)
    recent154 = [o for o in by_code.get(XID154, []) if now - o.ts < window_seconds]
    verdicts: list[XidVerdict] = []
    for code, occs in by_code.items():
        episode = _episode(occs, window_seconds)
        if not episode or now - episode[-1].ts >= window_seconds:
            continue
        since = episode[0].ts
        entry = catalog.entry(code)
        lines = sum(o.count for o in episode)
        counted = 1 if entry.sticky else lines
        what = f"Xid {code} ({entry.name}: {entry.description})"
        tally = f"{lines} line(s), sticky: counted once" if entry.sticky else f"{counted} occurrence(s)"
        if code == XID154:
            latest = episode[-1]
            action = recovery_action(latest.message)
            if action is None:
                verdicts.append(XidVerdict(Action.ALERT, (code,), f"{what}: unrecognised recovery action "
                                           f"{latest.message!r}", since, f"xid:{code}"))
            else:
                verdicts.append(XidVerdict(action, (code,), f"{what}: driver asks for {action.value} "
                                           f"({latest.message})", since, f"xid:{code}"))
            continue
        if code in catalog.overridden:
            verdicts.append(XidVerdict(entry.action, (code,), f"{what}, {tally}: {entry.source}", since,
                                       f"xid:{code}"))
            continue
        companion = _companion154(episode, recent154)
        if companion is not None:
            action = recovery_action(companion.message)
            if action is not None:
                verdicts.append(XidVerdict(action, (code, XID154), f"{what}, {tally}; Xid 154 overrides the "
                                           f"catalog's {entry.action.value}: {companion.message}", since,
                                           f"xid:{code}"))
                continue
        if code in REMAP_CODES and entry.category == "remap":
            verdicts.append(_remap_verdict(code, what, tally, entry.action, remap_pending, remap_failure, since))
            continue
        if entry.category == "app":
            bursts = _bursts(episode, burst_seconds)
            if bursts >= app_repeat_threshold:
                verdicts.append(XidVerdict(APP_REPEAT_ACTION, (code,), f"{what} repeated in {bursts} separate "
                                           f"bursts on this GPU within {window_seconds:g}s (threshold "
                                           f"{app_repeat_threshold}): possible hardware fault, run diagnostics",
                                           since, f"xid:{code}:repeat"))
            else:
                verdicts.append(XidVerdict(entry.action, (code,), f"{what}, {bursts} burst(s) of {lines} line(s): "
                                           "application-class, not a node fault on its own", since, f"xid:{code}"))
            continue
        action = entry.action
        if code in NVLINK5_CODES and entry.category != "unknown":
            action = occurrence_action(catalog, code, episode[-1].message)
        verdicts.append(XidVerdict(action, (code,), f"{what}, {tally}: {entry.source}", since, f"xid:{code}"))
    verdicts.sort(key=lambda v: (-_RANK[v.action], v.codes))
    return verdicts


def _episode(occs: list[XidOccurrence], window_seconds: float) -> list[XidOccurrence]:
    """The last run of occurrences whose consecutive gaps are shorter than the window."""
    start = 0
    for i in range(1, len(occs)):
        if occs[i].ts - occs[i - 1].ts >= window_seconds:
            start = i
    return occs[start:]


def _bursts(occs: list[XidOccurrence], burst_seconds: float) -> int:
    return len(burst_spans([o.ts for o in occs], burst_seconds))


def burst_spans(times: Sequence[float], burst_seconds: float) -> list[tuple[float, float]]:
    """(first, last) time of each burst in sorted ``times``: lines no further apart than
    ``burst_seconds`` are one fault's burst."""
    spans: list[tuple[float, float]] = []
    for ts in times:
        if spans and ts - spans[-1][1] <= burst_seconds:
            spans[-1] = (spans[-1][0], ts)
        else:
            spans.append((ts, ts))
    return spans


def _companion154(episode: list[XidOccurrence], recent154: list[XidOccurrence]) -> XidOccurrence | None:
    """The latest Xid 154 logged at or after this code's latest occurrence (within the slack the
    driver needs to print it first); None when the code happened after every 154."""
    latest = episode[-1].ts
    following = [o for o in recent154 if o.ts >= latest - XID154_AFTER_SLACK_SECONDS]
    return following[-1] if following else None


def _remap_verdict(code: int, what: str, tally: str, catalog_action: Action, pending: bool | None,
                   failure: bool | None, since: float) -> XidVerdict:
    if failure:
        action, state = Action.INSPECT_HARDWARE, "NVML reports a row-remap failure"
    elif pending:
        action, state = Action.RESET_GPU, "NVML reports a row remap pending a GPU reset"
    elif failure is False and pending is False:
        action, state = Action.OBSERVE, "NVML reports no pending remap and no failure"
    else:
        action, state = catalog_action, "NVML remapped-rows state unknown, catalog action applies"
    return XidVerdict(action, (code,), f"{what}, {tally}: {state}", since, f"xid:{code}")
