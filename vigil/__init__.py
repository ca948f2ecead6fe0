"""The ``vigil`` distribution: the agent, the aggregator, the simulator, their shared contract
(``vigil.contract``) and the command line (``vigil.cli``). ``vigil.__version__`` is the contract's."""

from vigil.contract.version import __version__ as __version__
