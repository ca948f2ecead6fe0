"""One member of the real multi-process collective test (tests/agent/probes/test_collective_processes.py):
a real NodeActionRunner with a node key handles the signed ``run_probes`` requests it is given, each
a ``collective`` probe over gloo on a loopback rendezvous, and writes each signed result.

argv: a JSON file {"node", "key_file", "requests": [request, ...], "slow_groups": [...],
"delay_seconds", "out"}. Where a request's probe group is in ``slow_groups``, this member's link is
the slowed one: its sends are delayed by ``delay_seconds`` through the probe's ``comm`` seam (a
wrapper of torch.distributed built here, in the test's harness; shipped code has no such branch).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from vigil.agent.node_action_runner import NodeActionRunner, NodeActionsConfig, ProbeWorld
from vigil.agent.probes import PROBES, ProbeSpec, collective
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.contract.wire import NodeActionRequest, ProbeResult, convert, to_builtins


class DelayedSends:
    """torch.distributed with every point-to-point send of this member held back ``delay_seconds``:
    a member whose link is slow, as every peer sees it."""

    def __init__(self, delay_seconds: float) -> None:
        self.delay_seconds = delay_seconds

    def init_process_group(self, *, backend: str, init_method: str, rank: int, world_size: int,
                           timeout: datetime.timedelta) -> None:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)

    def destroy_process_group(self) -> None:
        dist.destroy_process_group()

    def all_reduce(self, tensor: Any) -> Any:
        return dist.all_reduce(tensor)

    def send(self, tensor: Any, dst: int) -> Any:
        time.sleep(self.delay_seconds)
        return dist.send(tensor, dst=dst)

    def recv(self, tensor: Any, src: int) -> Any:
        return dist.recv(tensor, src=src)

    def barrier(self) -> Any:
        return dist.barrier()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    slow_groups = set(spec["slow_groups"])
    delayed = DelayedSends(spec["delay_seconds"])

    def collective_probe(ctx: ProbeContext) -> list[ProbeResult]:
        slowed = ctx.group is not None and ctx.group.group in slow_groups
        return [collective.measure(ctx, comm=delayed if slowed else None)]

    table = dict(PROBES)
    base = PROBES["collective"]
    table["collective"] = ProbeSpec(base.description, base.intrusive, base.needs_group, base.quick, base.unit,
                                    collective_probe)
    world = ProbeWorld(config=ProbesConfig(**spec["probes"]), table=table)
    runner = NodeActionRunner(NodeActionsConfig(allow=["run_probes"], key_file=spec["key_file"]), node=spec["node"],
                              boot_id=spec["boot_id"], nvml=None, clock=time.time, probes=world)
    results = [to_builtins(runner.handle(convert(request, NodeActionRequest))) for request in spec["requests"]]
    tmp = Path(spec["out"] + ".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(spec["out"])


if __name__ == "__main__":
    main()
