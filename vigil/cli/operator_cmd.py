"""``vigil aggregator gate|breaker|hold|resume|history|isolate|isolations``: operator actions via the API.

They talk to the running service (``--url``, with the operator's bearer token from
``--token-file``), never to its store, so the service that owns the gate's state is the one that
changes it: show the gate's state, show or reset the circuit breaker, hold a node (automation
leaves it alone) or resume it, show a node's remediation history, start a group-testing isolation
of a set of nodes (a freshly repaired set) and list isolations. A node is named exactly: a Slurm
hostlist or glob (``vnode[1-5]``) is refused before any request, never expanded (an expansion that
failed half-way would leave a set half held; the shell and ``scontrol show hostnames`` expand it
visibly). They decide nothing themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:9500"
TIMEOUT_SECONDS = 10.0
NODE_HELP = "the node's exact name, as its agent reports it (a hostlist is refused, not expanded)"


class ApiError(Exception):
    pass


def node_name(command: str) -> Callable[[str], str]:
    """argparse's type for ``command``'s node argument: one node's exact name (the aggregator's
    own rule), refused with the loop that does what a hostlist meant."""

    def check(text: str) -> str:
        from vigil.aggregator.operator_api import node_name_refusal

        why = node_name_refusal(text)
        if why is None:
            return text
        if "hostlist" in why:
            expand = f"$(scontrol show hostnames '{text[:80]}')"
            why += (f"; e.g. vigil aggregator isolate {expand}" if command == "isolate" else
                    f"; e.g. for n in {expand}; do vigil aggregator {command} \"$n\"; done")
        raise argparse.ArgumentTypeError(why)

    return check


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the aggregator's address (default {DEFAULT_URL})")
    p.add_argument("--token-file", metavar="FILE", help="the operator's bearer token")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")


def add_gate_args(p: argparse.ArgumentParser) -> None:
    _common(p)


def add_breaker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("breaker_action", choices=("show", "reset"), help="show the breaker, or reset a tripped one")
    _common(p)


def add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("node", type=node_name(p.prog.rsplit(" ", 1)[-1]), help=NODE_HELP)
    p.add_argument("--note", default="", help="why (kept with the hold and in the resume's reason)")
    _common(p)


def add_history_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("node", type=node_name("history"), help=NODE_HELP)
    p.add_argument("--limit", type=int, default=100, metavar="N",
                   help="the newest N entries (1..1000, default 100), printed oldest first")
    _common(p)


def call(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ApiError(f"cannot read token file {args.token_file}: {exc.strerror or exc}") from None
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        with exc:
            raw = exc.read()[:2000]
        try:
            doc = json.loads(raw)
            why = f"{doc.get('error', '')}: {doc.get('detail') or doc.get('reason') or ''}".strip(": ")
        except (ValueError, AttributeError):
            why = raw.decode(errors="replace").strip()
        raise ApiError(f"{method} {path}: HTTP {exc.code} {why}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ApiError(f"cannot reach the aggregator at {args.url}: {reason}") from None


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if ts else "-"


def _print_breaker(b: dict[str, Any]) -> None:
    if b["tripped"]:
        print(f"circuit breaker TRIPPED at {_when(b['tripped_ts'])}: {b['reason']}")
        print("  reset it (after finding the cause): vigil aggregator breaker reset")
    else:
        print("circuit breaker closed (acting normally)")
    grace = " (start-up grace: floor only)" if b.get("startup_grace") else ""
    print(f"  removals in the last {b['window_seconds']:.0f}s: {b['removals_in_window']} of a budget of "
          f"{b['budget']}{grace}; {b['reporting_nodes']} nodes reporting")
    print(f"  job restarts: {b['restarts_in_window']} of {b['restart_budget']}")


def _run(args: argparse.Namespace, method: str, path: str, show: Any, body: dict[str, Any] | None = None) -> int:
    try:
        answer = call(args, method, path, body)
    except ApiError as exc:
        print(f"vigil aggregator: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        show(answer)
    return 0


def gate(args: argparse.Namespace) -> int:
    def show(g: dict[str, Any]) -> None:
        _print_breaker(g["breaker"])
        store = g["store"]
        health = "ok" if store["problem"] is None else f"FAILING: {store['problem']} ({store['unstored']} waiting)"
        print(f"store {store['path']} (schema {store['schema_version']}): {health}")
        for node, hold in g["holds"].items():
            print(f"held: {node} since {_when(hold['ts'])} {hold['note']}".rstrip())
        for node, rec in g["nodes"].items():
            if rec["condition"] != "in_service":
                print(f"{rec['condition']}: {node} ({rec['last_removal']} at {_when(rec['last_removal_ts'])})")
        for node, entries in g["history"].items():
            print(f"history {node}: " + ", ".join(f"{e['action']}" + (f" gpu {e['gpu']}" if e["gpu"] is not None
                                                                        else "") for e in entries))

    return _run(args, "GET", "/v1/gate", show)


def breaker(args: argparse.Namespace) -> int:
    if args.breaker_action == "show":
        return _run(args, "GET", "/v1/breaker", _print_breaker)

    def show(r: dict[str, Any]) -> None:
        print("circuit breaker reset" if r["was_tripped"] else "circuit breaker was not tripped")

    return _run(args, "POST", "/v1/breaker/reset", show)


def hold(args: argparse.Namespace) -> int:
    def show(r: dict[str, Any]) -> None:
        print(f"{r['node']} held: automation leaves it alone until `vigil aggregator resume {r['node']}`"
              + (" (it was already held)" if r["was_held"] else ""))

    return _run(args, "POST", f"/v1/nodes/{urllib.parse.quote(args.node, safe='')}/hold", show, {"note": args.note})


def resume(args: argparse.Namespace) -> int:
    def show(r: dict[str, Any]) -> None:
        released = "hold released; " if r["was_held"] else ""
        if r["admitted"]:
            print(f"{r['node']}: {released}resume {r['resume']} admitted (delivered to the actuators)")
        else:
            print(f"{r['node']}: {released}no resume sent ({r['verdict']})")

    return _run(args, "POST", f"/v1/nodes/{urllib.parse.quote(args.node, safe='')}/resume", show, {"note": args.note})


def _iso(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else "-"


def _print_history(h: dict[str, Any]) -> None:
    s = h["standing"]
    if s["removed"]:
        by = f" by {s['removed_by']}" if s["removed_by"] else ""
        decision = f" (decision {s['removed_decision']})" if s["removed_decision"] else ""
        print(f"{h['node']}: {s['condition'].replace('_', ' ')}{by}{decision} since {_iso(s['removed_since'])}")
    else:
        print(f"{h['node']}: in service")
    if s["held"]:
        print(f"  held by {s['held_by']} since {_iso(s['held_since'])} {s['hold_note'] or ''}".rstrip())
    entries = list(reversed(h["entries"]))  # the API answers newest first; a log reads oldest first
    if not entries:
        print("  no history recorded for this node")
        return
    header = ("TIME (UTC)", "KIND", "ACTION", "OUTCOME", "ACTOR", "DETAIL")
    rows = [header, *((_iso(e["ts"]), e["kind"], e["action"] or "-", e["outcome"], e["actor"], e["detail"] or "-")
                      for e in entries)]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row[:5], widths, strict=True)) + f"  {row[5]}")
    if h["truncated"]:
        print(f"(the newest {h['limit']} entries; older ones: --limit up to 1000)")


def history(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 1000:
        print("vigil aggregator: --limit must be in 1..1000", file=sys.stderr)
        return 2
    path = f"/v1/nodes/{urllib.parse.quote(args.node, safe='')}/history?limit={args.limit}"
    return _run(args, "GET", path, _print_history)


def add_isolate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("nodes", nargs="+", metavar="NODE", type=node_name("isolate"),
                   help="the nodes to isolate the faulty ones among, each by its exact name "
                        "(a hostlist: $(scontrol show hostnames 'vnode[1-5]'))")
    p.add_argument("--d-hint", type=int, default=1, metavar="K", help="how many are expected faulty (default 1)")
    p.add_argument("--note", default="", help="why (kept with the isolation)")
    _common(p)


def add_isolations_args(p: argparse.ArgumentParser) -> None:
    _common(p)


def _print_isolation(i: dict[str, Any]) -> None:
    state = i["state"] if i["state"] != "done" else f"done, faulty: {', '.join(i['faulty']) or 'none'}"
    print(f"{i['name']} ({i['source']}) started {_when(i['started'])}: {len(i['nodes'])} nodes, d_hint {i['d_hint']}; "
          f"{state}; {i['tests_used']} tests (information bound {i['information_bound']})"
          + (f"; {i['detail']}" if i["detail"] else "") + (f"; {i['note']}" if i["note"] else ""))


def isolate(args: argparse.Namespace) -> int:
    def show(i: dict[str, Any]) -> None:
        print(f"isolation {i['name']} started: {len(i['nodes'])} nodes, d_hint {i['d_hint']} "
              f"(information bound {i['information_bound']} tests); follow it: vigil aggregator isolations")

    body = {"nodes": args.nodes, "d_hint": args.d_hint, "note": args.note}
    return _run(args, "POST", "/v1/probes/isolations", show, body)


def isolations(args: argparse.Namespace) -> int:
    def show(r: dict[str, Any]) -> None:
        if not r["isolations"]:
            print("no isolation has run")
        for i in r["isolations"]:
            _print_isolation(i)

    return _run(args, "GET", "/v1/probes/isolations", show)
