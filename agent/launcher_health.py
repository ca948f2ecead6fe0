"""The node health check that NVIDIA's resiliency extension asks before a rendezvous, answered
from vigil's standing of this node.

It reads the standing the aggregator's answers carry (agent/reporter.py ``Standing``) and serves
``nvhcd.HealthCheckService/RunHealthCheck`` over a Unix socket with gRPC: trusted -> healthy,
untrusted -> unhealthy (so ``ft_launcher`` leaves this node out of its next rendezvous), unknown (no
answer from the aggregator for ``stale_seconds``) -> healthy, saying so: it fails open, because vigil
must never take a fleet out of its jobs when its own aggregator is down. It judges nothing itself and
runs no check script; the two messages are encoded by hand (no protobuf dependency).

The contract is NVIDIA/nvidia-resiliency-ext's, read at commit d8686d9c (2026-08-07):
src/nvidia_resiliency_ext/shared_utils/proto/nvhcd.proto (``HealthCheckRequest{repeated string args
= 1}``, ``HealthCheckResponse{bool success = 1; int32 exit_code = 2; string output = 3; string error
= 4}``), and its client, ``NodeHealthCheck`` in shared_utils/health_check.py, which
``ft_launcher --ft-node-health-check-endpoint unix:///path`` builds and the barrier rendezvous calls
before a node joins: it sends ``args=["--no-slurm", "--group", ...]`` with a 60 s deadline, and
takes the node as healthy only when ``success`` is true and ``output`` is JSON with
``"fail_count": 0`` (any other output is unhealthy); a missing socket or a connection error it
treats as healthy (docs/source/fault_tolerance/usage_guide.rst, "Node health check service").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from pydantic import Field

from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.reporter import Standing
from vigil.agent.server import _gid
from vigil.contract.validation import StrictModel

log = logging.getLogger("vigil.agent.launcher_health")

SERVICE = "nvhcd.HealthCheckService"
METHOD = "RunHealthCheck"
# ft_launcher's request is a dozen short arguments (_DEFAULT_NODE_HEALTH_CHECK_ARGS, about 100
# bytes); these bounds are two orders of magnitude above it. gRPC refuses a larger message itself
# (RESOURCE_EXHAUSTED) before it reaches the decoder.
MAX_REQUEST_BYTES = 16 * 1024
MAX_ARGS = 64
MAX_ARG_BYTES = 1024
# Protobuf's largest field number (2^29 - 1) and a varint's most bytes (64 bits in 7-bit groups).
_MAX_FIELD_NUMBER = (1 << 29) - 1
_MAX_VARINT_BYTES = 10

ANSWERS = ("trusted", "untrusted", "unknown", "invalid")
CHECKS = MetricSpec("vigil_agent_launcher_health_checks_total", MetricKind.COUNTER,
                    "Node health checks a launcher (ft_launcher's nvhcd client) asked over launcher_health.socket, "
                    "by answer: trusted (healthy), untrusted (unhealthy: vigil has the node out or proposes to), "
                    "unknown (no standing from the aggregator within stale_seconds: answered healthy, vigil "
                    "fails open), invalid (a request that is not a HealthCheckRequest: INVALID_ARGUMENT).",
                    labels=("answer",))
LAUNCHER_HEALTH_SPECS = (CHECKS,)


class LauncherHealthConfig(StrictModel):
    # Off unless a site runs ft_launcher with --ft-node-health-check-endpoint pointed at `socket`
    # (docs/goodput.md); needs the `resiliency` extra (grpcio).
    enabled: bool = False
    # What ft_launcher's --ft-node-health-check-endpoint names (unix:///run/vigil/nvhcd.sock); its
    # directory must exist (bind-mount it into the job's container).
    socket: str = "/run/vigil/nvhcd.sock"
    # The launcher runs as the job's user: 0660 with a group the job's users are in; 0666 lets any
    # local process ask (the answer is this node's standing, nothing more).
    socket_mode: int = Field(default=0o660, ge=0, le=0o777)
    socket_group: str | None = None  # a name or gid; unset: the agent's own group
    # No standing in an answer for this long: unknown (healthy, fail open). 30 s is twelve reports
    # at the default aggregator.interval_seconds (2.5 s): longer than a leader's failover or a
    # reporter's first backoffs, well under ft_launcher's restart cycle.
    stale_seconds: float = Field(default=30.0, gt=0, le=3600)
    # Checks served at once; more are refused by gRPC (RESOURCE_EXHAUSTED). A node runs one launcher.
    max_concurrent_checks: int = Field(default=8, ge=1, le=256)


class MalformedRequest(ValueError):
    """Bytes that are not a HealthCheckRequest, or one past the bounds."""


class StandingSource(Protocol):
    def standing_at(self, now: float, stale_seconds: float) -> Standing | None: ...


# --- the wire: protobuf's encoding of the two messages ------------------------------------------

def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos + i >= len(data):
            raise MalformedRequest("truncated varint")
        byte = data[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if value >= 1 << 64:
                raise MalformedRequest("varint over 64 bits")
            return value, pos + i + 1
    raise MalformedRequest(f"varint longer than {_MAX_VARINT_BYTES} bytes")


def _fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field; unknown fields are kept for the caller to
    skip (a newer proto may add some). Groups, wire types 6-7 and field 0 are malformed."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if not 1 <= number <= _MAX_FIELD_NUMBER:
            raise MalformedRequest(f"field number {number}")
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if pos + width > len(data):
                raise MalformedRequest("truncated fixed-width field")
            value, pos = int.from_bytes(data[pos:pos + width], "little"), pos + width
        elif wire == 2:
            length, pos = _varint(data, pos)
            if length > len(data) - pos:
                raise MalformedRequest(f"field {number}: length {length} past the end")
            value, pos = data[pos:pos + length], pos + length
        else:
            raise MalformedRequest(f"field {number}: wire type {wire} (groups and types 6-7 are not used)")
        out.append((number, wire, value))
    return out


def decode_request(data: bytes) -> list[str]:
    """A HealthCheckRequest's ``args``; MalformedRequest for anything else or past the bounds."""
    if len(data) > MAX_REQUEST_BYTES:
        raise MalformedRequest(f"request of {len(data)} bytes, more than {MAX_REQUEST_BYTES}")
    args: list[str] = []
    for number, wire, value in _fields(data):
        if number != 1:
            continue  # unknown to this proto: skipped, as protobuf does
        if wire != 2 or not isinstance(value, bytes):
            raise MalformedRequest("args (field 1) is not length-delimited")
        if len(args) >= MAX_ARGS:
            raise MalformedRequest(f"more than {MAX_ARGS} args")
        if len(value) > MAX_ARG_BYTES:
            raise MalformedRequest(f"an arg of {len(value)} bytes, more than {MAX_ARG_BYTES}")
        try:
            args.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise MalformedRequest("an arg that is not UTF-8") from None
    return args


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _put_text(number: int, text: str) -> bytes:
    raw = text.encode("utf-8")
    return _put_varint(number << 3 | 2) + _put_varint(len(raw)) + raw


def encode_request(args: Sequence[str]) -> bytes:
    """A HealthCheckRequest (what ft_launcher sends; for tests and ``vigil`` tooling)."""
    return b"".join(_put_text(1, a) for a in args)


class Answer(NamedTuple):
    """A HealthCheckResponse, and the answer's label (CHECKS)."""

    success: bool
    exit_code: int
    output: str
    error: str
    label: str


def encode_response(a: Answer) -> bytes:
    """proto3: fields at their default (false, 0, "") are left out."""
    out = b""
    if a.success:
        out += b"\x08\x01"
    if a.exit_code:
        out += b"\x10" + _put_varint(a.exit_code & 0xFFFF_FFFF_FFFF_FFFF)  # int32: a negative is 10 bytes
    if a.output:
        out += _put_text(3, a.output)
    if a.error:
        out += _put_text(4, a.error)
    return out


def decode_response(data: bytes) -> tuple[bool, int, str, str]:
    """(success, exit_code, output, error) of a HealthCheckResponse (tests; a launcher's view)."""
    success, exit_code, output, error = False, 0, "", ""
    for number, _, value in _fields(data):
        if number == 1 and isinstance(value, int):
            success = value != 0
        elif number == 2 and isinstance(value, int):
            exit_code = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and isinstance(value, bytes):
            output = value.decode("utf-8")
        elif number == 4 and isinstance(value, bytes):
            error = value.decode("utf-8")
    return success, exit_code, output, error


# --- the answer ---------------------------------------------------------------------------------

def answer(standing: Standing | None, now: float, stale_seconds: float) -> Answer:
    """What a launcher is told. ``output`` is JSON with ``fail_count`` (ft_launcher's client reads
    it: 0 healthy, anything else unhealthy) and what vigil knows."""
    if standing is None:
        output = {"fail_count": 0, "failed_checks": [], "source": "vigil", "standing": "unknown",
                  "detail": f"no standing from vigil's aggregator within {stale_seconds:g} s: vigil fails open "
                            "(its aggregator being down must not take nodes out of jobs)"}
        return Answer(True, 0, json.dumps(output), "", "unknown")
    age = round(standing.age_seconds(now), 3)
    if standing.trusted:
        output = {"fail_count": 0, "failed_checks": [], "source": "vigil", "standing": "trusted",
                  "age_seconds": age, **({"detail": standing.reason} if standing.reason else {})}
        return Answer(True, 0, json.dumps(output), "", "trusted")
    output = {"fail_count": 1, "failed_checks": ["vigil"], "source": "vigil", "standing": "untrusted",
              "reason": standing.reason, "decision": standing.decision, "since": standing.since,
              "age_seconds": age}
    return Answer(False, 1, json.dumps(output), f"vigil distrusts this node: {standing.reason}", "untrusted")


def freshest(sources: Sequence[StandingSource], now: float, stale_seconds: float) -> Standing | None:
    """The latest standing any aggregator answered within ``stale_seconds`` (only the acting
    replica of an HA pair sends one), else None."""
    fresh = [s for src in sources if (s := src.standing_at(now, stale_seconds)) is not None]
    return max(fresh, key=lambda s: s.received, default=None)


class LauncherHealth:
    """The gRPC service on ``config.socket``, in the agent's event loop (grpc.aio). ``sources``:
    the reporters (their standings); ``clock``: the agent's."""

    def __init__(self, config: LauncherHealthConfig, sources: Sequence[StandingSource],
                 clock: Callable[[], float]) -> None:
        try:
            import grpc  # noqa: F401  (the optional extra: say so at start-up, not at the first check)
        except ImportError:
            raise RuntimeError("launcher_health.enabled needs grpcio: install vigil with the `resiliency` extra "
                               "(pip install 'vigil[resiliency]')") from None
        self.config = config
        self._sources = sources
        self._clock = clock
        self.counts = dict.fromkeys(ANSWERS, 0)
        self.specs = LAUNCHER_HEALTH_SPECS
        self._server: Any = None
        self._bound: tuple[str, int] | None = None  # (path, inode): remove ours, never a successor's

    def samples(self) -> list[Sample]:
        return [Sample.of(CHECKS, n, answer=a) for a, n in self.counts.items()]

    def check(self, request: bytes) -> Answer:
        """One check: MalformedRequest for bytes that are not a request (counted)."""
        try:
            decode_request(request)  # the args are ft_launcher's script arguments: vigil runs no script
        except MalformedRequest:
            self.counts["invalid"] += 1
            raise
        now = self._clock()
        a = answer(freshest(self._sources, now, self.config.stale_seconds), now, self.config.stale_seconds)
        self.counts[a.label] += 1
        if a.label == "untrusted":
            log.info("launcher health check answered unhealthy: %s", a.error)
        return a

    async def _run(self, request: bytes, context: Any) -> Answer:
        import grpc

        try:
            return self.check(request)
        except MalformedRequest as exc:
            reason = str(exc)
        # Outside the except: abort raises, and must not be caught as the decode error was.
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a nvhcd.HealthCheckRequest: {reason}")
        raise AssertionError("unreachable: abort raises")

    async def start(self) -> None:
        """Serve on ``config.socket``: bound in a private directory beside it, given its mode and
        group there, then renamed into place, so the path never exists with looser permissions. A
        stale socket there is replaced; any other file stops start-up."""
        import grpc

        target = Path(self.config.socket)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(target.lstat().st_mode):
                raise OSError(f"{target} exists and is not a socket; refusing to replace it "
                              "(launcher_health.socket)")
        try:
            gid = _gid(self.config.socket_group) if self.config.socket_group is not None else -1
        except KeyError:
            raise OSError(f"launcher_health.socket_group {self.config.socket_group!r}: no such group") from None
        # The request is passed through as bytes (no request_deserializer): a malformed one is then
        # the handler's INVALID_ARGUMENT, not the INTERNAL gRPC answers for a deserializer's error.
        handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(
            self._run, response_serializer=encode_response)})
        server = grpc.aio.server(handlers=[handler], maximum_concurrent_rpcs=self.config.max_concurrent_checks,
                                 options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
        private = tempfile.mkdtemp(prefix=".vigil-nvhcd-", dir=target.parent)  # mode 0700
        staged = os.path.join(private, "s")
        try:
            if server.add_insecure_port(f"unix:{staged}") == 0:
                raise OSError(f"cannot listen on {target} (launcher_health.socket)")
            await server.start()
            if gid >= 0:
                os.chown(staged, -1, gid)
            os.chmod(staged, self.config.socket_mode)
            os.rename(staged, target)
        except BaseException:
            await server.stop(None)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(staged)
            with contextlib.suppress(OSError):
                os.rmdir(private)
        self._server = server
        self._bound = (str(target), os.stat(target).st_ino)
        log.info("node health checks for ft_launcher on unix:%s (mode %o%s, stale after %g s)", target,
                 self.config.socket_mode, f", group {self.config.socket_group}" if self.config.socket_group else "",
                 self.config.stale_seconds)

    async def stop(self) -> None:
        """Stop serving (a check in flight gets a second) and remove the socket if it is still ours."""
        if self._server is not None:
            await self._server.stop(1.0)
            self._server = None
        if self._bound is not None:
            path, inode = self._bound
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
            self._bound = None
