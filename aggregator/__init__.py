"""vigil's cluster service: ingests every node's reports, judges them, and emits decisions.

It may import the agent's wire types; the agent never imports this package.
"""
