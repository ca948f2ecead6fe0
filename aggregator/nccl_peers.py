"""Which node a training log's peer names, and the NCCL log events of a job's nodes.

Reads the fleet view: node names, the addresses each node's agent lists under its topology key
``addresses`` (operator configuration, comma-separated), and the training-log events the agents
forward (agent/app_log.py, agent/nccl_ras.py). It resolves a peer as NCCL writes it (a name, a
first label, an IP address) to one node, or to none where nothing or more than one node matches,
and gathers a job's NCCL events in a window; it decides nothing (app_signals and hang do).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from vigil.aggregator.fleet import FleetView
from vigil.contract.wire import Event

# The topology key under which an agent's operator lists the node's own addresses (the RAS and
# bootstrap interfaces NCCL prints peers by), e.g. "10.0.0.7,10.1.0.7". A node can only claim
# addresses for itself: a lie draws blame to the liar, and an address two nodes claim resolves to
# neither.
ADDRESSES_KEY = "addresses"
_ADDRESSES_PER_NODE = 8
# Training-log kinds that speak of the collective layer (cuda_error is the node's own).
NCCL_KINDS = frozenset(("nccl_timeout", "nccl_warn", "nccl_ras"))


def _address(text: str) -> str | None:
    """The canonical form of an IP address (an IPv6 one without its ``%interface``), or None."""
    try:
        return str(ipaddress.ip_address(text.strip().strip("[]").split("%", 1)[0]))
    except ValueError:
        return None


class PeerNames:
    """The fleet's node names, unique first labels and claimed addresses, built once per evaluation."""

    def __init__(self, view: FleetView) -> None:
        self._view = view
        self._short: dict[str, list[str]] = {}
        self._addresses: dict[str, list[str]] = {}
        for name, node in view.nodes.items():
            self._short.setdefault(name.split(".")[0], []).append(name)
            claimed = node.topology.get(ADDRESSES_KEY, "")
            for text in claimed.split(",")[:_ADDRESSES_PER_NODE]:
                addr = _address(text)
                if addr is not None:
                    self._addresses.setdefault(addr, []).append(name)

    def resolve(self, peer: str) -> str | None:
        """The node a log line's peer names: a node's name, its first label where one node has it
        (``gpu-17`` for ``gpu-17.cluster``), or an address exactly one node claims; a ``:port``
        left off. Anything else (an address no node or several claim) is no node."""
        host = peer.strip()
        if host.count(":") == 1:
            host = host.split(":", 1)[0]
        if host in self._view.nodes:
            return host
        addr = _address(host)
        if addr is not None:
            owners = self._addresses.get(addr, [])
            return owners[0] if len(owners) == 1 else None
        matches = self._short.get(host.split(".")[0], [])
        return matches[0] if len(matches) == 1 else None


@dataclass(frozen=True, slots=True)
class NcclEvent:
    """One NCCL log event of a job: who logged it, the rank it names, the peer and its node."""

    ts: float
    kind: str
    reported_by: str
    rank: int | None
    peer: str | None
    peer_node: str | None
    message: str

    def evidence(self) -> dict[str, object]:
        return {"kind": self.kind, "rank": self.rank, "peer": self.peer, "node": self.peer_node,
                "reported_by": self.reported_by}


def job_nccl_events(view: FleetView, names: PeerNames, job: str, nodes: Iterable[str], since: float,
                    until: float) -> list[NcclEvent]:
    """The NCCL events of ``job`` that its nodes' agents forwarded with times in [since, until],
    oldest first (each node's event ring is bounded: fleet event_history)."""
    out: list[NcclEvent] = []
    for name in sorted(nodes):
        node = view.nodes.get(name)
        if node is None:
            continue
        for ts, event in node.events:
            if event.kind in NCCL_KINDS and event.job == job and since <= ts <= until:
                out.append(_of(names, name, ts, event))
    out.sort(key=lambda e: (e.ts, e.reported_by))
    return out


def _of(names: PeerNames, reporter: str, ts: float, event: Event) -> NcclEvent:
    peer_node = names.resolve(event.peer) if event.peer is not None else None
    return NcclEvent(ts=ts, kind=event.kind, reported_by=reporter, rank=event.rank, peer=event.peer,
                     peer_node=peer_node, message=event.message)


@dataclass(frozen=True, slots=True)
class Suspect:
    """A peer that NCCL events of several witnesses name: its node where one resolves."""

    peer: str
    node: str | None
    witnesses: int


def suspect(events: Iterable[NcclEvent], min_witnesses: int) -> Suspect | None:
    """The one peer named by the most distinct witnesses, at least ``min_witnesses`` of them, or
    None (none, or a tie). A witness is a rank that logged the line (its node where the line names
    no rank, as NCCL's own WARN lines do), or the node whose log carried a RAS report (the rank of a
    RAS event is the rank it reports, not a witness). A node never witnesses against itself."""
    seen: dict[str, set[tuple[str, int | None]]] = {}
    label: dict[str, tuple[str, str | None]] = {}
    for e in events:
        if e.peer is None or e.peer_node == e.reported_by:
            continue
        target = e.peer_node if e.peer_node is not None else (_address(e.peer) or e.peer)
        label.setdefault(target, (e.peer, e.peer_node))
        seen.setdefault(target, set()).add((e.reported_by, None if e.kind == "nccl_ras" else e.rank))
    if not seen:
        return None
    counts = sorted(((len(w), t) for t, w in seen.items()), reverse=True)
    best, target = counts[0]
    if best < min_witnesses or (len(counts) > 1 and counts[1][0] == best):
        return None
    peer, node = label[target]
    return Suspect(peer=peer, node=node, witnesses=best)
