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
from dataclasses import dataclass, field, replace
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
# NVML's recovery action field (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, nvmlDeviceGpuRecoveryAction_t;
# NVIDIA's "Error Recovery and Response Flags",
# https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/error-recovery-and-response-flags.html):
# Reset: "terminate all GPU processes, reset the GPU"; Reboot: the fault "may have left the OS in an
# inconsistent state, reboot"; Drain P2P: peer-to-peer traffic must be drained (the GPU cannot serve
# a multi-GPU job until then, no reset asked: drain); Drain and Reset: "Drain P2P and Reset Gpu"
# (cuda.bindings.nvml.DeviceGpuRecoveryAction): vigil's reset_gpu drains the node and resets. The
# same verdicts as a Xid 154 line's (XID154_ACTIONS), keyed by the wire's names.
NVML_RECOVERY_ACTIONS: Mapping[str, Action] = {
    "gpu_reset": Action.RESET_GPU,
    "node_reboot": Action.REBOOT_NODE,
    "drain_p2p": Action.DRAIN,
    "drain_and_reset": Action.RESET_GPU,
}
# NVLink5 Xids 144-150 carry their severity in the text ("RLW_REMAP Fatal ...") and two registers,
# intrInfo and errorStatus, that NVIDIA's "Xid 144-150 Decode" sheet (aggregator/data/
# nvlink5_decode.csv) resolves to a unit, a resolution and an investigatory action; Xid 74 carries
# seven NVLink registers that the catalog's WORKFLOW_NVLINK_ERR guide reads bit by bit. Decoded in
# ``decode_nvlink`` (below); a line the decode cannot place falls back to its severity word.
NVLINK5_CODES = frozenset(range(144, 151))
XID_NVLINK = 74
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


@dataclass(slots=True)
class XidOccurrence:
    """One de-duplicated Xid on one GPU, on the aggregator's clock: the fleet keeps these per GPU
    (NodeState.xids; an Xid seen by the kernel log and by NVML within the dedup window is one, its
    ``sources`` both readers and its ``count`` the larger) and judge_xids reads them."""

    code: int
    ts: float
    count: int = 1
    message: str = ""
    sources: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class XidVerdict:
    action: Action
    codes: tuple[int, ...]
    reason: str
    since: float
    key: str
    nvlink: NvlinkDecode | None = None  # Xid 74 / 144-150: the decoded line the action follows


NVLINK5_DATA_FILE = "nvlink5_decode.csv"
# NVIDIA's resolution buckets of the decode sheet (and catalog) -> vigil's action. XID_154_EVAL: "if
# an Xid 154 is seen along with this error, take that action; if no Xid 154 present, RESTART_APP"
# (judge_xids applies a companion 154; the application's restart is the job's, not the node's).
NVLINK_RESOLUTION_ACTIONS: Mapping[str, Action] = {
    "IGNORE": Action.OBSERVE,
    "XID_154_EVAL": Action.OBSERVE,
    "RESTART_APP": Action.OBSERVE,
    "RESET_GPU": Action.RESET_GPU,
    "RESTART_BM": Action.REBOOT_NODE,
}
# "Xid (PCI:...): 145, RLW_REMAP Fatal XC1 i0 Link 10 (0x00000082 0x00000040 ...)": <unit> <fatal vs
# nonfatal> <cross-contain> <injected> <link> (<intrInfo> <errorStatus> <errorDebugData[0..4]>)
# (catalog bucket WORKFLOW_NVLINK5_ERR). Older drivers print "Link -1" for a unit-wide event.
_NVLINK5_RE = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]*)\s+(?P<severity>Fatal|Non-?fatal)\s+XC\s*(?P<xc>\d+)\s+i\s*(?P<injected>\d+)\s+"
    r"Link\s+(?P<link>-?\d+)\s*[(\[](?P<regs>0x[0-9a-fA-F]{1,8}(?:[\s,]+0x[0-9a-fA-F]{1,8}){0,7})",
    re.IGNORECASE)
# "NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"; older drivers
# print the link alone.
_XID74_RE = re.compile(r"\blink\s+(?P<link>\d+)\s*(?:\((?P<regs>0x[0-9a-fA-F]{1,8}(?:,\s*0x[0-9a-fA-F]{1,8}){0,7})\))?",
                       re.IGNORECASE)
_HEX_RE = re.compile(r"0x[0-9a-fA-F]{1,8}")
# NVIDIA's WORKFLOW_NVLINK_ERR guide (nvsentinel/xid-resolution-buckets.csv) for Xid 74's seven
# registers: register (1-based) -> bit -> class; the first, third, fourth and fifth are valid on
# Hopper. "If bits other than those specifically outlined below are seen, please report a bug."
XID74_REGISTER_BITS: Mapping[int, Mapping[int, str]] = {
    1: {0: "ignore", 23: "ignore", 30: "ignore", 1: "sympathetic", 20: "sympathetic",
        4: "ecc_parity", 5: "ecc_parity", 8: "hardware", 9: "hardware", 12: "hardware", 16: "hardware",
        17: "hardware", 24: "hardware", 28: "hardware", 21: "marginal_si", 22: "marginal_si",
        27: "report_if_repeated", 29: "report_if_repeated"},
    3: {0: "ecc_parity", 1: "ecc_parity", 2: "ecc_parity", 6: "ecc_parity", 13: "unexpected",
        16: "diags_if_repeated", 19: "diags_if_repeated", 17: "report_if_repeated", 18: "report_if_repeated"},
    4: {16: "sympathetic", 17: "sympathetic", 18: "sympathetic_fabric_reset"},
    5: {18: "ecc_parity", 19: "ecc_parity", 21: "ecc_parity", 22: "ecc_parity", 24: "ecc_parity",
        25: "ecc_parity", 27: "ecc_parity", 28: "ecc_parity",
        20: "ecc_threshold", 23: "ecc_threshold", 26: "ecc_threshold", 29: "ecc_threshold"},
}
# The guide's words per class (investigatory action), and the classes that need no recovery: bits
# "that can be safely ignored" and ECC thresholds crossed "with no uncorrectable error: continue
# operation". Any other bit leaves the link in the fatal state the line reports: the catalog's
# action for Xid 74 (reset_gpu) applies.
XID74_GUIDANCE: Mapping[str, str] = {
    "ignore": "can be safely ignored",
    "sympathetic": "sympathetic or secondary: follow the other Xid/SXid; if solo, report a bug",
    "sympathetic_fabric_reset": "sympathetic, a reset of the fabric is required: follow the other Xid/SXid; "
                                "if solo, report a bug",
    "ecc_parity": "likely HW ECC/parity: more than 2 times on the same link, report a bug",
    "hardware": "possible HW issue: check link mechanical connections, re-seat; run diags if it persists",
    "marginal_si": "marginal channel SI: check link mechanical connections, run field diags, report a bug",
    "report_if_repeated": "if seen repeatedly, report a bug",
    "diags_if_repeated": "if seen repeatedly, run field diags and report a bug",
    "unexpected": "not expected in production: report a bug",
    "ecc_threshold": "ECC error threshold exceeded, no uncorrectable error: continue operation",
    "unlisted": "a bit the guide does not list: report a bug",
}
XID74_BENIGN = frozenset({"ignore", "ecc_threshold"})


@dataclass(frozen=True)
class Nvlink5Row:
    code: int
    unit: str
    intr_masks: tuple[tuple[int, int], tuple[int, int]]  # (mask, value) for drivers < R575, >= R575
    statuses: frozenset[int] | None  # None: any errorStatus
    resolution: str
    investigatory: str
    severity: str


def _pattern(text: str) -> tuple[int, int]:
    if len(text) != 32 or set(text) - set("-01"):
        raise ValueError(f"intrInfo pattern {text!r} is not 32 characters of 0, 1, -")
    mask = value = 0
    for i, ch in enumerate(text):
        if ch != "-":
            mask |= 1 << (31 - i)
            value |= int(ch) << (31 - i)
    return mask, value


def load_nvlink5_rows(text: str | None = None) -> list[Nvlink5Row]:
    """Parse the packaged NVLink5 decode sheet (or ``text`` in the same CSV form)."""
    def build(row: dict[str, str]) -> Nvlink5Row:
        if row["resolution"] not in NVLINK_RESOLUTION_ACTIONS:
            raise ValueError(f"unknown resolution {row['resolution']!r}")
        status = row["error_status_hex"].strip()
        return Nvlink5Row(int(row["xid"]), row["unit"], (_pattern(row["intrinfo_pattern_v1_lt_r575"]),
                          _pattern(row["intrinfo_pattern_v2_ge_r575"])),
                          frozenset(int(s, 16) for s in status.split("/")) if status else None,
                          row["resolution"], row["investigatory_action"], row["severity"])
    return _load_rows(NVLINK5_DATA_FILE, text, build)


@dataclass(frozen=True)
class NvlinkDecode:
    """What an Xid 74 or NVLink5 (144-150) line says: which link, fatal or not (the driver's word),
    the unit, NVIDIA's resolution and investigatory action, and the vigil action they map to.
    ``resolution`` is None when the registers match no row of NVIDIA's tables: the action then
    follows the line's severity word."""

    code: int
    link: int | None
    fatal: bool
    unit: str | None = None
    resolution: str | None = None
    investigatory: str | None = None
    severity: str | None = None  # the decode sheet's severity column (NVLink5)
    driver: str | None = None  # which pattern generation matched: "<R575" or ">=R575"
    registers: tuple[int, ...] = ()
    bits: tuple[str, ...] = ()  # Xid 74: "reg<N>.bit<B>=<class>" per set bit
    action: Action = Action.ALERT

    def evidence(self) -> dict[str, object]:
        out: dict[str, object] = {"link": self.link, "fatal": self.fatal, "unit": self.unit,
                                  "resolution": self.resolution, "investigatory": self.investigatory}
        if self.driver is not None:
            out["driver"] = self.driver
        if self.bits:
            out["register_bits"] = list(self.bits)
        return out

    def summary(self) -> str:
        parts = [f"link {self.link}" if self.link is not None else "link ?", "fatal" if self.fatal else "non-fatal"]
        if self.unit:
            parts.append(f"unit {self.unit}")
        parts.append(f"resolution {self.resolution or 'undecoded'}")
        if self.bits:
            parts.append(f"bits {' '.join(self.bits)}")
        if self.investigatory:
            parts.append(f"investigate: {self.investigatory}")
        return ", ".join(parts)


class NvlinkDecoder:
    """Decodes Xid 74 and 144-150 lines against NVIDIA's tables; ``catalog_action`` is the action
    of a fatal line the tables cannot place (the Xid catalog's, reset_gpu as shipped)."""

    def __init__(self, rows: Iterable[Nvlink5Row] | None = None) -> None:
        self._rows: dict[int, list[Nvlink5Row]] = {}
        for row in rows if rows is not None else load_nvlink5_rows():
            self._rows.setdefault(row.code, []).append(row)

    def decode(self, code: int, message: str, catalog_action: Action = Action.RESET_GPU) -> NvlinkDecode | None:
        if code == XID_NVLINK:
            return self._decode74(message, catalog_action)
        if code in NVLINK5_CODES:
            return self._decode5(code, message, catalog_action)
        return None

    def _decode5(self, code: int, message: str, catalog_action: Action) -> NvlinkDecode | None:
        m = _NVLINK5_RE.search(message)
        if m is None:
            return None
        fatal = not _NONFATAL_RE.fullmatch(m.group("severity"))
        regs = tuple(int(h, 16) for h in _HEX_RE.findall(m.group("regs")))
        link = int(m.group("link"))
        base = NvlinkDecode(code, link if link >= 0 else None, fatal, registers=regs,
                            action=catalog_action if fatal else Action.OBSERVE)
        if len(regs) < 2:
            return base
        intr, status = regs[0], regs[1]
        matched = [(gen, row) for row in self._rows.get(code, ()) for gen, (mask, value) in
                   zip(("<R575", ">=R575"), row.intr_masks, strict=True) if intr & mask == value]
        if not matched:
            return base
        exact = [(g, r) for g, r in matched if r.statuses is None or status in r.statuses]
        if not exact and status:
            # Several errorStatus bits at once: each bit its own row, all of them known.
            bits = [1 << b for b in range(32) if status >> b & 1]
            per_bit = [[(g, r) for g, r in matched if r.statuses is not None and bit in r.statuses] for bit in bits]
            if all(per_bit):
                exact = [found for rows in per_bit for found in rows]
        units = " or ".join(dict.fromkeys(r.unit for _, r in (exact or matched)))
        driver = " or ".join(dict.fromkeys(g for g, _ in (exact or matched)))
        if not exact:
            return replace(base, unit=units, driver=driver)
        _gen, row = max(exact, key=lambda found: _RANK[NVLINK_RESOLUTION_ACTIONS[found[1].resolution]])
        return replace(base, unit=units, driver=driver, resolution=row.resolution, investigatory=row.investigatory,
                       severity=row.severity, action=NVLINK_RESOLUTION_ACTIONS[row.resolution])

    @staticmethod
    def _decode74(message: str, catalog_action: Action) -> NvlinkDecode | None:
        m = _XID74_RE.search(message)
        if m is None:
            return None
        fatal = not _NONFATAL_RE.search(message)
        regs = tuple(int(h, 16) for h in _HEX_RE.findall(m.group("regs") or ""))
        bits: list[str] = []
        classes: list[str] = []
        for n, reg in enumerate(regs, start=1):
            for b in range(32):
                if reg >> b & 1:
                    cls = XID74_REGISTER_BITS.get(n, {}).get(b, "unlisted")
                    bits.append(f"reg{n}.bit{b}={cls}")
                    classes.append(cls)
        if not regs or not classes:
            return NvlinkDecode(XID_NVLINK, int(m.group("link")), fatal, registers=regs, action=catalog_action)
        benign = all(c in XID74_BENIGN for c in classes)
        guidance = "; ".join(XID74_GUIDANCE[c] for c in dict.fromkeys(classes))
        return NvlinkDecode(XID_NVLINK, int(m.group("link")), fatal, resolution="WORKFLOW_NVLINK_ERR",
                            investigatory=guidance, registers=regs, bits=tuple(bits),
                            action=Action.OBSERVE if benign else catalog_action)


_DECODER: NvlinkDecoder | None = None


def nvlink_decoder() -> NvlinkDecoder:
    """The decoder of the packaged tables, loaded once."""
    global _DECODER
    if _DECODER is None:
        _DECODER = NvlinkDecoder()
    return _DECODER


def decode_nvlink(catalog: XidCatalog, code: int, message: str) -> NvlinkDecode | None:
    """The decode of an Xid 74 / 144-150 line, its action refined from the catalog's; None for
    other codes, for a line without the fields, and for a code an operator overrode or the catalog
    does not know (their action is final)."""
    entry = catalog.entry(code)
    if code in catalog.overridden or entry.category == "unknown":
        return None
    return nvlink_decoder().decode(code, message, entry.action)


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
    decoded = decode_nvlink(catalog, code, message)
    if decoded is not None:
        return decoded.action
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
                 severity: str | None = None, sxids: SxidCatalog | None = None, error: str | None = None) -> Action:
    """What one kernel-log event calls for on its own (``vigil xid scan``): Xids by the catalog,
    a GPU fallen off the bus as Xid 79, SXids by the line's severity or else the SXid catalog,
    amdgpu events (``error``: the event's name) by the amdgpu catalog; mlx5 NIC errors alert (the
    network detectors judge links)."""
    if kind == "amdgpu":
        from vigil.aggregator.amdgpu_catalog import AmdgpuCatalog

        return AmdgpuCatalog().entry(error or "").action
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
        if code in NVLINK5_CODES or code == XID_NVLINK:
            decoded = _strongest_decode(catalog, code, episode)
            if decoded is not None:
                verdicts.append(XidVerdict(decoded.action, (code,), f"{what}, {tally}: {decoded.summary()}", since,
                                           f"xid:{code}", decoded))
                continue
            action = occurrence_action(catalog, code, episode[-1].message)
        verdicts.append(XidVerdict(action, (code,), f"{what}, {tally}: {entry.source}", since, f"xid:{code}"))
    verdicts.sort(key=lambda v: (-_RANK[v.action], v.codes))
    return verdicts


def _strongest_decode(catalog: XidCatalog, code: int, episode: list[XidOccurrence]) -> NvlinkDecode | None:
    """The decode of the episode's line that calls for the most (the latest among equals): a
    non-fatal line after a fatal one on the same GPU does not undo the fatal one."""
    best: NvlinkDecode | None = None
    for occ in episode:
        decoded = decode_nvlink(catalog, code, occ.message)
        if decoded is not None and (best is None or _RANK[decoded.action] >= _RANK[best.action]):
            best = decoded
    return best


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
