"""What the agent and the aggregator share: the wire types, the strict model base and its validators,
the limits both sides enforce, the OS seams, the node-action envelope, probe baselines, credential files
and the release number. It imports neither service (tests/test_layering.py holds the rule)."""
