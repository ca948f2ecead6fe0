"""The ``vigil`` command line: one entry point for the agent, the aggregator and the simulator.

``__version__`` is the single source of the release number: pyproject reads it, ``vigil --version``
prints it, both services export it as ``vigil_build_info`` and every agent report carries it.
"""

__version__ = "0.1.0"
