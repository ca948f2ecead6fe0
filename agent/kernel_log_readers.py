"""The kernel log's sources: /dev/kmsg, ``journalctl -k -f``, an open stream (a followed file is
``agent.file_follower.FileFollower``).

Each reader's ``read_lines`` hands back the lines available now without blocking beyond a short
poll, so a collector cycle stays bounded whatever the source does. They do not parse lines or
decide anything: the ``xid`` collector chooses the source and ``agent.kernel_log`` parses.
"""

from __future__ import annotations

import contextlib
import os
import queue
import stat
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

# /dev/kmsg returns one record per read(2); a record is at most 8 KiB (CONSOLE_EXT_LOG_MAX).
_KMSG_READ_BYTES = 8192


class LineSource(Protocol):
    """A followed kernel log: ``read_lines`` drains up to ``max_lines`` complete lines without
    blocking; ``cursor`` says where the next read starts, for resuming after a restart."""

    raw_kmsg: bool

    def read_lines(self, max_lines: int) -> list[str]: ...

    def wake_fd(self) -> int | None:
        """A descriptor that polls readable when new lines are there (None: ask at an interval)."""
        ...

    def cursor(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class KmsgReader:
    """Reads /dev/kmsg without blocking (O_NONBLOCK: EAGAIN means "nothing new"). Opening it
    replays the ring buffer from its oldest record; the collector skips what it already counted
    by sequence number. EPIPE means records were overwritten before we read them: counted in
    ``overruns``, and the next read continues with the oldest record still there."""

    raw_kmsg = True

    def __init__(self, path: str | Path = "/dev/kmsg") -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._pollable = False  # the device (or a pipe) polls; a regular file is always "readable"
        self._partial = b""
        self.overruns = 0

    def read_lines(self, max_lines: int) -> list[str]:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            mode = os.fstat(self._fd).st_mode
            self._pollable = stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)
        lines: list[str] = []
        while len(lines) < max_lines:
            try:
                chunk = os.read(self._fd, _KMSG_READ_BYTES)
            except BlockingIOError:
                break
            except BrokenPipeError:
                self.overruns += 1
                continue
            if not chunk:
                break  # a regular file standing in for the device: end of file
            data = self._partial + chunk
            parts = data.split(b"\n")
            self._partial = parts.pop()
            lines.extend(p.decode("utf-8", "replace") for p in parts)
        return lines

    def wake_fd(self) -> int | None:
        """The open device: /dev/kmsg polls readable while a record is there that this reader
        has not read (the kernel's devkmsg_poll), and with an error after an overrun."""
        return self._fd if self._pollable else None

    def cursor(self) -> dict[str, Any]:
        return {}  # kmsg resumes by sequence number, which the collector tracks

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class StreamReader:
    """Follows an already-open text stream (a pipe, a socket file, a test's StringIO) through a
    reader thread feeding a bounded queue: a blocking ``readline`` never holds up a cycle. When
    the queue is full the thread waits, so nothing read is dropped."""

    raw_kmsg = False

    def __init__(self, stream: IO[str], *, queue_max_lines: int = 100_000, raw_kmsg: bool = False) -> None:
        self.raw_kmsg = raw_kmsg
        self._queue: queue.Queue[str | None] = queue.Queue(maxsize=queue_max_lines)
        self._stream = stream
        self.ended = False
        self._thread = threading.Thread(target=self._pump, name="kernel-log-reader", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for line in self._stream:
                self._queue.put(line)
        except (OSError, ValueError):
            pass  # the stream was closed under us (close()): the reader ends
        finally:
            self._queue.put(None)

    def read_lines(self, max_lines: int) -> list[str]:
        lines: list[str] = []
        while len(lines) < max_lines:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.ended = True
                break
            lines.append(item)
        return lines

    def wake_fd(self) -> int | None:
        return None  # its reader thread takes the lines off the stream

    def cursor(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.close()


class Process(Protocol):
    """What JournalReader needs of a started command (subprocess.Popen in text mode)."""

    @property
    def stdout(self) -> IO[str] | None: ...

    @property
    def pid(self) -> int: ...

    def terminate(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


# Starts a long-running command and returns it with its stdout as a text pipe.
Spawner = Callable[[Sequence[str]], Process]


def spawn_process(argv: Sequence[str]) -> Process:
    """The real spawner: no shell, stdout piped as text, stderr discarded."""
    return subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            errors="replace")


# journalctl -k: the kernel ring buffer as journald stored it; -n 0: only records from now on
# (journald has no per-reader cursor here, so a restart does not replay and re-count history).
JOURNAL_ARGV = ("journalctl", "-k", "-f", "-n", "0", "-o", "short-iso", "--no-pager")


class JournalReader:
    """Follows ``journalctl -k -f`` (where /dev/kmsg is not readable) through a StreamReader;
    ``close`` stops the process by its pid."""

    raw_kmsg = False

    def __init__(self, argv: Sequence[str] = JOURNAL_ARGV, *, spawn: Spawner = spawn_process,
                 queue_max_lines: int = 100_000) -> None:
        self._proc = spawn(argv)
        if self._proc.stdout is None:
            raise OSError(f"{argv[0]}: no stdout pipe")
        self._reader = StreamReader(self._proc.stdout, queue_max_lines=queue_max_lines)

    def read_lines(self, max_lines: int) -> list[str]:
        lines = self._reader.read_lines(max_lines)
        if not lines and self._reader.ended:
            raise OSError("journalctl exited")
        return lines

    def wake_fd(self) -> int | None:
        return self._reader.wake_fd()

    def cursor(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=2.0)
        self._reader.close()
