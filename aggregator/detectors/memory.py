"""Memory detector: GPU memory faults from ECC counters, row remapping and page retirement.

It reads each GPU's ECC counters (as deltas between reports of one boot), row-remap flags and
retired-page counts. Uncorrectable errors drain, a pending remap asks for a GPU reset, a failed
remap or the retired-page limit sends the GPU to hardware inspection, and a corrected-error rate
that jumps far above the GPU's own baseline drains it before it fails. It does not read Xids.
"""

from __future__ import annotations

from pydantic import Field

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.fleet import FleetView, GpuHistory, NodeState
from vigil.contract.validation import StrictModel

NAME = "memory"


class MemoryConfig(StrictModel):
    enabled: bool = True
    # Any uncorrectable (double-bit) error: the application on that GPU was killed (Xid 48/94/95).
    uncorrectable_window_seconds: float = Field(default=600.0, gt=0)
    uncorrectable_action: Action = Action.DRAIN
    # NVIDIA A100/H100 row remapping guide: a pending remap takes effect at the next GPU reset;
    # NVSentinel maps DCGM_FR_PENDING_ROW_REMAP to COMPONENT_RESET and ROW_REMAP_FAILURE to
    # CONTACT_SUPPORT (dcgmerrorsmapping.csv).
    remap_pending_action: Action = Action.RESET_GPU
    remap_failure_action: Action = Action.INSPECT_HARDWARE
    # NVIDIA Dynamic Page Retirement guide: at most 64 pages are retired per GPU and a board with
    # 60 or more retired pages qualifies for RMA (DCGM_FR_RETIRED_PAGES_LIMIT -> CONTACT_SUPPORT).
    retired_pages_limit: int = Field(default=60, ge=1)
    # DCGM_FR_DBE_PENDING_PAGE_RETIREMENTS -> RESTART (the retirement applies on reattach).
    retired_pending_action: Action = Action.RESET_GPU
    # Corrected-error surge: the rate over `recent_seconds` against the GPU's own rate over the
    # preceding history. A surge of corrected errors precedes uncorrectable ones on failing HBM
    # (Meta, "Llama 3 herd of models" sec. 3.3.4; Google, "DRAM errors in the wild", SIGMETRICS 2009).
    recent_seconds: float = Field(default=60.0, gt=0)
    surge_factor: float = Field(default=10.0, gt=1)
    surge_min_errors: int = Field(default=100, ge=1)
    # A GPU with no history yet is assumed to see at most one corrected error per hour.
    baseline_floor_per_second: float = Field(default=1.0 / 3600, gt=0)
    surge_action: Action = Action.DRAIN


class MemoryDetector:
    name = NAME

    def __init__(self, config: MemoryConfig) -> None:
        self.config = config
        # The nodes to walk (docs/detectors.md, "change markers"): those whose GPUs' fault flags
        # changed (gpu_faults_revision) or whose GPU counters moved since the last pass, and those
        # with a flag set or a counter moved within the window when last walked.
        self._walk = ChangedNodes("gpu_faults", "gpu_counters")

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        cfg = self.config
        # A GPU with no flag set and no counter moved within the longer window has no finding
        # (``_judge``'s tests, in the order that skips the healthy GPU soonest: most of the fleet).
        moved_after = now - max(cfg.uncorrectable_window_seconds, cfg.recent_seconds)
        retired_limit = cfg.retired_pages_limit
        # A node none of whose GPUs had anything to judge when last walked is not visited until
        # a fault flag changes or a counter moves (the journals); a view without them is walked whole.
        walk = self._walk
        for node in walk.start(view, now):
            flagged = False
            for gpu in node.gpus.values():
                state = gpu.last
                if not (gpu.counters.last_increase_ts >= moved_after or state.remap_failure or state.remap_pending
                        or state.retired_pages_pending or (state.retired_pages_sbe is not None and (
                            state.retired_pages_sbe + (state.retired_pages_dbe or 0)) >= retired_limit)):
                    continue
                flagged = True
                if gpu.last_seen < node.last_seen:
                    continue  # absent from the latest report: the silence detector's case
                out.extend(self._judge(node, gpu, now))
            if flagged:
                walk.again(node)
        return out

    def _since(self, gpu: GpuHistory, flag: str) -> float:
        since = gpu.last_seen
        for sample in reversed(gpu.samples):
            if not getattr(sample, flag):
                break
            since = sample.ts
        return since

    def _judge(self, node: NodeState, gpu: GpuHistory, now: float) -> list[Finding]:
        cfg = self.config
        state = gpu.last
        base = {"detector": NAME, "node": node.name, "gpu": gpu.index}
        out: list[Finding] = []
        remap_known = state.remap_failure or state.remap_pending
        if state.remap_failure:
            out.append(Finding(**base, action=cfg.remap_failure_action, since=self._since(gpu, "remap_failure"),
                               key="remap_failure", reason=f"GPU {gpu.index}: row remapping failed (no spare rows)",
                               evidence={"signal": "remap_failure", "uuid": gpu.uuid,
                                         "remapped_rows_uncorrectable": state.remapped_rows_uncorrectable}))
        elif state.remap_pending:
            out.append(Finding(**base, action=cfg.remap_pending_action, since=self._since(gpu, "remap_pending"),
                               key="remap_pending", reason=f"GPU {gpu.index}: row remap pending, needs a GPU reset",
                               evidence={"signal": "remap_pending", "uuid": gpu.uuid,
                                         "remapped_rows_uncorrectable": state.remapped_rows_uncorrectable}))
        retired = (state.retired_pages_sbe or 0) + (state.retired_pages_dbe or 0)
        if state.retired_pages_sbe is not None and retired >= cfg.retired_pages_limit:
            out.append(Finding(**base, action=Action.INSPECT_HARDWARE, since=gpu.first_seen, key="retired_limit",
                               reason=f"GPU {gpu.index}: {retired} retired pages (limit {cfg.retired_pages_limit})",
                               evidence={"signal": "retired_pages", "uuid": gpu.uuid, "retired_pages": retired}))
        elif state.retired_pages_pending:
            out.append(Finding(**base, action=cfg.retired_pending_action,
                               since=self._since(gpu, "retired_pages_pending"), key="retired_pending",
                               reason=f"GPU {gpu.index}: page retirement pending, needs a GPU reset",
                               evidence={"signal": "retired_pages_pending", "uuid": gpu.uuid}))
        moved = gpu.counters.last_increase_ts
        if not remap_known and moved >= now - cfg.uncorrectable_window_seconds:
            recent = gpu.counters.increases_since("ecc_uncorrected_volatile", now - cfg.uncorrectable_window_seconds)
            if recent:
                total = sum(d for _, d in recent)
                out.append(Finding(**base, action=cfg.uncorrectable_action, since=recent[0][0], key="uncorrectable",
                                   latest=recent[-1][0],
                                   reason=f"GPU {gpu.index}: {total:.0f} uncorrectable ECC errors",
                                   evidence={"signal": "ecc_uncorrected", "uuid": gpu.uuid, "errors": total,
                                             "window_seconds": cfg.uncorrectable_window_seconds}))
        surge = self._surge(gpu, now) if moved >= now - cfg.recent_seconds else None
        if surge is not None:
            out.append(Finding(**base, **surge))
        return out

    def _surge(self, gpu: GpuHistory, now: float) -> dict[str, object] | None:
        cfg = self.config
        counters = gpu.counters
        name = "ecc_corrected_volatile"
        split = now - cfg.recent_seconds
        recent = counters.increases_since(name, split)
        recent_errors = sum(d for _, d in recent)
        if recent_errors < cfg.surge_min_errors:
            return None
        first_error_ts = recent[0][0]
        start = counters.baseline_since(name)
        if start is None:
            return None
        baseline_seconds = split - start
        baseline_errors = counters.sum_since(name, start) - recent_errors
        baseline_rate = baseline_errors / baseline_seconds if baseline_seconds > 0 else 0.0
        baseline_rate = max(baseline_rate, cfg.baseline_floor_per_second)
        recent_rate = recent_errors / cfg.recent_seconds
        if recent_rate < cfg.surge_factor * baseline_rate:
            return None
        return {
            "action": cfg.surge_action, "since": first_error_ts, "key": "corrected_surge",
            "reason": (f"GPU {gpu.index}: corrected ECC rate {recent_rate:.2f}/s is "
                       f"{recent_rate / baseline_rate:.0f}x its baseline"),
            "evidence": {"signal": "ecc_corrected_rate", "uuid": gpu.uuid, "recent_errors": recent_errors,
                         "recent_rate_per_second": round(recent_rate, 4),
                         "baseline_rate_per_second": round(baseline_rate, 6)},
        }
