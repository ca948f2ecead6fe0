"""The reserved synthetic-node namespace: node names starting ``loadgen-`` are ``vigil loadgen``'s
phantoms, never a real node. It reads a report's node name and the aggregator's dry-run switch,
and decides whether such a report is refused (outside dry run) and when a synthetic node is
forgotten; it judges nothing: the engine keeps synthetic nodes in a fleet of their own that no
detector, breaker count, silence check or node listing reads (aggregator/engine.py).
"""

from __future__ import annotations

from vigil.contract.wire import SYNTHETIC_NODE_PREFIX as SYNTHETIC_PREFIX

# A synthetic node that missed REPORTS_MISSED of its own reports (FORGET_AFTER_SECONDS_MIN at
# least) is forgotten at the next evaluation (a real node is kept fleet.forget_after_seconds, a
# day): a load test that ended leaves nothing behind within seconds. Four reports: a generator's
# passing stall does not drop its nodes (one that did would only resend them whole: 409 delta_base).
REPORTS_MISSED = 4
FORGET_AFTER_SECONDS_MIN = 2.0
REFUSAL_REASON = "synthetic_node"  # vigil_aggregator_refusals_total{door="reports", reason}


def is_synthetic(node: str) -> bool:
    return node.startswith(SYNTHETIC_PREFIX)


def refusal(node: str, dry_run: bool) -> str | None:
    """Why a report of ``node`` is refused (None: it may be taken). Outside dry run a synthetic
    node is refused whatever its credential: an aggregator that acts never holds a node it does
    not judge, so no node, real or not, can hide from judging there."""
    if dry_run or not is_synthetic(node):
        return None
    return (f"{node!r} is in the reserved synthetic namespace {SYNTHETIC_PREFIX}* (vigil loadgen), taken only by "
            "an aggregator in dry run; this one acts")


def forget_after_seconds(interval_seconds: float) -> float:
    """How long a synthetic node reporting every ``interval_seconds`` may be silent before it is forgotten."""
    return max(FORGET_AFTER_SECONDS_MIN, REPORTS_MISSED * interval_seconds)

