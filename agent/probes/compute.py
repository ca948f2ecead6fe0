"""gpu_compute: a timed matmul burn on every GPU (all at once where the engine drives them
concurrently), ``burn_passes`` passes of ``burn_pass_seconds``, with the GPU's SM clock, power and
clock-event (throttle) reasons read through NVML while it works.

One result per GPU: the median TFLOP/s of the passes, their coefficient of variation, the lowest
and median SM clock, the highest power and the share of samples each throttle reason was set in.
It fails on its own only on what needs no baseline: hardware slowdown under load, or passes that
disagree beyond a sanity bound; judging the TFLOP/s is contract/probe_baselines.py's.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

from vigil.agent.probes.context import ProbeContext
from vigil.agent.probes.engine import AllocationError, per_gpu, usable_engine
from vigil.contract.wire import ProbeResult, ProbeStatus

# Clock-event reasons that fail the burn (PynvmlBackend.reason_names' names). NVML API reference,
# nvmlClocksEventReasons: HW Slowdown (0x8) "is engaged ... an indicator of: temperature being too
# high, External Power Brake Assertion is triggered (e.g. by the system power supply), Power draw
# is too high and Fast Trigger protection is reducing the clocks"; HW Thermal Slowdown (0x40)
# "temperature being too high"; HW Power Brake Slowdown (0x80) "External Power Brake Assertion
# being triggered". Each halves the clocks or worse: a cooling, board or power-supply fault.
FAILING_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
# Recorded, never failing: SW Power Cap (0x4) is where a healthy H100/H200 sits under a bf16 burn
# (0.98-0.99 of its 700 W limit at 0.70-0.80 of its top clock: tests/fixtures/nvml-real*/), and SW
# Thermal Slowdown (0x20) keeps the GPU under its target temperature on a hot but working board.
RECORDED_REASONS = (*FAILING_REASONS, "sw_power_cap", "sw_thermal_slowdown")
# NVML: HW Slowdown "may be also reported during PState or clock change", so one sample is a
# transition; a failing reason must be seen in at least this many samples of the burn.
THROTTLE_SAMPLES_MIN = 2
# NVML is read at most this often per GPU during a burn (plus at every pass's start): a read takes
# a few ms on a real H100 (tests/fixtures/nvml-real/), 1% of the burn at this cadence.
SAMPLE_INTERVAL_SECONDS = 0.5
# ``--quick``: a screen, not a verdict.
QUICK_PASSES = 2
QUICK_PASS_SECONDS = 1.0


@dataclass
class _Samples:
    """What NVML showed during one GPU's burn."""

    sm_clock_mhz: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> samples it was set in
    count: int = 0
    health: str = "ok"  # the worst NVML health seen (a GPU lost under load)
    next_at: float = float("-inf")


def run(ctx: ProbeContext) -> list[ProbeResult]:
    engine = usable_engine(ctx, "gpu_compute")
    if isinstance(engine, list):
        return engine
    config = ctx.config
    passes = QUICK_PASSES if ctx.quick else config.burn_passes
    seconds = min(QUICK_PASS_SECONDS, config.burn_pass_seconds) if ctx.quick else config.burn_pass_seconds
    nvml_lock = threading.Lock()  # one NVML read at a time from this probe's threads
    return per_gpu(engine, ctx.gpus, lambda gpu: _burn(ctx, gpu, passes, seconds, nvml_lock))


def _read(ctx: ProbeContext, gpu: int, samples: _Samples, lock: threading.Lock, force: bool) -> None:
    """One NVML read of the loaded GPU, at most every SAMPLE_INTERVAL_SECONDS unless forced."""
    nvml = ctx.nvml
    if nvml is None:
        return
    now = ctx.clock()
    if not force and now < samples.next_at:
        return
    samples.next_at = now + SAMPLE_INTERVAL_SECONDS
    with lock:
        reading = nvml.read(gpu, slow=False)
        names = nvml.reason_names(reading.clock_event_reasons) if reading.clock_event_reasons is not None else []
    samples.count += 1
    if reading.health != "ok":
        samples.health = reading.health
        return
    if reading.sm_clock_hertz is not None:
        samples.sm_clock_mhz.append(reading.sm_clock_hertz / 1e6)
    if reading.power_watts is not None:
        samples.power_w.append(reading.power_watts)
    for name in names:
        if name in RECORDED_REASONS:
            samples.reasons[name] = samples.reasons.get(name, 0) + 1


def _burn(ctx: ProbeContext, gpu: int, passes: int, seconds: float, lock: threading.Lock) -> ProbeResult:
    engine = ctx.engine
    assert engine is not None
    started = ctx.clock()
    samples = _Samples()
    tflops: list[float] = []
    stopped = ""
    for _ in range(passes):
        if ctx.clock() + seconds > ctx.deadline:
            stopped = "timeout"
            break
        first = [True]

        def sample(first: list[bool] = first) -> None:
            _read(ctx, gpu, samples, lock, force=first[0])
            first[0] = False

        try:
            tflops.append(engine.matmul_tflops(gpu, seconds, sample))
        except AllocationError as exc:
            return ProbeResult(probe="gpu_compute", gpu=gpu, status="fail", reason="alloc_failed",
                               detail=f"GPU {gpu}: the burn's matrices could not be allocated: {exc}",
                               seconds=ctx.clock() - started)
        except Exception as exc:  # noqa: BLE001 - a CUDA error is the probe's error, reported, not raised
            return ProbeResult(probe="gpu_compute", gpu=gpu, status="error", reason="engine_failed",
                               detail=f"GPU {gpu}: {type(exc).__name__}: {exc}", seconds=ctx.clock() - started)
    return _result(ctx, gpu, tflops, samples, passes, stopped, ctx.clock() - started)


def _result(ctx: ProbeContext, gpu: int, tflops: list[float], samples: _Samples, passes: int, stopped: str,
            elapsed: float) -> ProbeResult:
    engine_kind = ctx.engine.kind if ctx.engine is not None else ""
    metrics: dict[str, float] = {"passes": float(len(tflops)), "nvml_samples": float(samples.count)}
    value = statistics.median(tflops) if tflops else None
    cv = None
    if len(tflops) >= 2 and statistics.fmean(tflops) > 0:
        cv = statistics.stdev(tflops) / statistics.fmean(tflops)
        metrics["cv"] = cv
    if tflops:
        metrics["tflops_min"] = min(tflops)
    if samples.sm_clock_mhz:
        metrics["sm_clock_mhz_min"] = min(samples.sm_clock_mhz)
        metrics["sm_clock_mhz_median"] = statistics.median(samples.sm_clock_mhz)
    if samples.power_w:
        metrics["power_w_max"] = max(samples.power_w)
    for name in RECORDED_REASONS:
        if samples.count:
            metrics[f"throttle_{name}"] = samples.reasons.get(name, 0) / samples.count
    where = f"GPU {gpu} ({engine_kind})"

    def result(status: ProbeStatus, reason: str, detail: str) -> ProbeResult:
        return ProbeResult(probe="gpu_compute", gpu=gpu, status=status, reason=reason, detail=detail,
                           value=value, unit="tflops", metrics=metrics, seconds=elapsed)

    if stopped:
        return result("error", "timeout",
                      f"{where}: {len(tflops)} of {passes} passes before the probe's deadline")
    if samples.health != "ok":
        return result("fail", f"gpu_{samples.health}",
                      f"{where}: NVML reports the GPU {samples.health} under load")
    throttled = [name for name in FAILING_REASONS if samples.reasons.get(name, 0) >= THROTTLE_SAMPLES_MIN]
    if throttled:
        clock = f", SM clock down to {min(samples.sm_clock_mhz):.0f} MHz" if samples.sm_clock_mhz else ""
        return result("fail", "throttled",
                      f"{where}: {', '.join(throttled)} under load in "
                      f"{max(samples.reasons[n] for n in throttled)} of {samples.count} samples{clock}")
    bound = ctx.config.burn_cv_max
    # On the CPU engine (no GPU: torch on the host) the passes vary with the OS scheduler and every
    # other process, not with any hardware under test: the figure is recorded, never failed.
    if cv is not None and cv > bound and engine_kind != "cpu":
        return result("fail", "cv_high",
                      f"{where}: passes vary by {cv:.1%} (bound {bound:.0%}): "
                      + ", ".join(f"{t:.3g}" for t in tflops) + " TFLOP/s")
    return result("pass", "ok",
                      f"{where}: {value or 0:.4g} TFLOP/s median of {len(tflops)} passes")
