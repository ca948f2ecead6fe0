"""The collective probe: an all-reduce among a probe group (NCCL on GPUs, gloo where there are
none), its bus bandwidth as nccl-tests computes it, then a pairwise sweep that measures this
member's bandwidth to each peer, so that the aggregator can name a slow member.

It reads the request's ``ProbeGroup`` (rendezvous, rank, world size, backend) and the
``probes`` configuration (buffer bytes, iterations) and talks to the other members through
torch.distributed (the ``comm`` seam: a test wraps it to slow one member's sends). It emits one
``ProbeResult``: ``value`` the all-reduce's bus bandwidth in GB/s, ``metrics`` this member's rank,
the algorithm bandwidth and ``peer_<rank>`` GB/s per measured peer. It judges nothing across
members: naming the slow one is contract/probe_baselines.py's ``slow_members``, on every member's result.
"""

from __future__ import annotations

import contextlib
import datetime
import random
from collections.abc import Callable
from typing import Any, Protocol

from vigil.agent.probes.context import ProbeContext
from vigil.contract.wire import MAX_PROBE_METRICS, ProbeGroup, ProbeResult

# Two metrics besides the peers (``rank`` and ``algbw_gb_per_s``): the rest of the wire's bound
# (wire.MAX_PROBE_METRICS, 16) holds peers. A larger group measures this many of its rounds, the
# same rounds on every member (drawn with the group id as the seed), so each member measures as
# many peers and every measured pair is measured from both of its ends.
MAX_PEER_METRICS = MAX_PROBE_METRICS - 2
# Timed round trips per pair in the sweep (after one untimed warm-up): the pair's figure is the fastest.
PAIR_ROUND_TRIPS = 5
# A quick run (``vigil check --quick``, a screen): this fraction of the configured iterations.
QUICK_ITERATION_DIVISOR = 5
GB = 1e9


class Comm(Protocol):
    """What the probe needs of torch.distributed (the module itself satisfies it): a test wraps it
    to delay one member's sends. Shipped code always uses torch.distributed."""

    def init_process_group(self, *, backend: str, init_method: str, rank: int, world_size: int,
                           timeout: datetime.timedelta) -> None: ...
    def destroy_process_group(self) -> None: ...
    def all_reduce(self, tensor: Any) -> Any: ...
    def send(self, tensor: Any, dst: int) -> Any: ...
    def recv(self, tensor: Any, src: int) -> Any: ...
    def barrier(self) -> Any: ...


class PeerTimeout(Exception):
    """A member never joined the rendezvous, or stopped answering, within the deadline."""


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """An all-reduce's bus bandwidth from its algorithm bandwidth (bytes / time): algbw * 2(n-1)/n,
    as nccl-tests defines it (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md,
    "AllReduce"): each rank sends and receives 2(n-1)/n of the buffer, so the figure compares with
    the links' speed whatever the group's size."""
    return algbw * 2.0 * (world_size - 1) / world_size if world_size > 1 else 0.0


def pair_rounds(world_size: int) -> list[list[tuple[int, int]]]:
    """Rounds in which every member meets at most one peer, every pair exactly once: rank XOR k
    (k = 1..n-1) for a power of two, a round-robin tournament (the circle method, a bye for an
    odd count) otherwise. The same list on every member."""
    n = world_size
    if n < 2:
        return []
    if n & (n - 1) == 0:
        return [[(r, r ^ k) for r in range(n) if r < r ^ k] for k in range(1, n)]
    slots = n if n % 2 == 0 else n + 1  # slot n is the bye
    ring = list(range(slots))
    rounds = []
    for _ in range(slots - 1):
        pairs = [(min(ring[i], ring[slots - 1 - i]), max(ring[i], ring[slots - 1 - i])) for i in range(slots // 2)]
        rounds.append(sorted(p for p in pairs if p[1] < n))
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def sampled_rounds(group: ProbeGroup) -> list[list[tuple[int, int]]]:
    """The rounds this run measures: all of them up to MAX_PEER_METRICS, else that many drawn at
    random with the group id as the seed (every member draws the same)."""
    rounds = pair_rounds(group.world_size)
    if len(rounds) <= MAX_PEER_METRICS:
        return rounds
    picked = sorted(random.Random(group.group).sample(range(len(rounds)), MAX_PEER_METRICS))
    return [rounds[i] for i in picked]


def run(ctx: ProbeContext) -> list[ProbeResult]:
    return [measure(ctx)]


def measure(ctx: ProbeContext, *, comm: Comm | None = None) -> ProbeResult:
    """The collective probe through ``comm`` (torch.distributed unless a test passes its wrapper)."""
    started = ctx.clock()
    group = ctx.group

    def result(status: str, reason: str, detail: str = "", **fields: Any) -> ProbeResult:
        return ProbeResult(probe="collective", status=status, reason=reason, detail=detail,  # type: ignore[arg-type]
                           unit="gb_per_s", seconds=max(0.0, ctx.clock() - started), **fields)

    if group is None or not group.rendezvous:
        return result("error", "no_group", "the request names no probe group with a rendezvous")
    if group.world_size < 2 or group.rank >= group.world_size:
        return result("skipped", "group_of_one" if group.world_size < 2 else "bad_rank",
                      f"rank {group.rank} of {group.world_size}")
    try:
        import torch
    except ImportError:
        return result("skipped", "not_installed", "torch is not installed")
    if comm is None:
        import torch.distributed as dist  # the real seam

        comm = dist
    assert comm is not None
    cuda = bool(torch.cuda.is_available()) and group.backend in ("auto", "nccl")
    if group.backend == "nccl" and not cuda:
        return result("skipped", "no_cuda", "backend nccl asked for and CUDA is not available")
    backend = "nccl" if cuda else "gloo"
    remaining = ctx.deadline - ctx.clock()
    if remaining <= 0:
        return result("error", "timeout", "no time left before the deadline")
    try:
        comm.init_process_group(backend=backend, init_method=f"tcp://{group.rendezvous}", rank=group.rank,
                                world_size=group.world_size, timeout=datetime.timedelta(seconds=remaining))
    except Exception as exc:  # noqa: BLE001 - DistStoreError, RuntimeError: nobody answered in time
        return result("error", "peer_timeout", f"rendezvous {group.rendezvous} ({backend}): {exc}")
    try:
        device = torch.device(f"cuda:{ctx.gpus[0] if ctx.gpus else 0}") if cuda else torch.device("cpu")
        algbw, peers = _sweep(ctx, comm, torch, device, group)
    except PeerTimeout as exc:
        return result("error", "peer_timeout", str(exc))
    except WrongSum as exc:
        return result("fail", "wrong_sum", str(exc))
    except Exception as exc:  # noqa: BLE001 - a peer gone mid-run: gloo/NCCL raise RuntimeError
        return result("error", "peer_timeout", f"{type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):  # already torn down by a failure: nothing left to free
            comm.destroy_process_group()
    busbw = bus_bandwidth(algbw, group.world_size)
    metrics: dict[str, float] = {"rank": float(group.rank), "algbw_gb_per_s": algbw / GB}
    metrics.update({f"peer_{peer}": bw / GB for peer, bw in sorted(peers.items())})
    return result("pass", "ok", f"{backend} all-reduce of {_bytes(ctx)} bytes among {group.world_size}",
                  value=busbw / GB, metrics=metrics)


class WrongSum(Exception):
    """The all-reduce's result is not the sum every member contributed: a corrupting link or GPU."""


def _bytes(ctx: ProbeContext) -> int:
    return ctx.config.collective_bytes


def _sweep(ctx: ProbeContext, comm: Comm, torch: Any, device: Any, group: ProbeGroup) -> tuple[float, dict[int, float]]:
    """The timed all-reduce (bytes per second) and this member's bandwidth to each measured peer."""
    nbytes = _bytes(ctx)
    iterations = ctx.config.collective_iterations
    if ctx.quick:
        iterations = max(1, iterations // QUICK_ITERATION_DIVISOR)
    buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else _no_sync

    def in_time() -> None:
        if ctx.clock() > ctx.deadline:
            raise PeerTimeout("the deadline passed during the sweep")

    comm.all_reduce(buffer)  # warm-up: connections, allocations (sum now n, checked below)
    sync()
    expected = float(group.world_size)
    if not bool(torch.all(buffer == expected)):
        raise WrongSum(f"all-reduce of ones gave {float(buffer.min())}..{float(buffer.max())}, not {expected}")
    comm.barrier()
    in_time()
    buffer.fill_(1.0)
    start = ctx.clock()
    for _ in range(iterations):
        comm.all_reduce(buffer)
    sync()
    elapsed = max(ctx.clock() - start, 1e-9)
    algbw = nbytes * iterations / elapsed
    peers: dict[int, float] = {}
    for pairs in sampled_rounds(group):
        in_time()
        peer = next((b if a == group.rank else a for a, b in pairs if group.rank in (a, b)), None)
        if peer is None:
            continue  # this member's bye in an odd group's round
        peers[peer] = _exchange(comm, buffer, group.rank, peer, sync, ctx.clock)
    comm.barrier()
    return algbw, peers


def _exchange(comm: Comm, buffer: Any, rank: int, peer: int, sync: Callable[[], None],
              clock: Callable[[], float]) -> float:
    """Bytes per second between this member and ``peer``: the buffer there and back (the lower rank
    sends first), the fastest of PAIR_ROUND_TRIPS timed round trips after one untimed. The fastest,
    as timeit takes the minimum: a round trip can only be slowed by other load on the hosts, never
    sped up, so the minimum is the link's figure; a slow link slows every round trip."""

    def round_trip() -> None:
        if rank < peer:
            comm.send(buffer, dst=peer)
            comm.recv(buffer, src=peer)
        else:
            comm.recv(buffer, src=peer)
            comm.send(buffer, dst=peer)
        sync()

    round_trip()
    fastest = float("inf")
    for _ in range(PAIR_ROUND_TRIPS):
        start = clock()
        round_trip()
        fastest = min(fastest, clock() - start)
    return 2.0 * buffer.numel() * buffer.element_size() / max(fastest, 1e-9)


def _no_sync() -> None:
    return None
