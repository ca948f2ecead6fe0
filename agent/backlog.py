"""The reporter's pending events: oldest first, as the JSON they are sent as, bounded in bytes, and
journaled to a file so that neither a restart nor a crash loses them.

Each event has a number (``first_id`` is the oldest's), so releasing "everything below N" after a
report is acknowledged cannot remove events that report did not carry, even if the oldest were
dropped meanwhile. The journal (``state_dir/pending-events.jsonl``, one event a line) is appended
to as events arrive, removed when nothing is pending, and rewritten once released lines outnumber
pending ones; after a crash the next run resends at most that many events twice (the aggregator
dedups events). It counts nothing and sends nothing: the reporter does both.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger("vigil.agent.backlog")

JOURNAL_FILE = "pending-events.jsonl"


class Backlog:
    def __init__(self, max_bytes: int, state_dir: Path | None = None) -> None:
        self.max_bytes = max_bytes
        self._events: deque[bytes] = deque()
        self.bytes = 0
        self.first_id = 0
        self._path = state_dir / JOURNAL_FILE if state_dir is not None else None
        self._journal_lines = 0  # lines in the journal: released ones first, then every pending one
        self._stale = False  # a write failed: the journal lacks events until it is rewritten

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._events)

    def recover(self) -> list[bytes]:
        """The events a previous run left in the journal, to be appended again (the caller checks
        them); the journal is then rewritten from what is appended."""
        if self._path is None or not self._path.exists():
            return []
        try:
            lines = [line for line in self._path.read_bytes().splitlines() if line.strip()]
            self._path.unlink()
        except OSError as exc:
            log.error("cannot read the event journal %s: %s", self._path, exc)
            return []
        return lines

    def append(self, events: Sequence[bytes]) -> int:
        """Add events (newest last); returns how many of the oldest were dropped to stay in bounds."""
        if not events:
            return 0
        self._events.extend(events)
        self.bytes += sum(len(e) for e in events)
        self._journal(events)
        dropped = 0
        while self.bytes > self.max_bytes and self._events:
            self._pop()
            dropped += 1
        if dropped:
            self._compact_if_mostly_released()
        return dropped

    def release_through(self, end_id: int) -> int:
        """Forget the events numbered below ``end_id``; returns how many were still pending."""
        n = 0
        while self._events and self.first_id < end_id:
            self._pop()
            n += 1
        if n:
            self._compact_if_mostly_released()
        return n

    def close(self) -> None:
        """At stop: leave exactly the pending events in the journal."""
        self._rewrite()

    def _pop(self) -> None:
        self.bytes -= len(self._events.popleft())
        self.first_id += 1

    def _journal(self, events: Sequence[bytes]) -> None:
        if self._path is None:
            return
        if self._stale:
            self._rewrite()
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._path.open("ab") as f:
                f.write(b"\n".join(events) + b"\n")
            self._journal_lines += len(events)
        except OSError as exc:
            self._failed(exc)

    def _compact_if_mostly_released(self) -> None:
        if self._path is None:
            return
        if self._stale or not self._events or self._journal_lines - len(self._events) >= len(self._events):
            self._rewrite()

    def _rewrite(self) -> None:
        if self._path is None:
            return
        try:
            if not self._events:
                self._path.unlink(missing_ok=True)
            else:
                tmp = self._path.with_suffix(".tmp")
                self._path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(b"\n".join(self._events) + b"\n")
                os.replace(tmp, self._path)
            self._journal_lines = len(self._events)
            self._stale = False
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        if not self._stale:  # once per failure spell, not once per event batch
            log.error("cannot write the event journal %s: %s; pending events survive a restart only once "
                      "it works again", self._path, exc)
        self._stale = True
