"""Which nodes a detector walks in a pass: those the fleet's journals name since its last pass
(docs/detectors.md, "change markers": a node whose marker moved, joined or left) and those it
asked to walk again (its own findings' time tests); every node where it cannot tell.

It reads only the view's journals and node places; it judges nothing and holds no finding. A
detector walks the nodes returned with its usual per-node walk, and says after each which ones
must be walked again whatever the journals say (``again``): a walk is always what the long way
does for that node, so a node walked once more than needed costs time, never a finding."""

from __future__ import annotations

import math
from collections.abc import Collection
from heapq import heapify, heappop, heappush
from operator import attrgetter

from vigil.aggregator.fleet import FleetView, NodeState
from vigil.aggregator.fleet.view import NodeJournal

_POSITION = attrgetter("position")


class ChangedNodes:
    """A detector's cursors into the journals it reads (``NodeJournals`` attribute names, besides
    ``members``), and its nodes to walk again: at the next pass, or at the first pass at or after
    a time (a persistence window ending, a silence growing past its limit).

    ``start`` each pass returns the nodes to walk, in the fleet's order, or every node of the
    view (``every`` True) where the view has no journals (built by hand, ``without_markers``), is of
    another fleet, goes back in time, or a journal let go of entries not read yet; then nothing
    asked before holds, and the walk says again what it needs. ``gone``: the names journaled
    since the last pass that the view no longer holds (their detector state is let go)."""

    __slots__ = ("_at", "_cursors", "_due", "_fleet", "_journals", "_next", "_now", "every", "gone")

    def __init__(self, *journals: str) -> None:
        self._journals = ("members", *journals)
        self._cursors = [0] * len(self._journals)
        self._fleet: object | None = None
        self._now = -math.inf
        self._next: set[str] = set()  # walk at the next pass
        self._due: dict[str, float] = {}  # walk at the first pass at or after this time
        self._at: list[tuple[float, str]] = []  # heap of (time, name); an entry not in _due is stale
        self.every = True
        self.gone: list[str] = []

    def start(self, view: FleetView, now: float) -> Collection[NodeState]:
        journals = view.journals
        names: set[str] = set()
        read = journals is not None and view.fleet is self._fleet and now >= self._now
        if journals is not None:
            self._fleet = view.fleet
            self._now = now
            for i, attr in enumerate(self._journals):
                journal: NodeJournal = getattr(journals, attr)
                fresh = journal.since(self._cursors[i]) if read else None
                if fresh is None:
                    read = False
                else:
                    names.update(fresh)
                self._cursors[i] = journal.end
        else:
            self._fleet = None
        self.gone = []
        if not read:
            self._forget()
            return view.nodes.values()
        self.every = False
        names |= self._next
        self._next = set()
        at, due = self._at, self._due
        while at and at[0][0] <= now:
            when, name = heappop(at)
            if due.get(name) == when:
                del due[name]
                names.add(name)
        nodes = view.nodes
        walk = []
        for name in names:
            node = nodes.get(name)
            if node is None:
                self.gone.append(name)
                due.pop(name, None)
            else:
                walk.append(node)
        walk.sort(key=_POSITION)
        return walk

    def reset(self) -> None:
        """The detector's state was let go: the next pass walks every node."""
        self._fleet = None
        self._forget()

    def _forget(self) -> None:
        self._next.clear()
        self._due.clear()
        self._at.clear()
        self.every = True

    def again(self, node: NodeState, at: float = -math.inf) -> None:
        """Walk ``node`` again at the next pass, or at the first pass at or after ``at``."""
        name = node.name
        if at == -math.inf:
            self._next.add(name)
            return
        self._due[name] = at
        heappush(self._at, (at, name))
        if len(self._at) > 2 * len(self._due) + 1024:  # stale entries (walked sooner): let them go
            self._at = [(when, n) for n, when in self._due.items()]
            heapify(self._at)
