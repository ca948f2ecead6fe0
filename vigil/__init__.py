"""The ``vigil`` command line: one entry point for the agent, the aggregator and the simulator."""
