"""The node-side detectors walking only the nodes the fleet's journals name (NodeJournals,
ChangedNodes: memory, pcie_nvlink, network, pcie_link, silence, thermal, gpu_peer) find exactly what
the long way finds, every pass, over a randomized evolving fleet: GPU faults appearing and clearing,
GPUs out of the reports and back, unhealthy GPUs, NVML lost and back, GPU and HCA links below their
maximum, AER errors, ports down and erroring, hot and throttled GPUs, jobs and power limits changing,
nodes silent long enough to alert and drain, forgotten and back under the same name, the whole fleet
silent while passes go on (time passing without reports), journals let go of before a detector read
them (it walks everything), and passes at uneven times, a few skipped, one going back in time.

The long way: each detector judging ``view.without_markers()`` (no journals: every node walked),
a fresh one each pass where it carries nothing, a twin fed only such views where it does (network's
drop memory, thermal's counted samples)."""

from __future__ import annotations

import random

import pytest

from tests.aggregator.conftest import GBPS, FakeNode, rank_summary
from tests.aggregator.detectors.test_incremental_gpu_side import compact
from vigil.aggregator.detectors.gpu_peer import GpuPeerConfig, GpuPeerDetector
from vigil.aggregator.detectors.memory import MemoryConfig, MemoryDetector
from vigil.aggregator.detectors.network import NetworkConfig, NetworkDetector
from vigil.aggregator.detectors.pcie_link import PcieLinkConfig, PcieLinkDetector
from vigil.aggregator.detectors.pcie_nvlink import PcieNvlinkConfig, PcieNvlinkDetector
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.detectors.silence import SilenceConfig, SilenceDetector
from vigil.aggregator.detectors.thermal import ThermalConfig, ThermalDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import Report

NODES = 14
THROTTLED = {"sm_clock_hertz": 1.1e9, "clock_event_reasons": ["hw_slowdown"]}


def linked(name: str) -> FakeNode:
    node = FakeNode(name, gpus=4, ports=2)
    for g in node.gpus.values():
        g.update(pcie_link_generation=5, pcie_link_generation_max=5, pcie_link_width=16, pcie_link_width_max=16,
                 job="a" if name < "n7" else "b", power_limit_watts=700.0)
    node.pcie = [{"pci_bus_id": f"0000:{0x40 + i:02x}:00.0", "kind": "hca", "name": f"mlx5_{i}",
                  "link_generation": 5, "link_generation_max": 5, "link_width": 16, "link_width_max": 16,
                  "aer_correctable_total": 0, "aer_nonfatal_total": 0, "aer_fatal_total": 0} for i in range(2)]
    return node


def churn(rng: random.Random, nodes: list[FakeNode]) -> None:
    """One random change to one node: a fault appearing or clearing, mostly."""
    node = rng.choice(nodes)
    g = node.gpus[rng.randrange(len(node.gpus))]
    p = node.ports[rng.randrange(len(node.ports))]
    d = node.pcie[rng.randrange(len(node.pcie))] if node.pcie else None
    kind = rng.randrange(16)
    if kind == 0:
        g["remap_pending"] = not g["remap_pending"]
    elif kind == 1:
        g["ecc_uncorrected_volatile"] += 1
    elif kind == 2:
        g["pcie_replay_total"] += rng.randrange(50, 400)
    elif kind == 3:
        g["nvlink_links_down"] = [] if g.get("nvlink_links_down") else [1]
    elif kind == 4:
        g["health"] = rng.choice(["ok", "ok", "lost", "reset_required"])
    elif kind == 5:
        node.nvml_available = not node.nvml_available
    elif kind == 6:
        g["pcie_link_generation"] = 3 if g["pcie_link_generation"] == 5 else 5
    elif kind == 7 and d is not None:
        d["link_width"] = 8 if d["link_width"] == 16 else 16
    elif kind == 8 and d is not None:
        d["aer_nonfatal_total"] += 1
    elif kind == 9:
        p["state"] = "DOWN" if p["state"] == "ACTIVE" else "ACTIVE"
    elif kind == 10:
        p["counters"]["symbol_error"] += rng.randrange(0, 60)
        p["counters"]["link_downed"] += rng.random() < 0.3
    elif kind == 11:
        p["rate_bits_per_second"] = 200 * GBPS if p["rate_bits_per_second"] == 400 * GBPS else 400 * GBPS
    elif kind == 12:
        if g["clock_event_reasons"] == ["sw_power_cap"]:
            g.update(THROTTLED)
        else:
            g.update(sm_clock_hertz=1.98e9, clock_event_reasons=["sw_power_cap"])
    elif kind == 13:
        g["memory_temperature_celsius"] = 94.0 if g["memory_temperature_celsius"] < 90 else 70.0
    elif kind == 14:
        g["job"] = rng.choice(["a", "b", None])
    else:
        g["power_limit_watts"] = rng.choice([700.0, 500.0])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_walking_the_journaled_nodes_finds_what_walking_every_node_finds(seed: int) -> None:
    rng = random.Random(seed)
    nodes = [linked(f"n{i:02d}") for i in range(NODES)]
    fleet = Fleet()
    network_config = NetworkConfig(flap_slow_threshold=3, flap_daily_threshold=2)
    short = [MemoryDetector(MemoryConfig()), PcieNvlinkDetector(PcieNvlinkConfig()), PcieLinkDetector(PcieLinkConfig()),
             SilenceDetector(SilenceConfig()), GpuPeerDetector(GpuPeerConfig())]
    fresh = [lambda: MemoryDetector(MemoryConfig()), lambda: PcieNvlinkDetector(PcieNvlinkConfig()),
             lambda: PcieLinkDetector(PcieLinkConfig()), lambda: SilenceDetector(SilenceConfig()),
             lambda: GpuPeerDetector(GpuPeerConfig())]
    carried = [(NetworkDetector(network_config), NetworkDetector(network_config)),
               (ThermalDetector(ThermalConfig()), ThermalDetector(ThermalConfig()))]
    held: dict[str, Report] = {}
    silent: dict[str, float] = {}  # node -> silent until
    found: set[str] = set()
    t, passes, walked_all = 0.0, 0, 0
    quiet_fleet = rng.uniform(300, 500)  # the whole fleet silent for 60 s from here, passes going on
    while t < 800:
        for _ in range(rng.randrange(0, 4)):
            churn(rng, nodes)
        if rng.random() < 0.04:
            name = rng.choice(nodes).name
            silent[name] = t + rng.choice([20.0, 130.0, 170.0])  # alerted, drained, or forgotten and back
        for node in nodes:
            if silent.get(node.name, -1.0) > t or quiet_fleet <= t < quiet_fleet + 60 or rng.random() < 0.03:
                continue
            drop = (rng.randrange(len(node.gpus)),) if rng.random() < 0.02 else ()
            report = node.report(t, drop_gpus=drop)
            arrival = t + rng.uniform(0, 0.5)
            sent = compact(fleet, held.get(node.name), report, arrival) if rng.random() < 0.85 else report
            fleet.ingest(sent, arrival)
            held[node.name] = report
        for gone in fleet.forget_departed(t + 1.0, lambda n: 150.0):
            held.pop(gone.name, None)
        t += 2.5
        if rng.random() < 0.15:
            continue  # no pass this time
        now = t - 2.5 + rng.choice([0.7, 1.0, 2.0])
        if rng.random() < 0.02:
            now -= 3.0  # a pass that goes back in time: every node walked
        if rng.random() < 0.05:  # journals let go of before the detectors read them: walk everything
            journals = fleet.journals
            for journal in (journals.gpu_faults, journals.gpu_health, journals.gpu_watch, journals.ports,
                            journals.pcie_links, journals.members):
                journal.trim(rng.randrange(0, 3))
        view = fleet.view()
        long_view = view.without_markers()
        passes += 1
        for detector, make in zip(short, fresh, strict=True):
            got = detector.evaluate(view, now)
            assert got == make().evaluate(long_view, now), (detector.name, now)
            walked_all += isinstance(getattr(detector, "_walk", None), ChangedNodes) and detector._walk.every
            found |= {f"{f.detector}:{f.key.split(':')[0]}:{f.action.value}" for f in got}
        for detector, twin in carried:
            got = detector.evaluate(view, now)
            assert got == twin.evaluate(long_view, now), (detector.name, now)
            found |= {f"{f.detector}:{f.key.split(':')[0]}:{f.action.value}" for f in got}
        assert carried[1][0]._throttled_time == carried[1][1]._throttled_time
    # Not vacuous: what each detector finds came and went, and most passes read the journals.
    assert {"silence:silent:alert", "silence:silent:drain", "silence:gpu_missing:drain", "silence:gpu_lost:drain",
            "silence:nvml_unavailable:alert", "memory:remap_pending:reset_gpu", "memory:uncorrectable:drain",
            "pcie_nvlink:nvlink_down:reboot_node", "pcie_link:gpu_link:drain", "pcie_link:link:drain",
            "pcie_link:aer_uncorrectable:drain", "network:port_down:drain", "thermal:hbm_temperature:alert",
            } <= found, sorted(found)
    assert walked_all < passes  # most passes walked the journaled nodes only


def test_a_journal_names_a_node_once_a_report_where_its_marker_moves_and_never_where_it_stays() -> None:
    fleet, node = Fleet(), linked("n1")
    fleet.ingest(node.report(0.0), 0.0)
    journals = fleet.journals
    assert journals.members.names == journals.gpu_faults.names == ["n1"]  # joined, GPUs taken whole: once
    base = node.report(2.5)
    fleet.ingest(base, 2.5)
    ends: dict[str, int] = {}
    for k in range(4):  # compact reports, nothing judged moves (temperatures do): nothing is appended
        node.gpus[0]["temperature_celsius"] += 1.0
        report = node.report(5.0 + 2.5 * k)
        fleet.ingest(compact(fleet, base, report, 5.0 + 2.5 * k), 5.0 + 2.5 * k)
        base = report
        if k == 0:  # the first compact one after a whole one takes the ports' long way (ports_revision)
            ends = {name: getattr(journals, name).end for name in journals.__slots__}
    assert all(getattr(journals, name).end == ends[name] for name in journals.__slots__)
    node.gpus[0]["remap_pending"] = node.gpus[1]["remap_pending"] = True
    report = node.report(20.0)
    before = journals.gpu_faults.end
    fleet.ingest(compact(fleet, base, report, 20.0), 20.0)
    assert journals.gpu_faults.names[before:] == ["n1"]  # two GPUs' flags: one entry
    before = journals.gpu_faults.end
    fleet.ingest(node.report(22.5), 22.5)  # whole, the flags as held: nothing to mark
    node.gpus[2]["nvlink_links_down"] = [1]
    fleet.ingest(node.report(25.0), 25.0)  # whole, a link down: marked
    assert journals.gpu_faults.names[before:] == ["n1"]
    fleet.forget_departed(200.0, lambda n: 10.0)
    assert journals.members.names[-1] == "n1"
    journals.members.trim(0)  # bounded: what no reader has read may be let go (a reader behind walks all)
    assert journals.members.since(0) is None and journals.members.since(journals.members.end) == []


def test_a_nodes_ranks_marker_moves_where_which_are_fresh_or_their_gpus_may_change() -> None:
    """``NodeState.ranks_revision`` and the ``rank_gpus`` journal (gpu_peer's GPUs placed by their
    ranks): moved by a rank joining, leaving or naming another GPU, by a report or a replay that
    leaves one of the node's ranks unrefreshed, and by the report after it; never by a report that
    refreshes every rank as it was."""
    fleet, node, other = Fleet(), linked("n1"), linked("n2")
    journals = fleet.journals
    t = 0.0
    sent: list[Report] = []

    def report(ranks: list[tuple[int, int]], on: FakeNode = node, exited: int | None = None) -> bool:
        """One report of ``on`` with these (rank, gpu); whether its marker moved (journaled once)."""
        nonlocal t
        t += 2.5
        on.ranks = [rank_summary("b", rank, gpu=gpu, ts=t, compute=1.0, comm=0.1,
                                 state="exited" if rank == exited else "running") for rank, gpu in ranks]
        before, end = fleet._nodes[on.name].ranks_revision, journals.rank_gpus.end
        sent.append(on.report(t))
        fleet.ingest(sent[-1], t)
        moved = fleet._nodes[on.name].ranks_revision != before
        assert [n for n in journals.rank_gpus.names[end:] if n == on.name] == ([on.name] if moved else [])
        return moved

    fleet.ingest(node.report(t), t)
    fleet.ingest(other.report(t), t)  # both join with no ranks
    four = [(r, r) for r in range(4)]
    assert report(four)  # ranks joined
    assert not report(four) and not report(four)  # every rank refreshed as it was
    assert report(four[:3])  # rank 3 left out: it may go stale
    assert report(four[:3])  # and again
    assert report(four)  # back: fresh again
    assert not report(four)
    moved = [(0, 0), (1, 1), (2, 3), (3, 3)]
    assert report(moved)  # rank 2 names GPU 3
    assert not report(moved)
    fleet.ingest(sent[-2], t + 0.5)  # a replay moves last_seen alone: the ranks are older by it
    assert journals.rank_gpus.names[-1] == "n1"
    assert report(moved)  # the report after it
    assert not report(moved, exited=3)  # a state is not what the marker follows
    before = fleet._nodes["n1"].ranks_revision
    assert report([(3, 0)], on=other)  # the exited rank taken by n2 ...
    assert fleet._nodes["n1"].ranks_revision != before and "n1" in journals.rank_gpus.names[-2:]  # ... off n1
    assert len(fleet._nodes["n1"].ranks) == 3
    assert not report(moved[:3])  # n1 without it: every rank it holds refreshed


def test_journals_stay_bounded_in_a_fleet_that_ingests_without_ever_taking_a_view() -> None:
    from vigil.aggregator.fleet.ingest import JOURNAL_TRIM_REPORTS
    fleet, node = Fleet(), linked("n1")
    ts = 0.0
    for _ in range(3 * JOURNAL_TRIM_REPORTS):  # a GPU's fault flag that flips every report: its marker moves each time
        node.gpus[0]["remap_pending"] = not node.gpus[0]["remap_pending"]
        fleet.ingest(node.report(ts), ts)
        ts += 2.5
    journals = fleet.journals
    assert journals.gpu_faults.end >= 3 * JOURNAL_TRIM_REPORTS  # each report appended
    assert len(journals.gpu_faults.names) <= 2 * 1 + 1024 + JOURNAL_TRIM_REPORTS
