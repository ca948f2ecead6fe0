"""vigil's training-side heartbeat client: one datagram per step to the node's vigil agent (its Unix socket, else UDP).

``Heartbeat`` (standard library only) is the client; ``vigil_heartbeat.pytorch`` times compute and
collective wait per rank (imports torch only when used); ``vigil_heartbeat.integrations`` holds the
Hugging Face Trainer callback and the DeepSpeed engine wrapper (they import nothing at import time).
"""

from vigil_heartbeat.client import PHASES, Heartbeat, resolve_addr, resolve_identity

__all__ = ["PHASES", "Heartbeat", "resolve_addr", "resolve_identity"]
__version__ = "0.1.0"
