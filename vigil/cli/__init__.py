"""``vigil`` command line: an explicit table of subcommands, each in its own module.

Each command module exposes ``add_parser(subparsers)`` and ``run(args) -> int`` (the exit code).
Modules are imported lazily so ``vigil xid scan`` does not load aiohttp, and the agent's
commands never import the aggregator.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vigil.contract.version import __version__

# subcommand -> module implementing it
COMMANDS: dict[str, str] = {
    "agent": "vigil.cli.agent_cmd",
    "aggregator": "vigil.cli.aggregator_cmd",
    "demo": "vigil.cli.demo_cmd",
    "xid": "vigil.cli.xid_cmd",
    "sim": "vigil.cli.sim_cmd",
    "replay": "vigil.cli.replay_cmd",
    "token": "vigil.cli.token_cmd",
    "loadgen": "vigil.cli.loadgen_cmd",
    "check": "vigil.cli.check_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vigil", description="GPU cluster fault detection")
    parser.add_argument("--version", action="version", version=f"vigil {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command])
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
