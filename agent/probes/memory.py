"""gpu_memory: per GPU, device-to-device copy bandwidth over ``probes.memory_bytes`` and a pattern
test over the same buffer (all zeros, all ones, 0x55.., 0xAA.., each word's own address and its
complement, written and read back), all GPUs at once where the engine drives them concurrently.

One result per GPU: ``value`` the copy bandwidth in GB/s (judged against the class baseline by
contract/probe_baselines.py); it fails on its own when a word reads back wrong (``pattern_errors``) or
the buffer cannot be allocated (``alloc_failed``). It does not read ECC counters (the GPU collector
does) and repairs nothing.
"""

from __future__ import annotations

from vigil.agent.probes.context import ProbeContext
from vigil.agent.probes.engine import AllocationError, per_gpu, usable_engine
from vigil.contract.wire import ProbeResult

# ``--quick``: at most this much per GPU (a 256 MiB copy takes ~0.2 ms on an H100's 3 TB/s HBM).
QUICK_BYTES = 256 << 20


def run(ctx: ProbeContext) -> list[ProbeResult]:
    engine = usable_engine(ctx, "gpu_memory")
    if isinstance(engine, list):
        return engine
    nbytes = min(ctx.config.memory_bytes, QUICK_BYTES) if ctx.quick else ctx.config.memory_bytes
    return per_gpu(engine, ctx.gpus, lambda gpu: _probe(ctx, gpu, nbytes))


def _probe(ctx: ProbeContext, gpu: int, nbytes: int) -> ProbeResult:
    engine = ctx.engine
    assert engine is not None
    started = ctx.clock()
    where = f"GPU {gpu} ({engine.kind})"

    def result(**fields: object) -> ProbeResult:
        return ProbeResult(probe="gpu_memory", gpu=gpu, unit="gb_per_s", seconds=ctx.clock() - started,
                           **fields)  # type: ignore[arg-type]

    if ctx.clock() >= ctx.deadline:
        return result(status="error", reason="timeout", detail=f"{where}: no time left before the deadline")
    try:
        gb_per_s = engine.copy_gb_per_s(gpu, nbytes)
        if ctx.clock() >= ctx.deadline:
            return result(status="error", reason="timeout", value=gb_per_s,
                          detail=f"{where}: the deadline passed before the pattern test")
        wrong = engine.pattern_errors(gpu, nbytes)
    except AllocationError as exc:
        return result(status="fail", reason="alloc_failed",
                      detail=f"{where}: {nbytes} bytes could not be allocated: {exc}")
    except Exception as exc:  # noqa: BLE001 - a CUDA error is the probe's error, reported, not raised
        return result(status="error", reason="engine_failed", detail=f"{where}: {type(exc).__name__}: {exc}")
    metrics = {"pattern_errors": float(wrong), "bytes": float(nbytes)}
    if wrong:
        return result(status="fail", reason="pattern_errors", value=gb_per_s, metrics=metrics,
                      detail=f"{where}: {wrong} words read back wrong in the pattern test")
    return result(status="pass", reason="ok", value=gb_per_s, metrics=metrics,
                  detail=f"{where}: {gb_per_s:.4g} GB/s copy, patterns read back intact")
