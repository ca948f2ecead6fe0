"""The simulated agent's side of active validation: run_probes answered from a hardware model.

It reads a signed ``run_probes`` request (contract/wire.py), the node's GPU model and its probe
faults (sim.scenario ``probe_only``, ``probe_slow``), and whether a job holds the node; it returns
the agent's ``NodeActionResult``, signed under the node key (contract/node_actions.py sign_result),
with one ``ProbeResult`` per probe (per GPU for the GPU probes) whose figures come from NVIDIA's
public specifications times an achieved fraction, with a little noise, degraded or failing where a
fault says so. It schedules nothing (sim/run.py delivers the result after the probes' simulated
duration), judges nothing against a baseline (contract/probe_baselines.py's ``judge`` does, in the
aggregator) and stands in for agent/probes/ and the runner's run_probes path: it does not run them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vigil.agent.probes import PROBES
from vigil.agent.probes.context import ProbesConfig
from vigil.contract.node_actions import node_key, sign_result, signature_ok
from vigil.contract.wire import NodeActionRequest, NodeActionResult, ProbeResult
from vigil.sim.scenario import ProbeSlow, SimProbes, UnderLoad

# The random stream of the probes' noise (apart from the jobs', the GPUs' and the phases').
_PROBE_STREAM = 0x5052_4F42


@dataclass(frozen=True)
class Figures:
    """What one healthy GPU of a model measures in the probes (higher is better)."""

    matmul_tflops: float  # the burn: dense BF16 matmul
    copy_gb_per_s: float  # device-to-device copy, read + write bytes
    p2p_gb_per_s: float  # one direction between two GPUs of the node
    sm_clock_mhz: float  # under the burn
    power_w: float  # under the burn


# Peak figures from NVIDIA's datasheets, times what a probe achieves of them (assumptions, stated
# here once): a large BF16 GEMM burn reaches ~70% of the dense tensor peak (H100 SXM: ~690 of 989
# TFLOP/s); a device-to-device copy ~85% of the HBM bandwidth; a P2P copy ~82% of NVLink's one
# direction (half the datasheet's bidirectional total). H100 SXM: 989 TFLOP/s dense BF16, 3.35 TB/s
# HBM3, NVLink 4 900 GB/s. H200: 989 TFLOP/s, 4.8 TB/s HBM3e, 900 GB/s. A100 SXM 80 GB: 312 TFLOP/s,
# 2,039 GB/s HBM2e, NVLink 3 600 GB/s. V100 SXM2: 125 TFLOP/s (FP16 tensor), 900 GB/s HBM2, NVLink 2
# 300 GB/s. Clocks and power under the burn: the profile's maximum SM clock and busy draw.
_MATMUL_FRACTION, _COPY_FRACTION, _P2P_FRACTION = 0.70, 0.85, 0.82
_PEAKS: dict[str, tuple[float, float, float]] = {  # profile -> (TFLOP/s, HBM GB/s, NVLink GB/s both ways)
    "h100-sxm-80gb": (989.0, 3350.0, 900.0),
    "h200-sxm-141gb": (989.0, 4800.0, 900.0),
    "a100-sxm-80gb": (312.0, 2039.0, 600.0),
    "v100-sxm2-32gb": (125.0, 900.0, 300.0),
}
# NDR InfiniBand (400 Gb/s) per HCA; ib_write_bw with large messages reaches ~97% of line rate.
RDMA_GBIT_PER_S = 400.0 * 0.97
# All-reduce bus bandwidth among 8-GPU nodes, one 400 Gb/s HCA per GPU (nccl-tests' busbw across
# nodes reaches ~90% of the NICs' aggregate: 8 x 50 GB/s x 0.9 = 360 GB/s; per HCA 45 GB/s).
COLLECTIVE_GB_PER_S_PER_HCA = 45.0

# What a fault does to the probes that see it (assumptions): a GPU that throttles at full power runs
# the burn at 75% of its clock, falling pass by pass; NVLink that errs at line rate replays until the
# copies reach 30%; an HCA that errs at line rate reaches 60% (ib_write_bw, and any collective it is
# in); a marginal HBM stack flips this many words per GiB of the pattern test.
POWER_THROTTLED_RATIO = 0.75
NVLINK_ERRING_RATIO = 0.30
RDMA_ERRING_RATIO = 0.60
HBM_ERRORS_PER_GIB = 16
# NVML's clocks-event reason bits (nvml.h): SW power cap 0x4, HW power brake slowdown 0x80.
_THROTTLE_POWER = 0x4 | 0x80


def figures(profile: str) -> Figures:
    from vigil.agent.nvml.profiles import PROFILES

    tflops, hbm, nvlink = _PEAKS[profile]
    p = PROFILES[profile]
    return Figures(matmul_tflops=tflops * _MATMUL_FRACTION, copy_gb_per_s=hbm * _COPY_FRACTION,
                   p2p_gb_per_s=nvlink / 2 * _P2P_FRACTION, sm_clock_mhz=float(p.sm_clock_max_mhz),
                   power_w=p.power_busy_mw / 1000.0)


class SimHardware:
    """One node's GPUs and HCAs under a probe's load: the agent's ComputeEngine protocol
    (agent/probes/engine.py) plus what NVML and perftest would show during the probe, from the
    profile's figures, the faults active at ``elapsed`` and the node's own noise stream."""

    kind = "sim"

    def __init__(self, profile: str, gpus: int, hcas: int, faults: Sequence[Any], elapsed: float,
                 noise: float, rng: np.random.Generator) -> None:
        self.figures = figures(profile)
        self.gpus = gpus
        self.hcas = hcas
        self._noise = noise
        self._rng = rng
        self.faults = [f for f in faults if f.at_seconds <= elapsed
                       and (f.until_seconds is None or elapsed < f.until_seconds)]

    def _jitter(self) -> float:
        return float(max(0.5, 1.0 + self._rng.normal(0.0, self._noise)))

    def _under_load(self, what: str, gpu: int | None = None, hca: int | None = None) -> bool:
        return any(isinstance(f, UnderLoad) and f.what == what and (gpu is None or f.gpu == gpu)
                   and (hca is None or f.hca == hca) for f in self.faults)

    def slow_factor(self, device: int) -> float:
        return math.prod(f.factor for f in self.faults
                         if isinstance(f, ProbeSlow) and (f.gpus is None or device in f.gpus))

    # -- the ComputeEngine protocol --------------------------------------------------------------

    def matmul_tflops(self, device: int, seconds: float, sag: float = 1.0) -> float:
        return self.figures.matmul_tflops * self._jitter() / self.slow_factor(device) * sag

    def copy_gb_per_s(self, device: int, nbytes: int) -> float:
        return self.figures.copy_gb_per_s * self._jitter()

    def pattern_errors(self, device: int, nbytes: int) -> int:
        return max(1, HBM_ERRORS_PER_GIB * nbytes >> 30) if self._under_load("hbm", gpu=device) else 0

    def p2p_gb_per_s(self, src: int, dst: int, nbytes: int) -> float:
        erring = self._under_load("nvlink", gpu=src) or self._under_load("nvlink", gpu=dst)
        return self.figures.p2p_gb_per_s * self._jitter() * (NVLINK_ERRING_RATIO if erring else 1.0)

    # -- what the node shows during a probe ------------------------------------------------------

    def power_throttled(self, device: int) -> bool:
        return self._under_load("power", gpu=device)

    def nvlink_erring(self, device: int) -> bool:
        return self._under_load("nvlink", gpu=device)

    def rdma_gbit_per_s(self, hca: int) -> float:
        return RDMA_GBIT_PER_S * self._jitter() * (RDMA_ERRING_RATIO if self._under_load("rdma", hca=hca) else 1.0)

    def collective_factor(self) -> float:
        """This node's share of a collective's speed: 1, or what its slowest link allows."""
        if self._under_load("rdma"):
            return RDMA_ERRING_RATIO
        return NVLINK_ERRING_RATIO if self._under_load("nvlink") else 1.0

    def dcgm_failures(self) -> list[str]:
        """The DCGM diagnostic tests that fail (a stress run loads the GPUs as a job does)."""
        out = []
        for f in self.faults:
            if isinstance(f, UnderLoad) and f.what in _DCGM_TEST:
                out.append(f"{_DCGM_TEST[f.what]} failed on GPU {f.gpu}")
        return out


# The dcgmi diag test that finds each under-load fault (DCGM user guide, "Diagnostic tests").
_DCGM_TEST = {"hbm": "Memory", "power": "Targeted Power", "nvlink": "NVLink"}


def probe_seconds(request: NodeActionRequest, config: SimProbes) -> float:
    """How long the request's probes take on the simulated clock: one after another."""
    return sum(config.duration(p) for p in request.probes)


class SimProbeAgent:
    """What one simulated node's agent does with a ``run_probes`` request: the checks a signed
    request gets (node, boot, validity, signature under the node key), a refusal while a job holds
    the node (every probe is intrusive), else the probes run on ``SimHardware`` and the signed
    result. ``rng``: the node's noise stream."""

    def __init__(self, node: str, master_key: bytes, config: SimProbes, rng: np.random.Generator) -> None:
        self.node = node
        self._key = node_key(master_key, node)
        self.config = config
        self._agent = ProbesConfig()  # the agent's default passes and buffers
        self.rng = rng

    def check(self, request: NodeActionRequest, boot_id: str, now: float, busy: str | None) -> NodeActionResult | None:
        """The refusal of ``request`` (signed), or None when it may run."""
        refusal: tuple[str, str] | None = None
        if request.node != self.node:
            refusal = ("wrong_node", f"addressed to {request.node}, this is {self.node}")
        elif request.boot_id != boot_id:
            refusal = ("stale_boot", f"issued for boot {request.boot_id}, this boot is {boot_id}")
        elif not request.issued_at - 60.0 <= now <= request.expires_at:
            refusal = ("expired", f"valid to {request.expires_at:.0f}, now {now:.0f}")
        elif not signature_ok(request, self._key):
            refusal = ("bad_signature", "signature does not verify under this node's key")
        elif busy is not None and any(PROBES[p].intrusive for p in request.probes):
            refusal = ("busy", busy)
        if refusal is None:
            return None
        return self._signed(request, boot_id, now, "refused", *refusal)

    def run(self, request: NodeActionRequest, boot_id: str, now: float, hardware: SimHardware,
            collective_gb_per_s: float | None = None) -> NodeActionResult:
        """The probes' results, signed, as of ``now`` (when the last probe finished).
        ``collective_gb_per_s``: the bus bandwidth the request's probe group reached (None: the
        group never met: an error)."""
        results: list[ProbeResult] = []
        for probe in request.probes:
            seconds = self.config.duration(probe)
            results.extend(self._probe(probe, request, hardware, seconds, collective_gb_per_s))
        return self._signed(request, boot_id, now, "done", "done", "", results)

    def _probe(self, probe: str, request: NodeActionRequest, hw: SimHardware, seconds: float,
               collective_gb_per_s: float | None) -> list[ProbeResult]:
        cfg = self._agent
        gpus = range(hw.gpus)
        if probe == "gpu_compute":
            return [self._burn(hw, g, seconds) for g in gpus]
        if probe == "gpu_memory":
            out = []
            for g in gpus:
                errors = hw.pattern_errors(g, cfg.memory_bytes)
                out.append(ProbeResult(
                    probe="gpu_memory", gpu=g, status="fail" if errors else "pass",
                    reason="pattern_errors" if errors else "ok",
                    detail=f"{errors} words differ in the pattern test" if errors else "",
                    value=round(hw.copy_gb_per_s(g, cfg.memory_bytes), 1), unit="gb_per_s",
                    metrics={"pattern_errors": errors}, seconds=seconds))
            return out
        if probe == "gpu_p2p":
            if hw.gpus < 2:
                return [ProbeResult(probe="gpu_p2p", status="skipped", reason="one_gpu", seconds=0.0)]
            out = []
            for g in gpus:
                peers = [hw.p2p_gb_per_s(g, d, cfg.memory_bytes) for d in gpus if d != g]
                erring = hw.nvlink_erring(g)
                out.append(ProbeResult(
                    probe="gpu_p2p", gpu=g, status="fail" if erring else "pass",
                    reason="link_errors" if erring else "ok",
                    detail="NVLink errors counted during the copies" if erring else "",
                    value=round(float(np.median(peers)), 1), unit="gb_per_s",
                    metrics={"min_peer_gb_per_s": round(min(peers), 1), "link_errors": 1000 if erring else 0},
                    seconds=seconds))
            return out
        if probe == "dcgm_diag":
            if not self.config.dcgm_installed:
                return [ProbeResult(probe="dcgm_diag", status="skipped", reason="not_installed",
                                    detail="dcgmi is not installed", seconds=0.0)]
            failures = hw.dcgm_failures()
            return [ProbeResult(probe="dcgm_diag", status="fail" if failures else "pass",
                                reason="diag_failed" if failures else "ok", detail="; ".join(failures),
                                metrics={"level": cfg.dcgm_level, "failed_tests": len(failures)}, seconds=seconds)]
        if probe == "rdma_bw":
            if hw.hcas == 0:
                return [ProbeResult(probe="rdma_bw", status="skipped", reason="no_hca", seconds=0.0)]
            rates = [hw.rdma_gbit_per_s(h) for h in range(hw.hcas)]
            # ib_write_bw sees no errors, only a rate: the baseline judges it.
            return [ProbeResult(probe="rdma_bw", status="pass", reason="ok", value=round(min(rates), 1),
                                unit="gbit_per_s", metrics={f"hca{h}_gbit_per_s": round(r, 1)
                                                            for h, r in enumerate(rates[:8])}, seconds=seconds)]
        assert probe == "collective", probe
        if request.probe_group is None:
            return [ProbeResult(probe="collective", status="error", reason="no_group",
                                detail="a collective needs a probe group", seconds=0.0)]
        if collective_gb_per_s is None:
            return [ProbeResult(probe="collective", status="error", reason="timeout",
                                detail="not every member of the group joined", seconds=seconds)]
        group = request.probe_group
        return [ProbeResult(probe="collective", status="pass", reason="ok", value=round(collective_gb_per_s, 1),
                            unit="gb_per_s", metrics={"world_size": group.world_size, "rank": group.rank},
                            seconds=seconds)]

    def _burn(self, hw: SimHardware, gpu: int, seconds: float) -> ProbeResult:
        """The timed matmul burn on one GPU: passes, their coefficient of variation, and the clocks,
        power and throttle reasons read during it. A GPU that throttles at full power sags pass by
        pass down to its throttled clock: the agent's absolute check (throttled under load) fails it."""
        passes = self._agent.burn_passes
        throttled = hw.power_throttled(gpu)
        sags = [1.0 - (1.0 - POWER_THROTTLED_RATIO) * k / (passes - 1) if throttled else 1.0 for k in range(passes)]
        values = [hw.matmul_tflops(gpu, seconds / passes, sag) for sag in sags]
        mean = sum(values) / len(values)
        cv = float(np.std(values)) / mean if mean > 0 else 0.0
        clock = hw.figures.sm_clock_mhz * (POWER_THROTTLED_RATIO if throttled else 1.0)
        return ProbeResult(
            probe="gpu_compute", gpu=gpu, status="fail" if throttled else "pass",
            reason="throttled" if throttled else "ok",
            detail="power throttling under load (clocks-event reasons SW power cap, HW power brake)" if throttled
            else "",
            value=round(mean, 1), unit="tflops",
            metrics={"cv": round(cv, 4), "passes": passes, "sm_clock_mhz": round(clock),
                     "power_w": round(hw.figures.power_w), "throttle_reasons": _THROTTLE_POWER if throttled else 0},
            seconds=seconds)

    def _signed(self, request: NodeActionRequest, boot_id: str, now: float, outcome: Any, reason: str,
                detail: str, probes: list[ProbeResult] | None = None) -> NodeActionResult:
        result = NodeActionResult(id=request.id, action=request.action, outcome=outcome, reason=reason, detail=detail,
                                  ts=now, probes=probes or [], node=self.node, boot_id=boot_id)
        return sign_result(result, self._key)


def node_rng(seed: int, index: int) -> np.random.Generator:
    """A node's probe-noise stream, fixed by the run's seed and the node's index."""
    return np.random.default_rng([seed, _PROBE_STREAM, index])
