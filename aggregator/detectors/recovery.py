"""Recovery detector: gives a node back only once it has proved healthy after its remediation.

It reads the nodes vigil removed for a remediation it follows (``FleetView.removed``: reboot_node by
default, reset_gpu where configured or when the agents reset GPUs), their reports since, the
node-action results their agents reported (``NodeState.action_results``) and, with probes on, the
recovery probe run. A node with evidence of the remediation (a new boot, the agent's reset ``done``)
and a clean window proposes ``resume``, a fault again after it ``inspect_hardware``, a reset not done
or a failed probe the ladder's next rung, and a node not verified in time an alert; it never follows
``drain`` or ``inspect_hardware``. Evidence, window, persistence, probes and the false-resume
reasoning: docs/detectors.md, "recovery".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.probe_verdict import Learned, judge_run, probe_request_id
from vigil.aggregator.fleet import ActionOutcome, FleetView, NodeState, Removal, port_is_active
from vigil.aggregator.outbox import BUSY, transient
from vigil.aggregator.xid_catalog import XidCatalog, occurrence_action
from vigil.contract.validation import StrictModel
from vigil.contract.wire import ProbeName

if TYPE_CHECKING:
    from vigil.aggregator.prober import ProbesConfig

NAME = "recovery"
# With probes on (aggregator/prober.py): the finding's signal that a node passed its passive checks
# and waits for its probe run (the prober requests it), and how many runs it gets before an alert.
PROBING = "probing"
PROBE_ATTEMPTS = 2

# The actions whose outcome can be verified from the reports (drain: a person decides;
# inspect_hardware: a technician does).
FOLLOWABLE = frozenset({Action.REBOOT_NODE, Action.RESET_GPU})
REMOVING_XID_ACTIONS = frozenset({Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE})
BAD_HEALTH = ("lost", "reset_required")


class RecoveryConfig(StrictModel):
    """Off by default: gives back nodes vigil rebooted once they verify (docs/detectors.md)."""
    enabled: bool = False
    # Which remediations it follows. reset_gpu is opt-in: a GPU reset leaves no trace in the
    # reports (no new boot), so only the fault signals' absence after the removal vouches for it.
    follow_actions: list[Action] = Field(default_factory=lambda: [Action.REBOOT_NODE])
    # How long the node must be clean after the remediation: 60 s is 24 reports at the agent's
    # 2.5 s cadence, longer than the xid dedup (5 s) and than the GPU reader's start after boot.
    persistence_seconds: float = Field(default=60.0, ge=0)
    # And at least this many reports in the new boot (a slow-reporting node proves nothing in 2).
    min_reports: int = Field(default=4, ge=1)
    # A node that has reported nothing for this many of its intervals is not judged (stale state).
    quiet_intervals: float = Field(default=3.0, gt=0)
    # Not verified this long after the remediation (a port that stays down, a GPU that reads
    # unavailable): one alert, so the node does not sit out of service unnoticed.
    unverified_alert_seconds: float = Field(default=1800.0, gt=0)

    @field_validator("follow_actions")
    @classmethod
    def _followable(cls, actions: list[Action]) -> list[Action]:
        bad = [a.value for a in actions if a not in FOLLOWABLE]
        if bad:
            raise ValueError(f"only reboot_node and reset_gpu can be verified, not {', '.join(bad)}")
        return actions


class RecoveryDetector:
    name = NAME

    def __init__(self, config: RecoveryConfig, catalog: XidCatalog | None = None) -> None:
        self.config = config
        self.follow = frozenset(config.follow_actions)
        self.catalog = catalog or XidCatalog.default()

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        # With agent resets on, a reset is seen (the agent's result): always followed.
        follow = self.follow | {Action.RESET_GPU} if view.agent_resets else self.follow
        for name, removal in view.removed.items():
            node = view.nodes.get(name)
            if node is None or removal.held or removal.action not in follow:
                continue
            finding = self._judge(node, removal, now, view.agent_resets, view)
            if finding is not None:
                out.append(finding)
        return out

    def _judge(self, node: NodeState, removal: Removal, now: float, agent_resets: bool = False,
               view: FleetView | None = None) -> Finding | None:
        cfg = self.config
        # A reboot is a new kernel boot id, not a restarted agent (wire.kernel_boot_id).
        new_boot = node.kernel_reboots > 0 and node.kernel_boot_started > removal.ts
        base: dict[str, object] = {
            "removal": removal.decision, "removed_by": removal.action.value, "removed_ts": removal.ts,
            "boot_id": node.boot_id, "boot_started": node.kernel_boot_started, "new_boot": new_boot}
        if new_boot:
            t_fix = node.kernel_boot_started
        elif removal.action is Action.RESET_GPU and agent_resets:
            outcome = node.action_results.get(removal.decision)
            if outcome is not None:
                r = outcome.result
                base["reset"] = {"outcome": r.outcome, "reason": r.reason, "detail": r.detail, "agent_ts": r.ts,
                                 "received": outcome.received}
            if outcome is None or outcome.result.outcome != "done":
                return self._reset_not_done(node, removal, outcome, now, base)
            t_fix = outcome.received
        elif removal.action is Action.RESET_GPU:
            t_fix = removal.ts
        elif removal.decision in node.action_expiry:
            # The agent was asked to request the reboot (kured's sentinel). Its `done` says the
            # sentinel is written, not that the node rebooted: only the new boot above is evidence.
            return self._reboot_not_seen(node, removal, now, base)
        else:
            return None  # not rebooted yet: nothing to verify
        if now - node.last_seen > cfg.quiet_intervals * node.interval_seconds or node.last_seen < t_fix:
            return self._unverified(node, removal, t_fix, now, "no recent report", base)
        fault = self._fault(node, t_fix)
        if fault is not None:
            signal, detail = fault
            return Finding(
                detector=NAME, node=node.name, action=Action.INSPECT_HARDWARE, since=t_fix, key="failed",
                reason=f"{removal.action.value} did not fix {node.name}: {detail}",
                evidence={**base, "signal": signal, "detail": detail})
        waiting = self._not_ready(node, t_fix, now)
        if view is not None and view.probes is not None:
            # The probes run while the passive window fills (the node is out of service either way):
            # resume needs both, and a failed probe climbs the ladder at once.
            return self._probed(node, removal, t_fix, now, base, view.probes, view.learned_probes, waiting)
        if waiting is not None:
            return self._unverified(node, removal, t_fix, now, waiting, base)
        return self._resume(node, removal, t_fix, now, "every expected GPU present, no fault since, RDMA ports active",
                            base)

    @staticmethod
    def _resume(node: NodeState, removal: Removal, t_fix: float, now: float, proof: str,
                evidence: dict[str, object]) -> Finding:
        return Finding(
            detector=NAME, node=node.name, action=Action.RESUME, since=t_fix, key="verified",
            reason=f"{node.name} healthy for {now - t_fix:.0f} s after {removal.action.value}: {proof}",
            evidence={**evidence, "signal": "recovered", "verified_seconds": round(now - t_fix, 1),
                      "gpus": len(node.gpus)})

    def _probed(self, node: NodeState, removal: Removal, t_fix: float, now: float, base: dict[str, object],
                probes: ProbesConfig, learned: Learned, passive_waiting: str | None) -> Finding | None:
        """Probing is on: from the remediation's first clean report the node waits for a probe run
        made after ``t_fix`` (the prober requests it on the ``probing`` finding), in parallel with
        the passive window (``passive_waiting``: why that has not passed yet, or None). Every probe
        passes and the passive window passed: resume; a probe fails: the next rung at once; an error
        or no result within the run's timeout: once more, then an alert."""
        ids = [probe_request_id("recovery", removal.decision, attempt) for attempt in range(PROBE_ATTEMPTS)]
        attempt = max((a for a, rid in enumerate(ids) if rid in node.action_results or rid in node.action_expiry),
                      default=0)
        request_id = ids[attempt]
        wanted = list(probes.recovery_probes)
        base = {**base, "probe_request": request_id, "attempt": attempt, "probes_requested": wanted}
        outcome = node.action_results.get(request_id)
        expires = node.action_expiry.get(request_id)
        done = outcome is not None and outcome.received >= t_fix and not transient(outcome.result)
        trouble: str | None = None
        if done:
            assert outcome is not None
            verdict = judge_run(outcome.result, node, wanted, probes.baselines, learned)
            evidence = {**base, "probes": verdict.evidence(), "probe_result_received": outcome.received}
            if verdict.outcome == "pass":
                if passive_waiting is not None:
                    return self._unverified(node, removal, t_fix, now, f"probes passed; {passive_waiting}", base)
                return self._resume(node, removal, t_fix, now, f"passed its probes ({verdict.detail})", evidence)
            if verdict.outcome == "fail":
                # The ladder's next rung: a reset that left a fault -> reboot; a reboot -> a technician.
                action = Action.REBOOT_NODE if removal.action is Action.RESET_GPU else Action.INSPECT_HARDWARE
                return Finding(
                    detector=NAME, node=node.name, action=action, since=outcome.received, key="probe_failed",
                    gpu=removal.gpu if action is Action.REBOOT_NODE else None,
                    reason=(f"{node.name} passed the passive checks after {removal.action.value} but failed its "
                            f"probes: {verdict.detail}"),
                    evidence={**evidence, "signal": "probe_failed", "failed": [j.evidence() for j in verdict.failed]})
            trouble = f"the probe run errored ({verdict.detail})"
        elif expires is not None and now >= expires:
            trouble = f"no probe result within {probes.run_timeout_seconds:.0f} s"
        if trouble is not None:
            if attempt + 1 < PROBE_ATTEMPTS:
                return self._probing(node, removal, t_fix, now, {**base, "previous": trouble},
                                     ids[attempt + 1], attempt + 1, wanted)
            return Finding(
                detector=NAME, node=node.name, action=Action.ALERT, since=t_fix, key="probe_error",
                reason=(f"{node.name} passed the passive checks after {removal.action.value} but its probes could not "
                        f"be judged ({trouble}, {PROBE_ATTEMPTS} attempts); it stays out of service"),
                evidence={**base, "signal": "probe_error", "detail": trouble})
        return self._probing(node, removal, t_fix, now, base, request_id, attempt, wanted)

    def _probing(self, node: NodeState, removal: Removal, t_fix: float, now: float, base: dict[str, object],
                 request_id: str, attempt: int, wanted: list[ProbeName]) -> Finding:
        # observe: recorded in the decision log (the node's state is visible) and acted on by nobody
        # but the prober; an alert would page a person for the normal path.
        return Finding(
            detector=NAME, node=node.name, action=Action.OBSERVE, since=t_fix,
            key=PROBING if attempt == 0 else f"{PROBING}:retry",
            reason=(f"{node.name} clean for {now - t_fix:.0f} s after {removal.action.value}, "
                    f"probing ({', '.join(wanted)})" + (" again" if attempt else "")),
            evidence={**base, "signal": PROBING, "probe_request": request_id, "attempt": attempt})

    def _reset_not_done(self, node: NodeState, removal: Removal, outcome: ActionOutcome | None, now: float,
                        base: dict[str, object]) -> Finding | None:
        """The agent has not reported the reset done: escalate on a final failure or refusal or on
        the request's expiry; otherwise (no result yet, or busy) wait, alerting once if it lasts."""
        where = f"GPU {removal.gpu} on {node.name}" if removal.gpu is not None else node.name
        result = outcome.result if outcome is not None else None
        expires = node.action_expiry.get(removal.decision)
        since: float | None = None
        if outcome is not None and result is not None and not (result.outcome == "refused" and result.reason == BUSY):
            since, key = outcome.received, "reset_failed"
            what = f"the agent's reset of {where} {result.outcome} ({result.reason})"
        elif expires is not None and now >= expires:
            since, key = expires, "reset_expired"
            what = (f"the agent did not report the reset of {where} done before its request expired"
                    + (f" (last: {result.outcome} {result.reason})" if result is not None else ""))
        if since is not None:
            return Finding(
                detector=NAME, node=node.name, action=Action.REBOOT_NODE, since=since, key=key, gpu=removal.gpu,
                reason=f"{what}: rebooting instead",
                evidence={**base, "signal": key, "request_expires": expires})
        why = (f"GPU busy ({result.detail or 'held by a process'})" if result is not None
               else "no reset result from the agent yet")
        return self._unverified(node, removal, removal.ts, now, why, base)

    def _reboot_not_seen(self, node: NodeState, removal: Removal, now: float,
                         base: dict[str, object]) -> Finding | None:
        """No new boot yet after the agent was asked to request a reboot: an alert at once when the
        agent reported the request failed or refused (nothing will reboot the node), else the usual
        alert once ``unverified_alert_seconds`` pass (the reboot daemon's lock or window may delay it)."""
        outcome = node.action_results.get(removal.decision)
        if outcome is not None and outcome.result.outcome != "done":
            r = outcome.result
            return Finding(
                detector=NAME, node=node.name, action=Action.ALERT, since=outcome.received,
                key="reboot_request_failed",
                reason=(f"the agent on {node.name} could not request the reboot ({r.outcome} {r.reason}); "
                        f"it stays out of service"),
                evidence={**base, "signal": "reboot_request_failed", "outcome": r.outcome, "reason": r.reason,
                          "detail": r.detail})
        why = "no new boot since the reboot was requested" if outcome is not None else \
            "the agent has not reported the reboot request yet"
        return self._unverified(node, removal, removal.ts, now, why, base)

    def _unverified(self, node: NodeState, removal: Removal, t_fix: float, now: float, why: str,
                    base: dict[str, object]) -> Finding | None:
        if now - t_fix < self.config.unverified_alert_seconds:
            return None
        return Finding(
            detector=NAME, node=node.name, action=Action.ALERT, since=t_fix, key="unverified",
            reason=f"{node.name} not verified {now - t_fix:.0f} s after {removal.action.value} ({why}); "
                   f"it stays out of service",
            evidence={**base, "signal": "unverified", "waiting_for": why})

    def _fault(self, node: NodeState, t_fix: float) -> tuple[str, str] | None:
        """The first fault signal seen since ``t_fix``, as (signal, detail), or None."""
        if node.last_seen >= t_fix and node.nvml_available and "gpu" not in node.failed_collectors:
            absent = sorted(i for i, g in node.gpus.items() if i in node.missing_gpus or g.last_seen < node.last_seen)
            if absent:
                return "gpu_missing", (f"GPU(s) {', '.join(map(str, absent))} of {len(node.gpus)} expected "
                                       f"absent after the remediation")
        for index, gpu in sorted(node.gpus.items()):
            for s in gpu.samples:
                if s.ts < t_fix:
                    continue
                if s.health in BAD_HEALTH:
                    return "gpu_health", f"GPU {index} health {s.health!r} after the remediation"
                if s.remap_failure:
                    return "row_remap_failure", f"GPU {index} row remap failed"
                if s.remap_pending:
                    return "row_remap_pending", f"GPU {index} row remap still pending"
            if gpu.counters.sum_since("ecc_uncorrected_volatile", t_fix) > 0:
                return "ecc_uncorrected", f"GPU {index} uncorrectable ECC errors after the remediation"
        for xid_gpu, records in node.xids.items():
            for rec in records:
                if rec.ts >= t_fix and occurrence_action(self.catalog, rec.code, rec.message) in REMOVING_XID_ACTIONS:
                    where = f"GPU {xid_gpu}" if xid_gpu is not None else "the node"
                    return "xid", f"Xid {rec.code} on {where} after the remediation"
        return None

    def _not_ready(self, node: NodeState, t_fix: float, now: float) -> str | None:
        """Why the node has not yet proved health, or None once it has: the last
        ``persistence_seconds`` (all after ``t_fix``) clean in every report."""
        cfg = self.config
        if now - t_fix < cfg.persistence_seconds:
            return f"{now - t_fix:.0f} s of {cfg.persistence_seconds:.0f} s clean"
        if not node.nvml_available or "gpu" in node.failed_collectors:
            return "no GPU state (NVML unavailable)"
        start = max(t_fix, now - cfg.persistence_seconds)
        reports = 0
        for gpu in node.gpus.values():
            window = [s for s in gpu.samples if s.ts >= start]
            reports = max(reports, len(window))
            if any(s.health != "ok" for s in window):
                return f"GPU {gpu.index} health not ok"
        if node.gpus and reports < cfg.min_reports:
            return f"{reports} of {cfg.min_reports} reports in {cfg.persistence_seconds:.0f} s"
        for port in node.ports.values():
            if not port.ever_active:
                continue  # never cabled or never up: not expected
            seen = [p for p in port.samples if p.ts >= start]
            if not seen or not all(p.active for p in seen) or not port_is_active(port.last):
                return f"port {port.name} not active for {cfg.persistence_seconds:.0f} s"
        return None
