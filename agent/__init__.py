"""vigil's per-node agent: observes GPUs, the kernel log, the RDMA fabric and training progress.

The agent observes and reports; it never judges. It must not import ``aggregator``.
"""

from vigil import __version__ as __version__  # one release number: vigil/__init__.py
