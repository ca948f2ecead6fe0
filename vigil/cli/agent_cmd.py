"""``vigil agent``: run the node agent. Flags override the config file for the common cases.

Flags are merged into the configuration before validation, so a bad value names its key path
just as a typo in the file does. SIGTERM and SIGINT stop the agent cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from vigil.cli.log_format import add_log_args, configure_logging, console_line

_LOGGER = "vigil.agent"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("agent", help="run the node agent", description="Run the vigil node agent.")
    p.add_argument("--config", metavar="FILE", help="agent configuration (YAML)")
    p.add_argument("--backend", choices=("nvml", "amdsmi", "auto", "fake"),
                   help="GPU library: nvml, amdsmi (AMD), auto (whichever initialises) or fake "
                        "(overrides nvml.backend)")
    p.add_argument("--vendor", choices=("nvidia", "amd"),
                   help="whose library the fake backend imitates: nvidia (FakeNvml) or amd (FakeAmdSmi, 8x MI300X) "
                        "(overrides nvml.vendor)")
    p.add_argument("--scenario", metavar="FILE|NAME", help="fake backend scenario (overrides nvml.scenario)")
    p.add_argument("--listen", metavar="HOST:PORT", help="HTTP address for /metrics (overrides listen)")
    p.add_argument("--heartbeat-listen", metavar="HOST:PORT",
                   help="node-local heartbeat address, UDP and HTTP (overrides collectors.training.udp_listen; "
                        "a second agent on one host needs its own)")
    p.add_argument("--heartbeat-socket", metavar="PATH",
                   help="heartbeat Unix socket (overrides collectors.training.unix_socket; a second agent on "
                        "one host needs its own)")
    p.add_argument("--node", help="node name (overrides node; default: the hostname)")
    p.add_argument("--aggregator", metavar="URL", help="aggregator base URL (overrides aggregator.url)")
    p.add_argument("--token-file", metavar="FILE", help="bearer token for the aggregator")
    p.add_argument("--kmsg", metavar="FILE", help="follow FILE instead of the kernel log (drills, tests)")
    p.add_argument("--boot-id-file", metavar="FILE",
                   help="read the boot id from FILE instead of /proc/sys/kernel/random/boot_id (drills, tests)")
    p.add_argument("--sysfs-root", metavar="DIR", help="sysfs mount point (default /sys)")
    add_log_args(p)
    p.add_argument("--check", action="store_true",
                   help="validate the configuration and the files it names, then exit (0 usable, 2 not)")


def _merged_config(args: argparse.Namespace) -> Any:
    from vigil.agent.config import parse_config
    from vigil.contract.validation import read_config_file

    data: dict[str, Any] = read_config_file(args.config) if args.config else {}
    if args.backend:
        data.setdefault("nvml", {})["backend"] = args.backend
    if args.scenario:
        data.setdefault("nvml", {})["scenario"] = args.scenario
    if args.vendor:
        data.setdefault("nvml", {})["vendor"] = args.vendor
    if args.listen:
        data["listen"] = args.listen
    if args.heartbeat_listen:
        data.setdefault("collectors", {}).setdefault("training", {})["udp_listen"] = args.heartbeat_listen
    if args.heartbeat_socket:
        data.setdefault("collectors", {}).setdefault("training", {})["unix_socket"] = args.heartbeat_socket
    if args.node:
        data["node"] = args.node
    if args.aggregator:
        target = data.setdefault("aggregator", {})
        target["url"] = args.aggregator
        target.pop("urls", None)  # the one given replaces the configured list
    if args.token_file:
        data.setdefault("aggregator", {})["token_file"] = args.token_file
    return parse_config(data)


def _check(config: Any, source: str) -> int:
    """The files the agent reads at start, read as this user (run it as the service's), and each
    https target's TLS context built as the reporter builds it."""
    import ssl

    from vigil.agent.nvml.scenario import ScenarioError, load_node_scenario
    from vigil.agent.reporter import client_ssl_context
    from vigil.cli.config_check import report, state_dir_problems, token_file_problems

    target = config.aggregator
    problems = [*(problem for key, path in (("aggregator.token_file", target.token_file),
                                            ("aggregator.ca_file", target.ca_file),
                                            ("aggregator.cert_file", target.cert_file),
                                            ("aggregator.key_file", target.key_file))
                  for problem in token_file_problems(key, path)),
                *state_dir_problems("state_dir", config.state_dir)]
    if not problems:
        for url in target.targets:
            try:
                client_ssl_context(url, target.ca_file, target.cert_file, target.key_file)
            except (OSError, ssl.SSLError) as exc:
                problems.append(f"aggregator: TLS for {url} (ca_file, cert_file, key_file): {exc}")
    if config.nvml.backend == "fake" and config.nvml.scenario:
        try:
            load_node_scenario(config.nvml.scenario)
        except ScenarioError as exc:
            problems.append(f"nvml.scenario: {exc}")
    return report("agent", source, problems)


def run(args: argparse.Namespace) -> int:
    from vigil.agent.daemon import BOOT_ID_PATH, Agent, make_seams
    from vigil.contract.validation import ConfigError

    configure_logging(args.log_level, args.log_format)
    try:
        config = _merged_config(args)
    except ConfigError as exc:
        print(console_line(args.log_format, f"vigil agent: {exc}", logger=_LOGGER, level=logging.ERROR),
              file=sys.stderr)
        return 2
    from vigil.agent.nvml.scenario import ScenarioError

    if args.check:
        return _check(config, args.config or "flags")
    try:
        seams = make_seams(config, kmsg=args.kmsg, sysfs_root=args.sysfs_root)
        agent = Agent(config, seams, boot_id_path=Path(args.boot_id_file) if args.boot_id_file else BOOT_ID_PATH)
    except (OSError, ValueError, ScenarioError) as exc:
        print(console_line(args.log_format, f"vigil agent: cannot start: {exc}", logger=_LOGGER,
                           level=logging.ERROR), file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await agent.run(stop, on_ready=lambda addr: print(
            console_line(args.log_format, f"vigil agent listening on {addr}", logger=_LOGGER), flush=True))

    try:
        asyncio.run(main())
    except OSError as exc:
        hint = ("; another process holds it (a second agent on this host needs its own --listen, "
                "--heartbeat-listen and --heartbeat-socket)" if exc.errno == errno.EADDRINUSE else "")
        print(console_line(args.log_format, f"vigil agent: {exc.strerror or exc}{hint}", logger=_LOGGER,
                           level=logging.ERROR), file=sys.stderr)
        return 1
    return 0
