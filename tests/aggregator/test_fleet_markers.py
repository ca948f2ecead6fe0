"""The fleet's change markers (INCREMENTAL.md) move whenever what they stand for changed: a node's
hardware-class revision whenever a GPU's model, maximum SM clock or power limit changed or a GPU
history was replaced, in whole and compact reports alike (a compact entry carries only what changed,
or lists it as cleared); a job's membership revision whenever a rank joined, left or moved; a rank's
window count with each window appended. A marker that stayed while its state changed would leave an
incremental detector judging a stale cache."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from tests.aggregator.conftest import FakeNode, rank_summary
from vigil.agent.report_delta import delta, whole
from vigil.agent.wire import COMPACT_VERSIONS, Report, decode_report
from vigil.aggregator.fleet import Fleet, FleetConfig

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
    bodies = [whole(reports[0], version)]
    for before, now in pairwise(reports):
        body = delta(whole(before, version), whole(now, version))
        # A new GPU at an index changes the report's structure: the agent sends it whole.
        bodies.append(whole(now, version) if body is None else {**body, "base_seq": before.seq})
    return [decode_report(json.dumps(b)) for b in bodies]


def _class_fields(fleet: Fleet) -> tuple[tuple[str | None, float | None, float | None, str | None], ...]:
    node = fleet.view().nodes["n1"]
    return tuple((h.last.name, h.last.sm_clock_max_hertz, h.last.power_limit_watts, h.uuid)
                 for _, h in sorted(node.gpus.items()))


@pytest.mark.parametrize("version", [None, *COMPACT_VERSIONS], ids=lambda v: f"v{v or 1}")
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
    assert joined > 0 and job.revision >= joined
    t += 2.5
    step(a, [0, 1])  # the same ranks again: membership stays, the summaries changed
    assert job.members_revision == joined and job.revision > joined
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
