"""Fake agents for the aggregator's tests: nodes that build ``Report``s the way the agent does."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.aggregator.aggregator_process import WebhookReceiver
from tests.postgres import PostgresServer, skip_reason
from vigil.aggregator.fleet import GPU_COUNTERS, NodeState
from vigil.aggregator.gate import GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.contract.wire import (
    Event,
    GpuState,
    HostFacts,
    NodeConfig,
    PcieDevice,
    PortState,
    RankSummary,
    Report,
    convert,
)

GBPS = 1e9


class FakeNode:
    """One node's agent: 8 H100s and 8 NDR ports by default, cumulative counters, a seq per boot."""

    def __init__(self, name: str, *, gpus: int = 8, ports: int = 8, interval: float = 2.5,
                 topology: dict[str, str] | None = None) -> None:
        self.name = name
        self.interval = interval
        self.boot_id = f"boot-{name}-1"
        self.seq = 0
        self.topology = topology or {}
        self.nvml_available = True
        self.gpus: dict[int, dict[str, Any]] = {
            i: {"index": i, "uuid": f"GPU-{name}-{i}", "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
                "utilization_gpu_ratio": 0.97, "sm_clock_hertz": 1.98e9, "sm_clock_max_hertz": 1.98e9,
                "temperature_celsius": 62.0, "memory_temperature_celsius": 70.0,
                "memory_max_temperature_celsius": 95.0, "power_watts": 650.0,
                "clock_event_reasons": ["sw_power_cap"], "ecc_corrected_volatile": 0,
                "ecc_uncorrected_volatile": 0, "retired_pages_sbe": 0, "retired_pages_dbe": 0,
                "remap_pending": False, "remap_failure": False, "pcie_replay_total": 40,
                "nvlink_crc_errors_total": 0, "nvlink_replay_errors_total": 0,
                "nvlink_recovery_errors_total": 0, "nvlink_links_active": 18}
            for i in range(gpus)}
        self.ports: dict[int, dict[str, Any]] = {
            p: {"device": f"mlx5_{p}", "port": 1, "state": "ACTIVE", "phys_state": "LinkUp",
                "rate_bits_per_second": 400 * GBPS, "link_layer": "InfiniBand",
                "counters": {"symbol_error": 0, "link_error_recovery": 0, "link_downed": 0,
                             "local_link_integrity_errors": 0, "port_rcv_errors": 0,
                             "np_ecn_marked_roce_packets": 0}}
            for p in range(ports)}
        self.ranks: list[RankSummary] = []
        # Sections sent whole in every report while set (the agent sends them when they change;
        # the aggregator keeps what it was last sent): wire.HostFacts, NodeConfig, [PcieDevice].
        self.host: dict[str, Any] | None = None
        self.config: dict[str, Any] | None = None
        self.pcie: list[dict[str, Any]] | None = None

    def reboot(self) -> None:
        self.boot_id = self.boot_id.rsplit("-", 1)[0] + f"-{int(self.boot_id.rsplit('-', 1)[1]) + 1}"
        self.seq = 0
        for g in self.gpus.values():
            for k in ("ecc_corrected_volatile", "ecc_uncorrected_volatile", "pcie_replay_total",
                      "nvlink_crc_errors_total"):
                g[k] = 0
        for p in self.ports.values():
            p["counters"] = dict.fromkeys(p["counters"], 0)

    def report(self, ts: float, *, events: list[Event] | None = None, urgent: bool = False,
               drop_gpus: tuple[int, ...] = ()) -> Report:
        self.seq += 1
        return Report(
            node=self.name, boot_id=self.boot_id, seq=self.seq, ts=ts, interval_seconds=self.interval,
            urgent=urgent, topology=dict(self.topology), nvml_available=self.nvml_available,
            # Copies: a Struct keeps the lists and dicts it is given, and these change later. GPU
            # entries are converted as the service decodes them (their sequences become tuples).
            gpus=[convert(g, GpuState) for i, g in self.gpus.items() if i not in drop_gpus],
            ports=[PortState(**copy.deepcopy(p)) for p in self.ports.values()],
            ranks=list(self.ranks), events=list(events or []),
            host=convert(self.host, HostFacts) if self.host is not None else None,
            config=convert(self.config, NodeConfig) if self.config is not None else None,
            pcie=[convert(d, PcieDevice) for d in self.pcie] if self.pcie is not None else None)


def rank_summary(job: str, rank: int, *, compute: float, comm: float, ts: float, gpu: int | None = None,
                 step: int = 100, progress_ts: float | None = None, state: str = "running",
                 window: float = 2.5, steps: int = 3) -> RankSummary:
    return RankSummary(job=job, rank=rank, gpu=gpu, state=state, window_seconds=window, steps=steps,  # type: ignore[arg-type]
                       last_step=step, last_progress_ts=ts if progress_ts is None else progress_ts,
                       step_seconds_p50=compute + comm, compute_seconds_p50=compute, comm_seconds_p50=comm)


@pytest.fixture
def make_node() -> Callable[..., FakeNode]:
    return FakeNode


def set_training(nodes: list[FakeNode], job: str, ts: float, *, noise: Callable[[], float] = lambda: 0.0,
                 slow: dict[str, float] | None = None, scale: float = 1.0, ranks_per_node: int = 8,
                 compute: float = 0.8, collective: float = 0.1, step: int = 100,
                 progress_ts: float | None = None) -> None:
    """Synchronous data-parallel training: every rank's step ends together, so a rank's
    collective wait is the slowest rank's compute minus its own, plus the collective itself.
    ``slow`` maps node -> compute factor; ``noise`` returns a relative jitter per rank."""
    slow = slow or {}
    computes: list[tuple[FakeNode, int, float]] = []
    for n_index, node in enumerate(nodes):
        for local in range(ranks_per_node):
            c = compute * scale * slow.get(node.name, 1.0) * (1.0 + noise())
            computes.append((node, n_index * ranks_per_node + local, c))
    slowest = max(c for _, _, c in computes)
    for node in nodes:
        node.ranks = []
    for node, rank, c in computes:
        node.ranks.append(rank_summary(job, rank, compute=c, comm=slowest - c + collective * scale, ts=ts,
                                       gpu=rank % ranks_per_node, step=step, progress_ts=progress_ts))


# A gate that refuses no distinct proposal on its own account (no dedup window, cooldown, ladder,
# breaker or restart budget): tests of what the detectors decide read every proposal the engine
# made as admitted, through the real ledger over a store in memory. (It still settles a drain of a
# node already out, as every gate does.)
EVERY_PROPOSAL = GateConfig(dedup_seconds=0, cooldown_seconds=0, max_remediation_attempts=1_000_000,
                            history_horizon_seconds=1e-9, breaker_floor_nodes=1_000_000,
                            breaker_startup_grace_seconds=0, restart_job_budget=1_000_000)


def proposals_ledger() -> Ledger:
    """The real ledger over a store in memory, behind ``EVERY_PROPOSAL``."""
    return Ledger.in_memory(EVERY_PROPOSAL)


def drive(engine: Any, nodes: list[FakeNode], start: float, end: float, *,
          before: Callable[[float], None] | None = None, skip: Callable[[FakeNode, float], bool] | None = None,
          ) -> list[Any]:
    """Every node reports each interval from ``start`` to ``end``; the engine evaluates after each
    round. Returns every decision admitted."""
    decisions = []
    interval = nodes[0].interval
    t = start
    while t <= end:
        if before is not None:
            before(t)
        for node in nodes:
            if skip is not None and skip(node, t):
                continue
            engine.ingest(node.report(t), t)
        decisions.extend(engine.evaluate(t))
        t += interval
    return decisions


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    """The site's webhook receiver on loopback (signature checked, each key applied once)."""
    r = WebhookReceiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL on loopback for the whole session (tests/postgres.py)."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.external)])
def open_store(request: pytest.FixtureRequest, tmp_path: Any) -> Callable[[], Store]:
    """Opens (and, called again, reopens: a restart) this test's store on each engine: a SQLite
    file, or an empty database on the real PostgreSQL."""
    if request.param == "sqlite":
        return lambda: Store(tmp_path / "d.db")
    server: PostgresServer = request.getfixturevalue("postgres_server")
    server.reset_database()
    return lambda: Store("postgresql", dsn=server.dsn)


def assert_same_node(a: NodeState, b: NodeState) -> None:
    """``b`` holds what ``a`` holds of one node: its own fields, and per GPU, port and rank the
    last state, the samples detectors read and every counter increase with the time it covers
    (the same reports ingested two ways, e.g. whole and compact)."""
    assert (b.topology, b.host, b.nvml_available, b.nvml_down_since, b.failed_collectors, b.missing_gpus) == \
        (a.topology, a.host, a.nvml_available, a.nvml_down_since, a.failed_collectors, a.missing_gpus)
    assert a.gpus.keys() == b.gpus.keys()
    for index, gpu in a.gpus.items():
        other = b.gpus[index]
        assert other.last == gpu.last
        assert list(other.samples) == list(gpu.samples)
        assert (other.counters.resets, other.counters.last_ts, other.counters.last_increase_ts) == \
            (gpu.counters.resets, gpu.counters.last_ts, gpu.counters.last_increase_ts)
        for name in GPU_COUNTERS:
            assert other.counters.increases_since(name, 0.0) == gpu.counters.increases_since(name, 0.0)
            assert other.counters.covered_seconds(name, 0.0) == gpu.counters.covered_seconds(name, 0.0)
            assert other.counters.baseline_since(name) == gpu.counters.baseline_since(name)
    assert a.ports.keys() == b.ports.keys()
    for key, port in a.ports.items():
        other_port = b.ports[key]
        assert other_port.last == port.last
        assert list(other_port.samples) == list(port.samples)
        assert (other_port.counters.last_ts, other_port.counters.last_increase_ts, other_port.max_rate_bits_per_second,
                other_port.active_this_boot) == (port.counters.last_ts, port.counters.last_increase_ts,
                                                 port.max_rate_bits_per_second, port.active_this_boot)
        for name in port.last.counters:
            assert other_port.counters.increases_since(name, 0.0) == port.counters.increases_since(name, 0.0)
            assert other_port.counters.covered_seconds(name, 0.0) == port.counters.covered_seconds(name, 0.0)
    assert a.ranks.keys() == b.ranks.keys()
    for key, rank in a.ranks.items():
        assert b.ranks[key].last == rank.last
        assert list(b.ranks[key].windows) == list(rank.windows)
