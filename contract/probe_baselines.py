"""Probe baselines and the one verdict both services give a probe's measurement: the aggregator
(recovery, suspects, group tests) and ``vigil check`` judge with the same code against the same
baselines.

It reads a ``ProbeResult`` (contract/wire.py), the baselines of the node's hardware class (from
configuration: ``probes.baselines``) and, where the aggregator has learned one, the fleet's own
figure for that class (the median of its passing probes). It returns pass or fail with the reason;
it runs nothing and learns nothing itself. ``slow_members`` reads every member's ``collective``
result of one group run and names the member(s) whose links are slow with every peer.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from vigil.contract.validation import StrictModel
from vigil.contract.wire import ProbeName, ProbeResult


class Baseline(StrictModel):
    """What one probe must reach on one hardware class."""

    # The probe's value (its unit: TFLOP/s, GB/s, Gb/s; higher is better) below this fails.
    min_value: float | None = Field(default=None, ge=0)
    # Any figure the probe records (``ProbeResult.metrics``) above its bound here fails, e.g.
    # {"cv": 0.05}: a burn whose passes vary by more than 5% (clocks sagging under load).
    max_metrics: dict[str, float] = Field(default_factory=dict)


class ProbeBaselines(StrictModel):
    """``probes.baselines``: per hardware class (the GPU model as NVML names it, e.g. "NVIDIA H100
    80GB HBM3"), per probe; ``default`` for a class not listed. Shared by the aggregator's config and
    ``vigil check --baselines``."""

    classes: dict[str, dict[ProbeName, Baseline]] = Field(default_factory=dict)
    default: dict[ProbeName, Baseline] = Field(default_factory=dict)
    # A learned figure (the median value of the class's passing probes) stands in for a missing
    # ``min_value``: a value more than this fraction below it fails. 10%: nccl-tests and matmul
    # burns repeat within a few percent on healthy hardware of one class.
    learned_tolerance: float = Field(default=0.10, gt=0, lt=1)
    # ...once at least this many passing probes of the class were seen (fewer say too little).
    learned_min_samples: int = Field(default=8, ge=2)

    def baseline(self, hardware_class: str | None, probe: ProbeName) -> Baseline | None:
        per_class = self.classes.get(hardware_class or "", {})
        return per_class.get(probe) or self.default.get(probe)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str  # ok, or the probe's own failure reason, below_baseline, below_learned, <metric>_high
    detail: str
    # The figure the value was held against (configured min_value or learned floor), if any.
    floor: float | None = None


def judge(result: ProbeResult, baselines: ProbeBaselines, hardware_class: str | None,
          learned_median: float | None = None, learned_samples: int = 0) -> Verdict:
    """The verdict on one probe result: the agent's own fail or error stands; ``skipped`` passes
    (no evidence either way: the caller decides whether a skipped probe may count); a pass is then
    held against the configured baseline, or the learned one where none is configured."""
    where = f"{result.probe}" + (f" on GPU {result.gpu}" if result.gpu is not None else "")
    if result.status in ("fail", "error"):
        return Verdict(False, result.reason or result.status, f"{where}: {result.detail or result.status}")
    if result.status == "skipped":
        return Verdict(True, "skipped", f"{where}: skipped ({result.reason or 'not applicable'})")
    base = baselines.baseline(hardware_class, result.probe)
    if base is not None:
        for metric, bound in sorted(base.max_metrics.items()):
            got = result.metrics.get(metric)
            if got is not None and got > bound:
                return Verdict(False, f"{metric}_high", f"{where}: {metric} {got:.4g} above {bound:.4g}")
    floor: float | None = None
    reason = "below_baseline"
    if base is not None and base.min_value is not None:
        floor = base.min_value
    elif learned_median is not None and learned_samples >= baselines.learned_min_samples:
        floor, reason = learned_median * (1.0 - baselines.learned_tolerance), "below_learned"
    if floor is not None and result.value is not None and result.value < floor:
        return Verdict(False, reason, f"{where}: {result.value:.4g} {result.unit} below {floor:.4g} "
                                      f"({'configured' if reason == 'below_baseline' else 'learned'} baseline)",
                       floor)
    return Verdict(True, "ok", f"{where}: {result.value if result.value is not None else '-'} {result.unit}", floor)


# A member is slow when the median of its pair bandwidths is below this fraction of the group's
# typical member (the median of the members' medians). One half: a link trained down to half its
# width or speed (4X to 2X, NDR to HDR), the smallest common degradation, halves what the pair
# moves, while healthy pairs of one fabric repeat within a few percent (nccl-tests' own tolerance:
# results vary by a few percent run to run); a healthy member paired once with a slow one keeps
# its median, since that is one pair of its n-1.
SLOW_PAIR_FRACTION = 0.5
# Below three members nobody can be named: with two, the one slow pair accuses both ends alike
# (the aggregator confirms such a pair against a known-healthy partner instead).
SLOW_MEMBERS_MIN_GROUP = 3


def slow_members(results: Mapping[str, ProbeResult]) -> list[str]:
    """The nodes whose links are slow with every peer while the group's other pairs are fine, from
    each member's ``collective`` result of one group run (by node). A pair's bandwidth is the
    lower of its two ends' ``peer_<rank>`` figures (either end alone where only one reported); a
    member is named when the median of its pairs is below ``SLOW_PAIR_FRACTION`` of the median of
    all members' medians. [] for a uniform group, fewer than ``SLOW_MEMBERS_MIN_GROUP`` members
    with figures, or results without pair figures. A member whose own result did not pass is never
    named here (its node is not known by rank), but its peers' figures about it still count."""
    rank_node: dict[int, str] = {}
    sides: dict[tuple[int, int], list[float]] = {}
    for node, result in results.items():
        if result.probe != "collective" or result.status != "pass" or "rank" not in result.metrics:
            continue
        rank = int(result.metrics["rank"])
        rank_node[rank] = node
        for name, gb_per_s in result.metrics.items():
            if name.startswith("peer_") and name[5:].isdigit():
                peer = int(name[5:])
                if peer != rank:
                    sides.setdefault((min(rank, peer), max(rank, peer)), []).append(gb_per_s)
    pairs = {pair: min(values) for pair, values in sides.items()}
    per_member: dict[int, list[float]] = {}
    for (a, b), gb_per_s in pairs.items():
        per_member.setdefault(a, []).append(gb_per_s)
        per_member.setdefault(b, []).append(gb_per_s)
    if len(per_member) < SLOW_MEMBERS_MIN_GROUP:
        return []
    medians = {rank: statistics.median(values) for rank, values in per_member.items()}
    typical = statistics.median(medians.values())
    slow = [rank for rank, median in medians.items() if median < SLOW_PAIR_FRACTION * typical]
    return sorted(rank_node[rank] for rank in slow if rank in rank_node)
