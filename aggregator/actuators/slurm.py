"""Slurm actuator: drains, reboots, resumes and requeues through ``scontrol``.

Removing actions drain the node (``State=DRAIN Reason="vigil: <reason> <decision id>"``); the
reset or inspection itself is left to the site's tooling, which reads the reason. ``resume``
undrains only a node that vigil took out (its reason starts with ``vigil:``), and ``restart_job``
requeues the job held, excludes the bad node and releases it. Commands go through an injectable
runner.

GPU resets (``reset_gpu: true``, off by default): the node is drained as above; the aggregator's
outbox then asks the node's agent to reset the GPU (aggregator/outbox.py), not this actuator.

Reboots (``reboot: true``, off by default): ``reboot_node`` runs ``scontrol reboot ASAP
nextstate=DOWN reason="vigil: reboot_node: <reason> <decision id>" <node>``. ASAP drains the node
at once (no new jobs; running ones finish or are requeued by ``restart_job``) and reboots it when
idle. ``nextstate=DOWN``, not RESUME: Slurm would otherwise put the node back in service as soon
as slurmd registers after the boot, before anyone checked that the reboot fixed it. DOWN keeps it
out until vigil's recovery detector has verified it (new boot id, every GPU back, no fault for the
persistence period) and the gate admitted ``resume``, which runs ``State=RESUME``; a node that
fails verification stays DOWN and goes to inspection. That hold needs slurm.conf's ReturnToService
0 or 1: with 2, slurmctld (22.05, checked) returns the DOWN node to IDLE at its next registration
(an `scontrol reconfigure` suffices), unverified, so with 2 the actuator drains instead of
rebooting (``scontrol show config`` read at each reboot; logged). Slurm keeps vigil's reason (appending
" : reboot issued" and the like), so ``resume`` still knows it as a node vigil took out. A node
someone else drained or downed is not rebooted (their reason would be overwritten).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
from collections.abc import Sequence

from vigil.agent.seams import CommandRunner, run_command
from vigil.aggregator.actuators.actuator import ActuatorConfig, DeliveryError, one_node
from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision

log = logging.getLogger(__name__)

REASON_PREFIX = "vigil:"
# Slurm stores the reason as free text; keep it to one readable sinfo line.
MAX_REASON_CHARS = 200
# scontrol's messages for mistakes no retry can fix (Slurm 22.05 src/common/slurm_errno.c).
PERMANENT_ERRORS = (
    "Invalid node name specified",
    "Invalid job id specified",
    "Access/permission denied",
    "not found",  # `scontrol show node X` for a node slurm.conf does not list
)


class SlurmConfig(ActuatorConfig):
    scontrol: str = "scontrol"
    squeue: str = "squeue"
    # The cluster's slurm.conf, when it is not the default one (passed as SLURM_CONF).
    slurm_conf: str | None = None
    # Carry out reboot_node with `scontrol reboot ASAP nextstate=DOWN` (slurm.conf needs a
    # RebootProgram); false: reboot_node only drains, and the site reboots. Pair with
    # detectors.recovery.enabled, which gives a verified node back (docs/gate.md).
    reboot: bool = False
    # reset_gpu: drain as always, then (once the drain is delivered) ask the node's agent to reset
    # the GPU through a signed request (needs node_actions.key_file, and node_actions.allow on the
    # agent); the recovery detector gives the node back after the agent's `done` and a clean
    # period. False: reset_gpu only drains, with the reason, and the site resets.
    reset_gpu: bool = False


def _run_with_conf(conf: str, argv: Sequence[str], timeout_seconds: float) -> str:
    done = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        check=True,
        env={**os.environ, "SLURM_CONF": conf},
    )
    return done.stdout


def _kv(line: str) -> dict[str, str]:
    """``scontrol show -o`` output as key -> value; Reason is free text up to ``[user@time]``."""
    out = {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", line)}
    reason = re.search(r" Reason=(.*?)(?: \[[^\]]*\])?\s*$", line)
    if reason:
        out["Reason"] = reason.group(1)
    return out


class SlurmActuator:
    name = "slurm"
    notify_in_dry_run = False

    def __init__(self, config: SlurmConfig, run: CommandRunner | None = None) -> None:
        self.config = config
        self.timeout_seconds = config.timeout_seconds
        if run is None:
            run = functools.partial(_run_with_conf, config.slurm_conf) if config.slurm_conf else run_command
        self.run = run

    def handles(self, decision: Decision) -> bool:
        if decision.action is Action.RESTART_JOB:
            return decision.job is not None
        return decision.action in REMOVING_ACTIONS or decision.action is Action.RESUME

    def deliver(self, decision: Decision) -> str:
        one_node(decision.node)  # one node per scontrol call, never a hostlist expression
        if decision.action is Action.RESUME:
            return self._resume(decision)
        if decision.action is Action.RESTART_JOB:
            return self._requeue(decision)
        if decision.action is Action.REBOOT_NODE and self.config.reboot:
            return self._reboot(decision)
        return self._drain(decision)

    def close(self) -> None:
        pass

    def check(self) -> str:
        """``scontrol ping``: every slurmctld it names must be UP."""
        out = " ".join(self._scontrol("ping").split())
        if "UP" not in out or "DOWN" in out:
            raise DeliveryError(f"scontrol ping: {out or 'no answer'}")
        return out

    @staticmethod
    def reason_for(decision: Decision) -> str:
        what = decision.reason if decision.action is Action.DRAIN else f"{decision.action.value}: {decision.reason}"
        what = " ".join(what.split())  # one line: newlines would end the sinfo row
        room = MAX_REASON_CHARS - len(REASON_PREFIX) - len(decision.id) - 2
        return f"{REASON_PREFIX} {what[:room]} {decision.id}"

    def _scontrol(self, *args: str) -> str:
        try:
            return self.run([self.config.scontrol, *args], self.timeout_seconds)
        except subprocess.CalledProcessError as exc:
            said = " ".join(f"{exc.stdout or ''} {exc.stderr or ''}".split())
            message = f"scontrol {' '.join(args)}: {said or f'exit status {exc.returncode}'}"
            raise DeliveryError(message, retryable=not any(p in message for p in PERMANENT_ERRORS)) from exc
        except (OSError, subprocess.SubprocessError) as exc:
            raise DeliveryError(f"scontrol {args[0]}: {exc}") from exc

    def _node(self, node: str) -> dict[str, str]:
        return _kv(self._scontrol("show", "node", "-o", node))

    def _drain(self, decision: Decision) -> str:
        current = self._node(decision.node)
        if "DRAIN" in current.get("State", "") and decision.id in current.get("Reason", ""):
            return f"{decision.node} already drained for {decision.id}"
        reason = self.reason_for(decision)
        self._scontrol("update", f"NodeName={decision.node}", "State=DRAIN", f"Reason={reason}")
        return f"drained {decision.node}: {reason}"

    def _reboot(self, decision: Decision) -> str:
        current = self._node(decision.node)
        state, reason = current.get("State", ""), current.get("Reason", "")
        if decision.id in reason and any(s in state for s in ("REBOOT", "DOWN", "DRAIN")):
            return f"{decision.node} reboot already requested for {decision.id} ({state})"
        if ("DRAIN" in state or "DOWN" in state) and reason and not reason.startswith(REASON_PREFIX):
            # Someone else took it out (a repair, a maintenance): not vigil's to reboot.
            raise DeliveryError(f"{decision.node} is out for someone else (reason: {reason!r}); not rebooted",
                                retryable=False)
        if self._return_to_service() == "2":
            # ReturnToService=2 makes a DOWN node that registers available again: the rebooted node
            # would be back in service before vigil verified it. Drain instead; the site reboots.
            log.warning("%s: not rebooting for %s: slurm.conf has ReturnToService=2, which returns a "
                        "rebooted node to service unverified; drained instead", decision.node, decision.id)
            return f"{self._drain(decision)} (not rebooted: slurm.conf ReturnToService=2 would skip verification)"
        reason = self.reason_for(decision)
        self._scontrol("reboot", "ASAP", "nextstate=DOWN", f"reason={reason}", decision.node)
        return f"reboot requested for {decision.node} (ASAP, next state DOWN until vigil verifies it): {reason}"

    def _return_to_service(self) -> str:
        """slurm.conf's ReturnToService as slurmctld runs it (``scontrol show config``); "" if absent."""
        for line in self._scontrol("show", "config").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "ReturnToService":
                return value.strip()
        return ""

    def _resume(self, decision: Decision) -> str:
        current = self._node(decision.node)
        state, reason = current.get("State", ""), current.get("Reason", "")
        if "DRAIN" not in state and "DOWN" not in state:
            return f"{decision.node} already in service ({state})"
        if not reason.startswith(REASON_PREFIX):
            # Someone else took it out for their own reason; that is theirs to undo. A node vigil
            # rebooted (DOWN after `reboot nextstate=DOWN`) keeps vigil's reason: Slurm appends to it.
            raise DeliveryError(f"{decision.node} was not drained by vigil (reason: {reason!r})", retryable=False)
        self._scontrol("update", f"NodeName={decision.node}", "State=RESUME")
        return f"resumed {decision.node}"

    def _job_ids(self, job: str) -> list[str]:
        if job.isdigit():
            return [job]
        try:
            out = self.run([self.config.squeue, "-h", "-n", job, "-o", "%i"], self.timeout_seconds)
        except (OSError, subprocess.SubprocessError) as exc:
            raise DeliveryError(f"squeue -n {job}: {exc}") from exc
        return out.split()

    def _requeue(self, decision: Decision) -> str:
        assert decision.job is not None  # handles() admits restart_job only with a job
        ids = self._job_ids(decision.job)
        if not ids:
            raise DeliveryError(f"no Slurm job named or numbered {decision.job!r}", retryable=False)
        done = []
        for job_id in ids:
            info = _kv(self._scontrol("show", "job", "-o", job_id))
            # Slurm's own list (possibly compressed, e.g. "vnode[2-3]"), kept as Slurm wrote it; the
            # one name vigil adds was checked above.
            excluded = [n for n in info.get("ExcNodeList", "(null)").split(",") if n and n != "(null)"]
            if info.get("JobState") in ("RUNNING", "SUSPENDED", "CONFIGURING"):
                # Held, so it cannot start again before the bad node is excluded.
                self._scontrol("requeuehold", job_id)
            if decision.node not in excluded:
                excluded.append(decision.node)
                self._scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(excluded)}")
            self._scontrol("release", job_id)
            done.append(job_id)
        return f"requeued job {','.join(done)} excluding {decision.node}"


def build(config: SlurmConfig) -> SlurmActuator:
    return SlurmActuator(config)
