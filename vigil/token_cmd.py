"""``vigil token``: make the aggregator's credentials (README "Security").

``vigil token secret`` prints a fresh random secret (a site secret, or an Alertmanager, operator
or read token); ``vigil token create --secret-file F --node NAME`` prints NAME's node token,
derived from the site secret, for the agent's ``aggregator.token_file``. It writes no file and
talks to no service.
"""

from __future__ import annotations

import argparse
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


def run(args: argparse.Namespace) -> int:
    from vigil.aggregator.auth import MIN_SECRET_CHARS, new_secret, node_token, read_secret
    from vigil.aggregator.config import ConfigError

    if args.token_action == "secret":
        print(new_secret())
        return 0
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
