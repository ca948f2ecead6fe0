"""The nodes a detector found nothing to look at when it last walked them, each with the change
marker it read then (docs/detectors.md, "change markers"): the detector passes over such a node
in O(1) while that marker stays and its own time test holds.

It reads only the view's markers and the node objects; it judges nothing and holds no finding.
Valid for one fleet and for views with markers: a view without them (the long way) empties it."""

from __future__ import annotations

from vigil.aggregator.fleet import FleetView, NodeState


class QuietNodes:
    __slots__ = ("_fleet", "_held")

    def __init__(self) -> None:
        self._held: dict[str, tuple[NodeState, int]] = {}  # node name -> (the node, its marker then)
        self._fleet: object | None = None

    def start(self, view: FleetView) -> bool:
        """A pass over ``view`` begins: whether its nodes may be passed over (it has markers, of
        the fleet the held ones were read from; else nothing is held). Nodes gone are let go."""
        marked = view.revision is not None
        if not marked or view.fleet is not self._fleet:
            self._held.clear()
            self._fleet = view.fleet
        held = self._held
        if len(held) > len(view.nodes):
            for name in [n for n in held if n not in view.nodes]:
                del held[name]
        return marked

    def holds(self, node: NodeState, marker: int) -> bool:
        """Whether ``node`` was quiet when last walked and ``marker`` has not moved since."""
        held = self._held.get(node.name)
        return held is not None and held[0] is node and held[1] == marker

    def walked(self, node: NodeState, marker: int, quiet: bool) -> None:
        """``node`` was walked with ``marker`` as it is now: ``quiet`` if nothing was found to look at."""
        if quiet:
            self._held[node.name] = (node, marker)
        else:
            self._held.pop(node.name, None)
