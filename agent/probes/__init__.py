"""Active validation on the node: the one table of probes an agent can run on request
(``run_probes``, agent/node_action_runner.py) or locally (``vigil check``), and what each needs.

A probe measures and makes the absolute checks it can make alone (errors, throttling under load, a
failed diagnostic); judging a measured figure against its hardware class's baseline is
contract/probe_baselines.py's, shared with the aggregator. Nothing here decides what to run or when.
"""

from __future__ import annotations

from dataclasses import dataclass

from vigil.agent.probes import collective, compute, dcgm, memory, p2p, rdma
from vigil.agent.probes.context import ProbeFunction
from vigil.contract.wire import ProbeName


@dataclass(frozen=True)
class ProbeSpec:
    """What one probe is and needs."""

    description: str
    # Takes the GPUs (or the fabric) for itself: never run while a job holds a GPU.
    intrusive: bool
    # Needs other nodes (a ProbeGroup in the request): a collective, or an RDMA partner.
    needs_group: bool
    # In ``vigil check --quick`` (seconds, not minutes).
    quick: bool
    # The unit of its ``value`` (higher is better), for the baselines and the docs.
    unit: str
    run: ProbeFunction


# The one table (wire.ProbeName lists the same keys; a test keeps them equal), in the order a
# request's probes run: the node's own hardware first, the fabric and other nodes last.
PROBES: dict[ProbeName, ProbeSpec] = {
    "gpu_compute": ProbeSpec("a timed matmul burn per GPU, clocks, power and throttle reasons read during it; "
                             "the coefficient of variation across passes", True, False, True, "tflops", compute.run),
    "gpu_memory": ProbeSpec("device memory bandwidth (copies) and an allocation/pattern test per GPU",
                            True, False, True, "gb_per_s", memory.run),
    "gpu_p2p": ProbeSpec("peer-to-peer copies between every pair of the node's GPUs (NVLink or PCIe)",
                         True, False, False, "gb_per_s", p2p.run),
    "dcgm_diag": ProbeSpec("dcgmi diag -r N where DCGM is installed", True, False, False, "", dcgm.run),
    "rdma_bw": ProbeSpec("ib_write_bw per HCA against a known-healthy partner, where perftest is installed",
                         True, True, False, "gbit_per_s", rdma.run),
    "collective": ProbeSpec("an all-reduce among a probe group (NCCL on GPUs, gloo elsewhere), bus bandwidth as "
                            "nccl-tests computes it, and each pair's bandwidth to name a slow member",
                            True, True, False, "gb_per_s", collective.run),
}
