"""Decisions: what the aggregator concluded about a node or a job, and what it proposes to do.

A detector returns ``Finding``s; the app turns each into a ``Decision`` with a stable id (the
idempotency key every actuator uses), which the gate admits or refuses. A decision about a whole
job (a job stopped everywhere with no culprit) names the job and no node (``node`` is None): no
node is blamed, counted or acted on for it. This module holds the types only: no judgement, no I/O.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from vigil.contract.validation import MutableStrictModel, StrictModel


class Action(StrEnum):
    """The closed set of actions (DESIGN.md section 3), in rising order of cost to the job."""

    OBSERVE = "observe"
    ALERT = "alert"
    RESTART_JOB = "restart_job"
    # Stop a job's restart loop and page a person (a job that cannot progress: crash loop, NaN
    # loss): Slurm requeues it held; it starts again only when a person releases it.
    HOLD_JOB = "hold_job"
    RESET_GPU = "reset_gpu"
    DRAIN = "drain"
    REBOOT_NODE = "reboot_node"
    INSPECT_HARDWARE = "inspect_hardware"
    RESUME = "resume"


# Actions that take capacity away from the scheduler: these are what the circuit breaker counts.
REMOVING_ACTIONS = frozenset({Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE})
# Actions that may be about a whole job (``node`` None, ``job`` set): they take no node away.
JOB_LEVEL_ACTIONS = frozenset({Action.OBSERVE, Action.ALERT, Action.RESTART_JOB, Action.HOLD_JOB})
# Actions about a job's run itself (restart or stop it): the gate's restart budget counts them.
JOB_RUN_ACTIONS = frozenset({Action.RESTART_JOB, Action.HOLD_JOB})
# The type of a detector's configurable action for a job-level finding (one of JOB_LEVEL_ACTIONS).
JobAction = Literal[Action.OBSERVE, Action.ALERT, Action.RESTART_JOB]
# The type of a detector's configurable action for a finding about a whole node (one decision per
# node, naming no single GPU to reset).
NodeAction = Literal[Action.OBSERVE, Action.ALERT, Action.DRAIN, Action.REBOOT_NODE, Action.INSPECT_HARDWARE]
# A job-level decision's subject as the store keys it (its rows' node column, the delivery order):
# ':' never appears in a node name (a DNS name, wire.NODE_NAME_PATTERN), so it cannot collide.
JOB_SUBJECT_PREFIX = "job:"
# A finding's ``node`` for a finding about its whole job (``job`` set): never a node name (those
# have 1..253 characters), so a detector reading other findings' nodes matches no node with it.
# Decision.from_finding turns it into ``node`` None, the wire's form.
WHOLE_JOB = ""


def _check_subject(node: str | None, job: str | None, action: Action) -> None:
    if node is None and (job is None or action not in JOB_LEVEL_ACTIONS):
        raise ValueError(f"a decision without a node must name a job and be one of "
                         f"{sorted(a.value for a in JOB_LEVEL_ACTIONS)}, got {action.value} for job {job!r}")


def subject(node: str | None, job: str | None) -> str:
    """What a decision is about, as one string: its node, or ``job:<job>`` for a job-level one."""
    return node if node is not None else JOB_SUBJECT_PREFIX + (job or "")


class Finding(StrictModel):
    """A detector's conclusion about one subject. ``key`` distinguishes independent episodes of
    the same detector on the same subject (e.g. the Xid code); ``since`` is when the episode
    began, so re-evaluating the same episode yields the same decision id."""

    detector: str
    node: str  # WHOLE_JOB (""): about the whole job (``job`` set), no node blamed
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

    @model_validator(mode="after")
    def _subject(self) -> Finding:
        _check_subject(self.node or None, self.job, self.action)
        return self


class Decision(MutableStrictModel):
    """The wire form (DESIGN.md section 6) handed to the gate, the store and the actuators."""

    id: str
    ts: float
    node: str | None  # None: a job-level decision (``job`` set); no node is blamed or acted on
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

    @model_validator(mode="after")
    def _subject(self) -> Decision:
        _check_subject(self.node, self.job, self.action)
        return self

    @property
    def subject(self) -> str:
        """Its node, or ``job:<job>`` for a job-level decision (the store's key)."""
        return subject(self.node, self.job)

    @classmethod
    def from_finding(cls, finding: Finding, now: float, dry_run: bool) -> Decision:
        return cls(
            id=decision_id(finding),
            ts=now,
            node=finding.node or None,
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
        subject(finding.node or None, finding.job),
        str(finding.gpu),
        str(finding.job),
        finding.action.value,
        finding.key,
        f"{finding.since:.3f}",
    )
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]
