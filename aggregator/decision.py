"""Decisions: what the aggregator concluded about a node, and what it proposes to do.

A detector returns ``Finding``s; the app turns each into a ``Decision`` with a stable id (the
idempotency key every actuator uses), which the gate admits or refuses. This module holds the
types only: no judgement, no I/O.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Action(StrEnum):
    """The closed set of actions (DESIGN.md section 3), in rising order of cost to the job."""

    OBSERVE = "observe"
    ALERT = "alert"
    RESTART_JOB = "restart_job"
    RESET_GPU = "reset_gpu"
    DRAIN = "drain"
    REBOOT_NODE = "reboot_node"
    INSPECT_HARDWARE = "inspect_hardware"
    RESUME = "resume"


# Actions that take capacity away from the scheduler: these are what the circuit breaker counts.
REMOVING_ACTIONS = frozenset({Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE})


class Finding(BaseModel):
    """A detector's conclusion about one subject. ``key`` distinguishes independent episodes of
    the same detector on the same subject (e.g. the Xid code); ``since`` is when the episode
    began, so re-evaluating the same episode yields the same decision id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    detector: str
    node: str
    action: Action
    reason: str
    since: float
    gpu: int | None = None
    job: str | None = None
    key: str = ""
    component: str | None = None  # a switch, rack or row, for topology findings
    evidence: dict[str, Any] = Field(default_factory=dict)
    # When the fault was last seen (the newest Xid line, ECC increase...), for detectors whose
    # episodes span repeats: a new occurrence well after the decision was made is a repeat.
    latest: float | None = None


class Decision(BaseModel):
    """The wire form (DESIGN.md section 6) handed to the gate, the store and the actuators."""

    model_config = ConfigDict(extra="forbid")

    id: str
    ts: float
    node: str
    action: Action
    reason: str
    detector: str
    gpu: int | None = None
    job: str | None = None
    component: str | None = None
    evidence: dict[str, Any] = Field(default_factory=dict)
    dry_run: bool = True
    # When the fault this decision answers began (the finding's ``since``); the gate's history
    # counts only earlier decisions made before it, not two readings of one event.
    since: float | None = None

    @classmethod
    def from_finding(cls, finding: Finding, now: float, dry_run: bool) -> Decision:
        return cls(
            id=decision_id(finding),
            ts=now,
            node=finding.node,
            action=finding.action,
            reason=finding.reason,
            detector=finding.detector,
            gpu=finding.gpu,
            job=finding.job,
            component=finding.component,
            evidence=dict(finding.evidence),
            dry_run=dry_run,
            since=finding.since,
        )


def decision_id(finding: Finding) -> str:
    """Stable across restarts and re-evaluations of one episode: a hash of what identifies it."""
    parts = (
        finding.detector,
        finding.node,
        str(finding.gpu),
        str(finding.job),
        finding.action.value,
        finding.key,
        f"{finding.since:.3f}",
    )
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]
