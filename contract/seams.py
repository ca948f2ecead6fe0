"""The agent's boundaries with the operating system and hardware, gathered in one value.

Every collector gets its world from here (NVML, sysfs, the kernel log, commands, the clock), so
a test or the simulator replaces the world by constructing a different ``Seams``; nothing is
patched. This module only describes the seams; the runner builds the real ones.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# Runs argv with a timeout in seconds and returns its stdout; raises OSError or
# subprocess.SubprocessError (including TimeoutExpired, CalledProcessError) on failure.
CommandRunner = Callable[[Sequence[str], float], str]
Clock = Callable[[], float]


def run_command(argv: Sequence[str], timeout_seconds: float) -> str:
    """The real command runner: no shell, bounded in time, stdout as text."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_seconds, check=True)
    return done.stdout


@dataclass(frozen=True)
class Seams:
    # The NVML backend (agent.nvml.backend.PynvmlBackend over pynvml or FakeNvml), or None when
    # NVML is unavailable on this node: then there are no GPU samples and a loud log line.
    nvml: Any = None
    sysfs_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")  # process table: which job a GPU's processes belong to
    # Kernel log source: a path (a file to follow, or /dev/kmsg) or an open text stream.
    kmsg: str | Path | IO[str] | None = None
    run: CommandRunner = run_command
    clock: Clock = time.time
    # Where collectors may keep small state across restarts (e.g. the kernel-log cursor).
    state_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
