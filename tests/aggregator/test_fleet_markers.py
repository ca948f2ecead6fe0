"""The fleet's change markers (docs/detectors.md, "change markers") move whenever what they stand for changed: a node's
hardware-class revision whenever a GPU's model, maximum SM clock or power limit changed or a GPU
history was replaced, in whole and compact reports alike (a compact entry carries only what changed,
or lists it as cleared); a job's membership revision whenever a rank joined, left or moved; a rank's
window count with each window appended; the fleet's GPU-job revision whenever a GPU's job
attribution or the fleet's GPUs changed (a listing kept across evaluations is the listing made
afresh). A marker that stayed while its state changed would leave an
incremental detector judging a stale cache."""

from __future__ import annotations

import json
import math
import random
from itertools import pairwise

import msgspec
import pytest

from tests.aggregator.conftest import FakeNode, rank_summary
from vigil.agent.report_delta import delta, whole
from vigil.aggregator.fleet import Fleet, FleetConfig
from vigil.aggregator.job_telemetry import JobNode, JobNodes, job_nodes
from vigil.contract.wire import REPORT_VERSIONS, Report, decode_report

ROUNDS = 12


def _reports() -> list[Report]:
    node = FakeNode("n1", gpus=4, ports=1)
    out = []
    for k in range(ROUNDS):
        node.gpus[0]["temperature_celsius"] = 60.0 + k  # moves every report: not a class field
        if k == 3:
            node.gpus[1]["power_limit_watts"] = 500.0
        if k == 5:
            node.gpus[2]["name"] = "NVIDIA H200"
        if k == 6:
            del node.gpus[2]["name"]  # absent: cleared in a compact report
        if k == 8:
            node.gpus[3]["uuid"] = "GPU-replaced"  # another GPU at this index: a new history
        if k == 10:
            node.gpus[1]["sm_clock_max_hertz"] = 1.41e9
        out.append(node.report(k * 2.5))
    return out


def _forms(reports: list[Report], version: int | None) -> list[Report]:
    if version is None:
        return reports
    bodies = [whole(reports[0])]
    for before, now in pairwise(reports):
        body = delta(whole(before), whole(now))
        # A new GPU at an index changes the report's structure: the agent sends it whole.
        bodies.append(whole(now) if body is None else {**body, "base_seq": before.seq})
    return [decode_report(json.dumps(b)) for b in bodies]


def _class_fields(fleet: Fleet) -> tuple[tuple[str | None, float | None, float | None, str | None], ...]:
    node = fleet.view().nodes["n1"]
    return tuple((h.last.name, h.last.sm_clock_max_hertz, h.last.power_limit_watts, h.uuid)
                 for _, h in sorted(node.gpus.items()))


@pytest.mark.parametrize("version", [None, *REPORT_VERSIONS], ids=lambda v: "whole" if v is None else f"v{v}")
def test_class_revision_moves_exactly_when_a_class_field_changed(version: int | None) -> None:
    fleet = Fleet()
    before = None
    moved = []
    for k, report in enumerate(_forms(_reports(), version)):
        mark = fleet.view().nodes["n1"].gpu_class_revision if k else None
        fleet.ingest(report, report.ts)
        fields = _class_fields(fleet)
        node = fleet.view().nodes["n1"]
        if k and fields != before:
            assert node.gpu_class_revision != mark, k
        if k and node.gpu_class_revision != mark:
            moved.append(k)
        before = fields
    # Only the rounds that changed a class field (none of the temperature's): no needless recompute.
    assert moved == [3, 5, 6, 8, 10]


def _fault_reports() -> list[Report]:
    node = FakeNode("n1", gpus=2, ports=2)
    out = []
    for k in range(ROUNDS):
        node.gpus[0]["temperature_celsius"] = 60.0 + k  # moves every report: judged by no fault test
        if k == 3:
            node.gpus[1]["remap_pending"] = True
        if k == 4:
            node.ports[0]["rate_bits_per_second"] /= 2  # trained down: a link fact, in no counter
        if k == 5:
            node.gpus[0]["nvlink_links_down"] = [1]
        if k == 6:
            node.gpus[0]["nvlink_links_down"] = []  # back to the default: cleared in a compact report
        if k == 7:
            node.ports[1]["state"] = "1: DOWN"
        if k == 8:
            node.gpus[1]["ecc_corrected_volatile"] += 3
        if k == 9:
            node.ports[0]["counters"]["symbol_error"] += 2
        if k == 10:
            node.ports[1]["flags"] = {"port_rcv_errors": "saturated"}  # a counter pinned at its maximum
        out.append(node.report(k * 2.5))
    return out


@pytest.mark.parametrize("version", [None, *REPORT_VERSIONS], ids=lambda v: "whole" if v is None else f"v{v}")
def test_fault_and_port_markers_move_when_what_the_gpu_and_port_detectors_read_changed(version: int | None) -> None:
    fleet = Fleet(port_counters=["symbol_error", "link_downed"])
    faults, ports = [], []
    for k, report in enumerate(_forms(_fault_reports(), version)):
        fleet.ingest(report, report.ts)
        node = fleet.view().nodes["n1"]
        if node.gpu_faults_revision == node.revision:
            faults.append(k)
        if node.ports_revision == node.revision:
            ports.append(k)
        assert node.gpu_counters_moved_ts == (-math.inf if k < 8 else 8 * 2.5)
        assert node.port_counters_moved_ts == (-math.inf if k < 9 else 9 * 2.5)
    if version is None:  # whole reports: compared with the state held, the rounds that changed a fault field or a link
        assert faults == [0, 3, 5, 6] and ports == [0, 4, 7, 10]
    else:  # the first whole; then only the rounds that changed a fault field or a port's link
        assert faults[:1] == ports[:1] == [0]
        assert {3, 5, 6} <= set(faults) <= {0, 3, 5, 6}
        # And the report after each (the fleet makes its own copy of the port's state then): never
        # the rounds that moved only a GPU's temperature or a counter.
        assert {0, 4, 7, 10} <= set(ports) <= {0, 1, 4, 5, 7, 8, 10, 11}, ports


def test_a_whole_report_holding_the_same_entry_objects_moves_the_markers_only_where_they_changed() -> None:
    """The simulator hands the service its agents' report objects: a whole report can hold the very
    GPU and port states the last one held. Nothing changed marks nothing; a GPU's fault flag set in
    a new read marks its node, and so does a port's link gone down or trained down in a new read
    (wire states are values: an agent's collector builds a new state at each read, and the very
    state held again is taken as unchanged, its sample and counters as the last ones)."""
    fleet = Fleet()
    report = FakeNode("n1", gpus=2, ports=2).report(0.0)
    fleet.ingest(report, 0.0)
    node = fleet.view().nodes["n1"]

    def again(k: int) -> tuple[bool, bool]:
        nonlocal report
        faults, ports = node.gpu_faults_revision, node.ports_revision
        report = msgspec.structs.replace(report, seq=report.seq + 1, ts=2.5 * k)  # the same entries
        fleet.ingest(report, 2.5 * k)
        return node.gpu_faults_revision != faults, node.ports_revision != ports

    assert again(1) == (False, False)
    report.ports[1] = msgspec.structs.replace(report.ports[1], state="1: DOWN")
    assert again(2) == (False, True)
    assert again(3) == (False, False)
    report.ports[0] = msgspec.structs.replace(report.ports[0],
                                              rate_bits_per_second=(report.ports[0].rate_bits_per_second or 0) / 2)
    assert again(4) == (False, True)
    report.gpus[1] = msgspec.structs.replace(report.gpus[1], remap_pending=True)  # a new read (wire states are values)
    assert again(5) == (True, False)
    assert again(6) == (False, False)


def test_a_rank_moving_to_another_node_is_a_change_to_the_node_it_left() -> None:
    fleet = Fleet()
    a, b = FakeNode("a"), FakeNode("b")
    a.ranks = [rank_summary("j", 0, compute=0.4, comm=0.1, ts=0.0)]
    fleet.ingest(a.report(0.0), 0.0)
    a.ranks = [rank_summary("j", 0, compute=0.4, comm=0.1, ts=2.5, state="exited")]
    fleet.ingest(a.report(2.5), 2.5)
    left = fleet.view().nodes["a"].revision
    b.ranks = [rank_summary("j", 0, compute=0.4, comm=0.1, ts=5.0)]
    fleet.ingest(b.report(5.0), 5.0)
    view = fleet.view()
    assert view.jobs["j"].ranks[0].node == "b" and ("j", 0) not in view.nodes["a"].ranks
    assert view.nodes["a"].revision == view.nodes["b"].revision > left


def test_membership_and_window_markers() -> None:
    fleet = Fleet(FleetConfig())
    a, b = FakeNode("a"), FakeNode("b")
    t = 0.0

    def step(node: FakeNode, ranks: list[int], window_end: float | None = None) -> None:
        node.ranks = [rank_summary("j", r, compute=0.4, comm=0.1, ts=t) for r in ranks]
        if window_end is not None:
            node.ranks = [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__},
                                         "window_end_ts": window_end}) for s in node.ranks]
        fleet.ingest(node.report(t), t)

    step(a, [0, 1])
    job = fleet.view().jobs["j"]
    joined = job.members_revision
    assert joined > 0
    t += 2.5
    step(a, [0, 1])  # the same ranks again: membership stays, the summaries changed
    assert job.members_revision == joined
    t += 2.5
    step(b, [2])  # a rank joins from another node
    assert job.members_revision > joined
    joined = job.members_revision
    fleet.forget_departed(t + 10**6, after_seconds=lambda n: 1.0 if n.name == "b" else 10.0**9)
    assert job.members_revision > joined and 2 not in job.ranks  # its node was forgotten
    rank = job.ranks[0]
    count = rank.window_count
    t += 2.5
    step(a, [0, 1], window_end=t)
    assert rank.window_count == count + 1 and len(rank.windows) >= 1
    t += 2.5
    step(a, [0, 1], window_end=t - 2.5)  # the same window repeated: stored once
    assert rank.window_count == count + 1
    view = fleet.view()
    assert view.revision == fleet.revision and view.fleet is fleet.identity
    assert view.without_markers().revision is None


def _shape(listing: dict[str, dict[str, JobNode]]) -> dict[str, dict[str, tuple[int, list[int]]]]:
    """A listing by object identity: which node state and which GPU histories, per job and node."""
    return {job: {name: (id(entry.node), [id(g) for g in entry.gpus]) for name, entry in nodes.items()}
            for job, nodes in listing.items()}


def test_job_nodes_kept_across_evaluations_is_the_listing_made_afresh() -> None:
    """JobNodes' listing against job_nodes' every step, over GPU job attribution changing (whole
    and compact reports), a GPU replaced, nodes joining and forgotten."""
    rng = random.Random(3)
    fleet = Fleet()
    nodes = [FakeNode(f"n{i}", gpus=4, ports=1) for i in range(6)]
    last: dict[str, Report] = {}
    kept = JobNodes()
    listings = set()
    t = 0.0
    for _ in range(300):
        t += 2.5
        for node in nodes:
            roll = rng.random()
            if roll < 0.05:
                node.gpus[rng.randrange(4)]["job"] = rng.choice(("a", "b", "c"))
            elif roll < 0.07:
                node.gpus[rng.randrange(4)].pop("job", None)
            elif roll < 0.075:
                node.gpus[rng.randrange(4)]["uuid"] = f"GPU-{rng.random()}"
            if node.name == "n5" and 100 < t < 200:
                continue  # silent, then forgotten, then back as new
            report = node.report(t)
            body = delta(whole(last[node.name]), whole(report)) if node.name in last and rng.random() < 0.7 \
                else None
            sent = decode_report(json.dumps({**body, "base_seq": last[node.name].seq})) if body is not None \
                else report
            fleet.ingest(sent, t)
            last[node.name] = report
        if t == 180.0:
            fleet.forget_departed(t, after_seconds=lambda n: 60.0)
        view = fleet.view()
        got = kept.of(view)
        assert _shape(got) == _shape(job_nodes(view)), t
        listings.add(id(got))
    assert 10 < len(listings) < 300  # listed again when attribution changed, kept otherwise
