"""Per-job telemetry: the GPUs and RDMA ports of each job, grouped by node, as the fleet holds them.

It reads a ``FleetView`` (each GPU's latest state and the agent's GPU-to-job attribution,
``GpuState.job``: the scheduler's job key, agent/attribution.py) and returns, per job, each node's
GPUs of that job and that node's ports. It judges nothing; detectors that judge a job from its
hardware telemetry (a hang, a slow rank) share it, each keeping its last listing in a ``JobNodes``
while the fleet's GPU attribution stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vigil.aggregator.fleet import FleetView, GpuHistory, NodeState, PortHistory


@dataclass(slots=True)
class JobNode:
    """One node's share of a job: its GPUs the agent attributes to the job, and all its ports (a
    port is not attributed to a job: a node's ports carry whatever its jobs send)."""

    node: NodeState
    gpus: list[GpuHistory] = field(default_factory=list)

    @property
    def ports(self) -> list[PortHistory]:
        return list(self.node.ports.values())


def job_nodes(view: FleetView) -> dict[str, dict[str, JobNode]]:
    """Job key -> node name -> that node's GPUs of the job (nodes in name order, GPUs by index).
    A GPU with no job attributed (idle, or its processes unknown) is in no job."""
    out: dict[str, dict[str, JobNode]] = {}
    for name in sorted(view.nodes):
        node = view.nodes[name]
        for index in sorted(node.gpus):
            gpu = node.gpus[index]
            job = gpu.last.job
            if job is None:
                continue
            per_node = out.setdefault(job, {})
            entry = per_node.get(name)
            if entry is None:
                entry = per_node[name] = JobNode(node)
            entry.gpus.append(gpu)
    return out


class JobNodes:
    """``job_nodes(view)`` for one detector across evaluations: listed again only when the fleet's
    GPUs or their job attribution changed (FleetView.gpu_jobs_revision), else the listing of the
    last evaluation (its GPU and node objects are the fleet's own, read live). A view without
    change markers is listed afresh. Callers must not change what it returns."""

    def __init__(self) -> None:
        self._key: tuple[object, int] | None = None
        self._listing: dict[str, dict[str, JobNode]] = {}

    def of(self, view: FleetView) -> dict[str, dict[str, JobNode]]:
        if view.revision is None:
            return job_nodes(view)
        key = (view.fleet, view.gpu_jobs_revision)
        if key != self._key:
            self._listing = job_nodes(view)
            self._key = key
        return self._listing
