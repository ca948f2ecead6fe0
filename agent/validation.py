"""How a configuration or scenario that fails validation is reported: one line per error, each
naming its key path (``collectors.gpu.interval_secnds: unknown key``). Shared by the agent's and
aggregator's configs and both kinds of scenario; it imports nothing of ours, so anything may use it.
"""

from __future__ import annotations

from pydantic import ValidationError


def format_validation_error(exc: ValidationError, header: str = "invalid configuration") -> str:
    """One line per error, each naming its key path: how every config and scenario error reads."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not path:  # cross-field checks name their own key path in the message
            lines.append(msg)
        elif err["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            got = err.get("input")
            tail = "" if isinstance(got, dict | list) else f" (got {got!r})"
            lines.append(f"{path}: {msg}{tail}")
    return f"{header}:\n  " + "\n  ".join(lines)
