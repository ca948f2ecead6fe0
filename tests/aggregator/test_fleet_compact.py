"""Compact reports (versions 2 and 3) leave the fleet exactly as the same reports sent whole: counter
increases, the time they cover, resets and the samples detectors read, whether judged counters
move in a report or none do (then the fleet records the read without comparing values), and when
only counters nobody judges move."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import msgspec
import pytest

from tests.aggregator.conftest import FakeNode, assert_same_node, rank_summary
from vigil.agent.report_delta import delta, whole
from vigil.aggregator.fleet import GPU_COUNTERS, Fleet, GpuHistory, GpuSample
from vigil.aggregator.fleet.completion import complete_gpu, complete_port, complete_rank
from vigil.contract.wire import (
    REPORT_VERSION,
    REPORT_VERSIONS,
    GpuProcess,
    GpuState,
    PortState,
    RankSummary,
    Report,
    decode_report,
)

ROUNDS = 12
JUDGED_PORT_COUNTERS = ["symbol_error", "link_downed", "link_error_recovery"]


def _wire(body: dict) -> Report:
    return decode_report(json.dumps(body))  # as the service validates


def _reports() -> list[Report]:
    node = FakeNode("n1")
    for p in node.ports.values():
        p["counters"]["port_xmit_data"] = 0  # traffic: moves every report, judged by no detector
    out = []
    for k in range(ROUNDS):
        node.gpus[0]["utilization_gpu_ratio"] = 0.8 + k / 100
        for p in node.ports.values():
            p["counters"]["port_xmit_data"] += 1_000_000
        if k in (3, 7):
            node.ports[0]["counters"]["symbol_error"] += 3
            node.gpus[1]["ecc_corrected_volatile"] += 2
        if k == 5:
            node.ports[2]["counters"]["link_downed"] += 1
            node.gpus[4]["pcie_replay_total"] += 9
        if k == 9:
            node.gpus[6]["pcie_replay_total"] = 1  # went backwards: a reset
        # Fields going absent and coming back: an optional one (named in `cleared`), fields with a
        # default other than None (absent in the compact entry means the default).
        if k == 4:
            del node.gpus[2]["temperature_celsius"]
            del node.ports[1]["rate_bits_per_second"]
            node.gpus[3]["health"] = "reset_required"
            node.gpus[5]["clock_event_reasons"] = []
            node.ports[3]["flags"] = {"port_rcv_errors": "saturated"}
        if k == 6:
            node.gpus[2]["temperature_celsius"] = 64.0
            node.ports[1]["rate_bits_per_second"] = 200 * 10**9
            del node.gpus[3]["health"]
            node.gpus[5]["clock_event_reasons"] = ["hw_slowdown"]
            del node.ports[3]["flags"]
        # A rank's state, the only field of a rank summary with a default other than None, leaves
        # the default and comes back (a hang, then progress again).
        node.ranks = [rank_summary("j1", r, compute=0.4, comm=0.1, ts=k * 2.5, gpu=r, step=10 * k,
                                   state="hung" if r == 1 and k in (5, 6) else "running") for r in range(2)]
        out.append(node.report(k * 2.5))
    return out


def _bodies(reports: list[Report], version: int) -> list[dict]:
    """The first whole in ``version``, each later one relative to the one before (agent/reporter.py)."""
    out = [whole(reports[0])]
    for before, now in pairwise(reports):
        body = delta(whole(before), whole(now))
        assert body is not None
        out.append({**body, "base_seq": before.seq})
    return out


def _compact(reports: list[Report], version: int) -> list[Report]:
    return [_wire(b) for b in _bodies(reports, version)]


def _ingested(reports: list[Report], port_counters: list[str] | None) -> Fleet:
    fleet = Fleet(port_counters=port_counters)
    for r in reports:
        assert fleet.refusal(r, r.ts) is None
        fleet.ingest(r, r.ts)
    return fleet


@pytest.mark.parametrize("version", REPORT_VERSIONS, ids=lambda v: f"v{v}")
@pytest.mark.parametrize("port_counters", [None, JUDGED_PORT_COUNTERS], ids=["all-judged", "some-judged"])
def test_compact_reports_leave_the_fleet_as_whole_reports_do(port_counters: list[str] | None, version: int) -> None:
    reports = _reports()
    compact = _compact(reports, version)
    assert all(r.base_seq is not None for r in compact[1:])
    assert "symbol_error" not in compact[4].ports[0].counters  # a quiet report carries no judged counter
    a = _ingested(reports, port_counters).view().nodes["n1"]
    b = _ingested(compact, port_counters).view().nodes["n1"]
    assert_same_node(a, b)
    assert [r.last.state for r in (b.ranks[("j1", 1)],)] == ["running"]
    assert compact[5].ranks[1].state == "hung" and compact[7].ranks[1].state == "running"
    # What moved is there: the judged counters' increases, the GPU counter reset.
    assert a.ports[("mlx5_0", 1)].counters.sum_since("symbol_error", 0.0) == 6
    assert b.ports[("mlx5_0", 1)].counters.sum_since("symbol_error", 0.0) == 6
    assert b.ports[("mlx5_2", 1)].counters.sum_since("link_downed", 0.0) == 1
    assert b.gpus[1].counters.sum_since("ecc_corrected_volatile", 0.0) == 4
    assert b.gpus[4].counters.sum_since("pcie_replay_total", 0.0) == 9
    assert b.gpus[6].counters.resets == 1
    assert b.ports[("mlx5_0", 1)].counters.last_ts == (ROUNDS - 1) * 2.5  # quiet reads are recorded too
    assert [s.health for s in b.gpus[3].samples][3:7] == ["ok", "reset_required", "reset_required", "ok"]
    assert b.gpus[2].last.temperature_celsius == 64.0 and b.ports[("mlx5_3", 1)].last.flags == {}
    assert b.gpus[5].last.clock_event_reasons == ("hw_slowdown",)
    if version == REPORT_VERSION:
        # Fields with a default are cleared too when they go back to it, and left out while unchanged.
        assert compact[4].cleared == [("gpus", 2, "temperature_celsius"), ("gpus", 5, "clock_event_reasons"),
                                      ("ports", 1, "rate_bits_per_second")]
        assert compact[6].cleared == [("gpus", 3, "health"), ("ports", 3, "flags")]
        assert compact[7].cleared == [("ranks", 1, "state")]
        sent = _bodies(reports, version)
        assert "clock_event_reasons" in sent[6]["gpus"][5] and "flags" in sent[4]["ports"][3]
        assert all("clock_event_reasons" not in b["gpus"][5] and "flags" not in b["ports"][3] for b in sent[7:])


@pytest.mark.parametrize("version", REPORT_VERSIONS, ids=lambda v: f"v{v}")
def test_the_fleet_completes_only_states_it_made_and_never_a_reports(version: int) -> None:
    """Version 3 completes a GPU's and a rank's state in place: only a copy the fleet made of it
    (once), never the state a report brought whole, which its sender may keep (the simulator hands
    its agent's own Report to the engine) and which a later whole report may bring again. Every
    report fed in, whole or compact, encodes afterwards as it did when it was fed; and while compact
    reports follow each other, each completes the same owned state (no copy a report)."""
    reports = _reports()
    compact = _compact(reports, version)
    # A whole report in the middle of the chain (the agent rebased): its states are the report's too.
    compact[6] = _wire(whole(reports[6]))
    fed = [msgspec.json.encode(r) for r in compact]
    fleet = Fleet()
    owned: list[tuple[int, int]] = []
    for r in compact:
        assert fleet.refusal(r, r.ts) is None
        fleet.ingest(r, r.ts)
        node = fleet.view().nodes["n1"]
        owned.append((id(node.gpus[0].last), id(node.ranks[("j1", 0)].last)))
    assert [msgspec.json.encode(r) for r in compact] == fed
    held = fleet.view().nodes["n1"]
    assert all(gpu.last is not r.gpus[gpu.index] for r in compact for gpu in held.gpus.values()
               if gpu.index < len(r.gpus))
    if version == REPORT_VERSION:
        # The first compact report after each whole one copies; the ones after it update that copy.
        assert owned[1] == owned[2] == owned[5] and owned[7] == owned[8] == owned[-1] != owned[5]
    assert_same_node(_ingested(reports, None).view().nodes["n1"], held)


@pytest.mark.parametrize("version", REPORT_VERSIONS, ids=lambda v: f"v{v}")
@pytest.mark.parametrize("port_counters", [None, JUDGED_PORT_COUNTERS], ids=["all-judged", "some-judged"])
def test_telemetry_held_back_leaves_the_fleet_as_the_agents_held_state_says(port_counters: list[str] | None,
                                                                            version: int) -> None:
    """The agent's base after a compact report with telemetry held back (report_delta puts the
    base's values back into its state) is exactly what the aggregator holds: the fleet fed the
    compact bodies equals the fleet fed those held states whole, and every third report (a
    refresh) brings the telemetry up to the agent's."""
    reports = _reports()
    for k, r in enumerate(reports):
        for gpu in r.gpus:
            gpu.sm_active_ratio = 0.5 + k / 100  # telemetry: moves every report
    compact, held = [_wire(whole(reports[0]))], [_wire(whole(reports[0]))]
    base = whole(reports[0])
    for k, now in enumerate(reports[1:], start=1):
        state = whole(now)
        body = delta(base, state, telemetry=k % 3 == 0)
        assert body is not None
        compact.append(_wire({**body, "base_seq": base["seq"]}))
        held.append(_wire(state))
        base = state
    a = _ingested(held, port_counters).view().nodes["n1"]
    b = _ingested(compact, port_counters).view().nodes["n1"]
    assert_same_node(a, b)
    assert [g.sm_active_ratio for g in held[4].gpus][:1] == [0.53]  # as refreshed at k=3
    assert held[4].ports[0].counters["port_xmit_data"] == reports[3].ports[0].counters["port_xmit_data"]
    assert held[4].ports[0].counters["symbol_error"] == reports[4].ports[0].counters["symbol_error"]  # a fault: sent
    assert b.gpus[0].last.sm_active_ratio == 0.5 + 9 / 100  # the last refresh, k=9 of 0..11
    assert b.gpus[0].last.utilization_gpu_ratio == reports[-1].gpus[0].utilization_gpu_ratio  # judged: every report


# A value away from its default for each PortState field a version-3 entry may carry besides its
# identity and counters (the test below checks the table against PortState's fields).
PORT_FIELD_CHANGES: dict[str, Any] = {
    "state": "DOWN", "phys_state": "Polling", "rate_bits_per_second": 2e11, "link_layer": "Ethernet",
                      "netdev": "eth9", "deltas": {"symbol_error": 1}, "rates_per_second": {"symbol_error": 0.5},
                      "flags": {"symbol_error": "saturated"}}


def test_a_version_3_port_entry_that_moved_only_counters_is_its_base_and_any_other_field_completes_it() -> None:
    """The port fast path (completion.complete_port) reads PortState's fields by name: an entry
    with only its identity and counters leaves the base itself with the counters merged; an entry
    with any other field set completes a new state with it (a field added to PortState and not
    to the fast path would be lost, so the table must name every one)."""
    others = {f.name for f in msgspec.structs.fields(PortState)
              if not f.required and f.name != "counters"}
    assert set(PORT_FIELD_CHANGES) == others
    complete = complete_port
    base = PortState(device="mlx5_0", port=1, state="ACTIVE", phys_state="LinkUp", rate_bits_per_second=4e11,
                     counters={"symbol_error": 3, "port_xmit_wait": 10})
    same = complete(base, PortState(device="mlx5_0", port=1, counters={"port_xmit_wait": 12}))
    assert same is base and base.counters == {"symbol_error": 3, "port_xmit_wait": 12}
    for name, value in PORT_FIELD_CHANGES.items():
        done = complete(base, PortState(device="mlx5_0", port=1, counters={"symbol_error": 4}, **{name: value}))
        assert done is not base and getattr(done, name) == value, name
        assert done.counters == {"symbol_error": 4, "port_xmit_wait": 12}
        assert all(getattr(done, f) == getattr(base, f) for f in others - {name}), name


def test_a_gpu_sample_and_counters_read_every_field_from_the_state() -> None:
    """GpuHistory.observe reads GpuSample's fields and the judged counters by name (no attrgetter
    on the hot path): each one from the state's field of that name, none swapped or missed."""
    names = ("sm_clock_hertz", "sm_clock_max_hertz", "memory_temperature_celsius", "memory_max_temperature_celsius")
    floats: dict[str, Any] = {name: float(k + 2) for k, name in enumerate(names)}
    floats["utilization_gpu_ratio"] = 0.25
    counters: dict[str, Any] = {name: 10 * (k + 1) for k, name in enumerate(GPU_COUNTERS)}
    state = GpuState(index=0, uuid="GPU-0", health="reset_required", clock_event_reasons=("hw_slowdown",),
                     remap_pending=True, remap_failure=False, retired_pages_pending=None, nvlink_links_down=(2, 5),
                     recovery_action="drain_p2p",
                     **floats, **counters)
    history = GpuHistory(state, 0.0, 8, 8)
    history.observe(state, 1.0)
    sample = history.samples[-1]
    assert sample.ts == 1.0
    assert all(getattr(sample, name) == getattr(state, name) for name in GpuSample.__struct_fields__[1:])
    assert len(set(map(repr, msgspec.structs.astuple(sample)[1:]))) == len(GpuSample.__struct_fields__) - 1
    # Each counter grows by its own amount: the increase each name records is its own.
    grown = msgspec.structs.replace(state, **{name: 10 * (k + 1) + k + 1 for k, name in enumerate(GPU_COUNTERS)})
    history.observe(grown, 2.0)
    assert [history.counters.sum_since(name, 0.0) for name in GPU_COUNTERS] == [float(k + 1)
                                                                               for k in range(len(GPU_COUNTERS))]


def test_a_version_3_entry_that_moved_a_defaulted_field_keeps_its_decoded_types() -> None:
    """A GPU entry whose throttle reasons, links down or processes moved (the fields with a default
    other than None): the completed state holds them as decoded, tuples of str and of GpuProcess
    Structs, not as the lists and dicts ``to_builtins`` makes of them (the detectors read
    ``p.pid``); a field left at its default keeps the base's. The same for a rank's state. (The
    version-3 GPU and rank completers update their base in place: each call gets its own copy, as
    the fleet completes only a copy it made.)"""
    base = GpuState(index=0, uuid="GPU-0", health="ok", power_watts=600.0, clock_event_reasons=("sw_power_cap",),
                    processes=(GpuProcess(pid=10, job="a"),))
    sent = GpuState(index=0, uuid="GPU-0", power_watts=650.0, clock_event_reasons=("sw_power_cap", "hw_slowdown"),
                    nvlink_links_down=(3,), processes=(GpuProcess(pid=11, job="b"),))
    own = msgspec.structs.replace(base)
    done = complete_gpu(own, sent)
    assert done is own
    assert done.power_watts == 650.0 and done.health == "ok"
    assert done.clock_event_reasons == ("sw_power_cap", "hw_slowdown") and done.nvlink_links_down == (3,)
    assert done.processes == (GpuProcess(pid=11, job="b"),) and isinstance(done.processes, tuple)
    assert type(done.processes[0]) is GpuProcess and done.processes[0].pid == 11
    kept = complete_gpu(msgspec.structs.replace(base), GpuState(index=0, uuid="GPU-0", power_watts=640.0))
    assert kept.clock_event_reasons == ("sw_power_cap",) and kept.processes == base.processes
    rank = rank_summary("j", 0, compute=0.1, comm=0.02, ts=1.0, step=5)
    hung = complete_rank(rank, RankSummary(job="j", rank=0, state="hung", window_seconds=2.5, steps=0, last_step=5,
                                           last_progress_ts=1.0))
    assert hung.state == "hung" and hung.compute_seconds_p50 == 0.1 and hung.steps == 0
