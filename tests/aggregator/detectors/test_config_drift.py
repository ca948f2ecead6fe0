"""The configuration drift detector: the odd node of a job is that node's drift; a job split by a
roll-out is one job-level alert with the mix and no node's fault; the site manifest; the lookalikes
(a consistent job, a 2-node split, a roll-out's odd node, a node in no job) do not blame a node."""

from typing import Any

import pytest

from tests.aggregator.conftest import FakeNode, proposals_ledger, rank_summary
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import WHOLE_JOB, Action
from vigil.aggregator.detectors.config_drift import ConfigDriftConfig, ConfigDriftDetector
from vigil.aggregator.engine import Engine
from vigil.aggregator.fleet import Fleet

H100 = "NVIDIA H100 80GB HBM3"
OLD, NEW = "535.161.08", "550.54.15"


def config(**changes: Any) -> dict[str, Any]:
    return {"driver_version": OLD, "cuda_driver_version": "12.2", "kernel": "5.15.0-105-generic",
            "gpu_model": H100, "gpu_count": 8, "vbios_version": "96.00.89.00.01", "ecc_mode": "enabled",
            "persistence_mode": "enabled", "power_limit_watts": 700.0, "hca_count": 8,
            "hca_link_rate_bits_per_second": 400e9, **changes}


def fleet_of(jobs: dict[str, int], odd: dict[str, dict[str, Any]] | None = None,
             spare: int = 0) -> list[FakeNode]:
    """Nodes of ``jobs`` (name -> node count), then ``spare`` nodes in no job; ``odd``: node -> config changes."""
    nodes = []
    for job, count in jobs.items():
        for i in range(count):
            node = FakeNode(f"{job}-n{i}", gpus=1, ports=0)
            node.ranks = [rank_summary(job, i, compute=0.8, comm=0.1, ts=0.0)]
            nodes.append(node)
    nodes += [FakeNode(f"spare-n{i}", gpus=1, ports=0) for i in range(spare)]
    for node in nodes:
        node.config = config(**(odd or {}).get(node.name, {}))
    return nodes


def judge(nodes: list[FakeNode], detector: ConfigDriftDetector | None = None, end: float = 700.0,
          each=None) -> list:
    detector = detector or ConfigDriftDetector(ConfigDriftConfig())
    fleet = Fleet()
    found: list = []
    t = 0.0
    while t <= end:
        for node in nodes:
            if each is not None:
                each(node, t)
            fleet.ingest(node.report(t), t)
        found = detector.evaluate(fleet.view(), t)
        t += 10.0
    return found


def test_one_node_with_another_driver_is_its_drift():
    nodes = fleet_of({"j1": 8}, odd={"j1-n3": {"driver_version": NEW}})
    [f] = judge(nodes)
    assert (f.node, f.action, f.key) == ("j1-n3", Action.ALERT, "config_drift")
    assert f.evidence["facts"] == [{"fact": "driver_version", "value": NEW, "peers": OLD, "job": "j1",
                                    "job_nodes": 8}]
    assert NEW in f.reason and OLD in f.reason


def test_two_odd_values_each_on_one_node_are_each_its_nodes_drift():
    nodes = fleet_of({"j1": 8, "j2": 8}, odd={"j1-n3": {"driver_version": NEW}, "j1-n5": {"driver_version": "999.1"}})
    found = judge(nodes)
    assert sorted((f.node, f.evidence["facts"][0]["value"]) for f in found) == [("j1-n3", NEW), ("j1-n5", "999.1")]


def test_the_usual_value_is_never_a_small_jobs_drift():
    # 2 of 3 nodes have an odd kernel: the third has the fleet's usual one, and is not blamed.
    odd = {"j1-n0": {"kernel": "6.8.0"}, "j1-n1": {"kernel": "6.8.0"}}
    found = judge(fleet_of({"j1": 3, "j2": 8}, odd=odd))
    assert [(f.node, f.job, f.key) for f in found] == [(WHOLE_JOB, "j1", "config_mix")]


def test_drift_waits_for_its_persistence():
    nodes = fleet_of({"j1": 8}, odd={"j1-n3": {"kernel": "6.8.0"}})
    assert judge(nodes, end=590.0) == []


def test_a_job_on_two_gpu_models_compares_class_facts_only_within_each_model():
    # A job on 6 H100 and 3 H200 nodes: the GPU model, VBIOS, power limit and clocks differ between
    # the classes by design and are never drift nor a mix; within the H200s, the one node with
    # another VBIOS is that node's drift; the driver is compared across the whole job.
    h200 = {"gpu_model": "NVIDIA H200", "vbios_version": "96.00.A5.00.01", "power_limit_watts": 700.0}
    odd = {f"j1-n{i}": dict(h200) for i in range(6, 9)}
    assert judge(fleet_of({"j1": 9}, odd=odd)) == []
    odd["j1-n8"] = {**h200, "vbios_version": "96.00.A5.00.07"}
    odd["j1-n1"] = {"driver_version": NEW}
    found = judge(fleet_of({"j1": 9}, odd=odd))
    assert sorted((f.node, [e["fact"] for e in f.evidence["facts"]]) for f in found) == [
        ("j1-n1", ["driver_version"]), ("j1-n8", ["vbios_version"])]


MI300X = "AMD Instinct MI300X"
AMDGPU = "6.8.5"


def mixed_vendor_job(nvidia: int, amd: int, odd: dict[str, dict[str, Any]] | None = None) -> list[FakeNode]:
    """One job j1 on ``nvidia`` H100 nodes then ``amd`` MI300X nodes (GpuState.vendor set on each GPU,
    the amdgpu driver and no CUDA on the AMD ones, the same kernel and RDMA stack), and a job j2 of 8
    H100 nodes."""
    nodes = fleet_of({"j1": nvidia + amd, "j2": 8})
    for i, node in enumerate(nodes):
        is_amd = node.name.startswith("j1-") and i >= nvidia
        for gpu in node.gpus.values():
            gpu.update(vendor="amd" if is_amd else "nvidia", name=MI300X if is_amd else H100)
        if is_amd:
            node.config = config(driver_version=AMDGPU, cuda_driver_version=None, gpu_model=MI300X,
                                 vbios_version="113-M3000100-102", power_limit_watts=750.0)
        node.config = {**node.config, **(odd or {}).get(node.name, {})}
    return nodes


def test_a_job_on_two_vendors_compares_drivers_only_within_each_vendor():
    # 6 H100 and 5 MI300X nodes in one job: NVIDIA's 535 and AMD's amdgpu 6.8.5 are both right
    # (before issue 46's follow-up, the 5 AMD nodes were 5/11 of the job: a config_mix "roll-out").
    assert judge(mixed_vendor_job(6, 5)) == []
    # A job mostly AMD with one NVIDIA node: the NVIDIA node's driver is no drift either.
    assert judge(mixed_vendor_job(1, 5)) == []


def test_drift_within_one_vendor_of_a_mixed_job_is_still_found():
    odd = {"j1-n7": {"driver_version": "6.10.5"}, "j1-n2": {"driver_version": NEW}}
    found = judge(mixed_vendor_job(6, 5, odd))
    assert sorted((f.node, f.key, f.evidence["facts"][0]["value"], f.evidence["facts"][0]["peers"])
                  for f in found) == [("j1-n2", "config_drift", NEW, OLD),
                                      ("j1-n7", "config_drift", "6.10.5", AMDGPU)]
    # The host's stack is still the whole job's: one AMD node on another kernel is its drift.
    [f] = judge(mixed_vendor_job(6, 5, {"j1-n8": {"kernel": "6.8.0"}}))
    assert (f.node, f.evidence["facts"][0]["fact"]) == ("j1-n8", "kernel")


def test_a_split_within_one_vendor_is_that_vendors_mix():
    # 3 of 5 AMD nodes upgraded: a roll-out on the AMD partition, named as such; NVIDIA's untouched.
    odd = {f"j1-n{i}": {"driver_version": "6.10.5"} for i in (6, 7, 8)}
    [f] = judge(mixed_vendor_job(6, 5, odd))
    assert (f.node, f.key) == (WHOLE_JOB, "config_mix")
    assert f.evidence["mix"] == {"driver_version (amd)": [["6.10.5", 3], [AMDGPU, 2]]}


def test_consistent_job_has_no_finding():
    assert judge(fleet_of({"j1": 8, "j2": 4})) == []


def test_staged_rollout_is_one_alert_per_job_with_the_mix_and_no_node_blamed():
    odd = {f"j{j}-n{i}": {"driver_version": NEW, "cuda_driver_version": "12.4"} for j in (1, 2) for i in range(4)}
    found = judge(fleet_of({"j1": 8, "j2": 8}, odd=odd))
    assert sorted((f.node, f.job, f.action, f.key) for f in found) == [
        (WHOLE_JOB, "j1", Action.ALERT, "config_mix"), (WHOLE_JOB, "j2", Action.ALERT, "config_mix")]
    mix = found[0]
    assert f"driver_version {NEW} on 4 nodes, {OLD} on 4 nodes" in mix.reason or \
        f"driver_version {OLD} on 4 nodes, {NEW} on 4 nodes" in mix.reason
    assert "cuda_driver_version" in mix.reason


def test_rollout_value_held_by_the_fleet_is_no_nodes_drift_even_as_a_jobs_odd_one():
    # Half the fleet has the new driver; j3 happens to have one new node among 10.
    odd = {f"j1-n{i}": {"driver_version": NEW} for i in range(10)}
    odd["j3-n0"] = {"driver_version": NEW}
    found = judge(fleet_of({"j1": 10, "j2": 9, "j3": 10}, odd=odd))
    assert [(f.node, f.job, f.key) for f in found] == [(WHOLE_JOB, "j3", "config_mix")]


def test_two_node_split_names_no_node():
    found = judge(fleet_of({"j1": 2}, odd={"j1-n1": {"ecc_mode": "disabled"}}))
    assert [(f.node, f.key) for f in found] == [(WHOLE_JOB, "config_mix")]


def test_a_node_in_no_job_is_not_compared_with_anyone():
    assert judge(fleet_of({"j1": 4}, spare=3, odd={"spare-n0": {"driver_version": NEW}})) == []


def test_facts_mixed_within_a_node_are_its_finding():
    [f] = judge(fleet_of({"j1": 4}, odd={"j1-n2": {"mixed": ["vbios_version"]}}))
    assert (f.node, f.key, f.action) == ("j1-n2", "config_mixed", Action.ALERT)


def test_manifest_shortfall_drains_per_policy():
    cfg = ConfigDriftConfig(manifest={H100: {"gpu_count": 8, "hca_count": 8, "hca_link_rate_bits_per_second": 400e9,
                                             "gpu_pcie_generation": 5, "gpu_pcie_width": 16,
                                             "driver_versions": [OLD]}})
    nodes = fleet_of({"j1": 4}, spare=2, odd={"spare-n1": {"gpu_count": 7, "hca_link_rate_bits_per_second": 200e9}})
    nodes[0].gpus[0].update(pcie_link_generation_max=4, pcie_link_width_max=16)
    found = judge(nodes, ConfigDriftDetector(cfg), end=100.0)
    by_node = {f.node: f for f in found}
    assert set(by_node) == {"spare-n1", "j1-n0"} and {f.action for f in found} == {Action.DRAIN}
    assert "gpu_count 7 (expected 8)" in by_node["spare-n1"].reason
    assert "hca_link_rate_bits_per_second 2e+11 (expected 4e+11)" in by_node["spare-n1"].reason
    assert "GPU 0 PCIe max Gen4 x16 (expected Gen5 x16)" in by_node["j1-n0"].reason


def test_drift_can_drain_and_the_mix_never_removes():
    cfg = ConfigDriftConfig(action="drain")
    [f] = judge(fleet_of({"j1": 8}, odd={"j1-n0": {"power_limit_watts": 500.0}}), ConfigDriftDetector(cfg))
    assert f.action is Action.DRAIN
    with pytest.raises(ValueError):
        ConfigDriftConfig(mix_action="drain")
    with pytest.raises(ValueError, match="unknown fact"):
        ConfigDriftConfig(facts=["driver"])


def test_engine_decides_the_mix_once_with_a_stable_id():
    engine = Engine(parse_config({}), proposals_ledger())
    odd = {f"j1-n{i}": {"driver_version": NEW} for i in range(16)}
    nodes = fleet_of({"j1": 32}, odd=odd)
    admitted = []
    t = 0.0
    while t <= 900.0:
        for node in nodes:
            engine.ingest(node.report(t), t)
        admitted += [d for d in engine.evaluate(t) if d.detector == "config_drift"]
        t += 10.0
    assert [(d.node, d.job, d.action) for d in admitted] == [(None, "j1", Action.ALERT)]
    assert f"driver_version {NEW} on 16 nodes, {OLD} on 16 nodes" in admitted[0].reason \
        or f"driver_version {OLD} on 16 nodes, {NEW} on 16 nodes" in admitted[0].reason


def test_marked_and_unmarked_views_agree():
    odd = {"j1-n3": {"driver_version": NEW}, "j2-n0": {"kernel": "6.8.0"}, "j2-n1": {"kernel": "6.8.0"}}
    nodes = fleet_of({"j1": 8, "j2": 4}, odd=odd)
    fleet = Fleet()
    marked, plain = ConfigDriftDetector(ConfigDriftConfig()), ConfigDriftDetector(ConfigDriftConfig())
    keys: set[tuple[str, str]] = set()
    t = 0.0
    while t <= 700.0:
        if t == 300.0:
            nodes[5].config = config(driver_version="999.1")  # a change mid-way moves the markers
        if t == 400.0:  # a node leaves j2 for j1 (membership), another leaves the fleet's reports
            nodes[9].ranks = [rank_summary("j1", 8, compute=0.8, comm=0.1, ts=t)]
        if t == 500.0:
            fleet.forget_departed(t, lambda n: 0.0 if n.name == "j2-n3" else 1e9)
            nodes.pop()
        for node in nodes:
            fleet.ingest(node.report(t), t)
        view = fleet.view()
        found = marked.evaluate(view, t)
        assert found == plain.evaluate(view.without_markers(), t)
        keys.update((f.node, f.key) for f in found)
        t += 10.0
    # The twins agree on something: j1's odd driver, j2's 2-2 kernel split (a mix, no node blamed).
    assert keys == {("j1-n3", "config_drift"), (WHOLE_JOB, "config_mix")}, keys
