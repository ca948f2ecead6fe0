"""Slurm actuator: drains, reboots, resumes, requeues and holds jobs through ``scontrol``.

It reads node and job state only from structured, non-free-text output (``sinfo --json``, ``scontrol show node
-o`` cut at ``Reason=``, ``squeue -j <numeric id> -o``) and acts only on a node or job it verified (a vigil
drain to resume, a job running on the decision's node); each refusal is a permanent DeliveryError counted in
``refusals`` by reason. It decides nothing, and never resets a GPU itself (the outbox asks the agent) nor
reboots a node unless ``reboot: true`` (docs/slurm.md, "The actuator"; docs/gate.md, "What the actuators
verify before they act").
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vigil.aggregator.actuators.actuator import ActuatorConfig, DeliveryError, job_nodes, one_node
from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision
from vigil.contract.seams import CommandRunner, run_command

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
# A Slurm job id is a uint32 (slurm.h: job_id); NO_VAL and above are never a job's id.
JOB_ID = re.compile(r"[0-9]{1,10}")
MAX_JOB_ID = 0xFFFFFFFD
# States in which a job runs and can be requeued (squeue %T); a COMPLETING one is already leaving.
REQUEUEABLE_STATES = frozenset({"RUNNING", "SUSPENDED", "CONFIGURING"})
# squeue fields with no free text in them: id, state, node list, excluded node list ("|" is in no
# node name or state). The job's name, comment or working directory are never read.
JOB_FORMAT = "%i|%T|%N|%x"
# What sinfo answers when it predates --json (Slurm < 21.08): the text parse is used instead.
NO_JSON = ("unrecognized option", "invalid option")
# Reasons a delivery was refused before anything was changed in Slurm (the `refusals` counter).
# Nodes given back by these detectors were verified (a clean period, probes passed): fit to be spares.
VERIFYING_DETECTORS = frozenset({"recovery", "probe_verdict"})
# squeue fields for hold_job: id, state, node list, priority (0: held); no free text.
HOLD_FORMAT = "%i|%T|%N|%Q"
# States in which a held job waits: a requeued-held job passes COMPLETING on its way to PENDING.
WAITING_STATES = frozenset({"PENDING", "COMPLETING", "REQUEUE_HOLD", "REQUEUED"})
REFUSAL_REASONS = ("job_not_numeric", "job_not_found", "job_not_on_node", "node_not_found", "not_drained_by_vigil",
                   "out_for_someone_else")


class SlurmConfig(ActuatorConfig):
    scontrol: str = "scontrol"
    squeue: str = "squeue"
    # Node state and reason are read with `sinfo --json` (Slurm 21.08+); an older sinfo falls back
    # to `scontrol show node -o`, read only up to its free-text Reason=.
    sinfo: str = "sinfo"
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


@dataclass(frozen=True)
class NodeState:
    """A node as slurmctld has it: ``state`` as scontrol writes it (``IDLE+DRAIN``,
    ``DOWN+REBOOT_ISSUED``) and its free-text ``reason`` ("" when none)."""

    state: str
    reason: str


def node_from_sinfo_json(text: str, node: str) -> NodeState | None:
    """``node`` in ``sinfo --json`` output (None if it is not there). 22.05 writes ``state`` as a
    word and ``state_flags`` as a list; 23.02+ writes ``state`` as a list of words. sinfo 22.05
    ignores ``-n`` with ``--json``, so the entry is picked by its exact name."""
    for entry in _sinfo_entries(text):
        if entry.get("name") != node:
            continue
        state = _state_of(entry)
        if state is None:
            raise DeliveryError(f"sinfo --json: node {node} has no readable state ({entry.get('state')!r}, "
                                f"{entry.get('state_flags')!r})")
        reason = entry.get("reason")
        return NodeState(state, reason if isinstance(reason, str) else "")
    return None


def _sinfo_entries(text: str) -> list[dict[str, object]]:
    """The node entries of ``sinfo --json`` output (those that are objects)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise DeliveryError(f"sinfo --json: not JSON ({exc})") from None
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, list):
        raise DeliveryError("sinfo --json: no node list in its answer")
    return [entry for entry in nodes if isinstance(entry, dict)]


def _state_of(entry: dict[str, object]) -> str | None:
    """An entry's state words, upper case, "+"-joined (``IDLE+DRAIN``); None if unreadable."""
    base, flags = entry.get("state"), entry.get("state_flags") or []
    words = [*base] if isinstance(base, list) else [base] if isinstance(base, str) else []
    words += flags if isinstance(flags, list) else []
    if not words or not all(isinstance(w, str) for w in words):
        return None
    return "+".join(str(w).upper() for w in words)


def _features(value: object) -> list[str]:
    """A feature list as sinfo writes it: "a,b" (22.05), a list (23.02+), "" or "(null)": none."""
    words = value if isinstance(value, list) else str(value or "").split(",")
    return [w for w in (str(x).strip() for x in words) if w and w != "(null)"]


def nodes_from_sinfo_json(text: str) -> list[tuple[str, str, list[str], list[str]]]:
    """Every node of ``sinfo --json``: (name, state words "+"-joined, upper case, available and
    active features). An entry without a readable name or state is skipped."""
    out = []
    for entry in _sinfo_entries(text):
        name, state = entry.get("name"), _state_of(entry)
        if isinstance(name, str) and state is not None:
            out.append((name, state, _features(entry.get("features")), _features(entry.get("active_features"))))
    return out


def nodes_from_sinfo_text(text: str) -> list[tuple[str, str, list[str], list[str]]]:
    """``sinfo -h -N -o %N|%T|%f|%b`` (name, state, available and active features: no free text),
    for a sinfo without --json. %T writes flags as suffixes ("idle~", "idle*", "drained")."""
    out = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4:
            continue
        name, state, available, active = fields
        out.append((name, state.upper(), _features(available), _features(active)))
    return out


def node_from_scontrol_text(line: str) -> NodeState:
    """``scontrol show node -o`` output, for a Slurm whose sinfo has no ``--json``. Every field
    is read from the text before the first `` Reason=`` only (scontrol prints the free-text reason
    after State, near the end of the line), and the first ``State=`` wins: no reason can forge one."""
    head, sep, tail = line.rstrip("\n").partition(" Reason=")
    state = re.search(r"(?:^| )State=(\S+)", head)
    if state is None:
        raise DeliveryError(f"scontrol show node: no State= in {head[:120]!r}")
    # Slurm appends " [user@time]" to the reason it stores.
    reason = re.sub(r" \[[^\]]*\]\s*$", "", tail).strip() if sep else ""
    return NodeState(state.group(1), reason)


class SlurmActuator:
    name = "slurm"
    notify_in_dry_run = False

    def __init__(self, config: SlurmConfig, run: CommandRunner | None = None) -> None:
        self.config = config
        self.timeout_seconds = config.timeout_seconds
        if run is None:
            run = functools.partial(_run_with_conf, config.slurm_conf) if config.slurm_conf else run_command
        self.run = run
        # None until the first read: whether sinfo takes --json (one answer per process).
        self._sinfo_json: bool | None = None
        # Whether a verified node should join the spare pool (the app sets the pool's wants_spare);
        # the feature it gets, and the nodes added (and failures to), for the pool's metrics.
        self.spare_wanted: Callable[[], bool] = lambda: False
        self.spare_feature = "vigil_spare"
        self.spares_added = 0
        self.spares_add_failed = 0
        # reason -> deliveries refused before anything changed in Slurm; deliveries run in the
        # dispatcher's threads, hence the lock.
        self.refusals: Counter[str] = Counter(dict.fromkeys(REFUSAL_REASONS, 0))
        self._refusals_lock = threading.Lock()

    def handles(self, decision: Decision) -> bool:
        if decision.action in (Action.RESTART_JOB, Action.HOLD_JOB):
            return decision.job is not None
        return decision.action in REMOVING_ACTIONS or decision.action is Action.RESUME

    def deliver(self, decision: Decision) -> str:
        if decision.action is Action.RESTART_JOB:
            return self._requeue(decision)  # job_nodes checks each node name it uses
        if decision.action is Action.HOLD_JOB:
            return self._hold(decision)
        one_node(decision.node or "")  # one node per scontrol call, never a hostlist expression
        if decision.action is Action.RESUME:
            return self._resume(decision)
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

    def _refuse(self, decision: Decision, reason: str, message: str) -> DeliveryError:
        """A permanent DeliveryError for ``decision``, counted under ``reason`` and logged."""
        with self._refusals_lock:
            self.refusals[reason] += 1
        log.error("slurm: refusing %s %s on %s (%s): %s", decision.action.value, decision.id, decision.subject,
                  reason, message)
        return DeliveryError(message, retryable=False)

    def _command(self, argv: Sequence[str]) -> str:
        try:
            return self.run(list(argv), self.timeout_seconds)
        except subprocess.CalledProcessError as exc:
            said = " ".join(f"{exc.stdout or ''} {exc.stderr or ''}".split())
            message = f"{' '.join(argv)[:200]}: {said or f'exit status {exc.returncode}'}"
            raise DeliveryError(message, retryable=not any(p in message for p in PERMANENT_ERRORS)) from exc
        except (OSError, subprocess.SubprocessError) as exc:
            raise DeliveryError(f"{argv[0]} {argv[1] if len(argv) > 1 else ''}: {exc}") from exc

    def _scontrol(self, *args: str) -> str:
        return self._command([self.config.scontrol, *args])

    def _node(self, decision: Decision) -> NodeState:
        node = decision.node or ""  # deliver checked it with one_node: a node action names its node
        if self._sinfo_json is not False:
            try:
                found = node_from_sinfo_json(self._command([self.config.sinfo, "--json", "-N", "-n", node]), node)
            except DeliveryError as exc:
                if self._sinfo_json is not None or not any(s in str(exc) for s in NO_JSON):
                    raise
                self._sinfo_json = False
                log.warning("slurm: %s has no --json (%s); node state is read from `scontrol show node -o` "
                            "up to its Reason= instead", self.config.sinfo, exc)
            else:
                self._sinfo_json = True
                if found is None:
                    raise self._refuse(decision, "node_not_found", f"sinfo does not list node {node}")
                return found
        return node_from_scontrol_text(self._scontrol("show", "node", "-o", node))

    def _drain(self, decision: Decision) -> str:
        current = self._node(decision)
        if "DRAIN" in current.state and decision.id in current.reason:
            return f"{decision.node} already drained for {decision.id}"
        reason = self.reason_for(decision)
        self._scontrol("update", f"NodeName={decision.node}", "State=DRAIN", f"Reason={reason}")
        return f"drained {decision.node}: {reason}"

    def _reboot(self, decision: Decision) -> str:
        current = self._node(decision)
        state, reason = current.state, current.reason
        if decision.id in reason and any(s in state for s in ("REBOOT", "DOWN", "DRAIN")):
            return f"{decision.node} reboot already requested for {decision.id} ({state})"
        if ("DRAIN" in state or "DOWN" in state) and reason and not reason.startswith(REASON_PREFIX):
            # Someone else took it out (a repair, a maintenance): not vigil's to reboot.
            raise self._refuse(decision, "out_for_someone_else",
                               f"{decision.node} is out for someone else (reason: {reason!r}); not rebooted")
        if self._return_to_service() == "2":
            # ReturnToService=2 makes a DOWN node that registers available again: the rebooted node
            # would be back in service before vigil verified it. Drain instead; the site reboots.
            log.warning("%s: not rebooting for %s: slurm.conf has ReturnToService=2, which returns a "
                        "rebooted node to service unverified; drained instead", decision.node, decision.id)
            return f"{self._drain(decision)} (not rebooted: slurm.conf ReturnToService=2 would skip verification)"
        reason = self.reason_for(decision)
        self._scontrol("reboot", "ASAP", "nextstate=DOWN", f"reason={reason}", decision.node or "")
        return f"reboot requested for {decision.node} (ASAP, next state DOWN until vigil verifies it): {reason}"

    def _return_to_service(self) -> str:
        """slurm.conf's ReturnToService as slurmctld runs it (``scontrol show config``); "" if absent."""
        for line in self._scontrol("show", "config").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "ReturnToService":
                return value.strip()
        return ""

    def _resume(self, decision: Decision) -> str:
        current = self._node(decision)
        state, reason = current.state, current.reason
        if "DRAIN" not in state and "DOWN" not in state:
            return f"{decision.node} already in service ({state})"
        if not reason.startswith(REASON_PREFIX):
            # Someone else took it out for their own reason; that is theirs to undo. A node vigil
            # rebooted (DOWN after `reboot nextstate=DOWN`) keeps vigil's reason: Slurm appends to it.
            raise self._refuse(decision, "not_drained_by_vigil",
                               f"{decision.node} was not drained by vigil (reason: {reason!r})")
        self._scontrol("update", f"NodeName={decision.node}", "State=RESUME")
        done = f"resumed {decision.node}"
        if decision.detector in VERIFYING_DETECTORS and self.spare_wanted():
            done += self._add_spare(decision.node or "")
        return done

    def _add_spare(self, node: str) -> str:
        """The pool's feature added to ``node`` (verified just now); a failure leaves the resume done."""
        feature = self.spare_feature
        try:
            available, active = self._features(node)
            if feature in active:
                return f"; already a spare ({feature})"
            self._scontrol("update", f"NodeName={node}", "AvailableFeatures=" + ",".join([*available, feature]
                                                                                      if feature not in available
                                                                                      else available),
                           "ActiveFeatures=" + ",".join([*active, feature]))
        except DeliveryError as exc:
            self.spares_add_failed += 1
            log.error("slurm: %s resumed, but not added to the spare pool (feature %s): %s", node, feature, exc)
            return f"; not added to the spare pool: {exc}"
        self.spares_added += 1
        log.info("slurm: %s added to the spare pool (feature %s)", node, feature)
        return f"; added to the spare pool (feature {feature})"

    def _features(self, node: str) -> tuple[list[str], list[str]]:
        """``node``'s available and active features."""
        for name, _, available, active in self._sinfo_nodes([node]):
            if name == node:
                return available, active
        raise DeliveryError(f"sinfo does not list node {node}", retryable=False)

    def _sinfo_nodes(self, nodes: Sequence[str] = ()) -> list[tuple[str, str, list[str], list[str]]]:
        """(name, state words joined by "+", available features, active features) per node."""
        if self._sinfo_json is not False:
            try:
                text = self._command([self.config.sinfo, "--json", *(["-N", "-n", ",".join(nodes)] if nodes else [])])
            except DeliveryError as exc:
                if self._sinfo_json is not None or not any(s in str(exc) for s in NO_JSON):
                    raise
                self._sinfo_json = False
            else:
                self._sinfo_json = True
                return nodes_from_sinfo_json(text)
        argv = [self.config.sinfo, "-h", "-N", "-o", "%N|%T|%f|%b", *(["-n", ",".join(nodes)] if nodes else [])]
        return nodes_from_sinfo_text(self._command(argv))

    def spare_nodes(self, feature: str) -> list[str]:
        """The idle nodes (no flag: not draining, down, reserved...) with the active ``feature``."""
        return sorted({name for name, state, _, active in self._sinfo_nodes()
                       if state == "IDLE" and feature in active})

    def _hostnames(self, hostlist: str) -> list[str]:
        """A Slurm hostlist (``vnode[2-3],gpu7``) as names, expanded by Slurm itself."""
        if not hostlist or hostlist == "(null)":
            return []
        return self._scontrol("show", "hostnames", hostlist).split()

    def _read_job(self, decision: Decision, fmt: str) -> tuple[str, list[str], list[str]]:
        """The job's numeric id, its squeue fields in ``fmt`` (4 of them) and the nodes that
        reported it; each refusal counted before Slurm is changed."""
        assert decision.job is not None  # handles() admits job actions only with a job
        job = decision.job
        if JOB_ID.fullmatch(job) is None or not 0 < int(job) <= MAX_JOB_ID:
            # A name would go to `squeue -n`, which reads "a,b" as two names: other teams' jobs.
            raise self._refuse(decision, "job_not_numeric",
                               f"job {job[:80]!r} is not a Slurm job id (a number); only ids are acted on")
        job_id = str(int(job))
        try:  # each a node name (one_node), before Slurm is asked anything
            reported = job_nodes(decision)
        except DeliveryError as exc:
            raise self._refuse(decision, "job_not_on_node", str(exc)) from None
        try:
            line = self._command([self.config.squeue, "-h", "-j", job_id, "-o", fmt]).strip()
        except DeliveryError as exc:
            if exc.retryable:
                raise
            raise self._refuse(decision, "job_not_found", f"Slurm has no job {job_id}: {exc}") from None
        if not line:
            # squeue answered (exit 0) with no line: slurmctld between two records of the job (seen
            # right after a requeue, as it leaves COMPLETING) or a job that just ended. An unknown id
            # is an error from squeue ("Invalid job id specified", refused above); this is retried.
            raise DeliveryError(f"squeue listed nothing for job {job_id} (between states?); retrying")
        fields = line.split("|")
        if len(fields) != 4 or fields[0] != job_id:
            raise self._refuse(decision, "job_not_found", f"Slurm has no job {job_id} (squeue: {line[:120]!r})")
        return job_id, fields, reported

    def _hold(self, decision: Decision) -> str:
        """Stop the job's restart loop: requeue it held (running), or find it held already."""
        job_id, (_, state, nodes, priority), reported = self._read_job(decision, HOLD_FORMAT)
        if state in WAITING_STATES and priority.strip() == "0":
            return f"job {job_id} is held ({state}, priority 0)"
        if state not in REQUEUEABLE_STATES:
            # Pending (not held) or ending: it runs on no node, so no report vouches for it. A
            # retry holds it once it runs again on a node that reported it.
            raise DeliveryError(f"job {job_id} is {state}, on no node: held once it runs again")
        if not set(reported) & set(self._hostnames(nodes)):
            raise self._refuse(decision, "job_not_on_node", f"job {job_id} ({state}) runs on {nodes or 'no node'}, "
                               f"on none of the nodes that reported it ({', '.join(reported)}); not held")
        self._scontrol("requeuehold", job_id)
        return f"job {job_id} requeued held: its restart loop is stopped until a person releases it"

    def _requeue(self, decision: Decision) -> str:
        job_id, (_, state, nodes, excluded_list), reported = self._read_job(decision, JOB_FORMAT)
        if decision.node is None:
            return self._requeue_job(decision, job_id, state, nodes, reported)
        excluded = self._hostnames(excluded_list)
        on_node = decision.node in self._hostnames(nodes)
        if not on_node and decision.node not in excluded:
            # Neither on the node (squeue's node list, expanded by Slurm) nor requeued from it by an
            # earlier delivery of this decision: someone else's job, whatever the report claimed.
            raise self._refuse(decision, "job_not_on_node", f"job {job_id} ({state}) runs on "
                               f"{nodes or 'no node'}, not on {decision.node}; not requeued")
        if on_node and state in REQUEUEABLE_STATES:
            # Held, so it cannot start again before the bad node is excluded.
            self._scontrol("requeuehold", job_id)
        if decision.node not in excluded:
            # Slurm's own list (possibly compressed, e.g. "vnode[2-3]"), kept as Slurm wrote it; the
            # one name vigil adds was checked by one_node.
            new = f"{excluded_list},{decision.node}" if excluded_list else decision.node
            self._scontrol("update", f"JobId={job_id}", f"ExcNodeList={new}")
        self._scontrol("release", job_id)
        return f"requeued job {job_id} excluding {decision.node}"

    def _requeue_job(self, decision: Decision, job_id: str, state: str, nodes: str, reported: list[str]) -> str:
        """A job-level restart: requeue the job, excluding no node (none is to blame)."""
        if state not in REQUEUEABLE_STATES:
            # Requeued by an earlier delivery of this decision, or ended: nothing runs to restart.
            return f"job {job_id} is {state}, not running: nothing requeued"
        if not set(reported) & set(self._hostnames(nodes)):
            raise self._refuse(decision, "job_not_on_node", f"job {job_id} ({state}) runs on {nodes or 'no node'}, "
                               f"on none of the nodes that reported it ({', '.join(reported)}); not requeued")
        self._scontrol("requeue", job_id)
        return f"requeued job {job_id} (a job-level restart: no node excluded)"


def build(config: SlurmConfig) -> SlurmActuator:
    return SlurmActuator(config)
