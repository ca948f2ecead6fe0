"""``vigil token``: make the aggregator's credentials (README "Security").

``vigil token secret --out F`` writes a fresh random secret (a site secret, or an Alertmanager,
operator or read token); ``vigil token create --secret-file F --node NAME --out F2`` writes NAME's
node token, derived from the site secret, for the agent's ``aggregator.token_file``. Node actions
(signed requests to agents, README "Security"): ``vigil token master-key --out F`` writes a new
master key (the aggregator's ``node_actions.key_file``) and ``vigil token node-key --master F --node
NAME --out F2`` writes NAME's node key derived from it (the agent's ``node_actions.key_file``).
Every ``--out`` file is created with mode 0600 and never overwritten or written through a link;
without ``--out``, ``secret`` and ``create`` print to stdout. It talks to no service.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("token", help="make credentials for the aggregator",
                       description="Print a new secret, or a node's token derived from the site secret.")
    actions = p.add_subparsers(dest="token_action", metavar="ACTION", required=True)
    secret = actions.add_parser("secret", help="write (or print) a new random secret (site secret or role token)")
    secret.add_argument("--out", metavar="FILE", help="create FILE (mode 0600, never overwritten) instead of printing")
    create = actions.add_parser("create", help="print a node's token (HMAC-SHA256 of its name under the site secret)")
    create.add_argument("--secret-file", required=True, metavar="FILE", help="the site secret (auth.site_secret_file)")
    create.add_argument("--node", required=True, action="append", metavar="NAME",
                        help="the node's name as it reports it (repeat for several: one token per line)")
    create.add_argument("--out", metavar="FILE", help="create FILE (mode 0600, never overwritten) instead of "
                        "printing; one --node only")
    master = actions.add_parser("master-key", help="write a new node-action master key (aggregator's "
                                "node_actions.key_file), mode 0600")
    master.add_argument("--out", required=True, metavar="FILE", help="the file to create (never overwritten)")
    node = actions.add_parser("node-key", help="write a node's node-action key, derived from the master key "
                              "(agent's node_actions.key_file), mode 0600")
    node.add_argument("--master", required=True, metavar="FILE", help="the master key (vigil token master-key)")
    node.add_argument("--node", required=True, metavar="NAME", help="the node's name as it reports it")
    node.add_argument("--out", required=True, metavar="FILE", help="the file to create (never overwritten)")


def _emit(out: str | None, text: str) -> int:
    """Create ``out`` (mode 0600) holding ``text``, or print ``text`` when there is no ``out``."""
    from vigil.contract.credential_file import create_private

    if out is None:
        print(text)
        return 0
    problem = create_private(out, text + "\n")
    if problem is not None:
        print(f"vigil token: {problem}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _key_files(args: argparse.Namespace) -> int:
    from vigil.aggregator.outbox import MIN_KEY_BYTES, read_key_file
    from vigil.contract.node_actions import node_key
    from vigil.contract.validation import ConfigError
    from vigil.contract.wire import check_node_name

    if args.token_action == "master-key":
        key = secrets.token_bytes(MIN_KEY_BYTES)
    else:
        try:
            key = node_key(read_key_file(args.master), check_node_name(args.node))
        except (ConfigError, ValueError) as exc:
            print(f"vigil token: {exc}", file=sys.stderr)
            return 2
    return _emit(args.out, key.hex())


def run(args: argparse.Namespace) -> int:
    from vigil.aggregator.auth import MIN_SECRET_CHARS, new_secret, node_token, read_secret
    from vigil.aggregator.config import ConfigError

    if args.token_action == "secret":
        return _emit(args.out, new_secret())
    if args.token_action in ("master-key", "node-key"):
        return _key_files(args)
    if args.out is not None and len(args.node) != 1:
        print("vigil token: --out takes one --node (one file per node)", file=sys.stderr)
        return 2
    try:
        secret = read_secret(args.secret_file, "site secret", MIN_SECRET_CHARS)
    except ConfigError as exc:
        print(f"vigil token: {exc}", file=sys.stderr)
        return 2
    from vigil.contract.credential_file import exposure

    problem = exposure(args.secret_file)
    if problem is not None:  # the aggregator refuses it at start; here it is only read
        print(f"vigil token: warning: {problem}", file=sys.stderr)
    tokens = []
    from vigil.contract.wire import check_real_node_name

    for node in args.node:
        try:
            tokens.append(node_token(secret, check_real_node_name(node)))
        except ValueError as exc:
            print(f"vigil token: node {node!r}: {exc}", file=sys.stderr)
            return 2
    return _emit(args.out, "\n".join(tokens))
