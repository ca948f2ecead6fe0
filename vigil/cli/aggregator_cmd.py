"""``vigil aggregator``: run the cluster service, read its decisions, and act on its gate.

Sub-actions are an explicit table (``serve`` is the default; ``decisions`` reads the store;
``gate``, ``breaker``, ``hold``, ``resume`` and ``history`` go through the running service's API). Flags are
merged into the configuration before validation, so a bad value names its key path as a typo in
the file does. A store that cannot be opened is one line and exit status 2. SIGTERM and SIGINT
stop the service cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from vigil.cli import operator_cmd
from vigil.cli.decisions_cmd import add_decisions_args, decisions
from vigil.cli.log_format import add_log_args, configure_logging, console_line
from vigil.contract.version import __version__


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="aggregator configuration (YAML)")
    p.add_argument("--listen", metavar="HOST:PORT", help="HTTP address (overrides listen; default 127.0.0.1:9500)")
    p.add_argument("--site-secret-file", metavar="FILE",
                   help="site secret that node tokens derive from (overrides auth.site_secret_file)")
    p.add_argument("--store", metavar="PATH", help="decision store path (overrides store_path)")
    add_log_args(p)
    p.add_argument("--check", action="store_true",
                   help="validate the configuration and the files it names, then exit (0 usable, 2 not)")


def _merged_config(args: argparse.Namespace) -> Any:
    from vigil.aggregator.config import parse_config
    from vigil.contract.validation import read_config_file

    data: dict[str, Any] = read_config_file(args.config) if args.config else {}
    if args.listen:
        data["listen"] = args.listen
    if args.site_secret_file:
        data.setdefault("auth", {})["site_secret_file"] = args.site_secret_file
    if args.store:
        data["store_path"] = args.store
    return parse_config(data)


def serve(args: argparse.Namespace) -> int:
    from vigil.aggregator.app import serve as serve_app
    from vigil.aggregator.config import ConfigError
    from vigil.aggregator.store import StoreError

    configure_logging(args.log_level, args.log_format)
    from vigil.aggregator.redact import RedactingFilter

    for handler in logging.getLogger().handlers:  # no URL's password or key reaches the log
        handler.addFilter(RedactingFilter())
    try:
        config = _merged_config(args)
    except ConfigError as exc:
        print(console_line(args.log_format, f"vigil aggregator: {exc}", logger="vigil.aggregator",
                           level=logging.ERROR), file=sys.stderr)
        return 2
    if args.check:
        from vigil.aggregator.preflight import startup_problems
        from vigil.cli.config_check import report

        # The service's own start-up checks (it refuses to start on any of them), as this user.
        return report("aggregator", args.config or "flags", startup_problems(config))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        dry = " (dry run: decisions are recorded, nothing is acted on)" if config.dry_run else ""

        def ready(addr: str) -> None:
            # The log line carries the release, so a log search shows which version ran when.
            logging.getLogger("vigil.aggregator").info("vigil aggregator %s on %s%s", __version__, addr, dry)
            print(console_line(args.log_format, f"vigil aggregator listening on {addr}{dry}",
                               logger="vigil.aggregator"), flush=True)

        await serve_app(config, stop=stop, on_ready=ready)

    try:
        asyncio.run(main())
    except (ConfigError, StoreError) as exc:
        print(console_line(args.log_format, f"vigil aggregator: {exc}", logger="vigil.aggregator",
                           level=logging.ERROR), file=sys.stderr)
        return 2
    except OSError as exc:
        print(console_line(args.log_format, f"vigil aggregator: {exc.strerror or exc}", logger="vigil.aggregator",
                           level=logging.ERROR), file=sys.stderr)
        return 1
    return 0


# sub-action -> (help, add its arguments, run it)
ACTIONS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "serve": ("run the aggregator service (the default)", _serve_args, serve),
    "decisions": ("list decisions with their gate verdict and delivery state", add_decisions_args, decisions),
    "gate": ("show the gate's state: breaker, removed and held nodes, fault history, store health",
             operator_cmd.add_gate_args, operator_cmd.gate),
    "breaker": ("show or reset the cluster circuit breaker", operator_cmd.add_breaker_args, operator_cmd.breaker),
    "hold": ("hold a node: automation leaves it alone until it is resumed", operator_cmd.add_node_args,
             operator_cmd.hold),
    "resume": ("release a node's hold and put it back in service", operator_cmd.add_node_args, operator_cmd.resume),
    "isolate": ("find the faulty nodes of a set with collective group tests (a freshly repaired set)",
                operator_cmd.add_isolate_args, operator_cmd.isolate),
    "isolations": ("list group-testing isolations: running, finished, tests used against the information bound",
                   operator_cmd.add_isolations_args, operator_cmd.isolations),
    "history": ("show a node's remediation history: decisions, verdicts, deliveries, holds",
                operator_cmd.add_history_args, operator_cmd.history),
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("aggregator", help="run the cluster aggregator",
                       description="Run the vigil aggregator, or one of its sub-actions.")
    # `vigil aggregator --listen ...` (no sub-action) serves: the serve flags live on the parent too.
    _serve_args(p)
    actions = p.add_subparsers(dest="aggregator_action", metavar="ACTION")
    for name, (help_text, add_args, _) in ACTIONS.items():
        add_args(actions.add_parser(name, help=help_text))


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "aggregator_action", None) or "serve"
    return ACTIONS[action][2](args)
