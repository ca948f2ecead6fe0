"""The gate's routes for people: read the breaker and the gate's state, hold and resume a node, isolate.

It serves ``GET /v1/breaker``, ``/v1/gate``, ``/v1/nodes/{node}/history`` and ``/v1/probes/isolations`` (read
role) and ``POST`` hold, resume and isolations (operator role), each taking one node by its exact name (a
hostlist or glob is refused 400 ``bad_node``) and writing in a worker thread. It judges nothing: a resume is a
decision through the ledger and its gate, and a hold or resume voids the node's pending node-action requests
at once (docs/gate.md, "Giving a node back"; docs/probes.md, "Isolations in the service";
docs/security-agent.md, "Node actions").
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from aiohttp import web

from vigil.aggregator.auth import Refusals
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.fleet import FleetView
from vigil.aggregator.gate import OPERATOR
from vigil.aggregator.history import DEFAULT_LIMIT, MAX_LIMIT, node_history
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.precision import TicketRefused
from vigil.aggregator.prober import IsolationRefused, Prober
from vigil.aggregator.store import WRITE_ERRORS
from vigil.contract.wire import check_node_name

MAX_NOTE_CHARS = 500
GATE_ROUTES = (("GET", "/v1/breaker"), ("GET", "/v1/gate"), ("POST", "/v1/nodes/{node}/hold"),
               ("POST", "/v1/nodes/{node}/resume"), ("GET", "/v1/nodes/{node}/history"))


def _error(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status)


# A node name is taken exactly: nothing is expanded. These characters mark a Slurm hostlist
# (``vnode[1-5]``, ``a,b``) or a shell glob (``vnode*``) that reached the API unexpanded.
_HOSTLIST_OR_GLOB = frozenset("[],*?")


def node_name_refusal(node: str) -> str | None:
    """Why ``node`` (a path segment) is not one node's name, or None when it is. A hostlist or
    glob is named as such: the operator meant several nodes, and each is held or resumed on its own."""
    try:
        check_node_name(node)
    except ValueError as exc:
        if _HOSTLIST_OR_GLOB & set(node):
            return (f"{node[:80]!r} is not a node name, it looks like a Slurm hostlist or a glob: each node "
                    "is named exactly, nothing is expanded (scontrol show hostnames expands a hostlist)")
        return str(exc)
    return None


async def _note(request: web.Request) -> str | web.Response:
    """The optional ``{"note": "..."}`` body, on one line."""
    if not request.can_read_body:
        return ""
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, "too_large", f"body exceeds {request.client_max_size - 1} bytes")
    except ValueError:
        return _error(400, "invalid_json", 'body must be a JSON object like {"note": "..."}')
    note = body.get("note", "") if isinstance(body, dict) else None
    if not isinstance(note, str) or len(note) > MAX_NOTE_CHARS:
        return _error(400, "bad_note", f"note must be a string of at most {MAX_NOTE_CHARS} characters")
    return " ".join(note.split())


def add_operator_routes(app: web.Application, ledger: Ledger, *, clock: Callable[[], float],
                        reporting: Callable[[], int], dry_run: bool,
                        void_node_actions: Callable[[str, str, float, str], int] | None = None,
                        refusals: Refusals | None = None) -> None:
    """``reporting``: how many nodes reported within the breaker window (the budget's fleet);
    ``void_node_actions(node, reason, now, why)``: cancel the node's pending node-action requests
    (reason ``held`` or ``resumed``), returning how many (called on the event loop);
    ``refusals``: where a request naming no node is counted (``bad_node`` at its door)."""
    if refusals is not None:
        for door in ("operator", "read"):
            refusals.counter.labels(door, "bad_node")  # the series exist at 0

    def bad_node(door: str, node: str) -> web.Response | None:
        why = node_name_refusal(node)
        if why is None:
            return None
        if refusals is not None:
            refusals.count(door, "bad_node")
        return _error(400, "bad_node", why)

    def void(node: str, reason: str, note: str) -> int:
        if void_node_actions is None:
            return 0
        return void_node_actions(node, reason, clock(), f"{reason} by an operator{': ' + note if note else ''}")

    async def get_breaker(_: web.Request) -> web.Response:
        return web.json_response(ledger.breaker_budget(clock(), reporting()))

    async def get_gate(_: web.Request) -> web.Response:
        return web.json_response(ledger.gate_state(clock(), reporting()))

    async def operator_note(request: web.Request) -> str | web.Response:
        """The body's note, or its refusal counted at the operator door as the door's other refusals."""
        note = await _note(request)
        if isinstance(note, web.Response) and refusals is not None:
            refusals.count("operator", json.loads(note.text or "{}").get("error", "invalid_json"))
        return note

    async def change_hold(request: web.Request, held: bool) -> tuple[str, str, bool] | web.Response:
        """(node, note, whether it was held) after setting or releasing a hold."""
        node = request.match_info["node"]
        refused = bad_node("operator", node)
        if refused is not None:
            return refused
        note = await operator_note(request)
        if isinstance(note, web.Response):
            return note
        try:
            was_held = await asyncio.to_thread(ledger.hold, node, held, clock(), note)
        except WRITE_ERRORS as exc:
            return _error(503, "store_unavailable", str(exc))
        return node, note, was_held

    async def hold_node(request: web.Request) -> web.Response:
        done = await change_hold(request, True)
        if isinstance(done, web.Response):
            return done
        node, note, was_held = done
        cancelled = void(node, "held", note)
        return web.json_response({"node": node, "held": True, "was_held": was_held,
                                  "node_actions_cancelled": cancelled})

    async def resume_node(request: web.Request) -> web.Response:
        """Release a hold, and put a removed node back in service (a resume decision by hand)."""
        done = await change_hold(request, False)
        if isinstance(done, web.Response):
            return done
        node, note, was_held = done
        cancelled = void(node, "resumed", note)
        now = clock()
        decision = Decision(id="resume-" + hashlib.sha256(f"{node}\x1f{now:.6f}".encode()).hexdigest()[:14],
                            ts=now, node=node, action=Action.RESUME, reason=f"resumed by an operator {note}".strip(),
                            detector=OPERATOR, dry_run=dry_run)
        admitted = await asyncio.to_thread(ledger.submit, [decision], now, reporting())
        problem = ledger.problem()
        if problem is not None:
            return _error(503, "store_unavailable", problem)
        verdict = ledger.store.verdict_of(decision.id)
        return web.json_response({"node": node, "was_held": was_held, "resume": decision.id,
                                  "admitted": bool(admitted), "verdict": verdict[1] if verdict else None,
                                  "node_actions_cancelled": cancelled})

    async def get_history(request: web.Request) -> web.Response:
        """The node's standing and its newest ``?limit=`` history entries, newest first."""
        node = request.match_info["node"]
        refused = bad_node("read", node)
        if refused is not None:
            return refused
        raw = request.query.get("limit", str(DEFAULT_LIMIT))
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIMIT:
            return _error(400, "bad_limit", f"limit must be an integer in 1..{MAX_LIMIT}, got {raw[:40]!r}")
        try:
            return web.json_response(await asyncio.to_thread(node_history, ledger.store, node, limit))
        except WRITE_ERRORS as exc:  # a store that cannot be read right now
            return _error(503, "store_unavailable", str(exc))

    async def close_ticket(request: web.Request) -> web.Response:
        """An operator closes a removal's hardware ticket: a fault found (confirmed) or none."""
        precision = ledger.precision
        decision_id = request.match_info["decision"]
        body = await _ticket_body(request)
        refused: tuple[int, str, str] | None = body if isinstance(body, tuple) and len(body) == 3 else None
        if precision is None:
            refused = (409, "precision_disabled", "precision.enabled is false: no removal is followed")
        elif not _DECISION_ID.fullmatch(decision_id):
            refused = (400, "bad_decision", "a decision id is 1..64 characters of [A-Za-z0-9._-]")
        if refused is None and precision is not None and isinstance(body, dict):
            try:
                outcome = await asyncio.to_thread(precision.close_ticket, decision_id, body["fault"], body["note"],
                                                  clock())
            except TicketRefused as exc:
                refused = (exc.status, exc.reason, exc.detail)
            else:
                return web.json_response({"decision": decision_id, **outcome.as_evidence()})
        assert refused is not None
        if refusals is not None:
            refusals.count("operator", refused[1])
        return _error(*refused)

    async def promote_rule(request: web.Request) -> web.Response:
        """An operator gives a demoted rule its action back."""
        precision = ledger.precision
        detector, rule = request.match_info["detector"], request.match_info["rule"]
        note = await operator_note(request)
        if isinstance(note, web.Response):
            return note
        try:
            if precision is None:
                raise TicketRefused(409, "precision_disabled", "precision.enabled is false: no rule is demoted")
            return web.json_response(await asyncio.to_thread(precision.promote, detector, rule, clock(), note))
        except TicketRefused as exc:
            if refusals is not None:
                refusals.count("operator", exc.reason)
            return _error(exc.status, exc.reason, exc.detail)

    async def get_precision(_: web.Request) -> web.Response:
        precision = ledger.precision
        return web.json_response({"enabled": precision is not None,
                                  "rules": await asyncio.to_thread(precision.rules) if precision else []})

    for method, path, handler in (("POST", TICKET_ROUTE, close_ticket), ("POST", PROMOTE_ROUTE, promote_rule),
                                  ("GET", PRECISION_ROUTE, get_precision)):
        app.router.add_route(method, path, handler)

    handlers = {"/v1/breaker": get_breaker, "/v1/gate": get_gate, "/v1/nodes/{node}/hold": hold_node,
                "/v1/nodes/{node}/resume": resume_node, "/v1/nodes/{node}/history": get_history}
    for method, path in GATE_ROUTES:
        app.router.add_route(method, path, handlers[path])


# Precision from outcomes (aggregator/precision.py): an operator closes a removal's hardware ticket
# (POST {"fault": true|false, "note": "..."}) or promotes a demoted rule; GET lists every rule.
TICKET_ROUTE = "/v1/decisions/{decision}/outcome"
PROMOTE_ROUTE = "/v1/precision/{detector}/{rule}/promote"
PRECISION_ROUTE = "/v1/precision"
_DECISION_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


async def _ticket_body(request: web.Request) -> dict[str, Any] | tuple[int, str, str]:
    """``{"fault": bool, "note": str}`` (note optional, one line, bounded), or the 400 refusal."""
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        return 413, "too_large", f"body exceeds {request.client_max_size - 1} bytes"
    except ValueError:
        return 400, "invalid_json", 'body must be a JSON object like {"fault": true, "note": "..."}'
    if not isinstance(body, dict) or set(body) - {"fault", "note"}:
        return 400, "unknown_field", 'body takes only "fault" and "note"'
    fault, note = body.get("fault"), body.get("note", "")
    if not isinstance(fault, bool):
        return 400, "bad_fault", '"fault" must be true (a fault was found) or false (none)'
    if not isinstance(note, str) or len(note) > MAX_NOTE_CHARS:
        return 400, "bad_note", f"note must be a string of at most {MAX_NOTE_CHARS} characters"
    return {"fault": fault, "note": " ".join(note.split())}


ISOLATION_ROUTE = "/v1/probes/isolations"
ISOLATION_KEYS = frozenset({"nodes", "d_hint", "note"})
# 4xx per refusal: a request that cannot be right (400) against one that cannot start now (409).
_CONFLICT = frozenset({"disabled", "running", "removed", "probe_running", "fleet_share", "no_partner"})


def _isolation_body(body: object, max_nodes: int) -> tuple[list[str], int, str] | tuple[str, str]:
    """(nodes, d_hint, note) from the body, or (reason, detail) of a 400."""
    if not isinstance(body, dict):
        return "invalid_json", 'body must be a JSON object like {"nodes": ["node-1", ...], "d_hint": 1}'
    extra = sorted(set(body) - ISOLATION_KEYS)
    if extra:
        return "unknown_field", f"unknown field(s) {', '.join(map(str, extra))[:200]} (nodes, d_hint, note)"
    nodes = body.get("nodes")
    if not isinstance(nodes, list) or not 1 <= len(nodes) <= max_nodes:
        return "bad_nodes", f"nodes must be a list of 1..{max_nodes} node names"
    for n in nodes:
        if not isinstance(n, str):
            return "bad_nodes", "nodes must be node names (strings)"
        try:
            check_node_name(n)
        except ValueError as exc:
            return "bad_nodes", str(exc)[:200]
    if len(set(nodes)) != len(nodes):
        return "bad_nodes", "nodes repeat"
    d_hint = body.get("d_hint", 1)
    if not isinstance(d_hint, int) or isinstance(d_hint, bool) or not 1 <= d_hint <= len(nodes):
        return "bad_d_hint", f"d_hint (the faulty nodes expected) must be an integer in 1..{len(nodes)}"
    note = body.get("note", "")
    if not isinstance(note, str) or len(note) > MAX_NOTE_CHARS:
        return "bad_note", f"note must be a string of at most {MAX_NOTE_CHARS} characters"
    return nodes, d_hint, " ".join(note.split())


def add_isolation_routes(app: web.Application, prober: Prober, *, view: Callable[[], FleetView],
                         clock: Callable[[], float], leads: Callable[[], bool]) -> None:
    """``view``: the fleet as the detectors see it (the gate's removals included); ``leads``:
    whether this replica leads (only the leader's prober offers requests)."""

    async def start(request: web.Request) -> web.Response:
        max_nodes = prober.config.max_isolation_nodes
        try:
            body = await request.json()
        except ValueError:
            body = None
        parsed = _isolation_body(body, max_nodes)
        if len(parsed) == 2:
            reason, detail = parsed
            prober.refused(reason)
            return _error(400, reason, detail)
        nodes, d_hint, note = parsed
        if not leads():
            prober.refused("standby")
            return _error(409, "standby", "this replica is a standby: start the isolation on the leader")
        try:
            outcome = prober.start_isolation(nodes, d_hint, view(), clock(), source="operator", note=note)
        except IsolationRefused as exc:
            return _error(409 if exc.reason in _CONFLICT else 400, exc.reason, exc.detail)
        return web.json_response(outcome.as_dict(), status=202)

    async def listing(_: web.Request) -> web.Response:
        return web.json_response({"isolations": [o.as_dict() for o in reversed(prober.isolations)]})

    app.router.add_post(ISOLATION_ROUTE, start)
    app.router.add_get(ISOLATION_ROUTE, listing)
