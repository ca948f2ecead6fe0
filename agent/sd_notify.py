"""systemd's notify protocol (sd_notify(3)), stdlib only: READY=1 once the agent serves, WATCHDOG=1
while its loop runs, STOPPING=1 on the way out, for a `Type=notify` unit with `WatchdogSec=`.

It sends datagrams to the socket systemd names in NOTIFY_SOCKET and nothing else; outside
systemd (no socket) every call is a no-op. A failed send is logged once and counted, never
raised: supervision must not be the thing that stops the agent.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("vigil.agent.sd_notify")


class SdNotifier:
    """Sends notify messages to ``address`` (a path, or an abstract socket starting with '@')."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec
        self.failures = 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SdNotifier:
        """What systemd hands a service: NOTIFY_SOCKET, and WATCHDOG_USEC (for WATCHDOG_PID, if set)."""
        env = os.environ if environ is None else environ
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if raw.isdigit() and int(raw) > 0 and (not pid or pid == str(os.getpid())):
            usec = int(raw)
        return cls(env.get("NOTIFY_SOCKET"), usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_seconds(self) -> float | None:
        """How often to ping: half the watchdog timeout, as sd_watchdog_enabled(3) advises."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 2e6

    def notify(self, message: str) -> bool:
        if self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), target)
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("sd_notify to %s failed: %s (further failures are counted, not logged)",
                            self.address, exc)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")
