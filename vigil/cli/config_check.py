"""``--check`` for ``vigil agent`` and ``vigil aggregator``: the config validates and the files it names
are usable, before a unit is started or a rollout proceeds.

Each check returns the problems it found as ``key.path: what is wrong`` lines; the commands print
them and exit 2 (or print ``config OK`` and exit 0). The aggregator's list is the service's own
(aggregator/preflight.py ``startup_problems``); the agent's file checks are here. It opens files
for reading only and creates nothing; it does not bind ports or contact the aggregator.
"""

from __future__ import annotations

import os
from pathlib import Path


def token_file_problems(key: str, path: str | None) -> list[str]:
    """A bearer-token file must be readable and non-empty (the documented token step writes it)."""
    if path is None:
        return []
    try:
        text = Path(path).read_text()
    except OSError as exc:
        return [f"{key}: cannot read {path}: {exc.strerror or exc} (create it: see deploy/slurm/README.md, "
                "'Create the token')"]
    return [] if text.strip() else [f"{key}: {path} is empty"]


def state_dir_problems(key: str, path: str | None) -> list[str]:
    """A directory the service writes: it exists and is writable, or its parent exists (systemd's
    StateDirectory= and the service itself create it)."""
    if path is None:
        return []
    p = Path(path)
    if p.is_dir():
        return [] if os.access(p, os.W_OK) else [f"{key}: {path} is not writable by this user"]
    if p.exists():
        return [f"{key}: {path} exists and is not a directory"]
    return [] if p.parent.is_dir() else [f"{key}: neither {path} nor its parent {p.parent} exists"]


def report(command: str, source: str, problems: list[str]) -> int:
    """Print the verdict; the exit code --check returns (0 usable, 2 not)."""
    if problems:
        print(f"vigil {command}: {source} cannot start:\n  " + "\n  ".join(problems))
        return 2
    print(f"vigil {command}: {source}: config OK")
    return 0
