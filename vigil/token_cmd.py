"""``vigil token``: make the aggregator's credentials (README "Security").

``vigil token secret`` prints a fresh random secret (a site secret, or an Alertmanager, operator
or read token); ``vigil token create --secret-file F --node NAME`` prints NAME's node token,
derived from the site secret, for the agent's ``aggregator.token_file``. Node actions (signed
requests to agents, README "Security"): ``vigil token master-key --out F`` writes a new master key
(the aggregator's ``node_actions.key_file``) and ``vigil token node-key --master F --node NAME --out
F2`` writes NAME's node key derived from it (the agent's ``node_actions.key_file``); both files are
hex, created with mode 0600 and never overwritten. It talks to no service.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("token", help="make credentials for the aggregator",
                       description="Print a new secret, or a node's token derived from the site secret.")
    actions = p.add_subparsers(dest="token_action", metavar="ACTION", required=True)
    actions.add_parser("secret", help="print a new random secret (site secret or role token)")
    create = actions.add_parser("create", help="print a node's token (HMAC-SHA256 of its name under the site secret)")
    create.add_argument("--secret-file", required=True, metavar="FILE", help="the site secret (auth.site_secret_file)")
    create.add_argument("--node", required=True, action="append", metavar="NAME",
                        help="the node's name as it reports it (repeat for several: one token per line)")
    master = actions.add_parser("master-key", help="write a new node-action master key (aggregator's "
                                "node_actions.key_file), mode 0600")
    master.add_argument("--out", required=True, metavar="FILE", help="the file to create (never overwritten)")
    node = actions.add_parser("node-key", help="write a node's node-action key, derived from the master key "
                              "(agent's node_actions.key_file), mode 0600")
    node.add_argument("--master", required=True, metavar="FILE", help="the master key (vigil token master-key)")
    node.add_argument("--node", required=True, metavar="NAME", help="the node's name as it reports it")
    node.add_argument("--out", required=True, metavar="FILE", help="the file to create (never overwritten)")


def _write_key(path: str, key: bytes) -> str | None:
    """Create ``path`` (mode 0600, never an existing file) holding ``key`` as hex; why not, or None."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return f"{path} exists; not overwritten (remove it first if you mean to replace the key)"
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror or exc}"
    with os.fdopen(fd, "w") as out:
        out.write(key.hex() + "\n")
    return None


def _key_files(args: argparse.Namespace) -> int:
    from vigil.agent.node_actions import node_key
    from vigil.agent.validation import ConfigError
    from vigil.agent.wire import check_node_name
    from vigil.aggregator.outbox import MIN_KEY_BYTES, read_key_file

    if args.token_action == "master-key":
        key = secrets.token_bytes(MIN_KEY_BYTES)
    else:
        try:
            key = node_key(read_key_file(args.master), check_node_name(args.node))
        except (ConfigError, ValueError) as exc:
            print(f"vigil token: {exc}", file=sys.stderr)
            return 2
    problem = _write_key(args.out, key)
    if problem is not None:
        print(f"vigil token: {problem}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    from vigil.aggregator.auth import MIN_SECRET_CHARS, new_secret, node_token, read_secret
    from vigil.aggregator.config import ConfigError

    if args.token_action == "secret":
        print(new_secret())
        return 0
    if args.token_action in ("master-key", "node-key"):
        return _key_files(args)
    try:
        secret = read_secret(args.secret_file, "site secret", MIN_SECRET_CHARS)
    except ConfigError as exc:
        print(f"vigil token: {exc}", file=sys.stderr)
        return 2
    tokens = []
    for node in args.node:
        try:
            tokens.append(node_token(secret, node))
        except ValueError as exc:
            print(f"vigil token: node {node!r}: {exc}", file=sys.stderr)
            return 2
    for token in tokens:
        print(token)
    return 0
