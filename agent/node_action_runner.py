"""The node-action runner: carries out what the aggregator asks of this node, if every check passes.

It reads one signed ``NodeActionRequest`` (contract/node_actions.py: the table, the key, the
signature), checks it in a fixed order (allowed by ``node_actions.allow``, this node, this boot,
not expired, signed under this node's key, for ``reset_gpu`` the named GPU and that no compute
process holds it) right before it runs it, so a request that waited in the queue past its offer's
short validity (the aggregator stopped offering it: the node was resumed or held) is refused
``expired``. Then it runs it: a GPU reset through the NVML backend's ``reset_gpu``, a
reboot request as the reboot daemon's sentinel file, or ``run_probes`` (agent/probes/: the named
probes in the table's order, within ``probes.run_timeout_seconds``, refused ``busy`` while a
compute process holds a GPU unless every probe named is non-intrusive and listed in
``probes.allow_with_job``; the result carries each probe's measurement, signed under the node key).
It returns a ``NodeActionResult`` and counts it in ``vigil_agent_node_actions_total`` (and each
probe in ``vigil_agent_probe_runs_total``); every refusal is logged. It runs nothing it was not
asked for, nothing twice for one id in a boot, and never reboots anything itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import Field, field_validator, model_validator

from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.probes import PROBES, ProbeSpec
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.agent.probes.engine import ComputeEngine
from vigil.contract.node_actions import NODE_ACTIONS, sign_result, signature_ok
from vigil.contract.seams import Clock, CommandRunner, run_command
from vigil.contract.validation import StrictModel
from vigil.contract.wire import (
    MAX_PROBE_RESULTS,
    NodeActionName,
    NodeActionOutcome,
    NodeActionRequest,
    NodeActionResult,
    ProbeName,
    ProbeResult,
    SchemaError,
    check,
)
from vigil.contract.wire import replace as wire_replace

log = logging.getLogger("vigil.contract.node_actions")

# kured's default sentinel (https://kured.dev/docs/configuration/, --reboot-sentinel): its
# presence makes kured drain and reboot the node under its own cluster-wide lock.
DEFAULT_REBOOT_SENTINEL = "/var/run/reboot-required"
# nvidia-smi --gpu-reset returns within seconds on a healthy board; past this it is stuck.
RESET_TIMEOUT_SECONDS = 60.0
# How far the aggregator's clock may run ahead of this node's: a request issued up to this long
# "in the future" is still taken. NTP keeps a fleet within milliseconds; a minute covers a node
# whose clock is plainly wrong without widening the replay window much.
CLOCK_SKEW_SECONDS = 60.0
# Request ids remembered per boot (repeats get their first result): far more than a node sees in
# flight (one per GPU), so a repeat within any realistic retry window is answered, not re-run.
REMEMBERED_IDS = 256
# The node key file holds the 32-byte node key as hex (node_actions.node_key; `vigil token`).
NODE_KEY_HEX_CHARS = 64
# Health states in which NVML cannot list a GPU's processes because the GPU itself is faulted: a
# reset is what they need, and nvidia-smi refuses to reset a GPU a process holds on its own.
_FAULTED = ("lost", "reset_required")
# nvidia-smi's answer when a process holds the GPU it was asked to reset ("GPU 00000000:4C:00.0 is
# currently in use by another process."): a busy GPU, not a failed reset.
_IN_USE = "in use by another process"
# Refusals that may pass on a later offer: not remembered, so the aggregator's next offer of the
# same id is checked afresh (aggregator/outbox.py keeps such a request pending and offers it
# again): the job holding the GPU ends (busy, processes_unknown), or an offer expired before it ran
# (the aggregator signs each offer valid for node_actions.offer_ttl_seconds, a minute by default,
# so that a request it voided when the node's removal ended dies here too; while the request
# stands, a fresh offer follows). Every other
# result is final for its id in this boot.
# A probe run abandoned past its timeout may still hold the GPUs (probe_running): asked again
# once it has ended.
_TRANSIENT_REASONS = frozenset({"busy", "processes_unknown", "expired", "probe_running"})
# The probes that measure through the compute engine (agent/probes/engine.py): without one (no
# torch on this node) they are reported skipped, reason no_engine, not run.
ENGINE_PROBES: frozenset[ProbeName] = frozenset({"gpu_compute", "gpu_memory", "gpu_p2p"})
# A probe's worst status names its run in vigil_agent_probe_runs_total (one count per probe run,
# whatever its number of per-GPU results).
_STATUS_ORDER = ("error", "fail", "pass", "skipped")

OUTCOMES = ("done", "refused", "failed", "repeat")
REASONS = ("done", "not_allowed", "wrong_node", "stale_boot", "expired", "bad_signature", "unknown_gpu",
           "busy", "processes_unknown", "command_failed", "write_failed", "bad_request", "probe_running")
NODE_ACTIONS_TOTAL = MetricSpec(
    "vigil_agent_node_actions_total", MetricKind.COUNTER,
    "Node actions the aggregator asked for, by action and outcome: done, refused (a check failed, nothing "
    "was run), failed (it ran and did not succeed) or repeat (an id already handled this boot: its first "
    "result sent again, nothing run); reason says which check or failure (not_allowed, wrong_node, "
    "stale_boot, expired, bad_signature, unknown_gpu, busy, processes_unknown, command_failed, write_failed, "
    "bad_request, probe_running).",
    labels=("action", "outcome", "reason"))
PROBE_RUNS_TOTAL = MetricSpec(
    "vigil_agent_probe_runs_total", MetricKind.COUNTER,
    "Probes run on the aggregator's request (run_probes), by probe and status: pass, fail (an absolute check "
    "failed), error (it could not finish: timeout, peer_timeout, a crash) or skipped (not installed, not "
    "applicable); one count per probe run, its worst status over its per-GPU results.",
    labels=("probe", "status"))
PROBE_SECONDS = MetricSpec(
    "vigil_agent_probe_seconds", MetricKind.GAUGE,
    "How long the last run of each probe took, in seconds; 0 until it has run (a probe stopped at "
    "probes.run_timeout_seconds reports the time it was given).",
    labels=("probe",))
NODE_ACTION_SPECS = (NODE_ACTIONS_TOTAL, PROBE_RUNS_TOTAL, PROBE_SECONDS)


class NodeActionsConfig(StrictModel):
    # Nothing is allowed unless listed here: an agent does no node action by default.
    allow: list[NodeActionName] = Field(default_factory=list)
    # This node's key (64 hex characters: HMAC-SHA256 of the node's name under the aggregator's
    # node-action master key, written by `vigil token node-key`). Requests are verified with it; required
    # when `allow` lists anything.
    key_file: str | None = None
    # nvidia-smi --gpu-reset is stopped (and the action reported failed) after this long.
    reset_timeout_seconds: float = Field(default=RESET_TIMEOUT_SECONDS, gt=0, le=600)
    # request_reboot writes this file; the site's reboot daemon (kured by default) does the rest.
    reboot_sentinel_path: str = DEFAULT_REBOOT_SENTINEL

    @field_validator("allow")
    @classmethod
    def _no_repeats(cls, allow: list[str]) -> list[str]:
        if len(set(allow)) != len(allow):
            raise ValueError("lists an action twice")
        return allow

    @field_validator("reboot_sentinel_path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not Path(path).is_absolute():
            raise ValueError("must be an absolute path")
        return path

    @model_validator(mode="after")
    def _allow_needs_key(self) -> NodeActionsConfig:
        if self.allow and not self.key_file:
            raise ValueError("node_actions.allow needs node_actions.key_file (the node key requests are signed with)")
        return self


def read_node_key(path: str | Path) -> bytes:
    """The node key in ``path`` (64 hex characters, surrounding whitespace ignored); ValueError
    naming the file otherwise, OSError if it cannot be read."""
    text = Path(path).read_text().strip()
    if len(text) != NODE_KEY_HEX_CHARS:
        raise ValueError(f"{path}: a node key is {NODE_KEY_HEX_CHARS} hex characters, got {len(text)} characters")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: a node key is {NODE_KEY_HEX_CHARS} hex characters (0-9, a-f)") from None


class GpuBackend(Protocol):
    """What the runner needs of the NVML backend (agent/nvml/backend.py's PynvmlBackend)."""

    def device_count(self) -> int: ...
    def identity(self, index: int) -> Any: ...
    def running_pids(self, index: int) -> list[int] | None: ...
    def read(self, index: int, *, slow: bool = True) -> Any: ...
    def reset_gpu(self, index: int, timeout_seconds: float = ...) -> str: ...


@dataclass(frozen=True)
class ProbeWorld:
    """What ``run_probes`` needs besides the request: the ``probes`` configuration and every seam a
    probe reaches the world through (agent/probes/context.py's ProbeContext is built from it per
    probe). ``table`` is the probe table (agent.probes.PROBES; a test hands in one whose probe
    functions it controls, e.g. the collective with a delaying ``comm``)."""

    config: ProbesConfig = field(default_factory=ProbesConfig)
    engine: ComputeEngine | None = None  # agent.probes.engine.build_engine(nvml); None: no torch
    run: CommandRunner = run_command
    monotonic: Clock = time.monotonic  # durations and the run's deadline (never the wall clock)
    sysfs_root: Path = Path("/sys")
    table: Mapping[ProbeName, ProbeSpec] = field(default_factory=lambda: dict(PROBES))


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class NodeActionRunner:
    """Checks and runs node action requests for one node and boot. ``handle`` blocks (a GPU reset
    takes seconds): call it off the event loop. Thread-safe; requests run one at a time."""

    def __init__(self, config: NodeActionsConfig, *, node: str, boot_id: str, nvml: GpuBackend | None,
                 clock: Callable[[], float], probes: ProbeWorld | None = None) -> None:
        self._config = config
        self._node = node
        self._boot_id = boot_id
        self._nvml = nvml
        self._clock = clock
        self._probes = probes or ProbeWorld()
        self._key = read_node_key(config.key_file) if config.key_file else None
        self._lock = threading.Lock()  # one request at a time
        self._handled: OrderedDict[str, NodeActionResult] = OrderedDict()
        # The counters have a lock of their own: a scrape must not wait for a probe run (minutes).
        self._metrics_lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}
        self._probe_counts: dict[tuple[str, str], int] = {}
        self._probe_seconds: dict[str, float] = {}
        # A probe thread left running past the run's timeout (a thread cannot be killed): while it
        # lives, no other run_probes starts (probe_running), so two probes never share the GPUs.
        self._abandoned: list[threading.Thread] = []

    def samples(self) -> list[Sample]:
        with self._metrics_lock:
            counts = dict(self._counts)
            probe_counts = dict(self._probe_counts)
            probe_seconds = dict(self._probe_seconds)
        # A zero for each action's "done", so the series exists before anything was asked.
        for action in NODE_ACTIONS:
            counts.setdefault((action, "done", "done"), 0)
        for probe in self._probes.table:
            probe_counts.setdefault((probe, "pass"), 0)
            probe_seconds.setdefault(probe, 0.0)
        return [*(Sample.of(NODE_ACTIONS_TOTAL, n, action=a, outcome=o, reason=r) for (a, o, r), n in counts.items()),
                *(Sample.of(PROBE_RUNS_TOTAL, n, probe=p, status=st) for (p, st), n in probe_counts.items()),
                *(Sample.of(PROBE_SECONDS, v, probe=p) for p, v in probe_seconds.items())]

    def handle(self, request: NodeActionRequest) -> NodeActionResult:
        """The result of ``request``: checked, then run if every check passed."""
        with self._lock:
            authentic = self._key is not None and signature_ok(request, self._key)
            first = self._handled.get(request.id) if authentic else None
            if first is not None:
                self._count(request.action, "repeat", first.reason)
                log.info("node action %s (%s) already handled in this boot: its result (%s) sent again, "
                         "nothing run", request.id, request.action, first.outcome)
                return first
            try:
                self._check(request, authentic)
            except _Refused as refused:
                result = self._result(request, "refused", refused.reason, refused.detail)
            else:
                result = self._run(request)
            if request.action == "run_probes" and authentic and self._key is not None:
                # Bound to the request id, this node and boot; signed under the node key.
                result = sign_result(wire_replace(result, node=self._node, boot_id=self._boot_id), self._key)
            # A forged request cannot claim an id and so void the real one; a busy GPU is asked again.
            if authentic and result.reason not in _TRANSIENT_REASONS:
                self._handled[request.id] = result
                while len(self._handled) > REMEMBERED_IDS:
                    self._handled.popitem(last=False)
            self._count(request.action, result.outcome, result.reason)
            level = logging.INFO if result.outcome == "done" else logging.WARNING
            log.log(level, "node action %s %s%s for %s: %s (%s)%s", request.id, request.action,
                    "" if request.gpu is None else f" on GPU {request.gpu}", request.node, result.outcome,
                    result.reason, f": {result.detail}" if result.detail else "")
            return result

    # --- checks, in order -------------------------------------------------------------------

    def _check(self, request: NodeActionRequest, authentic: bool) -> None:
        if request.action not in NODE_ACTIONS or request.action not in self._config.allow:
            raise _Refused("not_allowed", f"{request.action} is not in this agent's node_actions.allow")
        if self._key is None:
            raise _Refused("not_allowed", "no node_actions.key_file: this agent cannot verify requests")
        if request.node != self._node:
            raise _Refused("wrong_node", f"addressed to {request.node}, this is {self._node}")
        if request.boot_id != self._boot_id:
            raise _Refused("stale_boot", f"issued for boot {request.boot_id}, this boot is {self._boot_id}")
        now = self._clock()
        if not request.issued_at - CLOCK_SKEW_SECONDS <= now <= request.expires_at:
            raise _Refused("expired", f"valid from {request.issued_at:.0f} (less {CLOCK_SKEW_SECONDS:.0f} s skew) "
                                      f"to {request.expires_at:.0f}, now {now:.0f}")
        if not authentic:
            raise _Refused("bad_signature", "signature does not verify under this node's key")
        if NODE_ACTIONS[request.action].needs_gpu:
            self._check_gpu(request)
        if request.action == "run_probes":
            self._check_probes(request)

    def _check_probes(self, request: NodeActionRequest) -> None:
        table = self._probes.table
        if not request.probes:
            raise _Refused("bad_request", "run_probes names no probe")
        unknown = [p for p in request.probes if p not in table]
        if unknown:
            raise _Refused("bad_request", f"no such probe on this agent: {', '.join(unknown)}")
        grouped = [p for p in request.probes if table[p].needs_group]
        if grouped and request.probe_group is None:
            raise _Refused("bad_request", f"{', '.join(grouped)} needs a probe group and the request names none")
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        if self._abandoned:
            raise _Refused("probe_running", f"{len(self._abandoned)} probe(s) of an earlier run passed its timeout "
                                            "and still run")
        # Intrusive probes never run beside a job; a non-intrusive one only where allow_with_job lists it.
        beside_job = set(self._probes.config.allow_with_job)
        needs_idle = [p for p in request.probes if table[p].intrusive or p not in beside_job]
        if needs_idle and self._nvml is not None:
            self._check_idle(needs_idle)

    def _check_idle(self, probes: list[ProbeName]) -> None:
        nvml = self._nvml
        assert nvml is not None
        try:
            count = nvml.device_count()
        except Exception as exc:  # noqa: BLE001 - any NVMLError: the node's GPUs cannot be listed
            raise _Refused("processes_unknown", f"cannot count the GPUs through NVML: {exc}") from None
        held: list[str] = []
        for index in range(count):
            pids = nvml.running_pids(index)
            if pids is None:
                raise _Refused("processes_unknown", f"NVML cannot list GPU {index}'s processes: "
                                                    f"{', '.join(probes)} must not run beside a job")
            if pids:
                held.append(f"GPU {index}: pids {', '.join(map(str, sorted(pids)))}")
        if held:
            raise _Refused("busy", f"{', '.join(probes)} never run beside a job; "
                                   f"compute processes on {'; '.join(held)}")

    def _check_gpu(self, request: NodeActionRequest) -> None:
        nvml, index = self._nvml, request.gpu
        if nvml is None:
            raise _Refused("unknown_gpu", "NVML is not available on this node")
        if index is None or not request.gpu_uuid:
            raise _Refused("unknown_gpu", "the request names no GPU index and uuid")
        try:
            count = nvml.device_count()
            uuid = nvml.identity(index).uuid if index < count else None
        except Exception as exc:  # noqa: BLE001 - any NVMLError: the GPU cannot be identified
            raise _Refused("unknown_gpu", f"cannot read GPU {index}'s uuid from NVML: {exc}") from None
        if uuid is None:
            raise _Refused("unknown_gpu", f"no GPU {index} on this node ({count} GPUs)")
        if uuid != request.gpu_uuid:
            raise _Refused("unknown_gpu", f"GPU {index} is {uuid}, not {request.gpu_uuid}")
        pids = nvml.running_pids(index)
        if pids:
            raise _Refused("busy", f"compute processes on GPU {index}: pids {', '.join(map(str, sorted(pids)))}")
        if pids is None:
            health = nvml.read(index, slow=False).health
            if health not in _FAULTED:
                raise _Refused("processes_unknown", f"NVML cannot list GPU {index}'s processes (health {health})")
            # A lost or reset-required GPU answers no NVML query; nvidia-smi checks for users itself.

    # --- running ----------------------------------------------------------------------------

    def _run(self, request: NodeActionRequest) -> NodeActionResult:
        if request.action == "run_probes":
            return self._run_probes(request)
        if request.action == "reset_gpu":
            assert self._nvml is not None and request.gpu is not None  # _check_gpu
            try:
                output = self._nvml.reset_gpu(request.gpu, timeout_seconds=self._config.reset_timeout_seconds)
            except subprocess.TimeoutExpired:
                return self._result(request, "failed", "command_failed",
                                    f"nvidia-smi --gpu-reset did not finish in {self._config.reset_timeout_seconds} s")
            except subprocess.CalledProcessError as exc:
                said = " ".join(str(part).strip() for part in (exc.stderr, exc.output) if part)
                if _IN_USE in said:  # nvidia-smi saw a process NVML could not list: nothing was reset
                    return self._result(request, "refused", "busy", said)
                return self._result(request, "failed", "command_failed", f"{exc}{': ' + said if said else ''}")
            except Exception as exc:  # noqa: BLE001 - OSError (no nvidia-smi), an NVMLError reading the bus id
                return self._result(request, "failed", "command_failed", f"{type(exc).__name__}: {exc}")
            return self._result(request, "done", "done", output.strip())
        path = self._config.reboot_sentinel_path
        try:
            _write_atomically(Path(path), f"vigil node action {request.id}: {request.reason}\n")
        except OSError as exc:
            return self._result(request, "failed", "write_failed", f"cannot write {path}: {exc}")
        return self._result(request, "done", "done", f"wrote {path}")

    def _run_probes(self, request: NodeActionRequest) -> NodeActionResult:
        """Every probe the request names, in the table's order, within the run's timeout. A probe runs
        in a thread of its own: one that overruns is reported error/timeout and left behind (Python
        cannot stop a thread; its own deadline, ``ProbeContext.deadline``, is the run's, so a
        well-behaved probe ends soon after), the rest skipped (run_timeout); a probe that raises is
        reported error with the exception, and the run goes on."""
        world = self._probes
        started = world.monotonic()
        deadline = started + world.config.run_timeout_seconds
        try:
            gpus = list(range(self._nvml.device_count())) if self._nvml is not None else []
        except Exception:  # noqa: BLE001 - NVML gone since the checks: no GPU to probe
            gpus = []
        results: list[ProbeResult] = []
        timed_out = False
        for name in [p for p in world.table if p in request.probes]:
            probe_started = world.monotonic()
            if timed_out or probe_started >= deadline:
                got = [ProbeResult(probe=name, status="skipped", reason="run_timeout",
                                   detail=f"not run: the run's {world.config.run_timeout_seconds:g} s were spent")]
            elif name in ENGINE_PROBES and world.engine is None:
                got = [ProbeResult(probe=name, status="skipped", reason="no_engine",
                                   detail="no compute engine on this node (torch is not installed)")]
            else:
                ctx = ProbeContext(config=world.config, gpus=gpus, nvml=self._nvml, engine=world.engine,
                                   run=world.run, clock=world.monotonic, deadline=deadline,
                                   group=request.probe_group, quick=request.quick, sysfs_root=world.sysfs_root)
                got, timed_out = self._run_one(name, world.table[name], ctx, deadline - probe_started)
            self._count_probe(name, got, world.monotonic() - probe_started)
            results.extend(got)
        summary = ", ".join(f"{p} {_worst(p, results)}" for p in world.table if p in request.probes)
        return wire_replace(self._result(request, "done", "done", summary), probes=results[:MAX_PROBE_RESULTS])

    def _run_one(self, name: ProbeName, spec: ProbeSpec, ctx: ProbeContext,
                 seconds: float) -> tuple[list[ProbeResult], bool]:
        """``spec.run(ctx)`` in a worker thread given ``seconds``: its checked results, and whether it
        overran (then it is left running, remembered in ``_abandoned``)."""
        box: list[list[ProbeResult] | BaseException] = []
        done = threading.Event()

        def work() -> None:
            try:
                box.append(spec.run(ctx))
            except BaseException as exc:  # noqa: BLE001 - reported as the probe's error, never a crash
                box.append(exc)
            finally:
                done.set()

        worker = threading.Thread(target=work, name=f"vigil-probe-{name}", daemon=True)
        worker.start()
        if not done.wait(max(0.0, seconds)):
            self._abandoned.append(worker)
            log.error("probe %s did not return within the run's %g s: reported as timed out and left running",
                      name, self._probes.config.run_timeout_seconds)
            return [ProbeResult(probe=name, status="error", reason="timeout",
                                detail=f"did not return within {seconds:.1f} s (probes.run_timeout_seconds)",
                                seconds=seconds)], True
        outcome = box[0]
        if isinstance(outcome, BaseException):
            log.warning("probe %s raised %s: %s", name, type(outcome).__name__, outcome)
            return [ProbeResult(probe=name, status="error", reason="crashed",
                                detail=f"{type(outcome).__name__}: {outcome}")], False
        return [_checked(name, r) for r in outcome], False

    def _count_probe(self, name: ProbeName, results: list[ProbeResult], seconds: float) -> None:
        with self._metrics_lock:
            key = (name, _worst(name, results))
            self._probe_counts[key] = self._probe_counts.get(key, 0) + 1
            self._probe_seconds[name] = max(0.0, seconds)

    def _result(self, request: NodeActionRequest, outcome: NodeActionOutcome, reason: str,
                detail: str) -> NodeActionResult:
        return NodeActionResult(id=request.id, action=request.action, gpu=request.gpu, outcome=outcome,
                                reason=reason, detail=detail, ts=self._clock())

    def _count(self, action: str, outcome: str, reason: str) -> None:
        key = (action, outcome, reason)
        with self._metrics_lock:
            self._counts[key] = self._counts.get(key, 0) + 1


def _checked(name: ProbeName, result: object) -> ProbeResult:
    """A probe's result as the aggregator will decode it (bounds, types), or an error result: one
    malformed figure must not make the whole report undecodable."""
    if not isinstance(result, ProbeResult) or result.probe != name:
        return ProbeResult(probe=name, status="error", reason="invalid_result",
                           detail=f"the probe returned {type(result).__name__}, not its own ProbeResult")
    try:
        return check(result)
    except SchemaError as exc:
        return ProbeResult(probe=name, status="error", reason="invalid_result", detail=str(exc))


def _worst(name: str, results: list[ProbeResult]) -> str:
    statuses = {r.status for r in results if r.probe == name}
    return next((s for s in _STATUS_ORDER if s in statuses), "skipped")


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all: written beside it, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
