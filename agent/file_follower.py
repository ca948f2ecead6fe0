"""Follows one growing file the way ``tail -F`` does and hands back its new complete lines.

Reads a file by path across rotation (a new inode at the path: the old file is read to its end
first), truncation (the size fell below what was read: start over), unfinished last lines (held
until their newline) and over-long lines (dropped and counted), each call bounded in lines and
bytes, with a cursor to resume from after a restart. It does not parse lines or decide anything:
the ``xid`` (kernel log) and ``training`` (step log) collectors do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

# Bytes asked of one pread(2): large enough that a flood is read in few calls.
_READ_CHUNK_BYTES = 256 << 10
# A line longer than this is no line either reader parses (kernel records are at most 8 KiB,
# CONSOLE_EXT_LOG_MAX; a progress line is a few hundred bytes): it is dropped, not buffered.
DEFAULT_MAX_LINE_BYTES = 64 << 10


class FileFollower:
    """Follows one file. A file present at construction is read from ``start`` (or from a
    ``cursor`` saved for the same inode); a file that appears later is read from its beginning,
    since all of it was written after we started. ``read_lines`` never blocks: the file is opened
    with O_NONBLOCK and read with pread at our own offset."""

    # The ``LineSource`` protocol of the kernel-log readers: a file holds text lines, never
    # /dev/kmsg records.
    raw_kmsg = False

    def __init__(self, path: str | os.PathLike[str], *, start: Literal["beginning", "end"] = "end",
                 cursor: Mapping[str, Any] | None = None, max_bytes: int | None = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self.path = Path(path)
        self._max_bytes = max_bytes  # per read_lines call; None: bounded by lines only
        self._max_line_bytes = max_line_bytes
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._pos = 0  # bytes read from the open file, the held partial line included
        self._partial = b""
        self.rotations = 0
        self.truncations = 0
        self.overlong_lines = 0
        # Where the first open starts, decided now: (device, inode, offset) of the file present now.
        self._first: tuple[int, int, int] | None = None
        try:
            st = os.stat(self.path)
        except OSError:
            return  # not there (or not visible) yet: read from its beginning once it opens
        offset = int(cursor.get("offset", -1)) if cursor else -1
        if cursor and cursor.get("inode") == st.st_ino and 0 <= offset <= st.st_size:
            self._first = (st.st_dev, st.st_ino, offset)
        elif cursor is None and start == "end":
            self._first = (st.st_dev, st.st_ino, st.st_size)

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            # FileNotFoundError stays one: a caller may treat "not there yet" as no news.
            raise type(exc)(exc.errno, f"cannot open {self.path}: {exc.strerror}") from None
        st = os.fstat(fd)
        self._fd, self._ident, self._partial, self._pos = fd, (st.st_dev, st.st_ino), b"", 0
        first, self._first = self._first, None
        if first is not None and first[:2] == self._ident and first[2] <= st.st_size:
            self._pos = first[2]

    def read_lines(self, max_lines: int | None = None) -> list[str]:
        """The complete lines appended since the last call, at most ``max_lines`` of them and
        ``max_bytes`` read; the rest waits for the next call. Raises OSError when the file cannot
        be opened (FileNotFoundError while it does not exist)."""
        limit = sys.maxsize if max_lines is None else max_lines
        budget = sys.maxsize if self._max_bytes is None else self._max_bytes
        lines: list[str] = []
        if self._fd is None:
            self._open()
        try:
            st: os.stat_result | None = os.stat(self.path)
        except OSError:
            st = None  # rotated away and not yet recreated: the old file is drained below
        if st is not None and (st.st_dev, st.st_ino) == self._ident:
            if st.st_size == self._pos:
                return lines  # the file we hold, no longer than what we read: nothing new, no read
            if st.st_size < self._pos:
                self.truncations += 1  # logrotate's copytruncate: the file starts over
                self._pos, self._partial = 0, b""
            self._drain(lines, limit, budget)
            return lines
        # Rotated: what the writer appended to the old file before the rename comes first.
        used, at_end = self._drain(lines, limit, budget)
        if st is None or not at_end:
            return lines  # no new file yet, or the old one is not read to its end: next call
        if self._partial:
            lines.append(self._partial.decode("utf-8", "replace"))  # the old file's unended last line
        self._close()
        self.rotations += 1
        try:
            self._open()
        except FileNotFoundError:
            return lines  # gone again between stat and open: opened next call, from its beginning
        self._drain(lines, limit, budget - used)
        return lines

    def _drain(self, lines: list[str], limit: int, budget: int) -> tuple[int, bool]:
        """Appends the open file's complete lines to ``lines``; returns the bytes consumed and
        whether the end of the file was reached."""
        fd = self._fd
        assert fd is not None
        used = 0
        while len(lines) < limit and used < budget:
            chunk = os.pread(fd, min(_READ_CHUNK_BYTES, budget - used), self._pos)
            if not chunk:
                return used, True
            data = self._partial + chunk
            parts = data.split(b"\n")
            partial = parts.pop()
            room = limit - len(lines)
            if len(parts) > room:
                # Give back what does not fit this call: it is read again next call.
                parts = parts[:room]
                pos = self._pos - len(self._partial) + sum(len(p) + 1 for p in parts)
                used += pos - self._pos
                self._pos, self._partial = pos, b""
                lines.extend(p.decode("utf-8", "replace") for p in parts)
                return used, False
            used += len(chunk)
            self._pos += len(chunk)
            self._partial = partial
            if len(partial) > self._max_line_bytes:
                self.overlong_lines += 1  # no line we parse is this long: skip it
                self._partial = b""
            lines.extend(p.decode("utf-8", "replace") for p in parts)
        return used, False

    def wake_fd(self) -> int | None:
        """None: a regular file polls readable whether or not it grew, so it is read at intervals."""
        return None

    def cursor(self) -> dict[str, Any]:
        """Where the next read starts (the held partial line is read again), for resuming."""
        inode = self._ident[1] if self._ident is not None else None
        return {"path": str(self.path), "inode": inode, "offset": self._pos - len(self._partial)}

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close()
