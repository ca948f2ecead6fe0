"""vigil's cluster service: ingests every node's reports, judges them, and emits decisions.

It imports only ``vigil.contract`` beside its own modules, never the agent or the CLI; the agent never imports it.
"""
