"""``vigil aggregator``: run the cluster service (and, later, inspect its decisions).

Sub-actions are an explicit table (``serve`` is the default), so ``vigil aggregator decisions``
can be added beside it. Flags are merged into the configuration before validation, so a bad
value names its key path as a typo in the file does. SIGTERM and SIGINT stop the service cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from vigil.decisions_cmd import add_breaker_args, add_decisions_args, breaker, decisions


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="aggregator configuration (YAML)")
    p.add_argument("--listen", metavar="HOST:PORT", help="HTTP address (overrides listen; default 127.0.0.1:9500)")
    p.add_argument("--token-file", metavar="FILE", help="bearer token agents must present (overrides token_file)")
    p.add_argument("--store", metavar="PATH", help="decision store path (overrides store_path)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def _merged_config(args: argparse.Namespace) -> Any:
    from agent.config import read_config_file
    from aggregator.config import parse_config

    data: dict[str, Any] = read_config_file(args.config) if args.config else {}
    if args.listen:
        data["listen"] = args.listen
    if args.token_file:
        data["token_file"] = args.token_file
    if args.store:
        data["store_path"] = args.store
    return parse_config(data)


def serve(args: argparse.Namespace) -> int:
    from aggregator.app import serve as serve_app
    from aggregator.config import ConfigError

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        config = _merged_config(args)
    except ConfigError as exc:
        print(f"vigil aggregator: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        dry = " (dry run: decisions are recorded, nothing is acted on)" if config.dry_run else ""
        await serve_app(config, stop=stop,
                        on_ready=lambda addr: print(f"vigil aggregator listening on {addr}{dry}", flush=True))

    try:
        asyncio.run(main())
    except ConfigError as exc:
        print(f"vigil aggregator: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"vigil aggregator: {exc}", file=sys.stderr)
        return 1
    return 0


# sub-action -> (help, add its arguments, run it)
ACTIONS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "serve": ("run the aggregator service (the default)", _serve_args, serve),
    "decisions": ("list decisions with their gate verdict and delivery state", add_decisions_args, decisions),
    "breaker": ("show or reset the cluster circuit breaker", add_breaker_args, breaker),
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
