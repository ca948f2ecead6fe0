"""``vigil aggregator decisions``: read the decision store.

It opens the aggregator's SQLite store directly (WAL allows it while the service runs), or its
PostgreSQL store with ``--dsn-file`` (an HA pair's, docs/ha.md), and lists
each decision with its gate verdict and its delivery state per actuator. It changes nothing:
the operator's actions (breaker reset, hold, resume) go through the service's API
(``vigil.cli.operator_cmd``), which owns the gate's state.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vigil.aggregator.store import Store


def add_decisions_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="PATH", default="vigil-aggregator.sqlite", help="decision store path")
    p.add_argument("--dsn-file", metavar="FILE", help="read the PostgreSQL store of an HA pair instead (the file "
                   "holding its connection string, as store.dsn_file)")
    p.add_argument("--limit", type=int, default=50, help="most recent N decisions (default 50)")
    p.add_argument("--node", help="only this node")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")


def _open(path: str, dsn_file: str | None = None) -> Store | int:
    """The store, or the exit status: 1 when there is none, 2 when it cannot be read."""
    from vigil.aggregator.store import Store, StoreError, read_dsn

    if dsn_file is not None:
        try:
            return Store("postgresql", dsn=read_dsn(dsn_file))
        except StoreError as exc:
            print(f"vigil aggregator: {exc}", file=sys.stderr)
            return 2
    if not Path(path).exists():
        print(f"vigil aggregator: no decision store at {path}", file=sys.stderr)
        return 1
    try:
        return Store(path)
    except StoreError as exc:
        print(f"vigil aggregator: {exc}", file=sys.stderr)
        return 2


def decisions(args: argparse.Namespace) -> int:
    from vigil.aggregator.redact import redact_json, redact_text
    from vigil.aggregator.store import decisions_as_dicts

    store = _open(args.store, getattr(args, "dsn_file", None))
    if isinstance(store, int):
        return store
    try:
        rows = store.decisions(limit=args.limit, node=args.node)
        if args.json:
            # Delivery errors may quote a configured URL: never its password or key.
            print(json.dumps(redact_json({"breaker": vars(store.breaker()), "decisions": decisions_as_dicts(rows)}),
                             indent=2))
            return 0
        b = store.breaker()
        if b.tripped:
            print(f"CIRCUIT BREAKER TRIPPED: {b.reason} (reset: vigil aggregator breaker reset)")
        for r in rows:
            d = r.decision
            when = datetime.fromtimestamp(d.ts, UTC).strftime("%Y-%m-%d %H:%M:%S")
            verdict = r.verdict if r.admitted else f"REFUSED {r.verdict}"
            esc = f" (proposed {r.proposed_action.value})" if r.proposed_action is not d.action else ""
            dry = " [dry run]" if d.dry_run else ""
            print(f"{when} {d.id} {d.node} {d.action.value}{esc} by {d.detector}: {verdict}{dry}")
            print(f"    reason: {d.reason}")
            if r.detail:
                print(f"    gate: {r.detail}")
            for x in r.deliveries:
                err = f" last error: {x.last_error}" if x.last_error else ""
                line = f"    {x.actuator}: {x.state} after {x.attempts} attempt(s){err} {x.detail}"
                print(redact_text(line.rstrip()))
        return 0
    finally:
        store.close()
