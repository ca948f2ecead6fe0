"""The actuator contract: a synchronous deliverer of admitted decisions to one outside system.

An actuator says which decisions it takes (``handles``), delivers one (``deliver``), raising
``DeliveryError`` when it could not (``DeadlineExceeded`` when its target took longer than
``timeout_seconds`` in all), and at start-up ``check``s that it can reach its target, within the
same total deadline; the dispatch worker owns retries, backoff, the dead-letter state and each
actuator's own worker threads. An actuator judges nothing and keeps no delivery state of its own.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import Field, field_validator

from vigil.aggregator.decision import Decision
from vigil.contract.validation import StrictModel
from vigil.contract.wire import check_node_name


class DeliveryError(Exception):
    """Delivery failed. ``retryable`` False means retrying cannot help (e.g. 400 Bad Request,
    an unknown node): the delivery goes straight to the dead-letter state."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class DeadlineExceeded(DeliveryError):
    """The target did not finish within the total deadline (connect, headers and body together):
    retryable, and counted apart (``vigil_aggregator_actuator_deadline_exceeded_total``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


def one_node(name: str) -> str:
    """``name`` if it names exactly one node (a hostname), else a permanent DeliveryError: a
    scheduler must never be handed an expression it expands (``vnode[1-5]``, ``a,b``). Intake
    refuses such names already; this is the last check before a command or an API call."""
    try:
        return check_node_name(name)
    except ValueError as exc:
        raise DeliveryError(f"refusing to act on {name[:80]!r}: {exc}", retryable=False) from None


# At most this many nodes of a job-level decision's ``job_nodes`` are read (the hang detector
# names 16): a bound on the scheduler calls one delivery makes.
JOB_NODES_READ = 16


def job_nodes(decision: Decision) -> list[str]:
    """Where a job-level decision's job was reported running: its node, or for a decision naming
    no node, the nodes its evidence's ``job_nodes`` lists (each checked by ``one_node``). An
    actuator acts on the job only where the scheduler runs it on one of these, so a report's claim
    of another team's job acts on nothing. A permanent DeliveryError when there is none."""
    if decision.node is not None:
        return [one_node(decision.node)]
    listed = decision.evidence.get("job_nodes")
    if not isinstance(listed, list) or not listed or not all(isinstance(n, str) for n in listed):
        raise DeliveryError(f"job-level decision {decision.id} names no node the job ran on (evidence job_nodes)",
                            retryable=False)
    return [one_node(n) for n in listed[:JOB_NODES_READ]]


class Actuator(Protocol):
    name: str
    # Notifiers (Alertmanager, webhook) may be delivered even in dry run, when configured to.
    notify_in_dry_run: bool
    timeout_seconds: float

    def handles(self, decision: Decision) -> bool: ...

    def deliver(self, decision: Decision) -> str:
        """Act on the decision; return a one-line account of what was done. Must be idempotent
        in ``decision.id``: after a crash the dispatcher may deliver it again."""
        ...

    def check(self) -> str:
        """Reach the target without changing anything (``scontrol ping``, the API's version,
        Alertmanager's readiness, an OPTIONS request); return what answered, or raise
        ``DeliveryError`` saying why not. Run once at start-up when not in dry run."""
        ...

    def close(self) -> None: ...


class ActuatorConfig(StrictModel):
    """Settings every actuator has; an actuator's own config subclasses this."""

    enabled: bool = False
    # The total deadline of one delivery and of the start-up check: connect, headers and body
    # together (a receiver trickling its answer is cut off here, not per read).
    timeout_seconds: float = Field(default=10.0, gt=0)


class DispatchConfig(StrictModel):
    """Delivery retries (``actuators.delivery``): jittered exponential backoff, then dead letter."""

    enabled: bool = True
    max_attempts: int = Field(default=8, ge=1)
    base_backoff_seconds: float = Field(default=1.0, gt=0)
    max_backoff_seconds: float = Field(default=300.0, gt=0)
    # How often the worker looks for due retries when nothing wakes it.
    poll_seconds: float = Field(default=1.0, gt=0)
    # Due deliveries fetched per round is 8 times this (no longer a limit shared by actuators:
    # each has its own ``workers``).
    concurrency: int = Field(default=8, ge=1)
    # Each actuator's own worker threads: deliveries to one actuator run on its pool only, so one
    # stuck receiver never delays another actuator, intake, the store or leadership. While all of
    # an actuator's workers are busy, its due deliveries wait in the store (bounded by it).
    workers: int = Field(default=4, ge=1, le=64)
    # Per actuator (by name) where it should differ from ``workers``.
    workers_by_actuator: dict[str, int] = Field(default_factory=dict)

    @field_validator("workers_by_actuator")
    @classmethod
    def _bounded(cls, sizes: dict[str, int]) -> dict[str, int]:
        for name, size in sizes.items():
            if not 1 <= size <= 64:
                raise ValueError(f"workers_by_actuator.{name}: must be in 1..64, got {size}")
        return sizes

    def workers_of(self, actuator: str) -> int:
        return self.workers_by_actuator.get(actuator, self.workers)
