"""A whole report that holds the very GPU and port states the fleet took last (the simulator hands
the service its agents' objects, the same ones until a collector reads again) is taken the short way
(``held``: the last sample at the new time, the counters as compared last, the class, job and
recovery action as taken). Over random evolving nodes that re-read their GPUs and ports now and
then, reboot, leave a GPU out and are watched, a fleet fed those objects and a twin fed a fresh copy
of every entry in every report (the long way) hold the same samples, counters, link facts, markers
and journals after every report."""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
import pytest

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.fleet import Fleet
from vigil.aggregator.fleet.history import ClockWatch, CounterBaseline, GpuHistory, PortHistory
from vigil.contract.wire import GpuState, PortState, Report

STEPS = 300
NODES = 2
GPUS = 4
PORTS = 3
JUDGED = ["symbol_error", "link_downed", "port_rcv_errors"]


def _counters(b: CounterBaseline, names: list[str]) -> tuple[Any, ...]:
    return (b.last_ts, b.last_increase_ts, b.resets, b._last_values, dict(b._prev), dict(b._start),
            tuple(tuple(b.increases_since(n, -math.inf)) for n in names))


def _gpu(h: GpuHistory) -> tuple[Any, ...]:
    return (h.uuid, h.last, h.last_seen, list(h.samples),
            _counters(h.counters, ["ecc_corrected_volatile", "ecc_uncorrected_volatile", "pcie_replay_total",
                                   "nvlink_crc_errors_total", "nvlink_replay_errors_total",
                                   "nvlink_recovery_errors_total"]),
            None if h.link_below is None else (h.link_below.since, list(h.link_below.lows)))


def _port(h: PortHistory) -> tuple[Any, ...]:
    return (h.last, h.last_seen, list(h.samples), _counters(h.counters, [*JUDGED, "port_xmit_wait"]),
            h.active_this_boot, h.ever_active, h.max_rate_bits_per_second, h._flags)


def _state(fleet: Fleet) -> tuple[Any, ...]:
    nodes = fleet.view().nodes
    out: list[Any] = [fleet.revision, fleet.gpu_jobs_revision,
                      {name: list(getattr(fleet.journals, name).names) for name in fleet.journals.__slots__}]
    for name in sorted(nodes):
        n = nodes[name]
        out.append((n.revision, n.gpu_faults_revision, n.gpu_class_revision, n.gpu_watch_revision, n.ports_revision,
                    n.gpu_counters_moved_ts, n.port_counters_moved_ts, sorted(n.unhealthy_gpus),
                    sorted(n.recovery_gpus), dict(n.missing_gpus), dict(n.fabric_suspect_gpus),
                    sorted(n.gpu_links_below), n.gpus_reported,
                    {i: _gpu(h) for i, h in sorted(n.gpus.items())},
                    {k: _port(h) for k, h in sorted(n.ports.items())}))
    return tuple(out)


def _reread(rng: random.Random, node: FakeNode) -> None:
    """What a new read of the node's GPUs may find."""
    for g in node.gpus.values():
        g["temperature_celsius"] = 55.0 + rng.random() * 20
        g["utilization_gpu_ratio"] = rng.choice([0.0, 0.4, 0.97])
        g["sm_clock_hertz"] = rng.choice([1.98e9, 1.98e9, 1.2e9])
        if rng.random() < 0.2:
            g["ecc_corrected_volatile"] += rng.randint(1, 3)
        if rng.random() < 0.1:
            g["nvlink_crc_errors_total"] += 1
        if rng.random() < 0.05:
            g["clock_event_reasons"] = rng.choice([["sw_power_cap"], ["hw_thermal_slowdown"], []])
        if rng.random() < 0.05:
            g["memory_temperature_celsius"] = rng.choice([70.0, 90.0])
        if rng.random() < 0.04:
            g["remap_pending"] = not g["remap_pending"]
        if rng.random() < 0.03:
            g["power_limit_watts"] = rng.choice([500.0, 700.0])
        if rng.random() < 0.03:
            g["health"] = rng.choice(["ok", "ok", "lost"])
        if rng.random() < 0.03:
            g["recovery_action"] = rng.choice([None, "gpu_reset"])
        if rng.random() < 0.03:
            g["job"] = rng.choice([None, "llm-a"])
        if rng.random() < 0.04:
            g["pcie_link_generation"], g["pcie_link_generation_max"] = rng.choice([(5, 5), (4, 5)])


def _reread_ports(rng: random.Random, node: FakeNode) -> None:
    for p in node.ports.values():
        c = p["counters"]
        for name in c:
            if rng.random() < 0.1:
                c[name] += rng.randint(1, 4)
        if rng.random() < 0.05:
            c["link_downed"] = c.get("link_downed", 0) + 1
        if rng.random() < 0.04:
            p["state"] = rng.choice(["ACTIVE", "DOWN"])
        if rng.random() < 0.04:
            p["rate_bits_per_second"] = rng.choice([400e9, 200e9, 400e9])
        if rng.random() < 0.03:
            p["flags"] = rng.choice([{}, {"port_rcv_errors": "saturated"}])
        if rng.random() < 0.02:
            c["port_xmit_wait"] = c.get("port_xmit_wait", 0) + 10  # a counter appears


@pytest.mark.parametrize("seed", range(4))
def test_a_fleet_fed_the_held_objects_holds_what_a_fleet_fed_copies_holds(seed: int) -> None:
    rng = random.Random(seed)
    held, copied = Fleet(port_counters=JUDGED), Fleet(port_counters=JUDGED)
    nodes = [FakeNode(f"n{i}", gpus=GPUS, ports=PORTS) for i in range(NODES)]
    last: dict[str, tuple[list[GpuState], list[PortState]]] = {}
    watches: list[ClockWatch] = []
    reused = 0  # entries handed again as the very objects of the report before
    for k in range(STEPS):
        ts = 2.5 * k
        for node in nodes:
            if k and rng.random() < 0.01:
                node.reboot()  # the held objects stay (no agent keeps them across one; the fleet must not care)
            gpus_read = node.name not in last or rng.random() < 0.15
            ports_read = node.name not in last or rng.random() < 0.15
            if gpus_read:
                _reread(rng, node)
            if ports_read:
                _reread_ports(rng, node)
            fresh = node.report(ts)
            gpus = fresh.gpus if gpus_read else last[node.name][0]
            ports = fresh.ports if ports_read else last[node.name][1]
            last[node.name] = (gpus, ports)
            reused += (not gpus_read) * len(gpus) + (not ports_read) * len(ports)
            dropped = rng.randrange(GPUS) if rng.random() < 0.03 else None  # a GPU left out of this report
            sent = [g for g in gpus if g.index != dropped]
            report = msgspec.structs.replace(fresh, gpus=list(sent), ports=list(ports))
            twin = msgspec.structs.replace(fresh, gpus=[msgspec.structs.replace(g) for g in sent],
                                           ports=[msgspec.structs.replace(p, counters=dict(p.counters),
                                                                          flags=dict(p.flags)) for p in ports])
            assert isinstance(report, Report) and isinstance(twin, Report)
            held.ingest(report, ts)
            copied.ingest(twin, ts)
        if k == 20:  # a reader watches a band of clocks on each fleet's first node's GPUs
            for fleet in (held, copied):
                watch = ClockWatch(1.5e9, 2.1e9, 0.5)
                watches.append(watch)
                for h in fleet.view().nodes["n0"].gpus.values():
                    h.watch_clocks(watch)
        assert _state(held) == _state(copied), k
        if watches:
            assert watches[0].out_ts == watches[1].out_ts, k
    # Most entries were held objects (the short way's input), and the watch saw a clock out of band.
    assert reused > STEPS * NODES * (GPUS + PORTS) // 2
    assert watches[0].out_ts > -math.inf
