"""gpu_p2p: copy bandwidth between every ordered pair of the node's GPUs (peer to peer over NVLink
or PCIe where the hardware allows, through the host elsewhere), one pair at a time so that pairs
do not share links.

One result per source GPU: ``value`` its slowest pair in GB/s, ``metrics`` each pair as
``p2p_<src>_<dst>`` (a result holds at most 16 figures: one per peer fits a 16-GPU node, where
every pair in one result would not). Judging the figures is contract/probe_baselines.py's; with one
GPU there is nothing to measure (``skipped``).
"""

from __future__ import annotations

from vigil.agent.probes.context import ProbeContext
from vigil.agent.probes.engine import AllocationError, usable_engine
from vigil.contract.wire import ProbeResult

# Bytes per pair: 256 MiB moves in ~0.7 ms over an H100's NVLink (~370 GB/s one way), repeated for
# the engine's copy time; ``probes.memory_bytes`` if smaller.
PAIR_BYTES = 256 << 20
QUICK_PAIR_BYTES = 64 << 20


def run(ctx: ProbeContext) -> list[ProbeResult]:
    engine = usable_engine(ctx, "gpu_p2p", min_gpus=2)
    if isinstance(engine, list):
        return engine
    nbytes = min(ctx.config.memory_bytes, QUICK_PAIR_BYTES if ctx.quick else PAIR_BYTES)
    out = []
    for src in ctx.gpus:
        started = ctx.clock()
        pairs: dict[str, float] = {}
        failed: ProbeResult | None = None
        for dst in ctx.gpus:
            if dst == src:
                continue
            where = f"GPU {src} -> GPU {dst} ({engine.kind})"
            if ctx.clock() >= ctx.deadline:
                failed = ProbeResult(probe="gpu_p2p", gpu=src, status="error", reason="timeout",
                                     detail=f"{where}: no time left before the deadline")
                break
            try:
                pairs[f"p2p_{src}_{dst}"] = engine.p2p_gb_per_s(src, dst, nbytes)
            except AllocationError as exc:
                failed = ProbeResult(probe="gpu_p2p", gpu=src, status="fail", reason="alloc_failed",
                                     detail=f"{where}: {nbytes} bytes could not be allocated: {exc}")
                break
            except Exception as exc:  # noqa: BLE001 - a CUDA error is the probe's error, reported
                failed = ProbeResult(probe="gpu_p2p", gpu=src, status="error", reason="engine_failed",
                                     detail=f"{where}: {type(exc).__name__}: {exc}")
                break
        if failed is not None:
            failed.metrics = pairs
            failed.value = min(pairs.values()) if pairs else None
            failed.unit = "gb_per_s"
            failed.seconds = ctx.clock() - started
            out.append(failed)
            continue
        slowest = min(pairs, key=lambda k: pairs[k])
        out.append(ProbeResult(probe="gpu_p2p", gpu=src, status="pass", reason="ok", value=pairs[slowest],
                               unit="gb_per_s", metrics=pairs, seconds=ctx.clock() - started,
                               detail=f"GPU {src} ({engine.kind}): slowest pair {slowest} {pairs[slowest]:.4g} GB/s"))
    return out
