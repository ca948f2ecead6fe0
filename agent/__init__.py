"""vigil's per-node agent: observes GPUs, the kernel log, the RDMA fabric and training progress.

The agent observes and reports; it never judges. It imports only ``vigil.contract`` beside its
own modules, never the aggregator or the CLI.
"""
