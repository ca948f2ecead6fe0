"""vigil's per-node agent: observes GPUs, the kernel log, the RDMA fabric and training progress.

The agent observes and reports; it never judges. It must not import ``aggregator``.
"""

__version__ = "0.1.0"
