"""The training-side heartbeat client, re-exported for ``from vigil.agent.heartbeat import Heartbeat``.

The client lives in its own standard-library-only distribution (``clients/heartbeat``, imported
as ``vigil_heartbeat``) so a training image can install it without the daemon. This module adds
nothing and imports nothing else.
"""

from vigil_heartbeat.client import PHASES, Heartbeat, resolve_addr, resolve_identity

__all__ = ["PHASES", "Heartbeat", "resolve_addr", "resolve_identity"]
