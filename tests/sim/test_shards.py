"""sim/shards.py and `vigil sim --workers`: a healthy fleet cut by job, run apart, merged honestly;
refused for whatever needs one aggregator over the whole fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.sim.conftest import raw
from vigil.cli import main
from vigil.sim.run import SimDecision, run_scenario
from vigil.sim.scenario import ScenarioError, parse_scenario, shortened
from vigil.sim.score import score
from vigil.sim.shards import CAVEAT, fleet_decision, job_shards, named_shards, run_sharded, shard_refusal


def _healthy(seconds: float = 30.0) -> dict:
    data = shortened(parse_scenario(raw("healthy-2s5-fleet")), seconds).model_dump(exclude_none=True)
    return data


def test_shards_are_the_job_groups_renamed_from_zero_with_their_own_seeds() -> None:
    sc = parse_scenario(_healthy())
    shards = named_shards(sc)
    assert [s.name for s, _ in shards] == ["healthy-2s5-fleet-shard0", "healthy-2s5-fleet-shard1"]
    assert [s.seed for s, _ in shards] == [21000, 21001]
    assert [s.seed for s in job_shards(sc, seed=5)] == [5000, 5001]
    (a, names_a), (b, names_b) = shards
    assert names_a == [f"node-{i:04d}" for i in range(12)] and names_b == [f"node-{i:04d}" for i in range(12, 24)]
    assert b.node_names() == [f"node-{i:04d}" for i in range(12)]
    # node-0016..node-0023 are H200s: shard 1's nodes 4..11
    assert b.fleet.profiles[0].profile == "h200-sxm-141gb"
    assert b.resolve_nodes(b.fleet.profiles[0].nodes) == [f"node-{i:04d}" for i in range(4, 12)]
    assert not a.fleet.profiles
    assert [j.name for j in b.jobs] == ["llm-mixed"] and b.forbid == sc.forbid and b.max_removals == 0


def test_jobs_sharing_nodes_stay_together_and_a_bridging_job_joins_two_groups() -> None:
    data = _healthy()
    job = data["jobs"][0]
    data["jobs"] = [{**job, "name": "a", "nodes": "node-0000..node-0005"},
                    {**job, "name": "b", "nodes": "node-0010..node-0015"},
                    {**job, "name": "bridge", "nodes": ["node-0005", "node-0010"]},
                    {**job, "name": "apart", "nodes": "node-0016..node-0023"}]
    data["fleet"]["profiles"] = []
    data["jobs"] += [{**job, "name": "rest", "nodes": "node-0006..node-0009"}]
    shards = named_shards(parse_scenario(data))
    assert [sorted(j.name for j in s.jobs) for s, _ in shards] == [["a", "b", "bridge"], ["apart"], ["rest"]]
    assert shards[0][1] == [*(f"node-{i:04d}" for i in range(6)), *(f"node-{i:04d}" for i in range(10, 16))]


@pytest.mark.parametrize(("name", "why"), [("kernel-xid-79", "1 faults, 1 expectations"),
                                           ("remediation-reboot-fixes", "remediation"),
                                           ("breaker-storm", "faults")])
def test_refused_for_what_needs_the_whole_fleet(name: str, why: str) -> None:
    sc = parse_scenario(raw(name))
    refused = shard_refusal(sc)
    assert refused is not None and why in refused and CAVEAT in refused
    with pytest.raises(ScenarioError, match="cannot be run in shards"):
        job_shards(sc)


def test_refused_for_nodes_in_no_job_and_accepted_when_healthy() -> None:
    data = _healthy()
    data["jobs"] = data["jobs"][:1]
    assert "12 nodes in no job" in (shard_refusal(parse_scenario(data)) or "")
    assert shard_refusal(parse_scenario(_healthy())) is None


def test_merged_verdict_sums_node_days_and_unions_the_shards_decisions() -> None:
    # A trigger-happy straggler detector (any rank 0.1% off the median, one window) makes
    # decisions in a healthy fleet: the merged result holds each shard's, as each alone makes them.
    data = _healthy(40.0)
    data["aggregator"] = {"detectors": {"straggler": {"z_threshold": 0.5, "min_excess_ratio": 0.001,
                                                     "persistence_windows": 1, "max_outlier_node_share": 1.0}}}
    data["gate"] = {"breaker_max_share": 1.0}
    data["forbid"], data["max_removals"] = [], None
    sc = parse_scenario(data)
    merged = run_sharded(sc, workers=1)
    assert merged.node_days == pytest.approx(24 * 40.0 / 86400.0)
    assert merged.reports == 24 * 16
    # Each shard's start-up and first interval, and its closing and scoring after the last step, paid
    # once (bench_sim extrapolates the steps between): parts of its CPU, in that order.
    assert all(0.0 < s.start_cpu_seconds < s.steps_cpu_seconds < s.cpu_seconds for s in merged.shards)
    alone = [run_scenario(s) for s in job_shards(sc)]
    expected = sorted((d.t, d.node, d.job, d.action, f"healthy-2s5-fleet-shard{k}")
                      for k, r in enumerate(alone) for d in r.decisions)
    got = sorted((d["t"], d.get("node"), d.get("job"), d["action"], d["shard"]) for d in merged.to_json()["decisions"])
    assert got == expected and {g[-1] for g in got} == {"healthy-2s5-fleet-shard0", "healthy-2s5-fleet-shard1"}
    assert merged.false_removals == sum(len(score(r).false_removals) for r in alone) > 0
    assert merged.passed is False


def test_a_shards_node_decision_is_named_as_in_the_fleet_and_a_row_keeps_its_shard_name() -> None:
    back = {"node-0000": "node-0012", "node-0001": "node-0013"}
    drain = SimDecision(t=5.0, ts=5.0, id="", node="node-0001", action="drain", detector="straggler", reason="slow",
                        admitted=True, verdict="admitted")
    row = SimDecision(t=5.0, ts=5.0, id="", node="row-00", action="alert", detector="topology", reason="r",
                      admitted=True, verdict="admitted")
    assert fleet_decision(drain, "s1", back) == {**drain.to_json(), "node": "node-0013", "shard": "s1"}
    assert fleet_decision(row, "s1", back) == {**row.to_json(), "shard": "s1"}


def test_cli_workers_merges_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "h.yaml"
    path.write_text(yaml.safe_dump(_healthy(20.0)))
    assert main(["sim", "--scenario", str(path), "--json", "--workers", "2", "--progress-every", "-1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sharded"] and out["pass"] and out["caveat"] == CAVEAT and out["workers"] == 2
    assert [s["seed"] for s in out["shards"]] == [21000, 21001]
    assert out["node_days"] == round(24 * 20.0 / 86400.0, 3) and out["false_drains"] == 0
    fault = tmp_path / "x.yaml"
    fault.write_text(yaml.safe_dump(raw("kernel-xid-79")))
    assert main(["sim", "--scenario", str(fault), "--workers", "2"]) == 2
    assert "cannot be run in shards" in capsys.readouterr().err
