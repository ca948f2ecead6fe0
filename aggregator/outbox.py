"""The node-action outbox: the one owner of the requests the aggregator has for nodes' agents.

It reads delivered removals (``on_delivered``) and, where ``FOLLOW_UPS`` pairs the actuator and action with a
node action the site switched on, keeps a signed ``NodeActionRequest`` (reset_gpu, request_reboot, or the
prober's run_probes) for the node's current boot, offers it in answers to the node's reports until a final
result or expiry, takes the agent's ``action_results`` for the fleet, and ``void``s a node's requests when its
removal ends. It judges nothing, runs nothing on a node, and keeps its state in memory only
(docs/security-agent.md, "Node actions"; docs/kubernetes.md, "Reboots and GPU resets"; docs/probes.md,
"Running probes on request").
"""

from __future__ import annotations

import logging
import re
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from pydantic import Field

from vigil.aggregator.decision import Action, Decision
from vigil.contract.node_actions import NODE_ACTIONS, node_key, result_signature_ok, sign
from vigil.contract.validation import ConfigError, StrictModel
from vigil.contract.wire import (
    MAX_REQUESTS_PER_RESPONSE,
    NodeActionName,
    NodeActionRequest,
    NodeActionResult,
    ProbeGroup,
    ProbeName,
    replace,
)

if TYPE_CHECKING:
    from vigil.aggregator.config import AggregatorConfig
    from vigil.aggregator.fleet import Fleet

log = logging.getLogger("vigil.aggregator.outbox")

# A master key is 256 random bits written as hex (``vigil token master-key``); a node key
# file holds HMAC-SHA256(master, label + node) as hex too.
MIN_KEY_BYTES = 32
# The agent's refusal that keeps a request pending: the GPU is held by a process, which may end
# once Slurm's drain lets the job finish. Every other refusal is final.
BUSY = "busy"
# Metric label bounds: an agent's free-text reason becomes a label only if it is one short word,
# and only this many distinct ones (a misbehaving agent cannot create series at will).
_REASON_LABEL = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_REASON_LABELS = 32
OTHER = "other"
# Ids of finished requests remembered, so a result the agent repeats (its report's answer was
# lost) is known as a repeat rather than counted as an unknown id.
FINISHED_MEMORY = 4096
# Expired requests are looked for across all nodes at most this often (a node that never reports
# again still has its request expire and counted).
SWEEP_SECONDS = 1.0
# The agent's refusal of an offer past its (short) validity: final only once the request itself
# has expired; before that, the request is offered again, freshly signed.
EXPIRED = "expired"
# Why pending requests were cancelled (``void``): the node's removal ended.
VOID_REASONS = ("resumed", "held")


class NodeActionsConfig(StrictModel):
    """``node_actions``: signing and pacing of requests to agents (README "Security")."""

    # The master key (hex, ``vigil token master-key --out FILE``); each node holds only its
    # derived key. None: no node action is ever requested.
    key_file: str | None = None
    # A request not carried out within this long is void (the agent refuses it as expired) and
    # the recovery detector escalates: an hour covers a job that ends after the drain.
    request_ttl_seconds: float = Field(default=3600.0, gt=0, le=7 * 86400)
    # Offered again this long after the last offer while no final result arrived (a lost answer,
    # an agent restart, a GPU that was busy): 12 reports at the agent's 2.5 s cadence.
    retry_seconds: float = Field(default=30.0, gt=0)
    # Each offer is signed to expire this long after it is made (never after the request's own
    # expiry): a request voided by a resume or hold, and so no longer offered, is refused by the
    # agent as expired within this bound. A minute covers the answer's trip and one reset queued
    # ahead (the agent's reset_timeout_seconds); an agent whose clock runs ahead of the
    # aggregator's by more refuses every offer as expired (transient: offered again until the
    # request expires, then the recovery detector escalates).
    offer_ttl_seconds: float = Field(default=60.0, gt=0, le=3600)
    # Bounds: one request per GPU is the most a node ever has in flight.
    max_pending_per_node: int = Field(default=MAX_REQUESTS_PER_RESPONSE, ge=1, le=1024)
    max_pending_total: int = Field(default=4096, ge=1, le=1_000_000)


def read_key_file(path: str | Path, what: str = "node action master key") -> bytes:
    """The key in ``path`` (hex text, at least 32 bytes); ConfigError naming the file if not."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{what} file {path} does not hold a hex key (vigil token master-key)") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{what} file {path} holds {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return key


@dataclass(frozen=True)
class FollowUp:
    """What follows one actuator's delivery of one action: the node action the agent is asked for,
    and the actuator section's bool field that switches it on (off by default, needs the key)."""

    node_action: str  # a key of NODE_ACTIONS
    switch: str  # ``actuators.<actuator>.<switch>``


# The one table of (actuator, delivered action) -> the request to the node's agent that follows it.
# The removal comes first (Slurm drains; Kubernetes cordons and evicts), so the node runs no new
# work when the agent acts. Kubernetes reboots go through kured's sentinel file: kured drains and
# reboots under its own lock and window, and vigil needs no right to reboot anything (docs/kubernetes.md).
FOLLOW_UPS: dict[tuple[str, Action], FollowUp] = {
    ("slurm", Action.RESET_GPU): FollowUp("reset_gpu", "reset_gpu"),
    ("kubernetes", Action.RESET_GPU): FollowUp("reset_gpu", "reset_gpu"),
    ("kubernetes", Action.REBOOT_NODE): FollowUp("request_reboot", "reboot"),
}
# An Outbox built without a config follows the Slurm reset only (what it did before the table).
DEFAULT_FOLLOWED = frozenset({("slurm", Action.RESET_GPU)})


def switched_on(config: AggregatorConfig) -> list[str]:
    """The ``actuators.<name>.<switch>`` settings of FOLLOW_UPS that are true (enabled or not):
    each needs ``node_actions.key_file`` (aggregator/config.py refuses the config otherwise)."""
    on = [f"actuators.{actuator}.{follow.switch}" for (actuator, _), follow in FOLLOW_UPS.items()
          if getattr(getattr(config.actuators, actuator), follow.switch)]
    return list(dict.fromkeys(on))


def followed(config: AggregatorConfig) -> frozenset[tuple[str, Action]]:
    """The FOLLOW_UPS keys in effect: actuators on, the actuator's section enabled, its switch on,
    and a master key configured."""
    acts = config.actuators
    if not (acts.enabled and config.node_actions.key_file):
        return frozenset()
    return frozenset(key for key, follow in FOLLOW_UPS.items()
                     if getattr(acts, key[0]).enabled and getattr(getattr(acts, key[0]), follow.switch))


def agent_resets_enabled(config: AggregatorConfig) -> bool:
    """Whether an admitted reset_gpu becomes a request to the node's agent (after the removal)."""
    return any(FOLLOW_UPS[key].node_action == "reset_gpu" for key in followed(config))


@dataclass
class _Entry:
    request: NodeActionRequest  # signed
    last_offered: float | None = None
    last_result: NodeActionResult | None = None


# A run_probes refusal the agent lifts by itself (agent/node_action_runner.py): NVML cannot list the
# GPUs' processes now, or an abandoned probe of an earlier run still holds them. Kept pending like busy.
PROBE_TRANSIENT = frozenset({BUSY, "processes_unknown", "probe_running"})


def transient(result: NodeActionResult) -> bool:
    """Whether ``result`` keeps its request pending (offered again) rather than ending it."""
    if result.outcome != "refused":
        return False
    return result.reason in PROBE_TRANSIENT if result.action == "run_probes" else result.reason == BUSY


def _final(result: NodeActionResult) -> bool:
    return not transient(result)


class Outbox:
    """Pending requests per node. Single-threaded use (the app's event loop)."""

    def __init__(self, master_key: bytes | None, config: NodeActionsConfig | None = None,
                 fleet: Fleet | None = None, follow: Collection[tuple[str, Action]] = DEFAULT_FOLLOWED) -> None:
        """``follow``: the FOLLOW_UPS keys whose deliveries become requests (``followed(config)``)."""
        self.config = config or NodeActionsConfig()
        unknown = set(follow) - set(FOLLOW_UPS)
        if unknown:
            raise ValueError(f"no node action follows {sorted((a, b.value) for a, b in unknown)}")
        self.follow = {key: FOLLOW_UPS[key].node_action for key in follow}
        self._master = master_key
        self.fleet = fleet
        self._pending: dict[str, dict[str, _Entry]] = {}  # node -> id -> entry
        self._finished: OrderedDict[str, str] = OrderedDict()  # id -> node
        self._last_sweep = float("-inf")
        self._reasons: set[str] = set()
        self.offered: Counter[str] = Counter()  # action -> requests offered
        self.results: Counter[tuple[str, str, str]] = Counter()  # (action, outcome, reason)
        self.not_queued: Counter[tuple[str, str]] = Counter()  # (action, reason): decisions not turned into requests
        # (action, reason): results for a pending request refused before the fleet saw them
        # (bad_signature, node_mismatch, boot_mismatch: a run_probes result not bound to its request).
        self.refused: Counter[tuple[str, str]] = Counter()

    @classmethod
    def from_config(cls, config: AggregatorConfig, fleet: Fleet | None = None) -> Outbox:
        """Enabled (holding the master key) only when some FOLLOW_UPS pair is in effect
        (``followed``) or probing is on (``probes.enabled``: aggregator/prober.py); raises
        ConfigError when the key file cannot be read."""
        follow = followed(config)
        wanted = follow or config.probes.enabled  # the prober's run_probes requests are signed too
        key = read_key_file(config.node_actions.key_file) if wanted and config.node_actions.key_file else None
        return cls(key, config.node_actions, fleet, follow)

    @property
    def enabled(self) -> bool:
        return self._master is not None

    def pending(self) -> int:
        return sum(len(entries) for entries in self._pending.values())

    # Requests -----------------------------------------------------------------------------------

    def on_delivered(self, actuator: str, decision: Decision, now: float) -> None:
        """The dispatcher's hook: a decision an actuator delivered (the node is drained, or
        cordoned and emptied) becomes the request ``FOLLOW_UPS`` names, if that pair is followed."""
        if decision.action is Action.RESUME and decision.node is not None:  # a resume names its node
            self.void(decision.node, "resumed", now, f"resume {decision.id} delivered to {actuator}")
            return
        node_action = self.follow.get((actuator, decision.action))
        if node_action is not None and not decision.dry_run:
            self.enqueue(decision, now, node_action)

    def void(self, node: str, reason: str, now: float, why: str) -> int:
        """Cancel every pending request for ``node`` (its removal ended: ``reason`` resumed or held),
        counted as outcome ``cancelled`` and logged; returns how many. None is offered again, and
        the agent refuses a copy it holds once that offer's short validity ends."""
        if reason not in VOID_REASONS:
            raise ValueError(f"void reason {reason!r} is not one of {VOID_REASONS}")
        self._sweep(now)
        entries = self._pending.get(node)
        if not entries:
            return 0
        ids = list(entries)
        for request_id in ids:
            self._finish(node, request_id, entries[request_id].request.action, "cancelled", reason, why,
                         logging.WARNING)
        return len(ids)

    def _not_queued(self, action: str, subject: str, request_id: str, reason: str, why: str) -> None:
        self.not_queued[(action, reason)] += 1
        log.error("node action %s (%s %s) not requested: %s", request_id, action, subject, why)

    def enqueue(self, decision: Decision, now: float, node_action: str | None = None) -> NodeActionRequest | None:
        """The signed request for ``decision`` (id = the decision id, for the node's current boot),
        asking for ``node_action`` (default: the decision's own action's name), or None when it
        cannot be made (counted, logged) or is already queued or finished."""
        action = node_action or decision.action.value
        if decision.node is None:  # a job-level decision asks no node anything
            self._sweep(now)
            if self._master is not None:
                self._not_queued(decision.action.value, decision.subject, decision.id, "unknown_action",
                                 f"{action} is not a node action for {decision.subject}")
            return None
        return self._queue(decision.node, decision.id, action, now, gpu=decision.gpu, reason=decision.reason,
                           label=decision.action.value)

    def enqueue_request(self, node: str, request_id: str, action: str, now: float, *,
                        probes: Sequence[ProbeName] = (), probe_group: ProbeGroup | None = None,
                        quick: bool = False, reason: str = "", ttl_seconds: float | None = None,
                        gpu: int | None = None) -> NodeActionRequest | None:
        """A signed request that no delivered decision carries (the prober's run_probes: ``probes``,
        ``probe_group``), with the same bounds, signing and expiry as ``enqueue``; it expires
        ``ttl_seconds`` from now (default ``request_ttl_seconds``). None when it cannot be made
        (counted, logged) or is already queued or finished."""
        return self._queue(node, request_id, action, now, gpu=gpu, reason=reason, label=action, probes=probes,
                           probe_group=probe_group, quick=quick, ttl_seconds=ttl_seconds)

    def queued(self, node: str, request_id: str) -> bool:
        """Whether ``request_id`` for ``node`` waits for a final result."""
        return request_id in self._pending.get(node, {})

    def _queue(self, target: str, request_id: str, action: str, now: float, *, gpu: int | None, reason: str,
               label: str, probes: Sequence[ProbeName] = (), probe_group: ProbeGroup | None = None,
               quick: bool = False, ttl_seconds: float | None = None) -> NodeActionRequest | None:
        """The one place a request is made: checked against the node's state and the bounds,
        signed under the node's key, noted in the fleet. ``label`` names it in the not-queued count."""
        self._sweep(now)
        if self._master is None:
            return None
        if action not in NODE_ACTIONS:
            self._not_queued(label, target, request_id, "unknown_action", f"{action} is not a node action")
            return None
        node_pending = self._pending.get(target, {})
        if request_id in node_pending or request_id in self._finished:
            return None  # delivered again (at least once): the first request stands
        node = self.fleet.view().nodes.get(target) if self.fleet is not None else None
        if node is None:
            self._not_queued(label, target, request_id, "unknown_node", "the node has no state in the fleet")
            return None
        gpu_uuid = None
        if NODE_ACTIONS[action].needs_gpu:
            state = node.gpus.get(gpu) if gpu is not None else None
            if state is None:
                self._not_queued(label, target, request_id, "no_gpu", "the decision names no GPU the node reported")
                return None
            gpu_uuid = state.uuid
        if len(node_pending) >= self.config.max_pending_per_node or self.pending() >= self.config.max_pending_total:
            self._not_queued(label, target, request_id, "outbox_full",
                             f"{len(node_pending)} pending for the node, {self.pending()} "
                             f"in all (node_actions.max_pending_per_node/max_pending_total)")
            return None
        ttl = self.config.request_ttl_seconds if ttl_seconds is None else ttl_seconds
        request = NodeActionRequest(
            id=request_id, action=cast(NodeActionName, action), node=target, boot_id=node.boot_id,
            gpu=gpu if gpu_uuid is not None else None, gpu_uuid=gpu_uuid, issued_at=now,
            expires_at=now + ttl, reason=reason, probes=list(probes), probe_group=probe_group, quick=quick)
        signed = sign(request, node_key(self._master, target))
        self._pending.setdefault(target, {})[request_id] = _Entry(signed)
        if self.fleet is not None:
            self.fleet.note_action_request(signed)
        log.info("node action %s queued: %s %s gpu %s (%s), boot %s, expires in %.0f s", signed.id, action,
                 signed.node, signed.gpu, signed.gpu_uuid, signed.boot_id, ttl)
        return signed

    def due(self, node: str, now: float, boot_id: str | None = None,
            node_offset_seconds: float = 0.0) -> list[NodeActionRequest]:
        """The signed requests to offer ``node`` in this answer: never offered, or last offered
        ``retry_seconds`` ago; at most ``MAX_REQUESTS_PER_RESPONSE``. ``boot_id``: the boot the
        node reports from; a request for an earlier boot is void (the reboot reset every GPU)."""
        self._sweep(now)
        entries = self._pending.get(node)
        if not entries:
            return []
        out: list[NodeActionRequest] = []
        for entry in list(entries.values()):
            request = entry.request
            if boot_id is not None and request.boot_id != boot_id:
                self._finish(node, request.id, request.action, "void", "new_boot",
                             f"the node rebooted (boot {boot_id}, request for {request.boot_id})")
                continue
            if len(out) >= MAX_REQUESTS_PER_RESPONSE:
                continue
            if entry.last_offered is None or now - entry.last_offered >= self.config.retry_seconds:
                entry.last_offered = now
                self.offered[request.action] += 1
                out.append(self._offer(request, now, node_offset_seconds))
        return out

    def _offer(self, request: NodeActionRequest, now: float, node_offset_seconds: float) -> NodeActionRequest:
        """``request`` signed to expire ``offer_ttl_seconds`` from ``now`` (or at its own expiry),
        its validity told on the node's clock (``node_offset_seconds``: the node's clock minus
        the aggregator's, as the fleet measured it), which is the clock the agent checks it on: a
        node whose clock is off is offered requests it can take, for no longer than anyone else."""
        assert self._master is not None  # nothing is pending without the key
        expires_at = min(request.expires_at, now + self.config.offer_ttl_seconds)
        return sign(replace(request, issued_at=request.issued_at + node_offset_seconds,
                            expires_at=expires_at + node_offset_seconds), node_key(self._master, request.node))

    # Results ------------------------------------------------------------------------------------

    def record(self, node: str, results: Iterable[NodeActionResult], now: float) -> list[NodeActionResult]:
        """Take a node's reported results; returns those for requests this outbox made for that
        node (also handed to the fleet). Unknown ids are counted (reason unknown_id) and ignored."""
        accepted: list[NodeActionResult] = []
        for result in results:
            entry = self._pending.get(node, {}).get(result.id)
            if entry is None:
                if self._finished.get(result.id) == node:
                    log.debug("node action %s: result repeated by %s, already final", result.id, node)
                    continue
                self._count(result.action, result.outcome, "unknown_id")
                log.warning("node action result from %s for unknown id %r (%s %s %s): ignored", node,
                            result.id[:64], result.action, result.outcome, result.reason)
                continue
            if result.action != entry.request.action:
                self._count(result.action, result.outcome, "action_mismatch")
                log.warning("node action result from %s for %s says action %r, the request was %s: ignored",
                            node, result.id, result.action, entry.request.action)
                continue
            refusal = self._identity_refusal(entry.request, result)
            if refusal is not None:
                reason, why = refusal
                self.refused[(entry.request.action, reason)] += 1
                log.error("node action result from %s for %s refused (%s): %s; the request stays pending", node,
                          result.id, reason, why)
                continue
            if result.outcome == "refused" and result.reason == EXPIRED and now < entry.request.expires_at:
                # The offer's validity ended before the agent ran it (a queue, a clock ahead): the
                # request stands and is offered again, freshly signed. Not a result for the fleet.
                self._count(result.action, "refused", "offer_expired")
                log.warning("node action %s on %s: the agent refused the offer as expired (%s); offered again "
                            "in %.0f s until %.0f", result.id, node, result.detail, self.config.retry_seconds,
                            entry.request.expires_at)
                continue
            self._count(result.action, result.outcome, result.reason)
            entry.last_result = result
            accepted.append(result)
            line = (f"node action {result.id} on {node}: {result.action} gpu {result.gpu} {result.outcome} "
                    f"({result.reason}){': ' + result.detail if result.detail else ''}")
            if result.outcome == "done":
                log.info("%s", line)
            elif _final(result):
                log.error("%s", line)
            else:
                log.warning("%s; offered again in %.0f s until it expires", line, self.config.retry_seconds)
            if _final(result):
                self._forget(node, result.id)
        if accepted and self.fleet is not None:
            self.fleet.record_action_results(node, accepted, now)
        return accepted

    def _identity_refusal(self, request: NodeActionRequest, result: NodeActionResult) -> tuple[str, str] | None:
        """Why a result that carries measurements (run_probes: what the aggregator judges and learns
        from) must not reach the fleet, as (reason, detail), or None: it must be signed under the
        node's key (agent/node_actions.sign_result) and name the request's node and boot."""
        if request.action != "run_probes":
            return None
        assert self._master is not None  # nothing is pending without the key
        if not result.signature or not result_signature_ok(result, node_key(self._master, request.node)):
            return "bad_signature", "the result is not signed under the node's key"
        if result.node != request.node:
            return "node_mismatch", f"the result names node {result.node!r}, the request {request.node!r}"
        if result.boot_id != request.boot_id:
            return "boot_mismatch", f"the result names boot {result.boot_id!r}, the request {request.boot_id!r}"
        return None

    def _count(self, action: str, outcome: str, reason: str) -> None:
        action = action if action in NODE_ACTIONS else OTHER
        if reason not in self._reasons:
            if _REASON_LABEL.fullmatch(reason) is None or len(self._reasons) >= MAX_REASON_LABELS:
                reason = OTHER
            else:
                self._reasons.add(reason)
        self.results[(action, outcome, reason)] += 1

    def _forget(self, node: str, request_id: str) -> None:
        entries = self._pending.get(node, {})
        entries.pop(request_id, None)
        if not entries:
            self._pending.pop(node, None)
        self._finished[request_id] = node
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def _finish(self, node: str, request_id: str, action: str, outcome: str, reason: str, why: str,
                level: int = logging.ERROR) -> None:
        """End a request without an agent's final result (expired, void, cancelled), counted and logged."""
        self._count(action, outcome, reason)
        log.log(level, "node action %s on %s (%s) %s: %s", request_id, node, action, outcome, why)
        self._forget(node, request_id)

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < SWEEP_SECONDS:
            return
        self._last_sweep = now
        for node, entries in list(self._pending.items()):
            for entry in list(entries.values()):
                if now >= entry.request.expires_at:
                    last = entry.last_result
                    self._finish(node, entry.request.id, entry.request.action, "expired",
                                 "no_final_result", f"no final result by {entry.request.expires_at:.0f}"
                                 + (f" (last: {last.outcome} {last.reason})" if last else " (no result)"))

    # Metrics ------------------------------------------------------------------------------------

    def collector(self) -> PromCollector:
        return _OutboxMetrics(self)


class _OutboxMetrics(PromCollector):
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox

    def collect(self) -> Iterator[Metric]:
        box = self._outbox
        offered = CounterMetricFamily("vigil_aggregator_node_action_requests",
                                      "Signed node-action requests offered to agents in answers to their "
                                      "reports (a re-offer counts again).", labels=["action"])
        for action in sorted(NODE_ACTIONS):
            offered.add_metric([action], box.offered.get(action, 0))
        yield offered
        yield _by_labels("vigil_aggregator_node_action_results",
                         "Node-action results, by action, outcome (done, refused, failed as the agent reported; "
                         "expired, void, cancelled: ended by the aggregator) and reason (unknown_id: no such request "
                         "for that node, ignored; offer_expired: the agent refused an offer past its validity, offered "
                         "again; cancelled resumed or held: the node's removal ended).",
                         ["action", "outcome", "reason"], box.results)
        yield _by_labels("vigil_aggregator_node_action_not_requested",
                         "Delivered decisions that could not become a node-action request, by action and reason "
                         "(no_gpu, unknown_node, outbox_full).", ["action", "reason"], box.not_queued)
        yield _by_labels("vigil_aggregator_node_action_results_refused",
                         "Node-action results for a pending request refused before the fleet took them, by action "
                         "and reason (bad_signature: not signed under the node's key; node_mismatch, boot_mismatch: "
                         "not bound to the request's node and boot). The request stays pending until a bound result "
                         "or its expiry.", ["action", "reason"], box.refused)
        yield GaugeMetricFamily("vigil_aggregator_node_actions_pending",
                                "Node-action requests waiting for a final result.", value=box.pending())


def _by_labels(name: str, documentation: str, labels: list[str],
               counts: Mapping[Any, int]) -> CounterMetricFamily:
    """A counter family with one series per counted tuple of label values (the keys of ``counts``), sorted."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for values, n in sorted(counts.items()):
        family.add_metric(list(values), n)
    return family
