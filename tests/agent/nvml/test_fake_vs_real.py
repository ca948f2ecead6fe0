"""FakeNvml against the real GPUs it stands for, and the real agent's report against the detectors.

Each recorded board (an H100 and an H200, tests/agent/nvml/conftest.py's REAL_GPUS) is checked
against its fake: the profile answers, through the real backend, what the real board answered
(identity, memory, clocks, limits, what the board does not support, GPM); where the profile was
taken under the same driver as the recording, its thermal limits, reserve and strings too. The real
agent's report under a full tensor load (agent-state.json: SwPowerCap at 98-99% of the power limit,
SM clock at 0.70-0.80 of its maximum) is the lookalike a naive throttle rule would drain: replayed
for ten minutes across a job's nodes it must give the default detectors nothing, while the same
report with a thermal slowdown must drain. The real agent's report with a real training rank
(agent-state-training.json: StepTimer's CUDA events, 64-67 ms a step) is replayed as one
synchronous job across 8 nodes: its real spread drains nothing, one slower rank drains its node.
"""

from __future__ import annotations

import json
from typing import Any

import pynvml
import pytest

from tests.aggregator.conftest import proposals_ledger
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.engine import Engine
from vigil.contract.wire import Report, convert

from .conftest import REAL_GPUS, RealGpu


def _ops(gpu: RealGpu, op: str, phase: str | None = None) -> list[dict[str, Any]]:
    ops = json.loads((gpu.folder / "backend-ops.json").read_text())["ops"]
    return [o["result"] for o in ops if o["op"] == op and (phase is None or o["phase"] == phase)]


@pytest.fixture(scope="module")
def fake(real_gpu: RealGpu) -> PynvmlBackend:
    backend = PynvmlBackend(FakeNvml(load_node_scenario(real_gpu.scenario), clock=lambda: 0.0))
    backend.init()
    return backend


def _same_driver(gpu: RealGpu) -> bool:
    """Whether the profile was taken under the recording's driver (then every limit it prints must
    be the real one; under another driver only their order is comparable)."""
    [real] = _ops(gpu, "identity")
    return bool(real["driver_version"] == gpu.profile.driver_version)


def test_fake_identity_is_the_real_boards(real_gpu: RealGpu, fake: PynvmlBackend) -> None:
    [real] = _ops(real_gpu, "identity")
    got = fake.identity(0)
    keys = ["name", "memory_total_bytes", "sm_clock_max_hertz", "memory_clock_max_hertz",
            "memory_max_temperature_celsius"]
    if _same_driver(real_gpu):
        keys += ["slowdown_temperature_celsius", "shutdown_temperature_celsius", "gpu_max_temperature_celsius",
                 "vbios_version", "driver_version", "cuda_driver_version"]
    for key in keys:
        assert getattr(got, key) == real[key], key
    # The H100's recording has another driver (580) than its profile's 535 baseboard, which prints
    # other thermal limits; both must keep slowdown below shutdown and the order the thermal
    # detector relies on.
    assert got.slowdown_temperature_celsius is not None and got.shutdown_temperature_celsius is not None
    assert got.slowdown_temperature_celsius < got.shutdown_temperature_celsius
    assert real["slowdown_temperature_celsius"] < real["shutdown_temperature_celsius"]


def test_the_h200_profile_is_the_recorded_boards() -> None:
    """The H200 profile was taken from its recording (no other source had its reserve or limits):
    a later recording under another driver must update it, or move this row of REAL_GPUS."""
    assert _same_driver(REAL_GPUS["h200"])


def test_fake_answers_what_the_real_board_does_not_support(real_gpu: RealGpu, fake: PynvmlBackend) -> None:
    [real, *_] = _ops(real_gpu, "read", "idle")
    got = fake.read(0)
    for key in ("fan_speed_ratio", "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending"):
        assert real[key] is None and getattr(got, key) is None, key
    # Hopper answers GPM: the profile says so and the real reads carry the GPM ratios.
    assert real_gpu.profile.gpm_supported
    loaded = _ops(real_gpu, "read", "tensor")[-1]
    assert loaded["tensor_active_ratio"] is not None and loaded["sm_active_ratio"] is not None


def test_fake_memory_reserve_and_video_engines_answer_as_the_real_board(real_gpu: RealGpu,
                                                                         fake: PynvmlBackend) -> None:
    """The reserve, encoder and decoder answers the real board gave NVML. The reserve is the same at
    every load (H100 480 MiB, H200 615 MiB under driver 580); the H100 profile's driver 535 reserves
    551 MiB (its own recording, test_profiles.py), the H200 profile is its recording's. Both answer
    the video engines with 0 %, never NotSupported, though neither board has NVENC (over a
    100,000 us sampling period)."""
    reads = _ops(real_gpu, "read")
    got = fake.read(0)
    reserve = reads[0]["memory_reserved_bytes"]
    for real in reads:
        assert real["encoder_utilization_ratio"] == got.encoder_utilization_ratio == 0.0
        assert real["decoder_utilization_ratio"] == got.decoder_utilization_ratio == 0.0
        assert real["memory_reserved_bytes"] == reserve
        # v1's used counts the reserve: the idle real GPU "uses" exactly its reserve.
        assert real["memory_used_bytes"] >= real["memory_reserved_bytes"]
    assert reads[0]["memory_used_bytes"] == reserve
    assert got.memory_reserved_bytes is not None
    if _same_driver(real_gpu):
        assert got.memory_reserved_bytes == reserve
    else:
        assert 0.5 < got.memory_reserved_bytes / reserve < 1.5


def test_fake_raw_answers_have_the_real_boards_shape(real_gpu: RealGpu) -> None:
    """Below the backend: the fake's own answers to the calls whose extra fields the backend does not
    read, against the real GPU's recorded answers. The video engines answer [percent, sampling
    period us] (the real ones: [0, 100000]); MIG mode [current, pending]; memory v2 keeps
    free + used + reserved == total and v1's `used` is v2's `used` plus the reserve, as on the GPU."""
    calls = json.loads((real_gpu.folder / "nvml-recording.json").read_text())["calls"]

    def real(name: str) -> list[Any]:
        return [c["result"] for c in calls if c["call"] == name and "result" in c]

    nvml = FakeNvml(load_node_scenario(real_gpu.scenario), clock=lambda: 100.0, start=0.0)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    for name in ("nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization", "nvmlDeviceGetMigMode"):
        assert real(name) and all(answer == getattr(nvml, name)(handle) for answer in real(name)), name
    memory = real("nvmlDeviceGetMemoryInfo")
    v1 = [m for m in memory if "reserved" not in m]
    v2 = [m for m in memory if "reserved" in m]
    assert v1 and v2 and v1[0]["used"] == v2[0]["used"] + v2[0]["reserved"] and v1[0]["free"] == v2[0]["free"]
    assert all(m["free"] + m["used"] + m["reserved"] == m["total"] for m in v2)
    f1 = nvml.nvmlDeviceGetMemoryInfo(handle)
    f2 = nvml.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2)
    assert f1.used == f2.used + f2.reserved and f1.free == f2.free and f1.total == f2.total
    assert f2.free + f2.used + f2.reserved == f2.total
    nvml.nvmlShutdown()


def test_fake_loaded_power_and_clocks_stay_in_the_real_range(real_gpu: RealGpu) -> None:
    profile = real_gpu.profile
    tensor = _ops(real_gpu, "read", "tensor")
    real_limit_w = tensor[0]["power_limit_watts"]
    assert profile.power_limit_mw / 1000 == real_limit_w
    # A healthy loaded board draws close to its limit (real: 685-694 W of 700 W under bf16 matmul);
    # the fake's busy draw must be a loaded GPU's, not an idle one's.
    real_busy_w = min(r["power_watts"] for r in tensor)
    assert 0.85 * real_busy_w <= profile.power_busy_mw / 1000 <= real_limit_w
    idle = _ops(real_gpu, "read", "idle")
    assert all(r["power_watts"] < 0.25 * real_limit_w for r in idle)
    assert profile.power_idle_mw / 1000 < 0.25 * real_limit_w
    # Idle, the SM clock drops to the idle clock: 345 MHz on both boards under driver 580, once
    # settled; the H100 profile's 535 baseboard printed 86 MHz.
    if _same_driver(real_gpu):
        assert idle[-1]["sm_clock_hertz"] == profile.sm_clock_idle_mhz * 1e6
    assert profile.sm_clock_idle_mhz * 1e6 <= idle[-1]["sm_clock_hertz"] < 0.25 * profile.sm_clock_max_mhz * 1e6


def test_the_fakes_training_node_is_capped_as_the_real_board_is(real_gpu: RealGpu) -> None:
    """The board's training scenario (scenarios/node/training-h100|h200.yaml: every GPU held by the
    software power cap) read through the backend as the real board read under bf16 load: the
    SwPowerCap reason, the SM clock inside the real loaded range, and the draw at the enforced
    limit like the real one's (a capped GPU that drew 70% of its limit, as the fake used to, is no
    capped GPU), moving between reads by a few watts as the real draw does."""
    real = _ops(real_gpu, "read", "tensor")[1:] + _real_report(real_gpu)["gpus"]
    limit_w = real_gpu.profile.power_limit_mw / 1000
    clock_ratios = [r["sm_clock_hertz"] / (real_gpu.profile.sm_clock_max_mhz * 1e6) for r in real]
    draws = [r["power_watts"] / limit_w for r in real]
    now = [100.0]
    nvml = FakeNvml(load_node_scenario(real_gpu.training_scenario), clock=lambda: now[0], start=0.0)
    backend = PynvmlBackend(nvml)
    backend.init()
    watts = set()
    for _ in range(8):
        now[0] += 2.0
        for i in range(backend.device_count()):
            got = backend.read(i)
            assert backend.reason_names(got.clock_event_reasons or 0) == ["sw_power_cap"]
            assert got.sm_clock_hertz is not None and got.power_watts is not None
            assert min(clock_ratios) - 0.02 <= got.sm_clock_hertz / (real_gpu.profile.sm_clock_max_mhz * 1e6) \
                <= max(clock_ratios) + 0.02
            assert min(draws) - 0.01 <= got.power_watts / limit_w <= min(1.0, max(draws) + 0.01)
            watts.add(got.power_watts)
    assert len(watts) > 8  # the draw moves between reads, as the real one does


def _as_today(report: dict[str, Any]) -> dict[str, Any]:
    """A recorded report in today's wire: the node's kernel and driver moved from HostFacts to
    NodeConfig (issue 44's contract), so the recorded host facts lose them (NodeConfig is left out,
    as a report whose configuration did not change leaves it out)."""
    host = report.get("host")
    if isinstance(host, dict):
        report["host"] = {k: v for k, v in host.items() if k not in ("kernel", "driver_version")}
    return report


def _real_report(gpu: RealGpu) -> dict[str, Any]:
    state = json.loads((gpu.folder / "agent-state.json").read_text())
    return _as_today(state["last_report"])


def _replay(gpu: RealGpu, nodes: int, minutes: float, edit: Any = None,
            config: AggregatorConfig | None = None) -> list[Decision]:
    """The real agent's report from `nodes` nodes every 2.5 s for `minutes`, judged by the
    default engine after each round as the service does; every decision it made."""
    base = _real_report(gpu)
    engine = Engine(config or AggregatorConfig(), proposals_ledger())
    decisions: list[Decision] = []
    t, seq = 1000.0, 0
    while t <= 1000.0 + minutes * 60:
        seq += 1
        for i in range(nodes):
            raw = json.loads(json.dumps(base))
            raw.update(node=f"gpu-{i:02d}", boot_id=f"boot-{i}", seq=seq, ts=t)
            if edit is not None:
                edit(i, raw)
            engine.ingest(convert(raw, Report), t)
        decisions.extend(engine.evaluate(t))
        t += 2.5
    return decisions


def test_a_real_board_at_full_tensor_load_drains_nothing(real_gpu: RealGpu) -> None:
    [gpu] = _real_report(real_gpu)["gpus"]
    # The lookalike: power-capped at 99% of its limit, clocked well below its maximum (H100: 0.72 in
    # the first recording, 0.75 in the second, 0.71-0.80 across its loaded reads; H200: 0.73).
    assert gpu["clock_event_reasons"] == ["sw_power_cap"]
    assert gpu["sm_clock_hertz"] / gpu["sm_clock_max_hertz"] < 0.85
    assert gpu["power_watts"] > 0.98 * gpu["power_limit_watts"]
    assert _replay(real_gpu, nodes=8, minutes=10) == []


def test_the_same_report_with_a_thermal_slowdown_drains(real_gpu: RealGpu) -> None:
    def hot(i: int, raw: dict[str, Any]) -> None:
        if i == 3:
            raw["gpus"][0]["clock_event_reasons"] = ["sw_power_cap", "hw_thermal_slowdown"]

    decisions = _replay(real_gpu, nodes=8, minutes=3, edit=hot)
    assert [(d.node, d.action, d.gpu) for d in decisions] == [("gpu-03", Action.DRAIN, 0)]


def test_the_lookalike_is_real_counting_power_cap_as_throttle_would_drain_it(real_gpu: RealGpu) -> None:
    """Why the thermal detector leaves SwPowerCap out: a rule that counted it would drain a
    healthy node (here one node, so no job-wide guard applies)."""
    naive = AggregatorConfig()
    naive.detectors.thermal.reasons.append("sw_power_cap")
    decisions = _replay(real_gpu, nodes=1, minutes=3, config=naive)
    assert [(d.node, d.action) for d in decisions] == [("gpu-00", Action.DRAIN)]


def _training_report(gpu: RealGpu) -> dict[str, Any]:
    state = json.loads((gpu.folder / "agent-state-training.json").read_text())
    return _as_today(state["last_report"])


def _replay_training(gpu: RealGpu, nodes: int, minutes: float, slow_node: int | None = None,
                     slow_factor: float = 1.0, edit: Any = None) -> list[Decision]:
    """The real agent's report with its real rank (a bf16 training loop timed by StepTimer's CUDA
    events, 64 ms a step), as rank i of one synchronous job on each of `nodes` nodes, every 2.5 s
    for `minutes`: each agent window (5 s) advances, the steps with it. With `slow_node`, that
    node's compute is `slow_factor` times longer and, the job being synchronous, every other rank
    waits that long in its collectives (comm), so every rank's step is the slow one's."""
    base = _training_report(gpu)
    [rank] = base["ranks"]
    window = rank["window_seconds"]
    engine = Engine(AggregatorConfig(), proposals_ledger())
    decisions: list[Decision] = []
    t0 = t = base["ts"]
    seq = 0
    while t <= t0 + minutes * 60:
        seq += 1
        shift = t - t0
        windows = int(shift // window)
        for i in range(nodes):
            raw = json.loads(json.dumps(base))
            raw.update(node=f"gpu-{i:02d}", boot_id=f"boot-{i}", seq=seq, ts=t)
            r = raw["ranks"][0]
            r.update(rank=i, pid=1000 + i, window_end_ts=rank["window_end_ts"] + windows * window,
                     last_progress_ts=rank["last_progress_ts"] + shift,
                     last_step=rank["last_step"] + int(shift / rank["step_seconds_p50"]))
            # Each node's window lands anywhere in the rank's real spread (p50..p90 of its CUDA-event
            # compute, 64.0-65.6 ms), a different place each window: the noise between nodes.
            spread = rank["compute_seconds_p90"] - rank["compute_seconds_p50"]
            r["compute_seconds_p50"] = rank["compute_seconds_p50"] + spread * ((i * 5 + windows * 3) % 8) / 7
            if slow_node is not None:
                for q in ("p50", "p90"):
                    compute = rank[f"compute_seconds_{q}"]
                    slow = compute * slow_factor
                    r[f"step_seconds_{q}"] = slow
                    r[f"compute_seconds_{q}"] = slow if i == slow_node else compute
                    r[f"comm_seconds_{q}"] = 0.0 if i == slow_node else slow - compute
            if edit is not None:
                edit(i, seq, raw)
            engine.ingest(convert(raw, Report), t)
        decisions.extend(engine.evaluate(t))
        t += 2.5
    return decisions


def test_a_real_training_rank_at_full_load_drains_nothing(real_gpu: RealGpu) -> None:
    """The real rank's own spread (its p50..p90 from CUDA events) as the noise between 8 nodes, for
    10 minutes: nothing."""
    [rank] = _training_report(real_gpu)["ranks"]
    assert rank["state"] == "running" and rank["steps"] > 50
    # GPU-bound: compute is the step. Each quantile is taken over its own samples, so the compute
    # p50 may pass the step's by a hair (the H200: 67.196 against 67.178 ms).
    assert 0.05 < rank["step_seconds_p50"] < 0.1
    assert abs(rank["compute_seconds_p50"] / rank["step_seconds_p50"] - 1) < 0.01
    assert _replay_training(real_gpu, nodes=8, minutes=10) == []


def test_the_same_job_with_one_rank_slower_drains_that_node_only(real_gpu: RealGpu) -> None:
    decisions = _replay_training(real_gpu, nodes=8, minutes=3, slow_node=5, slow_factor=1.25)
    assert decisions and {(d.node, d.action) for d in decisions} == {("gpu-05", Action.DRAIN)}


def test_real_capped_clocks_spread_across_a_job_flag_nothing(real_gpu: RealGpu) -> None:
    """The GPU-peer lookalike: a capped board's SM clock moves from read to read (the H100's
    1.35-1.58 GHz, the H200's 1.38-1.46 under the same load, 0.68-0.80 of the top clock), and
    boards of one model differ by as much. Each node's GPU of one job sits for good in its own part
    of that real range, the first node at its two lowest readings, the last at its two highest,
    alternating between them report by report, for ten minutes: nothing. The same with one GPU
    clocked 20% under its part of the range flags that node alone."""
    real = _ops(real_gpu, "read", "tensor") + _training_report(real_gpu)["gpus"]
    readings = sorted((r["sm_clock_hertz"], r["power_watts"]) for r in real)
    assert readings[-1][0] / readings[0][0] > 1.04  # the spread is real
    nodes = 8

    def spread(i: int, seq: int, raw: dict[str, Any]) -> None:
        low = round(i * (len(readings) - 2) / (nodes - 1))
        gpu = raw["gpus"][0]
        gpu["sm_clock_hertz"], gpu["power_watts"] = readings[low + seq % 2]

    assert _replay_training(real_gpu, nodes=nodes, minutes=10, edit=spread) == []

    def one_slow(i: int, seq: int, raw: dict[str, Any]) -> None:
        spread(i, seq, raw)
        if i == 2:
            raw["gpus"][0]["sm_clock_hertz"] *= 0.8

    decisions = _replay_training(real_gpu, nodes=nodes, minutes=3, edit=one_slow)
    assert decisions and {(d.node, d.action) for d in decisions} == {("gpu-02", Action.ALERT)}
