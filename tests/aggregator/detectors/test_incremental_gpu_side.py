"""The GPU- and port-side detectors judged the short way (carried windows, nodes' GPUs read again
only after a report, the usual one-new-sample pass, healthy GPUs and ports skipped before their
full test) find exactly what the long way finds, every evaluation, over a randomized evolving
fleet: a whole-rack thermal event (the job's, not a node's), a power-capped node, a GPU braking in
bursts, hot HBM, a shared switch's link drops beside a node's own, bit errors, a degraded link,
memory and NVLink faults, idle GPUs, a reboot, replayed reports, a node that leaves and comes back,
lagging reports and passes at uneven times. Most reports are compact (version 3, as the agent sends
them), so a node is passed over on its markers (NodeState.gpu_faults_revision, ports_revision and
the counters' moved times) between the faults: among them a GPU that leaves the reports and comes
back with a remap failure, an NVLink and a port that come back up, a link back at full rate.

The long way: a fresh GPU peer detector every pass (it reads every window whole); every GPU and
port through ``_judge``; twins judging the view without change markers (every node's hardware
class and the GPUs' jobs read afresh), the GPU straggler's gathering and judging each window's ranks
one by one, every rank read on every pass (``LongWayGpuStraggler``); the thermal detector's samples
counted one by one with its own tests, as before the short walk. A fifth of the passes are
skipped, so the next finds two new samples a GPU."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import deque
from typing import cast

import pytest

from tests.aggregator.conftest import GBPS, FakeNode, rank_summary
from vigil.agent.report_delta import delta, whole
from vigil.aggregator.decision import Finding
from vigil.aggregator.detectors.gpu_peer import GpuPeerConfig, GpuPeerDetector
from vigil.aggregator.detectors.gpu_straggler import (
    GpuStragglerConfig,
    GpuStragglerDetector,
    _Flag,
    _JobMemo,
    _Roster,
    _Verdict,
    _Window,
)
from vigil.aggregator.detectors.memory import MemoryConfig, MemoryDetector
from vigil.aggregator.detectors.network import NetworkConfig, NetworkDetector
from vigil.aggregator.detectors.pcie_nvlink import PcieNvlinkConfig, PcieNvlinkDetector
from vigil.aggregator.detectors.peer_class import HardwareClass, HardwareClasses, describe, hardware_class
from vigil.aggregator.detectors.straggler import SPREAD_MEMORY_WINDOWS, last_complete_window, mad_sigma
from vigil.aggregator.detectors.telemetry_hang import TelemetryHangConfig, TelemetryHangDetector
from vigil.aggregator.detectors.telemetry_straggler import TelemetryStragglerConfig, TelemetryStragglerDetector
from vigil.aggregator.detectors.thermal import ThermalConfig, ThermalDetector
from vigil.aggregator.fleet import Fleet, FleetView, GpuHistory, JobState, NodeState, RankHistory
from vigil.contract.wire import Report, decode_report

NODES = 12
THROTTLED = {"sm_clock_hertz": 1.1e9, "clock_event_reasons": ["hw_slowdown", "hw_thermal_slowdown"]}


class LongWayThermal(ThermalDetector):
    """The thermal detector counting every new sample with ``_throttled`` and choosing the GPUs
    to judge with ``_throttled`` and ``_hbm_hot``: the walk before it was written out."""

    def _take_samples(self, view: FleetView, now: float) -> list[tuple[NodeState, GpuHistory]]:
        for name in [n for n in self._counted if n not in view.nodes]:
            del self._counted[name]  # a node gone from the view is counted afresh if it comes back
        judge = []
        for node in view.nodes.values():
            counted_of = self._counted.setdefault(node.name, {})
            for gpu in node.gpus.values():
                if not gpu.samples:
                    continue
                if gpu.last_seen >= node.last_seen and (self._throttled(gpu.samples[-1])
                                                        or self._hbm_hot(gpu.samples[-1])):
                    judge.append((node, gpu))
                counted = counted_of.get(gpu.index, -math.inf)
                if gpu.samples[-1].ts <= counted:
                    continue
                counted_of[gpu.index] = gpu.samples[-1].ts
                newer = [s for s in reversed(gpu.samples) if s.ts > counted]
                newer = newer[:next((i for i, s in enumerate(newer) if s.ts <= counted), len(newer))]
                for i, sample in enumerate(newer):
                    if self._throttled(sample):
                        before = newer[i + 1].ts if i + 1 < len(newer) else counted
                        self._throttled_time.setdefault((node.name, gpu.index), deque()).append(
                            (sample.ts, min(sample.ts - before, 4 * node.interval_seconds)))
        return judge


class LongWayGpuStraggler(GpuStragglerDetector):
    """The GPU straggler detector gathering each window with the walk over every rank's newest
    windows, then by hardware class rank by rank, and judging every class's ranks one by one with
    the outlier scan: as before a window's ranks were read by class as they are read, the usual
    rank's newest entry without the walk, and a window with no rank at its floor judged without
    the scan."""

    def _width(self, view: FleetView, job: JobState) -> float:
        return max([self.config.window_seconds] + [r.last.window_seconds for r in job.ranks.values()])

    def _judged_up_to_date(self, memo: _JobMemo, now: float) -> bool:
        return False

    def _last_window(self, view: FleetView, job: JobState, roster: _Roster, width: float, now: float) -> int:
        interval = max([0.0] + [view.nodes[n].interval_seconds for n in job.nodes() if n in view.nodes])
        return last_complete_window(list(job.ranks.values()), interval, width, now)

    def _rows(self, view: FleetView, roster: _Roster, first: int, last: int, width: float,
              now: float) -> dict[int, dict[HardwareClass, _Window]]:
        flat: dict[int, list[tuple[RankHistory, tuple[float, float, float | None, int, float | None]]]] = {}
        for rank in list(roster.job.ranks.values()):
            seen = None
            for entry in reversed(rank.windows):
                k = math.ceil(entry[0] / width - 1e-9)
                if k < first:
                    break
                if entry[2] is None or k == seen:
                    continue
                seen = k
                flat.setdefault(k, []).append((rank, entry))
        out: dict[int, dict[HardwareClass, _Window]] = {}
        for k in range(first, last + 1):
            classes: dict[str, HardwareClass] = {}
            for rank, entry in flat.get(k, []):
                if rank.node not in classes:
                    classes[rank.node] = self._class_of(view, rank.node, now)
                window = out.setdefault(k, {}).setdefault(classes[rank.node], _Window())
                window.ranks.append(rank)
                window.ids.append(rank.rank)
                window.computes.append(entry[1])
                window.comms.append(cast(float, entry[2]))
                window.steps.append(entry[3])
        return out

    def _verdict(self, memo: _JobMemo, by_class: dict[HardwareClass, _Window]) -> _Verdict:
        cfg = self.config
        flagged: dict[int, _Flag] = {}
        nodes_of: dict[int, str] = {}
        judged: set[int] = set()
        for cls, window in by_class.items():
            members = list(range(len(window.ranks)))
            baseline = [i for i in members if window.ids[i] not in memo.removed]
            n = len(baseline)
            if n < cfg.min_ranks:
                continue
            judged.update(window.ids)
            computes = sorted(window.computes[i] for i in baseline)
            med = statistics.median(computes)
            if med <= 0:
                continue
            mad = statistics.median(abs(c - med) for c in computes)
            spreads = memo.spreads.setdefault(cls, deque(maxlen=SPREAD_MEMORY_WINDOWS))
            spreads.append(mad_sigma(mad, n) / med)
            sigma = max(spreads[-1], statistics.median(spreads), cfg.min_spread_ratio) * med
            floor = med + max(cfg.min_excess_ratio * med, cfg.z_threshold * sigma)
            comm_limit = sorted(window.comms[i] for i in baseline)[int(cfg.max_comm_quantile * (n - 1))]
            outliers = [i for i in members if window.computes[i] >= floor and window.comms[i] <= comm_limit]
            if sum(1 for i in outliers if window.ids[i] not in memo.removed) > max(
                    1, math.floor(cfg.max_outlier_rank_share * n)):
                continue
            for i in outliers:
                compute = window.computes[i]
                excess, z = round((compute - med) / med, 4), round((compute - med) / sigma, 2)
                nodes_of[window.ids[i]] = window.ranks[i].node
                flagged[window.ids[i]] = _Flag(excess, z, {
                    "compute_seconds_p50": round(compute, 6), "group_median_compute_seconds": round(med, 6),
                    "excess_ratio": excess, "z": z, "comm_seconds_p50": round(window.comms[i], 6),
                    "group_comm_seconds_limit": round(comm_limit, 6), "steps": window.steps[i], "group_ranks": n,
                    "hardware_class": describe(cls)})
        every = [rank.node for window in by_class.values() for rank in window.ranks]
        for rank_id, node in list(nodes_of.items()):
            slow = sum(1 for other in nodes_of.values() if other == node)
            if slow >= cfg.max_node_rank_share * every.count(node):
                del flagged[rank_id]
            else:
                flagged[rank_id].evidence.update(node_ranks_slow=slow, node_ranks=every.count(node))
        return _Verdict(flagged, judged)


def every_gpu(detector: MemoryDetector | PcieNvlinkDetector, view: FleetView, now: float) -> list[Finding]:
    return [f for node in view.nodes.values() for gpu in node.gpus.values() if gpu.last_seen >= node.last_seen
            for f in detector._judge(node, gpu, now)]


def every_port(detector: NetworkDetector, view: FleetView, now: float) -> list[Finding]:
    shared = detector._shared_drops(view, now)
    return [f for node in view.nodes.values() for port in node.ports.values() if port.last_seen >= node.last_seen
            for f in detector._judge(node, port, now, shared)]


def compact(fleet: Fleet, base: Report | None, report: Report, now: float) -> Report:
    """``report`` relative to ``base`` as the agent sends it (version 3), where the fleet holds that
    base and the two have the same structure; else ``report`` whole."""
    if base is None:
        return report
    body = delta(whole(base), whole(report))
    if body is None:
        return report
    sent = decode_report(json.dumps({**body, "base_seq": base.seq}))
    return sent if fleet.refusal(sent, now) is None else report


def fleet_nodes() -> list[FakeNode]:
    nodes = [FakeNode(f"n{i}", ports=2, topology={"rack": f"rack-{i // 4}", "leaf_switch": f"leaf-{i // 6}"})
             for i in range(NODES)]
    for i, node in enumerate(nodes):
        for g in node.gpus.values():
            g["job"] = "a" if i < 8 else None  # job b's GPUs are placed by its ranks' heartbeats
            g["power_limit_watts"] = 700.0
    return nodes


def faults(rng: random.Random, nodes: list[FakeNode], t: float, plan: dict[str, float]) -> None:
    """The fleet's state at ``t``: noise, and each fault from its planned start."""
    for i, node in enumerate(nodes):
        for g in node.gpus.values():
            g["sm_clock_hertz"] = 1.98e9 * (1 + rng.uniform(-0.03, 0.0))
            g["clock_event_reasons"] = ["sw_power_cap"]
            g["utilization_gpu_ratio"] = 0.97
        if i >= 8:
            # One rank 30% slow for a while (its peers wait for it in the collective). Ranks left
            # out of their node's reports long enough to go stale (gpu_peer: three intervals) and
            # too briefly to, and a rank that names its neighbour's GPU for a while: the GPU it
            # left has no job then.
            node.ranks = [rank_summary("b", i * 8 + local, ts=t, gpu=gpu, step=int(t), comm=0.1 if slow else 0.4,
                                       compute=(1.3 if slow else 1.0) * (1 + rng.uniform(-0.01, 0.01)))
                          for local in node.gpus
                          if not ((i, local) == (9, 5) and plan["rank_out"] <= t < plan["rank_out"] + 30)
                          and not ((i, local) == (9, 6) and plan["rank_blip"] <= t < plan["rank_blip"] + 5)
                          for gpu in [3 if (i, local) == (10, 2) and plan["rank_swap"] <= t < plan["rank_swap"] + 40
                                      else local]
                          for slow in [(i, local) == (11, 3) and plan["slow_rank"] <= t < plan["slow_rank"] + 200]]
    # A whole rack throttled at once (a cooling failure): the job's, not its nodes'.
    if plan["rack"] <= t < plan["rack"] + 120:
        for node in nodes[8:]:
            for g in node.gpus.values():
                g.update(THROTTLED)
    # One node power-capped by hand: its clocks and limit sit below its peers' (power cap alone is normal).
    if t >= plan["cap"]:
        for g in nodes[7].gpus.values():
            g["power_limit_watts"], g["sm_clock_hertz"] = 400.0, 1.4e9
    # A node whose limit alone was lowered (a power brake policy): its clocks look like its peers'.
    if t >= plan["limit"]:
        for g in nodes[10].gpus.values():
            g["power_limit_watts"] = 550.0
    # A GPU braking in bursts shorter than the persistence, and one held down for good.
    if t >= plan["bursts"] and (t - plan["bursts"]) % 60 < 30:
        nodes[5].gpus[2].update(THROTTLED)
    if t >= plan["held"]:
        nodes[6].gpus[4].update(THROTTLED)
    nodes[5].gpus[1]["memory_temperature_celsius"] = 94.0 if t >= plan["hbm"] else 70.0
    # A GPU unhealthy for a while, and one whose job attribution lapses for a while.
    nodes[3].gpus[7]["health"] = "reset_required" if plan["health"] <= t < plan["health"] + 60 else "ok"
    nodes[2].gpus[1]["job"] = None if plan["attribution"] <= t < plan["attribution"] + 40 else "a"
    # Idle now and then: an idle GPU drops its clocks by design.
    if rng.random() < 0.05:
        nodes[rng.randrange(NODES)].gpus[rng.randrange(8)]["utilization_gpu_ratio"] = 0.1
    # A switch's drops on every node under it, and a node's own.
    if abs(t - plan["switch"]) < 1.0 or abs(t - plan["switch"] - 400) < 1.0:
        for node in nodes[:6]:
            node.ports[0]["counters"]["link_downed"] += 1
    if plan["own"] <= t < plan["own"] + 100 and rng.random() < 0.1:
        nodes[7].ports[1]["counters"]["link_downed"] += 1
    if t >= plan["errors"]:
        nodes[10].ports[0]["counters"]["symbol_error"] += rng.randrange(0, 40)
    nodes[4].ports[1]["state"] = "1: DOWN" if t >= plan["down"] else "4: ACTIVE"
    if t >= plan["degraded"]:
        nodes[11].ports[0]["rate_bits_per_second"] = 200 * GBPS
    if t >= plan["memory"]:
        nodes[2].gpus[0]["remap_pending"] = True
        nodes[2].gpus[6]["retired_pages_pending"] = True
        nodes[4].gpus[3]["ecc_uncorrected_volatile"] = int((t - plan["memory"]) // 50)
        nodes[8].gpus[3]["nvlink_links_down"] = [2] if t < plan["memory"] + 150 else []
        nodes[3].gpus[5]["pcie_replay_total"] += rng.randrange(0, 200)
    # Back to health in a compact entry (a field cleared, a port up again, a link at full rate).
    if t >= plan["down"] + 200:
        nodes[4].ports[1]["state"] = "4: ACTIVE"
    if t >= plan["degraded"] + 250:
        nodes[11].ports[0]["rate_bits_per_second"] = 400 * GBPS
    # A GPU whose remap fails while it is out of the reports: it comes back with the flag; out
    # again for two reports, it comes back braking.
    nodes[1].gpus[2]["remap_failure"] = t >= plan["absent"] + 20
    if plan["absent"] + 65 <= t < plan["absent"] + 85:
        nodes[1].gpus[2].update(THROTTLED)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_short_way_finds_what_the_long_way_finds_every_pass(seed: int) -> None:
    rng = random.Random(seed)
    nodes = fleet_nodes()
    plan = {name: rng.uniform(60, 400) for name in
            ("rack", "cap", "limit", "bursts", "held", "hbm", "switch", "own", "errors", "degraded", "down",
             "memory", "health", "attribution", "slow_rank")}
    wire = random.Random(-seed)  # how each report goes (its own stream: the faults' draws stay as they were)
    plan["absent"], plan["pause"] = wire.uniform(60, 400), wire.uniform(100, 700)
    ranks = random.Random(seed + 100)  # the ranks' own (the other streams stay as they were)
    plan.update({name: ranks.uniform(60, 700) for name in ("rank_out", "rank_blip", "rank_swap")})
    fleet = Fleet()
    peer_config = GpuPeerConfig()
    peer, thermal = GpuPeerDetector(peer_config), ThermalDetector(ThermalConfig())
    long_thermal = LongWayThermal(ThermalConfig())
    memory, pcie = MemoryDetector(MemoryConfig()), PcieNvlinkDetector(PcieNvlinkConfig())
    telemetry, telemetry_twin = (TelemetryStragglerDetector(TelemetryStragglerConfig()),
                                 TelemetryStragglerDetector(TelemetryStragglerConfig()))
    straggler, straggler_twin = GpuStragglerDetector(GpuStragglerConfig()), LongWayGpuStraggler(GpuStragglerConfig())
    hang, hang_twin = TelemetryHangDetector(TelemetryHangConfig()), TelemetryHangDetector(TelemetryHangConfig())
    network = NetworkDetector(NetworkConfig(flap_slow_threshold=3, flap_daily_threshold=2))
    found: set[str] = set()
    sent: dict[str, list] = {}
    held: dict[str, Report] = {}  # per node: its latest report ingested (the next compact one's base)
    t = 0.0
    gone_at = rng.uniform(200, 500)
    while t < 900:
        faults(rng, nodes, t, plan)
        for node in nodes:
            if node.name == "n0" and gone_at <= t < gone_at + 40:
                continue  # silent: forgotten below, then a new node of the same name
            if rng.random() < 0.04:
                continue  # a lost report
            if node.name == "n6" and abs(t - 450) < 1.0:
                node.reboot()
            absent = (2,) if node.name == "n1" and (plan["absent"] <= t < plan["absent"] + 40
                                                   or plan["absent"] + 60 <= t < plan["absent"] + 65) else ()
            report = node.report(t, drop_gpus=absent)
            arrival = t + rng.uniform(0, 0.5)
            fleet.ingest(compact(fleet, held.get(node.name), report, arrival) if wire.random() < 0.8 else report,
                         arrival)
            held[node.name] = report
            sent.setdefault(node.name, []).append(report)
            if rng.random() < 0.02 and len(sent[node.name]) > 3:
                fleet.ingest(sent[node.name][-3], t + 0.6)  # replayed: moves last_seen alone
        fleet.forget_departed(t + 1.0, lambda n: 20.0)
        t += 2.5
        if rng.random() < 0.2:
            continue  # no pass this time: the next one finds two reports of each node
        if plan["pause"] <= t < plan["pause"] + 100:
            continue  # no pass for 40 reports: the next one finds more than a GPU's samples hold
        now = t - 2.5 + rng.choice([0.7, 1.0, 2.0])
        view = fleet.view()
        long_view = view.without_markers()  # every node's class and the GPUs' jobs read afresh
        short = peer.evaluate(view, now)
        assert short == GpuPeerDetector(peer_config).evaluate(long_view, now)
        short_thermal = thermal.evaluate(view, now)
        assert short_thermal == long_thermal.evaluate(view, now)
        assert thermal._throttled_time == long_thermal._throttled_time  # the long horizon's memory too
        short_memory, short_pcie = memory.evaluate(view, now), pcie.evaluate(view, now)
        assert short_memory == every_gpu(memory, view, now)
        assert short_pcie == every_gpu(pcie, view, now)
        assert telemetry.evaluate(view, now) == telemetry_twin.evaluate(long_view, now)
        assert hang.evaluate(view, now) == hang_twin.evaluate(long_view, now)
        short_straggler = straggler.evaluate(view, now)
        assert short_straggler == straggler_twin.evaluate(long_view, now)
        found |= {f"gpu_straggler:{f.node}" for f in short_straggler}
        short_network = network.evaluate(view, now)
        assert short_network == every_port(network, view, now)
        found |= {f"{f.detector}:{f.key.split(':')[0]}:{f.action.value}"
                  for f in short_memory + short_pcie + short_network}
        found |= {f"thermal:{f.key}:{f.action.value}" for f in short_thermal}
        found |= {f"gpu_peer:{f.node}:{f.evidence['signal']}" for f in short}
    # The run holds what each detector acts on and what it must not act on.
    assert {"gpu_peer:n7:power_limit_watts", "gpu_peer:n10:power_limit_watts", "gpu_peer:n6:sm_clock_hertz",
            "thermal:clock_throttle:drain", "thermal:clock_throttle:onset:observe",
            "thermal:clock_throttle:shared:observe", "thermal:clock_throttle:job:alert",
            "thermal:clock_throttle:intermittent:alert", "thermal:hbm_temperature:alert",
            "memory:remap_pending:reset_gpu", "memory:retired_pending:reset_gpu", "memory:uncorrectable:drain",
            "memory:remap_failure:inspect_hardware",
            "pcie_nvlink:nvlink_down:reboot_node", "pcie_nvlink:pcie_replay_total:drain",
            "network:bit_errors:drain", "network:degraded:drain", "network:port_down:drain", "network:flap:drain",
            "network:flap_daily:alert", "gpu_straggler:n11",
            } <= found, sorted(found)


def test_thermal_counts_what_it_passed_over_as_the_walk_counts_it() -> None:
    """A node passed over while quiet, then: a GPU braking from the third of 34 reports with no
    pass between (its samples hold 32: the first counted is the oldest held), and a GPU out of two
    reports that comes back braking. The long horizon's memory is the long way's after every pass."""
    fleet, node = Fleet(), FakeNode("n1", gpus=2, ports=0)
    short, long = ThermalDetector(ThermalConfig()), LongWayThermal(ThermalConfig())
    t = 0.0

    def report(passes: bool = True, drop: tuple[int, ...] = ()) -> None:
        nonlocal t
        t += 2.5
        fleet.ingest(node.report(t, drop_gpus=drop), t)
        if passes:
            view = fleet.view()
            assert short.evaluate(view, t + 1.0) == long.evaluate(view, t + 1.0)
            assert short._throttled_time == long._throttled_time

    for _ in range(8):
        report()
    assert "n1" in short._clean  # quiet: passed over
    for k in range(34):
        if k == 2:
            node.gpus[0].update(THROTTLED)
        report(passes=k == 33)
    assert min(short._throttled_time[("n1", 0)])[1] == 7.5  # from the last pass's count (a pass over)
    node.gpus[0].update(sm_clock_hertz=1.98e9, clock_event_reasons=["sw_power_cap"])
    for _ in range(6):
        report()
    assert "n1" in short._clean
    report(drop=(1,))
    report(drop=(1,))
    assert "n1" not in short._clean  # a GPU out of the latest report: walked
    node.gpus[1].update(THROTTLED)
    for _ in range(3):
        report()
    assert min(short._throttled_time[("n1", 1)])[1] == 7.5  # since its last sample before it left
    # A configuration acting on what the fleet does not mark walks every node, every pass.
    assert short._watched and not ThermalDetector(ThermalConfig(reasons=["sw_power_cap"]))._watched
    assert not ThermalDetector(ThermalConfig(memory_margin_celsius=12.0))._watched


def test_a_nodes_hardware_class_is_read_again_when_what_names_it_changed() -> None:
    fleet, node = Fleet(), FakeNode("n1", ports=0)
    classes = HardwareClasses(power_limit=False)

    def class_of_n1() -> tuple[str, int | None, int | None]:
        view = fleet.view()
        classes.start(view)
        return classes.of(view.nodes["n1"])

    fleet.ingest(node.report(0.0), 0.0)
    state = fleet.view().nodes["n1"]
    assert class_of_n1() == hardware_class(state, power_limit=False) == ("", 132, None)
    for g in list(node.gpus.values())[:5]:
        g["name"] = "NVIDIA H200"
    fleet.ingest(node.report(2.5), 2.5)
    assert class_of_n1() == ("NVIDIA H200", 132, None)
    # Gone, then back as a new node (a new NodeState) of the same name, of another model.
    assert fleet.forget_departed(100.0, lambda n: 10.0) == [state]
    for g in node.gpus.values():
        g["name"] = "NVIDIA A100"
    fleet.ingest(node.report(100.0), 100.0)
    again = fleet.view().nodes["n1"]
    assert again is not state and class_of_n1() == ("NVIDIA A100", 132, None)
    # Another fleet's node of the same name, and a view built by hand, are read afresh.
    other, other_node = Fleet(), FakeNode("n1", ports=0)
    other.ingest(other_node.report(0.0), 0.0)
    view = other.view()
    classes.start(view)
    assert classes.of(view.nodes["n1"]) == ("", 132, None)
    classes.start(fleet.view().without_markers())
    assert classes.of(again) == ("NVIDIA A100", 132, None)
