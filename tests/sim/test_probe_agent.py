"""The simulated agent's run_probes (sim/probes.py): signed results bound to the request, one per
probe and GPU, figures from the hardware model, and the faults only a probe sees (``probe_only``,
``probe_slow``) failing exactly the probes that load what is faulty. No simulation runs here."""

from __future__ import annotations

from typing import Any

import pytest

from vigil.contract.node_actions import node_key, result_signature_ok, sign
from vigil.contract.probe_baselines import ProbeBaselines, judge
from vigil.contract.wire import NodeActionRequest, ProbeGroup
from vigil.sim.probes import SimHardware, SimProbeAgent, figures, node_rng, probe_seconds
from vigil.sim.run import sim_master_key
from vigil.sim.scenario import ProbeSlow, ScenarioError, SimProbes, UnderLoad, parse_scenario

MASTER = sim_master_key(3)
NODE = "node-0001"
BOOT = "sim-3-000002"
NOW = 1_767_225_600.0 + 500.0
ALL_GPU_PROBES = ["gpu_compute", "gpu_memory", "gpu_p2p", "dcgm_diag"]


def request(probes: list[str], *, node: str = NODE, boot: str = BOOT, key: bytes | None = None,
            group: ProbeGroup | None = None) -> NodeActionRequest:
    req = NodeActionRequest(id="probe-recovery-abc", action="run_probes", node=node, boot_id=boot,
                            issued_at=NOW - 5, expires_at=NOW + 60, probes=probes,  # type: ignore[arg-type]
                            probe_group=group)
    return sign(req, key if key is not None else node_key(MASTER, node))


def hardware(*faults: Any, gpus: int = 8, hcas: int = 1, noise: float = 0.01, seed: int = 0) -> SimHardware:
    return SimHardware("h100-sxm-80gb", gpus, hcas, list(faults), 500.0, noise, node_rng(seed, 1))


def run(req: NodeActionRequest, hw: SimHardware, busbw: float | None = None) -> Any:
    agent = SimProbeAgent(NODE, MASTER, SimProbes(), node_rng(0, 1))
    assert agent.check(req, BOOT, NOW, busy=None) is None
    return agent.run(req, BOOT, NOW, hw, busbw)


def by(result: Any, probe: str) -> dict[int | None, Any]:
    return {p.gpu: p for p in result.probes if p.probe == probe}


def test_a_healthy_node_passes_every_probe_with_its_class_s_figures_signed_and_bound_to_the_request() -> None:
    result = run(request(ALL_GPU_PROBES), hardware())
    assert (result.id, result.action, result.outcome, result.node, result.boot_id) == (
        "probe-recovery-abc", "run_probes", "done", NODE, BOOT)
    assert result_signature_ok(result, node_key(MASTER, NODE))
    assert not result_signature_ok(result, node_key(MASTER, "node-0002"))  # another node's key cannot vouch
    # One result per probe and GPU (dcgm: per node), each passing on the agent's side.
    assert sorted(by(result, "gpu_compute")) == list(range(8)) == sorted(by(result, "gpu_memory"))
    assert list(by(result, "dcgm_diag")) == [None]
    assert {p.status for p in result.probes} == {"pass"}
    fig = figures("h100-sxm-80gb")
    for p in by(result, "gpu_compute").values():
        assert p.unit == "tflops" and abs(p.value - fig.matmul_tflops) < 0.05 * fig.matmul_tflops
        assert p.metrics["throttle_reasons"] == 0 and p.metrics["cv"] < 0.05
    for p in by(result, "gpu_memory").values():
        assert p.metrics["pattern_errors"] == 0 and abs(p.value - fig.copy_gb_per_s) < 0.05 * fig.copy_gb_per_s


def test_the_figures_are_the_datasheets_times_the_stated_achieved_fractions() -> None:
    h100, h200 = figures("h100-sxm-80gb"), figures("h200-sxm-141gb")
    assert h100.matmul_tflops == pytest.approx(989 * 0.70) and h200.matmul_tflops == h100.matmul_tflops
    assert h100.copy_gb_per_s == pytest.approx(3350 * 0.85) and h200.copy_gb_per_s == pytest.approx(4800 * 0.85)
    assert h100.p2p_gb_per_s == pytest.approx(450 * 0.82)


def test_a_marginal_hbm_stack_fails_only_its_gpu_s_pattern_test_and_dcgm() -> None:
    result = run(request(ALL_GPU_PROBES), hardware(UnderLoad(kind="probe_only", what="hbm", node=NODE, gpu=2,
                                                             at_seconds=100)))
    memory = by(result, "gpu_memory")
    assert (memory[2].status, memory[2].reason) == ("fail", "pattern_errors")
    assert memory[2].metrics["pattern_errors"] > 0
    assert {g for g, p in memory.items() if p.status == "fail"} == {2}
    assert {p.status for p in by(result, "gpu_compute").values()} == {"pass"}
    [dcgm] = by(result, "dcgm_diag").values()
    assert (dcgm.status, dcgm.reason) == ("fail", "diag_failed") and "Memory" in dcgm.detail


def test_a_gpu_that_throttles_at_full_power_fails_the_burn_with_its_throttle_reasons() -> None:
    result = run(request(["gpu_compute"]), hardware(UnderLoad(kind="probe_only", what="power", node=NODE, gpu=5,
                                                              at_seconds=0)))
    compute = by(result, "gpu_compute")
    bad = compute[5]
    assert (bad.status, bad.reason) == ("fail", "throttled")
    assert bad.metrics["throttle_reasons"] != 0 and bad.metrics["cv"] > 0.05  # clocks sag pass by pass
    assert bad.metrics["sm_clock_mhz"] < compute[0].metrics["sm_clock_mhz"]
    assert [g for g, p in compute.items() if p.status != "pass"] == [5]


def test_nvlink_that_errs_at_line_rate_fails_its_gpu_s_p2p_and_slows_a_collective() -> None:
    fault = UnderLoad(kind="probe_only", what="nvlink", node=NODE, gpu=3, at_seconds=0)
    result = run(request(["gpu_p2p"]), hardware(fault))
    p2p = by(result, "gpu_p2p")
    assert [g for g, p in p2p.items() if p.status == "fail"] == [3] and p2p[3].reason == "link_errors"
    # The others' median peer is healthy; their slowest peer is GPU 3.
    assert p2p[0].value > 2 * p2p[3].value and p2p[0].metrics["min_peer_gb_per_s"] < p2p[0].value / 2
    assert hardware(fault).collective_factor() < 1.0 == hardware().collective_factor()


def test_an_hca_that_errs_at_line_rate_shows_only_as_a_low_rate_for_the_baseline_to_judge() -> None:
    result = run(request(["rdma_bw"]), hardware(UnderLoad(kind="probe_only", what="rdma", node=NODE, at_seconds=0)))
    [rdma] = result.probes
    assert rdma.status == "pass" and rdma.unit == "gbit_per_s"  # ib_write_bw reports a rate, no errors
    baselines = ProbeBaselines.model_validate({"default": {"rdma_bw": {"min_value": 350}}})
    assert judge(rdma, baselines, None).reason == "below_baseline"
    [healthy] = run(request(["rdma_bw"]), hardware()).probes
    assert judge(healthy, baselines, None).passed


def test_a_sub_floor_slow_node_measures_a_few_percent_low_and_fails_only_a_baseline_between() -> None:
    slow = ProbeSlow(kind="probe_slow", factor=1.04, node=NODE, at_seconds=0)
    baselines = ProbeBaselines.model_validate({"classes": {"NVIDIA H100 80GB HBM3": {
        "gpu_compute": {"min_value": 675}}}})
    for seed in range(5):  # the same noise on both: only the slowness differs
        slow_run = run(request(["gpu_compute"]), hardware(slow, seed=seed))
        healthy_run = run(request(["gpu_compute"]), hardware(seed=seed))
        assert {p.status for p in slow_run.probes} == {"pass"}  # nothing the agent can see alone
        verdicts = [judge(p, baselines, "NVIDIA H100 80GB HBM3") for p in slow_run.probes]
        assert any(not v.passed and v.reason == "below_baseline" for v in verdicts)
        assert all(judge(p, baselines, "NVIDIA H100 80GB HBM3").passed for p in healthy_run.probes)


def test_a_fault_before_its_time_or_after_its_end_is_not_seen() -> None:
    late = UnderLoad(kind="probe_only", what="hbm", node=NODE, gpu=0, at_seconds=600)
    over = UnderLoad(kind="probe_only", what="hbm", node=NODE, gpu=0, at_seconds=0, until_seconds=400)
    for fault in (late, over):
        assert {p.status for p in run(request(["gpu_memory"]), hardware(fault)).probes} == {"pass"}


def test_the_agent_refuses_a_busy_node_a_forged_a_misdirected_and_a_stale_request_signed() -> None:
    agent = SimProbeAgent(NODE, MASTER, SimProbes(), node_rng(0, 1))
    key = node_key(MASTER, NODE)
    cases = {
        "busy": (request(["gpu_compute"]), "job pretrain holds the node's GPUs"),
        "bad_signature": (request(["gpu_compute"], key=bytes(32)), None),
        "wrong_node": (request(["gpu_compute"], node="node-0002"), None),
        "stale_boot": (request(["gpu_compute"], boot="sim-3-000001"), None),
    }
    for reason, (req, busy) in cases.items():
        refused = agent.check(req, BOOT, NOW, busy)
        assert refused is not None and (refused.outcome, refused.reason) == ("refused", reason)
        assert refused.probes == [] and result_signature_ok(refused, key)


def test_a_collective_without_its_group_met_is_an_error_not_a_verdict() -> None:
    group = ProbeGroup(group="g1", rank=1, world_size=4)
    [err] = run(request(["collective"], group=group), hardware()).probes
    assert (err.status, err.reason) == ("error", "timeout")
    [ok] = run(request(["collective"], group=group), hardware(), busbw=360.0).probes
    assert (ok.status, ok.value, ok.metrics["world_size"]) == ("pass", 360.0, 4)


def test_durations_add_up_in_the_order_the_probes_run_and_unknown_probes_are_refused() -> None:
    config = SimProbes(seconds={"gpu_compute": 20, "gpu_memory": 10})
    assert probe_seconds(request(["gpu_compute", "gpu_memory", "dcgm_diag"]), config) == 20 + 10 + 120
    with pytest.raises(ValueError, match="unknown probe"):
        SimProbes(seconds={"gpu_burn": 5})


def test_scenario_checks_the_probe_faults_targets() -> None:
    base: dict[str, Any] = {"duration_seconds": 60, "fleet": {"nodes": 2, "gpus_per_node": 2, "hcas_per_node": 1}}
    with pytest.raises(ScenarioError, match=r"faults\.0\.gpu"):
        parse_scenario({**base, "faults": [{"kind": "probe_only", "what": "hbm", "node": NODE, "gpu": 2,
                                            "at_seconds": 0}]})
    with pytest.raises(ScenarioError, match=r"faults\.0\.hca"):
        parse_scenario({**base, "faults": [{"kind": "probe_only", "what": "rdma", "node": NODE, "hca": 1,
                                            "at_seconds": 0}]})
    with pytest.raises(ScenarioError, match=r"faults\.0\.gpus"):
        parse_scenario({**base, "faults": [{"kind": "probe_slow", "node": NODE, "gpus": [], "at_seconds": 0}]})
    with pytest.raises(ScenarioError, match="what"):
        parse_scenario({**base, "faults": [{"kind": "probe_only", "what": "fans", "node": NODE, "at_seconds": 0}]})
