"""Training-side heartbeat client: one datagram per step to the local vigil agent.

Reads its job, rank and local GPU from torchrun's or Slurm's environment when not given, and
sends compact JSON matching the agent's ``Heartbeat`` wire model (plus pid and ts), including the
job's phase ("checkpointing", "evaluating") so a long save is not taken for a hang, and where the
loop gives them the step's loss and gradient norm (NaN and infinity spelled as strings), to the agent's
Unix socket ``/run/vigil/heartbeat.sock`` when ``/run/vigil`` exists (the agent learns from the
kernel which process, and so which Slurm job or pod, sent each datagram), else to UDP
127.0.0.1:9401, or where ``VIGIL_HEARTBEAT_ADDR`` says. The job name it sends is only a label:
the agent keys the job by the scheduler's identity of the sending process. It uses the standard
library only, never raises into the training loop, never blocks, and does no retrying, batching
or validation: a lost datagram costs one step's sample, never a training step.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from types import TracebackType

DEFAULT_ADDR = ("127.0.0.1", 9401)
# The agent's heartbeat socket (collectors.training.unix_socket in the shipped configurations):
# the default wherever its directory exists, on the host or mounted into a pod.
DEFAULT_UNIX_PATH = "/run/vigil/heartbeat.sock"
ADDR_ENV = "VIGIL_HEARTBEAT_ADDR"
UNIX_PREFIX = "unix:"
# torchrun's rendezvous id defaults to the literal "none" when --rdzv-id is not given.
_UNSET_RUN_IDS = ("", "none")
FALLBACK_JOB = "local"
# Phase names the wire carries; aliases let a loop say what it means ("allreduce", "dataloader").
_PHASE_ALIASES = {
    "compute": "compute",
    "forward_backward": "compute",
    "comm": "comm",
    "collective": "comm",
    "allreduce": "comm",
    "data": "data",
    "dataloader": "data",
}
# What the job is doing between steps; "training" is the default and is not sent. The agent's
# hang detection gives the other two their own, longer limits.
PHASES = ("training", "checkpointing", "evaluating")
# How the phase times were measured: on the GPU's own timeline, or on the host around the calls.
TIMINGS = ("cuda_events", "cpu")
# The agent's bound on a training value (contract/wire.py ``Num``: |x| <= 1e18, which refuses NaN and
# infinity as numbers); a finite value beyond it is sent as the bound, so the datagram stays valid.
VALUE_BOUND = 1e18
_INF = float("inf")


def _value(value: object, signed: bool) -> bytes | None:
    """A loss or gradient norm as the wire spells it: a number, or "nan"/"inf"/"-inf" (JSON has no
    NaN). A tensor (anything with ``.item()``) is read with one ``.item()``; None when the value is
    not a number, or negative where a norm is meant (the agent would refuse the whole heartbeat)."""
    if type(value) is not float:
        item = getattr(value, "item", None)
        number = float(item() if item is not None else value)  # type: ignore[arg-type]
    else:
        number = value
    if number != number:
        return b'"nan"'
    if -VALUE_BOUND <= number <= VALUE_BOUND:
        if number < 0 and not signed:
            return None
        return b"%.9g" % number
    if number == _INF:
        return b'"inf"'
    if number == -_INF:
        return b'"-inf"'  # non-finite is the signal, for a norm too
    if number > 0:
        return b"%.9g" % VALUE_BOUND
    return b"%.9g" % -VALUE_BOUND if signed else None


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def _json_string(value: str) -> str:
    # Job ids are plain ASCII in practice; escape the few characters JSON requires so a quote
    # or backslash in an id cannot break the payload.
    out = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c >= " " else f"\\u{ord(c):04x}" for c in out) + '"'


def resolve_identity(env: Mapping[str, str]) -> tuple[str, int, int | None]:
    """(job, rank, local rank) from torchrun's, then Slurm's variables; ("local", 0, None) if neither."""
    job = env.get("TORCHELASTIC_RUN_ID", "")
    if job.strip().lower() in _UNSET_RUN_IDS:
        job = env.get("SLURM_JOB_ID", "").strip() or FALLBACK_JOB
    rank = _int_or_none(env.get("RANK"))
    if rank is None:
        rank = _int_or_none(env.get("SLURM_PROCID"))
    local = _int_or_none(env.get("LOCAL_RANK"))
    if local is None:
        local = _int_or_none(env.get("SLURM_LOCALID"))
    return job.strip(), (rank if rank is not None and rank >= 0 else 0), local


def resolve_addr(env: Mapping[str, str], unix_path: str = DEFAULT_UNIX_PATH) -> tuple[str, int] | str:
    """``VIGIL_HEARTBEAT_ADDR`` as host:port (IPv6 in brackets) or ``unix:PATH``; without it
    ``unix_path`` when it or its directory exists (an agent restarting has removed the socket for
    a moment), else 127.0.0.1:9401 (which an agent takes only where the site opted in)."""
    raw = env.get(ADDR_ENV, "").strip()
    if not raw:
        try:
            if os.path.exists(unix_path) or os.path.isdir(os.path.dirname(unix_path) or "/"):
                return unix_path
        except (OSError, ValueError, TypeError):
            pass
        return DEFAULT_ADDR
    if raw.startswith(UNIX_PREFIX):
        return raw[len(UNIX_PREFIX):] or DEFAULT_ADDR
    host, sep, port = raw.rpartition(":")
    port_number = _int_or_none(port)
    if not sep or port_number is None or not 0 < port_number < 65536:
        return DEFAULT_ADDR  # a bad variable must not stop training; the agent sees no beats
    return host.strip("[]") or DEFAULT_ADDR[0], port_number


class _PhaseTimer:
    """Context manager adding its elapsed wall time to one phase of the current step."""

    __slots__ = ("_hb", "_index", "_start")

    def __init__(self, hb: Heartbeat, index: int) -> None:
        self._hb = hb
        self._index = index
        self._start = 0.0

    def __enter__(self) -> _PhaseTimer:
        self._start = self._hb._clock()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._index >= 0:
            self._hb._phase_seconds[self._index] += self._hb._clock() - self._start


class _PhaseState:
    """Context manager: the job is in ``phase`` inside the block, back to training after it."""

    __slots__ = ("_hb", "_phase", "_previous")

    def __init__(self, hb: Heartbeat, phase: str) -> None:
        self._hb = hb
        self._phase = phase
        self._previous = "training"

    def __enter__(self) -> _PhaseState:
        self._previous = self._hb.current_phase
        self._hb.set_phase(self._phase)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hb.set_phase(self._previous)


class Heartbeat:
    """Per-rank heartbeat sender. ``hb.step(n, step_seconds)`` once per step; or time phases
    with ``with hb.phase("compute"):`` and call ``hb.step(n)``, which then sends the accumulated
    phases and the wall time since the previous ``step`` call.

    ``sent`` and ``dropped`` count datagrams handed to the kernel and datagrams lost (socket
    errors, unencodable values), ``unreadable`` the loss and gradient-norm values left out of a
    heartbeat that was still sent; nothing is ever raised to the caller.
    """

    __slots__ = ("_addr", "_clock", "_last_step", "_last_step_at", "_phase", "_phase_seconds", "_prefix", "_sock",
                 "_suffix", "_timers", "_unix_path", "dropped", "gpu", "job", "rank", "sent", "unreadable")

    def __init__(self, job: str | None = None, rank: int | None = None, gpu: int | None = None,
                 addr: tuple[str, int] | str | None = None, *, env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.perf_counter, unix_path: str = DEFAULT_UNIX_PATH) -> None:
        self._sock: socket.socket | None = None
        env = os.environ if env is None else env
        self._clock = clock  # monotonic seconds for step and phase durations
        env_job, env_rank, env_local = resolve_identity(env)
        self.job = str(job) if job else env_job
        self.rank = int(rank) if rank is not None else env_rank
        self.gpu = int(gpu) if gpu is not None else env_local
        self._addr = addr if addr is not None else resolve_addr(env, unix_path)
        self.sent = 0
        self.dropped = 0
        self.unreadable = 0  # loss/grad_norm values left out (not a number, a negative norm)
        self._phase_seconds = [0.0, 0.0, 0.0]  # compute, comm, data
        self._timers = {name: _PhaseTimer(self, ("compute", "comm", "data").index(canon))
                        for name, canon in _PHASE_ALIASES.items()}
        self._last_step_at = clock()
        self._last_step = 0
        self._phase = "training"
        self._suffix = b""  # the phase field while not training
        # Everything constant is encoded once; a step only formats numbers.
        gpu_part = f',"gpu":{self.gpu}' if self.gpu is not None and self.gpu >= 0 else ""
        # errors="replace": a job name with an unpaired surrogate must not raise here either.
        self._prefix = (f'{{"job":{_json_string(self.job)},"rank":{self.rank}{gpu_part},'
                        f'"pid":{os.getpid()},"step":').encode("utf-8", "replace")
        self._unix_path: str | None = None
        sock = None
        try:
            if isinstance(self._addr, str):
                # A Unix socket path: sendto() each step, so an agent that starts (or restarts)
                # after the training process is found without reconnecting.
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)
                self._unix_path = self._addr
            else:
                family = socket.AF_INET6 if ":" in self._addr[0] else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_DGRAM)
                sock.setblocking(False)
                # connect() on UDP only fixes the peer: no packet is sent, and send() skips the
                # per-call address lookup that sendto() would do.
                sock.connect(self._addr)
            self._sock = sock
        except (OSError, ValueError, TypeError, OverflowError):
            if sock is not None:
                sock.close()  # every step then counts as dropped

    def phase(self, name: str) -> _PhaseTimer:
        """A reusable timer for ``name`` (compute, comm, data or an alias); unknown names time nothing."""
        timer = self._timers.get(name)
        if timer is None:
            timer = _PhaseTimer(self, -1)
        return timer

    @property
    def current_phase(self) -> str:
        return self._phase

    def set_phase(self, phase: str) -> None:
        """Say what the job does now ("training", "checkpointing", "evaluating") and tell the agent
        at once, repeating the last step: a checkpoint that outlasts the hang limit is not a hang.
        An unknown name is ignored (never raises)."""
        if phase not in PHASES or phase == self._phase:
            return
        self._phase = phase
        self._suffix = b"" if phase == "training" else b',"phase":"%s"' % phase.encode()
        self._send(b'%s%d,"step_seconds":0%s,"ts":%.6f}' % (self._prefix, self._last_step, self._suffix, time.time()))

    def checkpointing(self) -> _PhaseState:
        """``with hb.checkpointing(): save(...)``: the save has the checkpoint limit, not the hang limit."""
        return _PhaseState(self, "checkpointing")

    def evaluating(self) -> _PhaseState:
        """``with hb.evaluating(): evaluate(...)``: evaluation has its own, longer limit."""
        return _PhaseState(self, "evaluating")

    def _send(self, msg: bytes) -> None:
        try:
            if self._sock is None:
                self.dropped += 1
            elif self._unix_path is not None:
                self._sock.sendto(msg, self._unix_path)
                self.sent += 1
            else:
                self._sock.send(msg)
                self.sent += 1
        except Exception:  # noqa: BLE001 - the promise is that training never sees our errors
            self.dropped += 1

    def step(self, step: int, step_seconds: float | None = None, compute_seconds: float | None = None,
             comm_seconds: float | None = None, data_seconds: float | None = None, *,
             timing: str | None = None, loss: object = None, grad_norm: object = None) -> None:
        """Send one heartbeat; phase arguments override the timed phases. ``timing`` says how the
        phase times were measured ("cuda_events" or "cpu"). ``loss`` and ``grad_norm`` (optional)
        are the step's loss and global gradient norm: a float, or a tensor read with one
        ``.item()`` (on a CUDA tensor that waits for the GPU to finish the work queued before it:
        pass the float a loop already logs to avoid a second wait); NaN and infinity are sent as
        "nan"/"inf"/"-inf", the signal itself. Never raises or blocks."""
        now = self._clock()
        phases = self._phase_seconds
        try:
            if step_seconds is None:
                step_seconds = now - self._last_step_at
            if compute_seconds is None and phases[0]:
                compute_seconds = phases[0]
            if comm_seconds is None and phases[1]:
                comm_seconds = phases[1]
            if data_seconds is None and phases[2]:
                data_seconds = phases[2]
            # bytes %-formatting with fixed precision is about twice as fast as str + encode();
            # microseconds are finer than any step's timing noise.
            msg = b'%s%d,"step_seconds":%.6f' % (self._prefix, step, step_seconds)
            if compute_seconds is not None:
                msg += b',"compute_seconds":%.6f' % compute_seconds
            if comm_seconds is not None:
                msg += b',"comm_seconds":%.6f' % comm_seconds
            if data_seconds is not None:
                msg += b',"data_seconds":%.6f' % data_seconds
            if timing is not None and timing in TIMINGS:
                msg += b',"timing":"%s"' % timing.encode()
            if loss is not None:
                msg += self._signal(b',"loss":', loss, True)
            if grad_norm is not None:
                msg += self._signal(b',"grad_norm":', grad_norm, False)
            msg += b'%s,"ts":%.6f}' % (self._suffix, time.time())
            self._last_step = step
            self._send(msg)
        except Exception:  # noqa: BLE001 - the promise is that training never sees our errors
            self.dropped += 1
        finally:
            phases[0] = phases[1] = phases[2] = 0.0
            self._last_step_at = now

    def _signal(self, key: bytes, value: object, signed: bool) -> bytes:
        # A value that cannot be read (a tensor on a dead device, a string) costs the field, never
        # the heartbeat: its step still counts as progress.
        try:
            text = _value(value, signed)
        except Exception:  # noqa: BLE001 - the promise is that training never sees our errors
            text = None
        if text is None:
            self.unreadable += 1
            return b""
        return key + text

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __del__(self) -> None:
        # Training scripts rarely close their client; close quietly instead of a ResourceWarning.
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
