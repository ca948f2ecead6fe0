"""``vigil loadgen``: a load test of an aggregator over HTTP (README "Load test").

It reads its flags (and the site secret, read token files for a running aggregator), runs
vigil/cli/loadgen.py's open-loop schedule of N nodes, and prints throughput, intake latency, errors,
its own CPU and the aggregator's CPU and memory, as lines or ``--json``, and exits 3 when its own
generator fell behind schedule (the figures then measure it). With ``--spawn`` it starts a dry-run
aggregator of its own and stops it at the end; with ``--url`` it sends only synthetic nodes
(loadgen-*) and refuses an aggregator not in dry run. It never acts on anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# The exit status of a run whose generator fell behind its schedule (its figures are invalid);
# 2 is a refusal (bad flags, or a running aggregator that must not take synthetic nodes).
EXIT_BEHIND_SCHEDULE = 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser("loadgen", help="load-test an aggregator with agent-built reports from N nodes",
                       description="Post agent-built reports for N nodes to an aggregator, open-loop at the "
                                   "agent's cadence, and print throughput, latency, errors, CPU and memory.")
    p.add_argument("--nodes", type=int, default=2000, metavar="N", help="simulated nodes (default 2000)")
    p.add_argument("--duration", type=float, default=30.0, metavar="SECONDS", help="how long to send (default 30)")
    p.add_argument("--warmup", type=float, default=0.0, metavar="SECONDS",
                   help="send this long first without measuring (80 fills the aggregator's windows: its "
                        "steady state; default 0)")
    p.add_argument("--interval", type=float, default=2.5, metavar="SECONDS",
                   help="each node posts this often (default 2.5, the agent's)")
    p.add_argument("--workers", type=int, default=1, metavar="K", help="generator processes splitting the nodes")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--spawn", action="store_true",
                       help="start a dry-run aggregator of its own (credentials in a scratch directory)")
    where.add_argument("--url", metavar="URL", help="a running aggregator, e.g. http://127.0.0.1:9500")
    p.add_argument("--site-secret-file", metavar="FILE", help="with --url: the site secret the node tokens derive from")
    p.add_argument("--read-token-file", metavar="FILE", help="with --url: to count the nodes in GET /v1/nodes")
    p.add_argument("--aggregator-pid", type=int, metavar="PID", help="with --url: read its CPU and RSS from /proc")
    p.add_argument("--node-prefix", metavar="PREFIX",
                   help="node names PREFIX-00000... (default: load with --spawn; with --url, loadgen: against a "
                        "running aggregator they must be in the reserved synthetic namespace loadgen-*)")
    p.add_argument("--hca-sysfs", metavar="DIR",
                   help="a recorded class/infiniband/<hca> directory to build the 8 HCAs from "
                        "(default: the simulator's ConnectX-7 tree)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


def run(args: argparse.Namespace) -> int:
    from vigil.aggregator.auth import read_secret
    from vigil.cli.loadgen import Plan, Target, refusal, run_load, run_spawned, summary_lines
    from vigil.contract.validation import ConfigError

    if args.nodes < 1 or args.workers < 1 or args.duration <= 0 or args.interval <= 0 or args.warmup < 0:
        print("vigil loadgen: --nodes, --workers, --duration and --interval must be positive, --warmup not negative",
              file=sys.stderr)
        return 2
    plan = Plan(nodes=args.nodes, duration_seconds=args.duration, interval_seconds=args.interval,
                workers=args.workers, node_prefix=args.node_prefix or ("load" if args.spawn else "loadgen"),
                warmup_seconds=args.warmup)
    hca = Path(args.hca_sysfs) if args.hca_sysfs else None
    if args.spawn:
        summary = run_spawned(plan, hca)
    else:
        if not args.site_secret_file:
            print("vigil loadgen: --url needs --site-secret-file (node tokens derive from it)", file=sys.stderr)
            return 2
        try:
            secret = read_secret(args.site_secret_file, "site secret")
            read = read_secret(args.read_token_file, "read token").decode() if args.read_token_file else None
        except ConfigError as exc:
            print(f"vigil loadgen: {exc}", file=sys.stderr)
            return 2
        target = Target(args.url, secret, read, args.aggregator_pid)
        refused = refusal(target, plan)
        if refused is not None:
            print(f"vigil loadgen: refused: {refused}", file=sys.stderr)
            return 2
        summary = run_load(target, plan, hca)
    if args.json:
        print(json.dumps(summary))
    else:
        for line in summary_lines(summary):
            print(line)
    # A generator behind its schedule measured itself: the run is invalid (EXIT_BEHIND_SCHEDULE).
    return 0 if summary["valid"] else EXIT_BEHIND_SCHEDULE
