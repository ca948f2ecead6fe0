"""``vigil xid scan FILE`` and ``vigil xid explain CODE``: the kernel-log reader and the Xid catalog by hand.

``scan`` reads a saved kernel log in any format the agent reads (dmesg, dmesg -T, ISO, journald,
syslog, raw /dev/kmsg, each also as collected from many hosts by pdsh/clush with a "<host>: "
prefix) and prints each fault (Xid, SXid, fallen off the bus, mlx5 error; companion and detail
lines folded into their fault) with the catalogs' action for it; ``explain`` prints one Xid
catalog entry. Neither follows a live log. An Xid 74 or NVLink5 (144-150) line also prints its
decode (``xid_catalog.decode_nvlink``, the one the xid detector uses): link, fatal or not, unit,
NVIDIA's resolution and investigatory action.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

from vigil.agent.kernel_log import KernelEvent, KernelLogParser
from vigil.aggregator.xid_catalog import NvlinkDecode, SxidCatalog, XidCatalog, decode_nvlink, event_action


def add_parser(sub: Any) -> None:
    p = sub.add_parser("xid", help="scan a kernel log for Xids, explain an Xid code",
                       description="Read saved kernel logs and NVIDIA's Xid catalog.")
    xsub = p.add_subparsers(dest="xid_command", required=True, metavar="SUBCOMMAND")
    scan = xsub.add_parser("scan", help="print every GPU/NVSwitch/NIC fault line of a saved kernel log")
    scan.add_argument("file", metavar="FILE", help="a saved kernel log (dmesg, dmesg -T, journalctl -k, syslog, "
                      "kmsg; also as pdsh/clush print it, each line behind '<host>: ')")
    scan.add_argument("--json", action="store_true", help="one JSON object per line")
    explain = xsub.add_parser("explain", help="print the catalog entry of an Xid code")
    explain.add_argument("code", metavar="CODE", help="Xid code, e.g. 79")
    explain.add_argument("--json", action="store_true", help="print the entry as JSON")


def run(args: argparse.Namespace) -> int:
    if args.xid_command == "scan":
        return scan(args.file, as_json=args.json)
    return explain(args.code, as_json=args.json)


def scan(path: str, *, as_json: bool = False) -> int:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        print(f"vigil xid scan: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    catalogs = (XidCatalog.default(), SxidCatalog.default())
    parser = KernelLogParser()
    unparsed: Counter[str] = Counter()
    folded: Counter[str] = Counter()
    try:
        events = _print_events(data, catalogs, parser, unparsed, folded, as_json)
    except BrokenPipeError:
        # `vigil xid scan log | head`: the reader left; not an error, and no traceback at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    if unparsed:
        detail = ", ".join(f"{reason}: {n}" for reason, n in sorted(unparsed.items()))
        print(f"vigil xid scan: skipped {sum(unparsed.values())} unparsable line(s) ({detail})", file=sys.stderr)
    if not as_json:
        note = f" ({sum(folded.values())} companion line(s) folded into their fault)" if folded else ""
        print(f"vigil xid scan: {events} event(s) in {path}{note}", file=sys.stderr)
    return 0


def _print_events(data: bytes, catalogs: tuple[XidCatalog, SxidCatalog], parser: KernelLogParser,
                  unparsed: Counter[str], folded: Counter[str], as_json: bool) -> int:
    events = 0
    out = sys.stdout
    for line in data.decode("utf-8", "replace").splitlines():
        parsed = parser.feed(line)
        if parsed.unparsed:
            unparsed[parsed.unparsed] += 1
        if parsed.folded:
            folded[parsed.folded] += 1
        if parsed.event is None:
            continue
        events += 1
        ev = parsed.event
        action = event_action(catalogs[0], ev.kind, ev.code, ev.text, ev.severity, catalogs[1], ev.error)
        decoded = decode_nvlink(catalogs[0], ev.code, ev.text) if ev.kind == "xid" and ev.code is not None else None
        if as_json:
            out.write(json.dumps(_record(ev, action.value, decoded)) + "\n")
        else:
            out.write(_text(ev, action.value, decoded) + "\n")
    out.flush()
    return events


def _record(ev: KernelEvent, action: str, decoded: NvlinkDecode | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"ts": ev.ts_text or None, "kind": ev.kind, "pci_bus_id": ev.pci_bus_id,
                              "code": ev.code, "action": action, "text": ev.text}
    for key in ("host", "device", "severity", "error", "pid", "process"):
        value = getattr(ev, key)
        if value is not None:
            record[key] = value
    if decoded is not None:
        record["nvlink"] = decoded.evidence()
    return record


def _text(ev: KernelEvent, action: str, decoded: NvlinkDecode | None = None) -> str:
    what = {"xid": f"Xid {ev.code}", "sxid": f"SXid {ev.code}", "gpu_lost": "fallen off the bus",
            "mlx5_error": f"mlx5 {ev.error}", "amdgpu": f"amdgpu {ev.error}"}[ev.kind]
    where = ev.pci_bus_id or "-"
    if ev.kind == "sxid" and ev.device:
        where = f"{where} ({ev.device})"
    elif ev.kind == "mlx5_error" and ev.device:
        where = ev.device
    text = f"{ev.severity}, {ev.text}" if ev.severity else ev.text
    line = f"{ev.ts_text or '-'}\t{where}\t{what}\t{action}\t{text}"
    if decoded is not None:
        line = f"{line}\t[{decoded.summary()}]"
    return f"{ev.host}\t{line}" if ev.host else line


def explain(code_text: str, *, as_json: bool = False) -> int:
    try:
        code = int(code_text, 10)
    except ValueError:
        print(f"vigil xid explain: {code_text!r} is not an Xid code (an integer such as 79)", file=sys.stderr)
        return 2
    entry = XidCatalog.default().entry(code)
    if as_json:
        print(json.dumps({"code": entry.code, "name": entry.name, "description": entry.description,
                          "action": entry.action.value, "category": entry.category, "sticky": entry.sticky,
                          "source": entry.source}))
        return 0
    print(f"Xid {entry.code}: {entry.name}")
    print(f"  description: {entry.description}")
    print(f"  action:      {entry.action.value}")
    print(f"  category:    {entry.category}")
    print(f"  sticky:      {'yes (counted once per window)' if entry.sticky else 'no'}")
    print(f"  source:      {entry.source}")
    return 0
