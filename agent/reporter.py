"""The reporter: builds compact Reports from the snapshot and pushes them to the aggregator.

A report carries the collectors' report contributions (GPU, port, rank and host state) and the
oldest pending events that fit under the aggregator's body limit (contract/limits.py). Events are
kept, serialized, until the aggregator accepts them: a backlog goes out over as many reports as it
takes, oldest first, and a 413 splits the report instead of dropping it. A refusal a later resend
can pass (the clock: an older aggregator's 422 future_ts or stale_ts; a 409 such as seq_jump) keeps
them too, resent with backoff and counted. Only the bound on the backlog, an event no report can
carry, or a report the aggregator refuses for its content drops events, each counted by reason and
logged; pending events are journaled (agent/backlog.py), so a
restart or a crash keeps them. An urgent event makes the reporter push at once. Node action requests
in the aggregator's 202 answer go to the node-action runner (off the event loop, one at a time), and
their results ride the following reports until one carrying them is accepted. Reports are of
wire.REPORT_VERSION: whole until one is accepted, then each carries only what changed since the
last one accepted (agent/report_delta.py), its telemetry (wire.GPU_TELEMETRY_FIELDS,
wire.PORT_TRAFFIC_COUNTERS) at most every ``telemetry_seconds``. A compact report refused for its
base (409 delta_base) or its content is resent whole at once, events kept.
A report whose answer was lost (a timeout) may have been taken: when the 409 delta_base names that
report as the one the aggregator holds, it becomes the base and the report is resent compact. An
aggregator behind on its work sheds reports (503 or 429 with ``Retry-After``; nothing taken, the
base kept): the reporter waits that long, jittered; other failures back off exponentially; it
never sends again sooner than its cadence (``Backoff``).
The answer's ``standing`` (whether the aggregator trusts this node) is kept with when it came, for
the launcher health check (agent/launcher_health.py). It judges nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from vigil.agent.backlog import Backlog
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.report_delta import delta, whole
from vigil.agent.snapshot import Snapshot
from vigil.contract.credential_file import TokenFile
from vigil.contract.limits import PENDING_EVENTS_MAX_BYTES, REPORT_MAX_BYTES, REPORT_MAX_EVENTS
from vigil.contract.version import __version__
from vigil.contract.wire import (
    MAX_REQUESTS_PER_RESPONSE,
    MAX_RESULTS_PER_REPORT,
    Event,
    NodeActionRequest,
    NodeActionResult,
    Report,
    WireError,
    convert,
    decode,
    encode,
    replace,
)

log = logging.getLogger("vigil.agent.reporter")

RESULTS = ("ok", "error", "split", "rejected", "rebased", "downgraded")
REPORTS = MetricSpec("vigil_agent_reports_total", MetricKind.COUNTER,
                     "Reports pushed to the aggregator, by result: ok, error (not delivered, retried), split "
                     "(413: resent in smaller parts), rejected (refused for its content), rebased (a compact "
                     "report the aggregator had no base for: resent whole), downgraded (a compact report "
                     "refused for its content: resent whole).", labels=("result",))
ERROR_REASONS = ("unreachable", "timeout", "tls", "unauthorized", "throttled", "server_error", "refused_transient")
REPORT_ERRORS = MetricSpec("vigil_agent_report_errors_total", MetricKind.COUNTER,
                           "Reports not delivered (kept and retried), by reason: unreachable, timeout, tls "
                           "(certificate not verified), unauthorized (401/403), throttled (408/429), "
                           "server_error (5xx), refused_transient (a refusal a later resend can pass: 409, "
                           "or the clock's 422 future_ts/stale_ts of an aggregator that checks it).",
                           labels=("reason",))
# A shed report's Retry-After is honoured up to the reporter's max_backoff_seconds; each wait is
# its base times a uniform draw in [1, 1 + BACKOFF_JITTER] (never sooner than asked): agents shed
# together come back spread over a quarter of the wait, not in the same instant.
BACKOFF_JITTER = 0.25


class Backoff:
    """How long to wait before the next attempt: after a shed answer, what its Retry-After asked
    (the aggregator knows its load; it takes a node quiet for 10 s whatever the load, so waits
    that grew would only make nodes look silent); after any other failure, the cadence doubled per
    consecutive failure. Never less than one cadence (a failing aggregator never gets reports
    faster than a healthy one), at most ``max_seconds``, before jitter. ``uniform`` is the
    jitter's source (a test passes its own)."""

    def __init__(self, interval_seconds: float, max_seconds: float,
                 uniform: Callable[[float, float], float] = random.uniform) -> None:
        self.interval_seconds = interval_seconds
        self.max_seconds = max_seconds
        self._uniform = uniform
        self.failures = 0

    def failed(self, retry_after_seconds: float | None = None) -> float:
        """One more failure: the seconds to wait before the next attempt."""
        self.failures += 1
        wanted = retry_after_seconds if retry_after_seconds is not None else \
            self.interval_seconds * 2.0 ** min(self.failures - 1, 32)
        base = min(self.max_seconds, max(self.interval_seconds, wanted))
        return base * self._uniform(1.0, 1.0 + BACKOFF_JITTER)

    def succeeded(self) -> None:
        self.failures = 0


def retry_after(value: str | None) -> float | None:
    """An answer's Retry-After in seconds (RFC 9110 delay-seconds; an HTTP date or garbage: None)."""
    if value is None or not value.strip().isdigit():
        return None
    return float(int(value.strip()))


# Refusals that say nothing about the report's content: the same events pass once the clocks agree
# again or the seq bound has grown with time (aggregator/fleet.py). Any 409 but delta_base (resent
# whole at once) is one too: a conflict with the aggregator's state of this node, not the content.
TRANSIENT_REFUSALS = frozenset({"future_ts", "stale_ts", "seq_jump"})
EVENTS_PENDING = MetricSpec("vigil_agent_events_pending", MetricKind.GAUGE,
                            "Events waiting for the aggregator to accept them.")
EVENTS_PENDING_BYTES = MetricSpec("vigil_agent_events_pending_bytes", MetricKind.GAUGE,
                                  "Serialized size of the events waiting for the aggregator.", unit="bytes")
DROP_REASONS = ("backlog_full", "too_large", "rejected", "unreadable")
EVENTS_DROPPED = MetricSpec("vigil_agent_events_dropped_total", MetricKind.COUNTER,
                            "Events dropped, by reason: backlog_full (aggregator unreachable too long, oldest "
                            "dropped), too_large (one event the aggregator refused alone with 413), rejected "
                            "(in a report the aggregator refused for its content), unreadable (a line of the "
                            "saved backlog that does not parse).", labels=("reason",))
LAST_SUCCESS = MetricSpec("vigil_agent_last_report_success_timestamp_seconds", MetricKind.GAUGE,
                          "Unix time of the last report the aggregator accepted.", unit="seconds")
IGNORED_REASONS = ("malformed", "too_many", "queue_full")
REQUESTS_IGNORED = MetricSpec("vigil_agent_node_action_requests_ignored_total", MetricKind.COUNTER,
                              "Node action requests in the aggregator's answers not handed to the runner, by "
                              "reason: malformed (an answer or request that does not parse; counted once per "
                              "answer), too_many (an answer with more than the wire's bound), queue_full.",
                              labels=("reason",))
RESULT_DROP_REASONS = ("backlog_full", "rejected")
RESULTS_DROPPED = MetricSpec("vigil_agent_node_action_results_dropped_total", MetricKind.COUNTER,
                             "Node action results never delivered, by reason: backlog_full (aggregator unreachable "
                             "too long, oldest dropped), rejected (in a report the aggregator refused for its "
                             "content).", labels=("reason",))
REPORTER_SPECS = (REPORTS, REPORT_ERRORS, EVENTS_PENDING, EVENTS_PENDING_BYTES, EVENTS_DROPPED, LAST_SUCCESS,
                  REQUESTS_IGNORED, RESULTS_DROPPED)
# Results kept while the aggregator cannot take them: four reports' worth.
MAX_PENDING_RESULTS = 4 * MAX_RESULTS_PER_REPORT
# Requests waiting for the runner (distinct ids; the aggregator resends what is still open).
MAX_QUEUED_REQUESTS = 4 * MAX_REQUESTS_PER_RESPONSE
# The 202 answer is a few hundred bytes per request; anything past this is not an answer.
MAX_ANSWER_BYTES = 256 * 1024
NodeActionHandler = Callable[[NodeActionRequest], NodeActionResult]

_EVENTS_KEY = b',"events":['
_CLOSE = b"]}"

# Sections a collector may contribute; anything else in a Collection.report is a programming error.
_REPORT_SECTIONS = frozenset({"gpus", "ports", "ranks", "collectives", "host", "nvml_available", "config", "pcie"})


def build_report(
    snapshot: Snapshot,
    events: Sequence[Event],
    *,
    node: str,
    boot_id: str,
    seq: int,
    ts: float,
    interval_seconds: float,
    topology: Mapping[str, str],
    urgent: bool = False,
    action_results: Sequence[NodeActionResult] = (),
) -> Report:
    sections: dict[str, Any] = snapshot.report_sections()
    unknown = sections.keys() - _REPORT_SECTIONS
    if unknown:
        raise ValueError(f"collectors contributed unknown report sections: {sorted(unknown)}")
    return Report(
        node=node,
        boot_id=boot_id,
        seq=seq,
        ts=ts,
        interval_seconds=interval_seconds,
        urgent=urgent,
        topology=dict(topology),
        events=list(events),
        failed_collectors=snapshot.failed(),
        agent_version=__version__,
        action_results=list(action_results),
        **sections,
    )


def client_ssl_context(url: str | None, ca_file: str | None = None, cert_file: str | None = None,
                       key_file: str | None = None) -> ssl.SSLContext | None:
    """The TLS context for an https aggregator: the system's trust store, or only ``ca_file``'s CAs;
    with ``cert_file``/``key_file`` a client certificate for sites that use mTLS. Hostnames are
    always verified. None for http (no TLS)."""
    if not url or not url.startswith("https://"):
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


class Standing(NamedTuple):
    """The aggregator's last word on this node (its answer's ``standing``: aggregator/node_standing.py)
    and when it came (this agent's clock)."""

    trusted: bool
    reason: str
    decision: str
    since: float | None
    received: float

    def age_seconds(self, now: float) -> float:
        return now - self.received


# What the agent keeps of a standing's strings (the aggregator sends at most 240 characters of reason).
STANDING_TEXT_MAX_CHARS = 240


def parse_standing(raw: object, received: float) -> Standing | None:
    """``raw`` (an answer's ``standing``) as a Standing; None when it is not one (malformed)."""
    if not isinstance(raw, dict):
        return None
    trusted, reason, decision, since = (raw.get(k) for k in ("trusted", "reason", "decision", "since"))
    if not isinstance(trusted, bool) or not isinstance(reason, str) or not isinstance(decision, str):
        return None
    if since is not None and (isinstance(since, bool) or not isinstance(since, int | float)):
        return None
    return Standing(trusted, reason[:STANDING_TEXT_MAX_CHARS], decision[:STANDING_TEXT_MAX_CHARS],
                    float(since) if since is not None else None, received)


class _Held(NamedTuple):
    """A compact report's state as the aggregator holds it once accepted: its seq, the state
    (without events; held-back telemetry at the values sent before), and when it last got the
    telemetry (the agent's clock)."""

    seq: int
    state: dict[str, Any]
    telemetry_ts: float


class Reporter:
    def __init__(
        self,
        *,
        url: str | None,
        token: str | TokenFile | None,
        node: str,
        boot_id: str,
        topology: Mapping[str, str],
        snapshot: Snapshot,
        interval_seconds: float = 2.5,
        timeout_seconds: float = 5.0,
        max_backoff_seconds: float = 60.0,
        max_report_bytes: int = REPORT_MAX_BYTES,
        max_pending_event_bytes: int = PENDING_EVENTS_MAX_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        state_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
        node_actions: NodeActionHandler | None = None,
        telemetry_seconds: float = 30.0,
    ) -> None:
        self._url = url.rstrip("/") + "/v1/reports" if url else None
        self._token = token
        self._node = node
        self._boot_id = boot_id
        self._topology = dict(topology)
        self._snapshot = snapshot
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self._max_backoff = max_backoff_seconds
        self._backoff = Backoff(interval_seconds, max_backoff_seconds)
        # The Retry-After of the last shed answer (None: none), for the next wait.
        self._retry_after: float | None = None
        self._ssl = ssl_context
        self._backlog = Backlog(max_pending_event_bytes, state_dir)
        # Reports are built at or under this; a 413 lowers it to what the aggregator took.
        self.body_limit_bytes = max_report_bytes
        self._state_bytes = 0
        self._clock = clock
        self._seq = 0
        self._wake = asyncio.Event()
        self._urgent = False
        self.counts = dict.fromkeys(RESULTS, 0)
        self.errors = dict.fromkeys(ERROR_REASONS, 0)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.last_success_ts: float | None = None
        # The body last built as sent (a compact one lists only what changed), and that report
        # whole with the events it carried (/v1/state, the demo's view): kept as references, turned
        # into JSON only when asked.
        self.last_report_body: bytes | None = None
        self._last_built: tuple[Report, list[bytes]] | None = None
        # The last report the aggregator accepted (seq, state without events: what a compact
        # report is relative to), the state of the body just built (the base once it is
        # accepted), and whether that body was compact (relative to the base).
        self._base: _Held | None = None
        self._built: _Held | None = None
        self._built_compact = False
        # A compact-version report sent whose answer was lost (the aggregator may hold it).
        self._unanswered: _Held | None = None
        # A compact report carries the telemetry that moved only when the base's is this old.
        self._telemetry_seconds = telemetry_seconds
        # Node actions: the runner (blocking: run in a thread), requests waiting for it, and
        # results waiting for an accepted report (those in the last body built are "carried").
        self._node_actions = node_actions
        self._requests: asyncio.Queue[NodeActionRequest] = asyncio.Queue()
        self._queued_ids: set[str] = set()
        self.action_results: list[NodeActionResult] = []
        self._carried: list[NodeActionResult] = []
        self.requests_ignored = dict.fromkeys(IGNORED_REASONS, 0)
        self.results_dropped = dict.fromkeys(RESULT_DROP_REASONS, 0)
        # The node's standing from the last answer that carried one (a standby's carries none), and
        # how many answers carried one that does not parse (the previous one is kept and ages).
        self.standing: Standing | None = None
        self.standing_malformed = 0
        recovered: list[bytes] = []
        for raw in self._backlog.recover():
            try:
                decode(raw, Event)
            except WireError:
                self.dropped["unreadable"] += 1
                continue
            recovered.append(raw)
        if recovered or self.dropped["unreadable"]:
            log.info("resending %d event(s) a previous run left pending (%d unreadable, dropped)", len(recovered),
                     self.dropped["unreadable"])
        self._append(recovered)

    @property
    def dropped_events(self) -> int:
        return sum(self.dropped.values())

    @property
    def pending_events(self) -> int:
        return len(self._backlog)

    @property
    def last_report(self) -> Report | None:
        """The last report built, whole whichever version was sent, with the events it carried
        (for /v1/state and tests)."""
        if self._last_built is None:
            return None
        report, taken = self._last_built
        return replace(report, events=[decode(raw, Event) for raw in taken])

    def add_events(self, events: Sequence[Event]) -> None:
        """Called on the event loop by the runner after a collector cycle."""
        self._append([encode(ev) for ev in events])
        if any(ev.urgent for ev in events):
            self._urgent = True
            self._wake.set()

    def _append(self, raws: list[bytes]) -> None:
        dropped = self._backlog.append(raws)
        if dropped:
            self.dropped["backlog_full"] += dropped
            log.error("event backlog full (%d bytes, aggregator unreachable): dropped the %d oldest event(s); "
                      "%d dropped so far", self._backlog.max_bytes, dropped, self.dropped["backlog_full"])

    def samples(self) -> list[Sample]:
        out = [Sample.of(REPORTS, n, result=r) for r, n in self.counts.items()]
        out.extend(Sample.of(REPORT_ERRORS, n, reason=r) for r, n in self.errors.items())
        out.append(Sample.of(EVENTS_PENDING, len(self._backlog)))
        out.append(Sample.of(EVENTS_PENDING_BYTES, self._backlog.bytes))
        out.extend(Sample.of(EVENTS_DROPPED, n, reason=r) for r, n in self.dropped.items())
        if self.last_success_ts is not None:
            out.append(Sample.of(LAST_SUCCESS, self.last_success_ts))
        out.extend(Sample.of(REQUESTS_IGNORED, n, reason=r) for r, n in self.requests_ignored.items())
        out.extend(Sample.of(RESULTS_DROPPED, n, reason=r) for r, n in self.results_dropped.items())
        return out

    def build_body(self) -> tuple[bytes, int, int]:
        """The next report's JSON body, the id just past the last event it carries, and how many.

        The body holds the snapshot's state and the oldest pending events that keep it within
        ``body_limit_bytes`` and ``REPORT_MAX_EVENTS``, and at least one event if any is pending
        (the aggregator's 413 then says whether that one can go at all)."""
        report = build_report(
            self._snapshot, (), node=self._node, boot_id=self._boot_id, seq=self._seq, ts=self._clock(),
            interval_seconds=self._interval, topology=self._topology, urgent=self._urgent,
            action_results=self.action_results[:MAX_RESULTS_PER_REPORT])
        self._carried = list(report.action_results)
        # Every attempt gets a new seq, a resent backlog included: a report the aggregator took
        # but whose answer was lost is never followed by another with the same seq (a replay).
        self._seq += 1
        self._urgent = False
        head = self._head(report)
        size = len(head) - 1 + len(_EVENTS_KEY) + len(_CLOSE)
        self._state_bytes = size  # the report without events: what a split cannot shrink
        taken: list[bytes] = []
        for raw in self._backlog:
            grown = size + len(raw) + (1 if taken else 0)
            if taken and (grown > self.body_limit_bytes or len(taken) >= REPORT_MAX_EVENTS):
                break
            taken.append(raw)
            size = grown
        body = head[:-1] + _EVENTS_KEY + b",".join(taken) + _CLOSE
        self.last_report_body = body
        self._last_built = (report, taken)
        return body, self._backlog.first_id + len(taken), len(taken)

    def _head(self, report: Report) -> bytes:
        """The report without events as JSON: compact relative to the last report accepted, or
        whole when there is none or the structure changed."""
        state = whole(report)
        now = self._clock()
        body, telemetry_ts = state, now
        self._built_compact = False
        if self._base is not None:
            # (A clock stepped back refreshes at once rather than holding telemetry until it catches up.)
            since = now - self._base.telemetry_ts
            refresh = since >= self._telemetry_seconds or since < 0
            # Holding telemetry back puts the base's values back into ``state``: what the
            # aggregator holds once it accepts this body, so the base of the next one.
            compact = delta(self._base.state, state, telemetry=refresh)
            if compact is not None:
                body = {**compact, "base_seq": self._base.seq}
                telemetry_ts = now if refresh else self._base.telemetry_ts
                self._built_compact = True
        self._built = _Held(report.seq, state, telemetry_ts)
        # msgspec's encoder: the same JSON as json.dumps (compact, shortest float repr), a fraction
        # of its CPU on the ~9 KiB compact body (bench_agent).
        return encode(body)

    def next_report(self) -> tuple[Report, int]:
        """The report to send now, parsed, and how many pending events it carries (tests, benches)."""
        body, _, n = self.build_body()
        return decode(body, Report), n

    def acknowledge(self, n_events: int) -> None:
        self._backlog.release_through(self._backlog.first_id + n_events)

    def _auth_headers(self) -> dict[str, str]:
        """This node's credential, read for each report: a token file is re-read once replaced
        (kubelet rotates a projected service-account token)."""
        token = self._token.current() if isinstance(self._token, TokenFile) else self._token
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def run(self, stop: asyncio.Event) -> None:
        if self._url is None:
            log.info("no aggregator configured: reports are built for /v1/state only")
        headers = {"Content-Type": "application/json"}
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True)
        worker = asyncio.create_task(self._run_node_actions()) if self._node_actions is not None else None
        try:
            async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as session:
                await self._loop(session, stop)
        finally:
            if worker is not None:
                # A request in its thread finishes there (bounded by its own timeout); its result is lost.
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker
            self._backlog.close()

    async def _loop(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        backoff = 0.0
        more = False  # a backlog remains after an accepted report: send the next part at once
        while not stop.is_set():
            # An urgent event that arrived while the previous report was in flight goes out now:
            # the wake flag is cleared only after a wait, never before, so it cannot be lost.
            if not self._urgent and not more:
                delay = backoff if backoff > 0 else self._interval
                waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())}
                _, pending = await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
            self._wake.clear()
            if stop.is_set():
                break
            body, end_id, n = self.build_body()
            if self._url is None:
                self._backlog.release_through(end_id)
                more = False
                continue
            outcome = await self._post(session, body, n)
            if outcome == "resend":  # nothing was taken; the next body is whole or version 1
                backoff, more = 0.0, True
                continue
            if outcome == "retry":
                # Jittered exponential backoff, Retry-After honoured; events stay pending and ride
                # the next report (compact against the same base: nothing was taken).
                backoff = self._backoff.failed(self._retry_after)
                self._retry_after = None
                more = False
                continue
            self._backoff.succeeded()
            if outcome == "ok":
                self._backlog.release_through(end_id)
                self._release_results()
            elif outcome in ("rejected", "too_large"):  # logged in _post; counted here, once
                self.dropped[outcome] += self._backlog.release_through(end_id)
                if outcome == "rejected":
                    self.results_dropped["rejected"] += self._release_results()
            backoff = 0.0
            more = bool(self._backlog) and outcome != "state_too_large"

    async def _post(self, session: aiohttp.ClientSession, body: bytes, n_events: int) -> str:
        """One POST: "ok", "retry" (keep everything, back off), "split" (413: smaller next time),
        "too_large" (413 for a single event: it is dropped), "rejected" (the aggregator refused
        the content: its events are dropped) or "state_too_large" (413 with no events)."""
        assert self._url is not None
        try:
            async with session.post(self._url, data=body, headers=self._auth_headers()) as resp:
                status = resp.status
                if status < 300:
                    self.counts["ok"] += 1
                    self.last_success_ts = self._clock()
                    answer = await _read_bounded(resp, MAX_ANSWER_BYTES)
                    parsed = _parse_answer(answer)
                    self.accepted(parsed)
                    if self._node_actions is not None:
                        self._take_requests(answer, parsed)
                    return "ok"
                text = (await resp.text())[:MAX_ANSWER_BYTES]
        except aiohttp.ClientSSLError as exc:
            return self._error("tls", f"TLS to {self._url} failed (certificate not verified?): {exc}")
        except TimeoutError:
            self._unanswered = self._built  # it may have been taken: a 409 delta_base will say
            return self._error("timeout", f"aggregator at {self._url} did not answer in {self._timeout}s")
        except (aiohttp.ClientError, OSError) as exc:
            if not isinstance(exc, aiohttp.ClientConnectorError):  # connected: it may have been taken
                self._unanswered = self._built
            return self._error("unreachable", f"cannot reach aggregator at {self._url}: {exc or type(exc).__name__}")
        if status in (429, 503):
            self._retry_after = retry_after(resp.headers.get("Retry-After"))
        if status == 413:
            return self._split(len(body), n_events)
        if status in (401, 403):
            return self._error("unauthorized", f"aggregator refused this node's credential: {status} {text[:300]}")
        if status in (408, 429):
            return self._error("throttled", f"aggregator answered {status}: {text[:300]}")
        if status >= 500:
            return self._error("server_error", f"aggregator answered {status}: {text[:300]}")
        refused = _parse_answer(text.encode())
        reason = refused.get("error") if isinstance(refused, dict) else None
        if (status == 409 and reason != "delta_base") or (status == 422 and reason in TRANSIENT_REFUSALS):
            # Nothing was taken, the base included: the events ride a later report (the backlog's
            # bound still holds, drops counted backlog_full).
            return self._error("refused_transient", f"aggregator refused a report for now ({status} {reason}; "
                               f"{n_events} event(s) kept and resent): {text[:300]}")
        if self._built_compact:
            return self._refused_compact(status, text)
        # Any other 4xx: the aggregator refused this report's content and would refuse it again.
        self.counts["rejected"] += 1
        log.error("aggregator rejected a report (%d bytes, %d event(s), dropped and counted): %d %s",
                  len(body), n_events, status, text[:300])
        return "rejected"

    def _refused_compact(self, status: int, text: str) -> str:
        """A compact report refused: resend at once (events kept), whole, unless the aggregator's
        409 delta_base names the report whose answer was lost as the one it holds (then compact
        against that one). A whole report refused for its content is dropped (``_post``)."""
        parsed = _parse_answer(text.encode())
        self._base = None
        unanswered, self._unanswered = self._unanswered, None
        if status == 409 and isinstance(parsed, dict) and parsed.get("error") == "delta_base":
            held = parsed.get("held")
            if (unanswered is not None and isinstance(held, dict) and held.get("boot_id") == self._boot_id
                    and held.get("seq") == unanswered.seq):
                # The report whose answer was lost was taken: it is the base, the resend compact.
                self._base = unanswered
                self.counts["rebased"] += 1
                log.info("aggregator took report %d although its answer was lost: resending compact against it",
                         unanswered.seq)
                return "resend"
            self.counts["rebased"] += 1
            log.info("aggregator has no base for the compact report (restarted, or an answer was lost): resending "
                     "it whole")
            return "resend"
        self.counts["downgraded"] += 1
        log.warning("aggregator refused a compact report (%d %s): resending it whole", status, text[:300])
        return "resend"

    def _error(self, reason: str, message: str) -> str:
        self.counts["error"] += 1
        self.errors[reason] += 1
        log.warning("%s", message)
        return "retry"

    def _split(self, body_bytes: int, n_events: int) -> str:
        self.counts["split"] += 1
        if n_events == 0:
            log.error("aggregator refused a report of %d bytes with no events (413): the node's state alone "
                      "is over its max_body_bytes; raise it (contract/limits.py)", body_bytes)
            return "state_too_large"
        if n_events == 1:
            log.error("aggregator refused one event alone (413, report of %d bytes): dropped and counted",
                      body_bytes)
            return "too_large"
        # Halve the events' share, not the whole body: the state part is the same in every report.
        events_bytes = max(0, body_bytes - self._state_bytes)
        self.body_limit_bytes = min(self.body_limit_bytes, self._state_bytes + events_bytes // 2)
        log.warning("aggregator refused a report of %d bytes (413): reports now kept under %d bytes",
                    body_bytes, self.body_limit_bytes)
        return "split"

    # --- node actions ---------------------------------------------------------------------------

    def accepted(self, answer: object) -> None:
        """The aggregator accepted the body built last and answered ``answer`` (its parsed JSON):
        that report is the base of the next compact one."""
        self._base = self._built
        self._unanswered = None
        raw = answer.get("standing") if isinstance(answer, dict) else None
        if raw is not None:
            standing = parse_standing(raw, self._clock())
            if standing is None:
                self.standing_malformed += 1
                log.warning("the aggregator's answer has a standing that does not parse (ignored): %.200r", raw)
            else:
                self.standing = standing

    def standing_at(self, now: float, stale_seconds: float) -> Standing | None:
        """The standing if an answer brought it within ``stale_seconds`` (on this agent's clock; a
        clock stepped back past it counts as stale too), else None: unknown."""
        s = self.standing
        if s is None or not 0 <= s.age_seconds(now) <= stale_seconds:
            return None
        return s

    def _take_requests(self, answer: bytes | None, parsed: object) -> None:
        """Queue the node action requests of an accepted report's answer. A malformed answer or
        request is ignored and counted, never raised: the report itself was accepted."""
        if not isinstance(parsed, dict):
            if answer:  # an empty answer carries no requests; anything else must be a JSON object
                self._ignore("malformed", 1, "the aggregator's answer is not a JSON object")
            return
        raw = parsed.get("requests")
        if raw is None:
            return
        if not isinstance(raw, list):
            self._ignore("malformed", 1, "the aggregator's answer has requests that are not a list")
            return
        if len(raw) > MAX_REQUESTS_PER_RESPONSE:
            self._ignore("too_many", len(raw), f"the aggregator's answer carries {len(raw)} node action requests, "
                                               f"more than {MAX_REQUESTS_PER_RESPONSE}: all ignored")
            return
        bad = 0
        for item in raw:
            try:
                request = convert(item, NodeActionRequest)
            except WireError:
                bad += 1
                continue
            if request.id in self._queued_ids or any(r.id == request.id for r in self.action_results):
                continue  # being handled, or its result is on its way: the aggregator resends until then
            if len(self._queued_ids) >= MAX_QUEUED_REQUESTS:
                self._ignore("queue_full", 1, f"node action request {request.id} ignored: "
                                              f"{MAX_QUEUED_REQUESTS} are waiting already")
                continue
            self._queued_ids.add(request.id)
            self._requests.put_nowait(request)
        if bad:
            self._ignore("malformed", 1, f"{bad} node action request(s) in the aggregator's answer do not parse")

    def _ignore(self, reason: str, n: int, message: str) -> None:
        self.requests_ignored[reason] += n
        log.warning("%s", message)

    async def _run_node_actions(self) -> None:
        """One request at a time, each in a thread: a GPU reset blocks for seconds."""
        assert self._node_actions is not None
        while True:
            request = await self._requests.get()
            try:
                result = await asyncio.to_thread(self._node_actions, request)
            except Exception:  # a bug in the runner must not stop the reporter
                log.exception("node action %s: the runner failed", request.id)
                continue
            finally:
                self._queued_ids.discard(request.id)
            self.add_action_result(result)

    def add_action_result(self, result: NodeActionResult) -> None:
        """Queue ``result`` for the next report and push it at once."""
        self.action_results.append(result)
        overflow = len(self.action_results) - MAX_PENDING_RESULTS
        if overflow > 0:
            del self.action_results[:overflow]
            self.results_dropped["backlog_full"] += overflow
            log.error("node action results pending beyond %d (aggregator unreachable): dropped the %d oldest",
                      MAX_PENDING_RESULTS, overflow)
        self._wake.set()

    def _release_results(self) -> int:
        """Forget the results the last report carried (it was answered); how many."""
        carried = {id(r) for r in self._carried}
        before = len(self.action_results)
        self.action_results = [r for r in self.action_results if id(r) not in carried]
        self._carried = []
        return before - len(self.action_results)


def _parse_answer(answer: bytes | None) -> object:
    """The aggregator's answer as JSON, or None when it is absent or does not parse."""
    try:
        return json.loads(answer) if answer else None
    except ValueError:
        return None


async def _read_bounded(resp: aiohttp.ClientResponse, limit_bytes: int) -> bytes | None:
    """The answer's body, or None when it is longer than ``limit_bytes``."""
    if resp.content_length is not None and resp.content_length > limit_bytes:
        return None
    body = await resp.content.read(limit_bytes + 1)
    while len(body) <= limit_bytes:
        more = await resp.content.read(limit_bytes + 1 - len(body))
        if not more:
            return body
        body += more
    return None
