"""Fleet scenario validation: key-path errors, node sets, components, shortened runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest

from vigil.sim.scenario import ScenarioError, load_scenario, parse_scenario, shipped_scenarios, shortened

BASE = {"duration_seconds": 600, "fleet": {"nodes": 64}}


def _bad(extra: dict, *, fleet: dict | None = None) -> str:
    data = {**BASE, **extra}
    if fleet is not None:
        data["fleet"] = fleet
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, "test.yaml")
    return str(err.value)


def test_typo_names_its_key_path() -> None:
    msg = _bad({}, fleet={"nodes": 4, "gpu_per_node": 8})
    assert "test.yaml" in msg and "fleet.gpu_per_node: unknown key" in msg


def test_wrong_type_names_the_fault_and_its_kind() -> None:
    msg = _bad({"faults": [{"kind": "slow_node", "node": "node-0001", "at_seconds": "soon"}]})
    assert "faults.0.slow_node.at_seconds" in msg


def test_unknown_fault_kind_lists_the_known_ones() -> None:
    msg = _bad({"faults": [{"kind": "gpu_on_fire", "node": "node-0001", "at_seconds": 1}]})
    assert "faults.0" in msg and "gpu_on_fire" in msg and "slow_node" in msg


def test_unknown_node_and_job_references() -> None:
    assert "faults.0.node: unknown node 'node-0099'" in _bad(
        {"faults": [{"kind": "silence", "node": "node-0099", "at_seconds": 1}]})
    assert "faults.0.job: unknown job 'nope'" in _bad(
        {"faults": [{"kind": "data_stall", "job": "nope", "at_seconds": 1, "extra_seconds": 1}]})
    assert "expect.0.node" in _bad({"expect": [{"node": "gpu-7", "action": "drain", "within_seconds": 9}]})
    assert "jobs.0.nodes" in _bad({"jobs": [{"name": "a", "step_seconds": 1, "nodes": "node-0010..node-0100"}]})


def test_nvml_fault_fields_are_checked_by_the_node_scenario_model() -> None:
    msg = _bad({"faults": [{"kind": "xid", "node": "node-0001", "at_seconds": 1, "gpu": 0}]})
    assert "faults.0.xid.code" in msg
    msg = _bad({"faults": [{"kind": "ecc_corrected_growth", "node": "node-0001", "at_seconds": 1, "gpu": 0,
                            "rate_per_second": 5, "colour": "red"}]})
    assert "faults.0.ecc_corrected_growth.colour: unknown key" in msg


def test_fault_needs_exactly_one_target_and_phases_sum_to_one() -> None:
    assert "exactly one of node, nodes, component" in _bad(
        {"faults": [{"kind": "silence", "node": "node-0001", "component": "rack-000", "at_seconds": 1}]})
    assert "must be 1" in _bad({"jobs": [{"name": "a", "step_seconds": 1, "phases": {"compute": 0.5}}]})


def test_ranges_components_and_fault_times() -> None:
    sc = parse_scenario({
        **BASE,
        "fleet": {"nodes": 64, "topology": {"nodes_per_rack": 4, "racks_per_row": 4, "nodes_per_leaf": 16}},
        "faults": [{"kind": "port_errors", "component": "leaf-001", "at_seconds": 100}],
        "expect": [{"component": "leaf-001", "action": "inspect_hardware", "within_seconds": 60},
                   {"node": "node-0020", "action": "alert", "within_seconds": 60}],
    })
    assert sc.resolve_nodes("node-0002..node-0005") == ["node-0002", "node-0003", "node-0004", "node-0005"]
    assert sc.topology_of(17) == {"row": "row-01", "rack": "rack-004", "leaf_switch": "leaf-001"}
    assert sc.fault_nodes(sc.faults[0]) == [f"node-{i:04d}" for i in range(16, 32)]
    assert sc.subject_fault_time(sc.expect[0]) == 100.0
    assert sc.subject_fault_time(sc.expect[1]) == 100.0  # a node under the faulty leaf


def test_shortened_drops_what_it_cannot_judge() -> None:
    sc = parse_scenario({
        **BASE,
        "faults": [{"kind": "silence", "node": "node-0001", "at_seconds": 100},
                   {"kind": "silence", "node": "node-0002", "at_seconds": 500}],
        "expect": [{"node": "node-0001", "action": "drain", "within_seconds": 60},
                   {"node": "node-0002", "action": "drain", "within_seconds": 60}],
    })
    short = shortened(sc, 300)
    assert short.duration_seconds == 300
    assert [f.node for f in short.faults] == ["node-0001"]
    assert [e.node for e in short.expect] == ["node-0001"]


def test_bad_yaml_file_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet: [unclosed\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", shipped_scenarios(), ids=lambda p: p.stem)
def test_every_shipped_scenario_loads_and_has_answers(path: Path) -> None:
    sc = load_scenario(path)
    assert sc.name == path.stem
    assert sc.description
    # a scenario without expectations must at least say that nothing may be drained
    assert sc.expect or not sc.faults or sc.expect_breaker != "any" or "no drain" in sc.description.lower()


# -- docs/simulator.md's fault table: every kind it documents is one the schema takes ----------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"


def _documented_fault_kinds() -> dict[str, list[str]]:
    """Each fault kind of docs/simulator.md's "Faults" table -> the fields the table names for it
    in parentheses (the NVML row lists its kinds as `kind` (`field`, ...)); other rows name their
    kind in the first column."""
    section = DOCS.read_text().split("\n## Faults", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    out: dict[str, list[str]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0].startswith("`"):
            out[cells[0].strip("`")] = []
            continue
        assert cells[0] == "NVML kinds", f"a row of the fault table that names no kind: {row}"
        for kind, fields in re.findall(r"`(\w+)`(?:\s*\(([^)]*)\))?", cells[2]):
            out[kind] = re.findall(r"`(\w+)`", fields or "")
    assert len(out) > 10, f"the fault table of {DOCS} was not found or changed shape: {sorted(out)}"
    return out


def _minimal_fault(kind: str, fields: list[str]) -> dict[str, Any]:
    """A fault of ``kind`` with each required field (and each documented one) given a value its
    model takes: 1 for numbers, the test's job for a job."""
    from vigil.agent.nvml import scenario as node_level
    from vigil.sim import scenario as fleet_level

    fault: dict[str, Any] = {"kind": kind, "at_seconds": 10, "node": "node-0001"}
    # An NVML kind's fields are the node-level model's (the one definition the simulator checks).
    union = node_level.Fault if kind in node_level.FAULT_KINDS else fleet_level.Fault
    members = get_args(get_args(union)[0])  # Annotated[A | B | ..., discriminator] -> (A, B, ...)
    model = next(m for m in members if kind in get_args(m.model_fields["kind"].annotation))
    required = [name for name, info in model.model_fields.items() if info.is_required()]
    # Fields whose model takes no 1: a probe_only's kind of load, a GPU list, the one HCA's index.
    values: dict[str, Any] = {"job": "train", "what": "hbm", "gpus": [1], "hca": 0, "event": "ras_uncorrectable"}
    for name in (*required, *fields):
        fault.setdefault(name, values.get(name, 1))
    # Kinds whose fields are each optional though one of them must be given.
    fault.update({"pcie_device": {"aer_severity": "nonfatal"}}.get(kind, {}))
    return fault


def test_every_fault_kind_in_the_docs_table_is_accepted() -> None:
    from vigil.agent.nvml.scenario import AMD_ONLY_FAULT_KINDS, FAULT_KINDS

    documented = _documented_fault_kinds()
    # Every node-level FakeNvml kind is documented, and every documented kind parses with the
    # fields the table names for it.
    assert set(FAULT_KINDS) <= set(documented), sorted(set(FAULT_KINDS) - set(documented))
    for kind, fields in documented.items():
        # An Ethernet (RoCE) fabric: roce_congestion needs it, the other kinds do not mind.
        fault = _minimal_fault(kind, fields)
        jobs: list[dict[str, Any]] = [{"name": "train", "step_seconds": 1.0}]
        if kind.startswith("uninstrumented_"):  # a fault of a job with no heartbeats, named by its Slurm id
            jobs = [{"name": "7001", "heartbeats": False, "step_seconds": 1.0}]
            fault["job"] = "7001"
            if kind == "uninstrumented_hang":
                del fault["node"]  # the whole job
        fleet: dict[str, Any] = {"nodes": 64, "link_layer": "Ethernet"}
        if kind in AMD_ONLY_FAULT_KINDS:  # a kind only an AMD board shows: an MI300X fleet
            fleet["profile"] = "mi300x-oam-192gb"
        data = {**BASE, "fleet": fleet, "jobs": jobs, "faults": [fault]}
        sc = parse_scenario(data, f"docs-{kind}.yaml")
        assert sc.faults[0].kind == kind
