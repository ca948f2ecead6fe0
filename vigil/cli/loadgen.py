"""The load generator behind ``vigil loadgen``: N simulated nodes post agent-built reports
(vigil/cli/agent_reports.py) to a running aggregator over HTTP, open-loop at the real cadence.

Each node posts every ``interval_seconds`` with the nodes' phases spread evenly; a send is never
held back by a slow answer (a send that starts late is counted as late). Each node negotiates the
report version as the agent does (agent/reporter.py): version 1 until an answer lists the
newest compact version (3), then that version whole, then compact relative to its last accepted
report; a 409 ``delta_base`` is resent whole at once (counted as rebased). Like the agent, a node
sends one report at a time, and one whose report was shed (503 or 429) or not answered (a timeout,
a dropped connection) waits as agent/reporter.py's ``Backoff`` says
(Retry-After honoured, jittered, never sooner than its cadence), skipping its slots meanwhile
(counted as deferred) and keeping its compact base; a node whose answer was lost sends its next
report compact against the lost one (a 409 delta_base: whole). It measures its own
lateness (each send's start against its due time, one monotonic clock) and says when it fell
behind (the run is then invalid: it measured the generator), offered and accepted reports/s,
intake latency percentiles, errors by status or exception, sheds and deferred slots, what happened
to the reports due in each TIMELINE_SECONDS of the run (accepted fraction over time), its own CPU,
and, given the
aggregator's pid, the aggregator's CPU and RSS from ``/proc/<pid>``. With ``spawn`` it
makes the credentials and a dry-run config for N nodes in a scratch directory and runs
``vigil aggregator`` as a child, stopped by pid at the end; against a running aggregator its nodes
are synthetic (loadgen-*: held apart, never judged, forgotten seconds after the run) and it refuses
one not in dry run. It decides nothing and acts on nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from vigil.agent.reporter import Backoff, retry_after
from vigil.aggregator.auth import node_token
from vigil.cli.agent_reports import INTERVAL_SECONDS, RenderedReport, report_forms, topology_of
from vigil.contract.credential_file import create_private
from vigil.contract.wire import REPORT_VERSION, SYNTHETIC_NODE_PREFIX

# A send that starts this long after its due time is late: the generator, not the aggregator,
# was behind (a tenth of the 250 ms intake budget of issue #20).
LATE_SECONDS = 0.025
# One send's whole exchange; past it the send counts as a TimeoutError (the agent's own
# request timeout is of this order).
REQUEST_TIMEOUT_SECONDS = 10.0
# How long to wait for the last answers once the schedule has ended.
DRAIN_SECONDS = 15.0
# Consecutive reports built per run: enough that a node's counters only move forward for a
# couple of minutes at 2.5 s; a longer run cycles them (the aggregator sees a counter reset).
MAX_ROUNDS = 48
START_TIMEOUT_SECONDS = 60.0
HEALTH_TIMEOUT_SECONDS = 10.0  # GET /healthz, before and after a run against a running aggregator
STOP_TIMEOUT_SECONDS = 10.0
# Workers start on a common clock this far ahead (a spawned Python imports aiohttp in ~1 s).
WORKER_START_SECONDS = 3.0
# The timeline's resolution: what became of the reports due in each such span of the run.
TIMELINE_SECONDS = 5.0
# An agent's own ceiling on its backoff (agent/reporter.py Reporter's max_backoff_seconds).
MAX_BACKOFF_SECONDS = 60.0
TIMELINE_KEYS = ("due", "accepted", "shed", "deferred", "errors")


# The generator is behind schedule when more than this share of its sends started LATE_SECONDS or
# more after their due time: its offered load was not the plan's, and every figure then measures
# the generator (a starved event loop), not the aggregator. A tenth leaves room for a passing
# stall of a shared machine (a 250 ms pause delays 5 of 40 sends at 20 reports/s) and none for a
# generator that falls further behind all run long (all of its sends late).
MAX_LATE_FRACTION = 0.10


class Pace:
    """The generator's own lateness: each send's start against its due time, both on one
    monotonic ``clock``; says whether the offered load was the plan's."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lateness_seconds: list[float] = []
        self.first_due: float | None = None
        self.last_start: float | None = None

    def started(self, due: float) -> float:
        """A send due at ``due`` starts now: its start (the clock's reading)."""
        now = self.clock()
        self.lateness_seconds.append(max(0.0, now - due))
        self.first_due = due if self.first_due is None else min(self.first_due, due)
        self.last_start = now if self.last_start is None else max(self.last_start, now)
        return now

    @property
    def late(self) -> int:
        return sum(1 for x in self.lateness_seconds if x > LATE_SECONDS)


def pace_summary(paces: list[Pace], target_per_second: float, slot_seconds: float) -> dict[str, Any]:
    """Whether the generators sent at the plan's rate: their lateness percentiles, the rate they
    actually sent at (sends over the span from the first due time to the last start, one slot
    added: a generator on time sends exactly the plan's rate), and ``behind_schedule``."""
    lateness = sorted(x for p in paces for x in p.lateness_seconds)
    sent = len(lateness)
    late = sum(p.late for p in paces)
    firsts = [p.first_due for p in paces if p.first_due is not None]
    lasts = [p.last_start for p in paces if p.last_start is not None]
    span = max(lasts) - min(firsts) + slot_seconds if firsts and lasts else 0.0
    sent_per_second = sent / span if span > 0 else 0.0
    return {"behind_schedule": sent > 0 and late > MAX_LATE_FRACTION * sent,
            "offered_reports_per_second": round(target_per_second, 1),
            "sent_reports_per_second": round(sent_per_second, 1),
            "late_sends": late, "late_fraction": round(late / sent, 4) if sent else 0.0,
            "lateness_seconds": {"p50": percentile(lateness, 0.50), "p99": percentile(lateness, 0.99),
                                 "max": lateness[-1] if lateness else 0.0}}


def pace_line(generator: dict[str, Any]) -> str:
    """The verdict on the generator, to print beside the throughput."""
    g, lat = generator, generator["lateness_seconds"]
    if not g["behind_schedule"]:
        return (f"generator on schedule: offered {g['offered_reports_per_second']:,.0f} reports/s, sent "
                f"{g['sent_reports_per_second']:,.0f}/s; lateness p99 {lat['p99'] * 1000:.1f} ms")
    return (f"INVALID: generator behind schedule: offered {g['offered_reports_per_second']:,.0f} reports/s, sent "
            f"{g['sent_reports_per_second']:,.0f}/s ({g['late_fraction']:.0%} of sends started over "
            f"{LATE_SECONDS * 1000:.0f} ms late, p99 {lat['p99'] * 1000:,.0f} ms); the figures measure the "
            "generator, not the aggregator (more --workers, or fewer --nodes)")


@dataclass(frozen=True)
class Target:
    url: str  # e.g. http://127.0.0.1:9500
    site_secret: bytes  # node tokens are derived from it
    read_token: str | None = None  # to list the fleet at the end
    pid: int | None = None  # the aggregator's, for CPU and RSS


@dataclass(frozen=True)
class Plan:
    nodes: int
    duration_seconds: float
    interval_seconds: float = INTERVAL_SECONDS
    workers: int = 1
    node_prefix: str = "load"
    connections: int = 1024  # open connections per worker at most (keep-alive)
    # Sent at the same cadence before the measured duration and not counted: an aggregator in
    # steady state has full windows (the fleet's 80 s sample rings, the detectors' 60 s windows),
    # which a short run from an empty fleet never reaches.
    warmup_seconds: float = 0.0


# The forms a node sends a round in, as an agent of this release does: whole (no base), or compact
# against its last accepted report.
FORMS = (f"whole v{REPORT_VERSION}", f"compact v{REPORT_VERSION}")


@dataclass(frozen=True)
class RenderedRound:
    """One round's report in each form (vigil/cli/agent_reports.py RoundForms), ready to render."""

    whole: RenderedReport
    compact: RenderedReport | None


@dataclass
class WorkerResult:
    sent: int = 0
    accepted: int = 0
    rebased: int = 0  # compact reports refused with 409 delta_base and resent whole
    by_form: Counter[str] = field(default_factory=Counter)  # accepted sends by FORMS
    latencies_seconds: list[float] = field(default_factory=list)  # accepted sends only
    errors: Counter[str] = field(default_factory=Counter)  # "HTTP 401", "TimeoutError", ...
    cpu_seconds: float = 0.0
    # The aggregator as the measured duration began (worker 0 reads it after a warm-up).
    aggregator_at_start: ProcSample | None = None
    measured_from_wall: float | None = None  # when the measured duration began (Unix time; worker 0)
    warmup_errors: Counter[str] = field(default_factory=Counter)  # the warm-up's, kept apart
    pace: Pace = field(default_factory=Pace)  # the measured sends' lateness
    shed: int = 0  # answered 503 or 429 (the aggregator behind): not taken, resent after Retry-After
    deferred: int = 0  # slots a node skipped while backing off (as the agent waits)
    # Per TIMELINE_SECONDS of the measured duration (by due time): TIMELINE_KEYS counts.
    timeline: dict[int, Counter[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcSample:
    cpu_seconds: float
    rss_bytes: int
    peak_rss_bytes: int
    # Of cpu_seconds, its main thread's: the event loop (HTTP, validation, ingest, the loop's share
    # of each evaluation); the rest is its other threads' (the detectors' judging thread).
    main_thread_cpu_seconds: float = 0.0


def read_proc(pid: int, proc_root: Path = Path("/proc")) -> ProcSample:
    """utime + stime (the process's, its main thread's) and VmRSS/VmHWM of ``pid`` (proc(5))."""
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu_of(stat_path: Path) -> float:
        stat = stat_path.read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        return (int(fields[11]) + int(fields[12])) / ticks  # fields 14 and 15 of the whole line

    cpu = cpu_of(proc_root / str(pid) / "stat")
    try:
        main = cpu_of(proc_root / str(pid) / "task" / str(pid) / "stat")
    except OSError:
        main = cpu
    status = dict(line.split(":", 1) for line in (proc_root / str(pid) / "status").read_text().splitlines()
                  if ":" in line)
    kib = lambda key: int(status.get(key, "0 kB").split()[0]) * 1024  # noqa: E731
    return ProcSample(cpu, kib("VmRSS"), kib("VmHWM"), main)


def node_name(prefix: str, n: int) -> str:
    return f"{prefix}-{n:05d}"


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def raise_nofile() -> None:
    """Soft open-file limit up to the hard one: thousands of connections need it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _drive(templates: list[RenderedRound], target: Target, plan: Plan, worker: int, start_monotonic: float,
                 run_id: str) -> WorkerResult:
    result = WorkerResult()
    mine = [n for n in range(plan.nodes) if n % plan.workers == worker]
    node_json = {n: json.dumps(node_name(plan.node_prefix, n)).encode() for n in mine}
    boot_json = {n: json.dumps(f"{run_id}-{n:05d}").encode() for n in mine}
    topo_json = {n: json.dumps(topology_of(n)).encode() for n in mine}
    tokens = {n: f"Bearer {node_token(target.site_secret, node_name(plan.node_prefix, n))}" for n in mine}
    slot_seconds = plan.interval_seconds / plan.nodes
    total_slots = int((plan.warmup_seconds + plan.duration_seconds) / slot_seconds)
    measured_from = int(plan.warmup_seconds / slot_seconds)  # the first slot counted
    measure_start = start_monotonic + measured_from * slot_seconds
    url = target.url.rstrip("/") + "/v1/reports"
    pending: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    wall_offset = time.time() - time.monotonic()
    # Per node, as the agent's Reporter keeps it: the seq of its last accepted report (the base of
    # a compact one).
    base: dict[int, int | None] = dict.fromkeys(mine)
    # As the agent: the seq of a report whose answer was lost, the backoff, and until when (monotonic).
    unanswered: dict[int, int | None] = dict.fromkeys(mine)
    backoff = {n: Backoff(plan.interval_seconds, MAX_BACKOFF_SECONDS) for n in mine}
    hold_until = dict.fromkeys(mine, 0.0)
    # The next report's seq (a shed report's round is sent again: nothing was taken), and the
    # nodes with a send in flight (an agent sends one report at a time: such a node skips its slot).
    next_seq = dict.fromkeys(mine, 1)
    in_flight: set[int] = set()

    def mark(due: float, key: str) -> None:
        """Count ``key`` against the timeline span of a measured send due at ``due``."""
        span = int((due - measure_start) // TIMELINE_SECONDS)
        result.timeline.setdefault(span, Counter())[key] += 1

    def failed(n: int, after: float | None) -> None:
        hold_until[n] = time.monotonic() + backoff[n].failed(after)

    async def send(session: aiohttp.ClientSession, n: int, seq: int, due: float, counted: bool) -> None:
        """One report of node ``n``; ``counted``: in the measured duration (else the warm-up's)."""
        tally = result if counted else warmup
        rendered = templates[(seq - 1) % len(templates)]
        form = FORMS[1] if seq - 1 in (base[n], unanswered[n]) and rendered.compact is not None else FORMS[0]
        started = tally.pace.started(due)
        tally.sent += 1
        status = 0
        in_flight.add(n)
        try:
            while True:
                template = rendered.whole if form == FORMS[0] else rendered.compact
                assert template is not None
                body = template.render(n, node_json[n], boot_json[n], topo_json[n], seq, due + wall_offset)
                async with session.post(url, data=body, headers={"Authorization": tokens[n],
                                                                 "Content-Type": "application/json"}) as resp:
                    answer = await resp.read()
                    status = resp.status
                    after = resp.headers.get("Retry-After")
                if status == 409 and form == FORMS[1] and b'"delta_base"' in answer:
                    tally.rebased += 1  # the agent resends it whole at once
                    form = FORMS[0]
                    continue
                break
            if status == 202:
                backoff[n].succeeded()
                unanswered[n] = None
                next_seq[n] = seq + 1
                if counted:
                    mark(due, "accepted")
                tally.accepted += 1
                tally.by_form[form] += 1
                tally.latencies_seconds.append(time.monotonic() - started)
                base[n] = seq
            elif status in (429, 503):  # shed: nothing taken, the base kept
                tally.shed += 1
                if counted:
                    mark(due, "shed")
                failed(n, retry_after(after))
            else:
                # Any other refusal (a 401 of a wrong secret) is counted at every slot: a
                # misconfigured run shows as such, not as a slower one.
                tally.errors[f"HTTP {status}"] += 1
                if counted:
                    mark(due, "errors")
        except Exception as exc:  # noqa: BLE001 - every failure is a counted error, by kind
            tally.errors[type(exc).__name__] += 1
            if counted:
                mark(due, "errors")
            if status == 0 and not isinstance(exc, aiohttp.ClientConnectorError):
                unanswered[n] = seq  # sent, answer lost: the aggregator may hold it
                next_seq[n] = seq + 1
            failed(n, None)
        finally:
            in_flight.discard(n)

    warmup = WorkerResult()  # what the warm-up's sends did: only its errors are reported
    cpu_start = time.process_time()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    connector = aiohttp.TCPConnector(limit=plan.connections)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        slot = worker  # slots of node n are n, n + N, n + 2N, ...; this worker's nodes are n % K == worker
        measuring = measured_from == 0
        while slot < total_slots:
            due = start_monotonic + slot * slot_seconds
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if not measuring and slot >= measured_from:
                measuring = True  # the warm-up is over: what is measured starts now
                cpu_start = time.process_time()
                if worker == 0:
                    result.measured_from_wall = time.time()
                if worker == 0 and target.pid is not None:
                    result.aggregator_at_start = read_proc(target.pid)
            n = slot % plan.nodes
            if measuring:
                mark(due, "due")
            if n in in_flight or hold_until[n] > due:  # as the agent: one at a time, backing off
                if measuring:
                    result.deferred += 1
                    mark(due, "deferred")
                slot += plan.workers
                continue
            task = loop.create_task(send(session, n, next_seq[n], due, measuring))
            pending.add(task)
            task.add_done_callback(pending.discard)
            slot += plan.workers
        if pending:
            _, still = await asyncio.wait(set(pending), timeout=DRAIN_SECONDS)
            for task in still:
                task.cancel()
            if still:
                result.errors["not answered by the end"] += len(still)
    result.cpu_seconds = time.process_time() - cpu_start
    result.warmup_errors = warmup.errors
    return result


def _worker_main(templates: list[RenderedRound], target: Target, plan: Plan, worker: int, start_wall: float,
                 run_id: str) -> WorkerResult:
    raise_nofile()
    start_monotonic = start_wall - (time.time() - time.monotonic())
    return asyncio.run(_drive(templates, target, plan, worker, start_monotonic, run_id))


def build_templates(plan: Plan, hca_template: Path | None) -> list[RenderedRound]:
    seconds = plan.warmup_seconds + plan.duration_seconds
    rounds = max(2, min(MAX_ROUNDS, int(seconds / plan.interval_seconds) + 2))
    return [RenderedRound(RenderedReport.of(r.whole), None if r.compact is None else RenderedReport.of(r.compact))
            for r in report_forms(rounds, hca_template, plan.interval_seconds)]


def health(target: Target) -> dict[str, Any]:
    """The aggregator's GET /healthz (public): its dry_run, its synthetic node count."""
    import urllib.request

    with urllib.request.urlopen(target.url.rstrip("/") + "/healthz", timeout=HEALTH_TIMEOUT_SECONDS) as resp:
        body = json.loads(resp.read())
    return body if isinstance(body, dict) else {}


def refusal(target: Target, plan: Plan) -> str | None:
    """Why this run must not start against a running aggregator (None: it may). Its nodes must be
    in the reserved synthetic namespace (the aggregator holds them apart, judges none of them and
    forgets them seconds after the run), and the aggregator must be in dry run (one that acts
    refuses them: vigil/aggregator/synthetic_nodes.py)."""
    first = node_name(plan.node_prefix, 0)
    if not first.startswith(SYNTHETIC_NODE_PREFIX):
        return (f"node names {first}... are not in the reserved synthetic namespace {SYNTHETIC_NODE_PREFIX}*: against "
                "a running aggregator they would be judged as real nodes (use --node-prefix loadgen)")
    import urllib.error

    try:
        dry_run = health(target).get("dry_run")
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return f"cannot read {target.url.rstrip('/')}/healthz to check that the aggregator is in dry run: {exc}"
    if dry_run is not True:
        return ("the aggregator is not in dry run (GET /healthz: dry_run false): it acts, so it refuses synthetic "
                "nodes; load-test a dry-run aggregator (a shadow replica, or --spawn)")
    return None


def fleet_nodes(target: Target, plan: Plan) -> int | None:
    """How many of this run's nodes the aggregator holds: its synthetic count (GET /healthz) for
    synthetic nodes, else those its fleet lists (GET /v1/nodes; None without a read token)."""
    if node_name(plan.node_prefix, 0).startswith(SYNTHETIC_NODE_PREFIX):
        count = health(target).get("synthetic_nodes", 0)  # present only while there are any
        return count if isinstance(count, int) else None
    if target.read_token is None:
        return None
    import urllib.request

    req = urllib.request.Request(target.url.rstrip("/") + "/v1/nodes",
                                 headers={"Authorization": f"Bearer {target.read_token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        nodes = json.loads(resp.read())["nodes"]
    ours = {node_name(plan.node_prefix, n) for n in range(plan.nodes)}
    return sum(1 for node in nodes if node["node"] in ours)


def run_load(target: Target, plan: Plan, hca_template: Path | None = None,
             proc_root: Path = Path("/proc")) -> dict[str, Any]:
    """Run ``plan`` against ``target``; the summary as a JSON-ready dict."""
    raise_nofile()
    templates = build_templates(plan, hca_template)
    run_id = secrets.token_hex(8)
    before = read_proc(target.pid, proc_root) if target.pid else None
    started = time.perf_counter()
    if plan.workers == 1:
        results = [asyncio.run(_drive(templates, target, plan, 0, time.monotonic() + 0.2, run_id))]
    else:
        start_wall = time.time() + WORKER_START_SECONDS
        with ProcessPoolExecutor(plan.workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_worker_main, templates, target, plan, w, start_wall, run_id)
                       for w in range(plan.workers)]
            results = [f.result() for f in futures]
    elapsed = time.perf_counter() - started
    after = read_proc(target.pid, proc_root) if target.pid else None
    # The aggregator's CPU over the measured duration (from the warm-up's end); its memory from
    # before the first report.
    measured_from = results[0].aggregator_at_start or before if plan.warmup_seconds else before
    latencies = sorted(x for r in results for x in r.latencies_seconds)
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r.errors)
    sent = sum(r.sent for r in results)
    accepted = sum(r.accepted for r in results)
    by_form: Counter[str] = Counter()
    for r in results:
        by_form.update(r.by_form)
    sample = lambda t: len(t.render(0, b'"x"', b'"x"', b"{}", 2, 0.0)) if t is not None else 0  # noqa: E731
    loadgen_cpu = sum(r.cpu_seconds for r in results)
    generator = pace_summary([r.pace for r in results], plan.nodes / plan.interval_seconds,
                             plan.interval_seconds / plan.nodes)
    summary: dict[str, Any] = {
        "nodes": plan.nodes, "interval_seconds": plan.interval_seconds, "duration_seconds": plan.duration_seconds,
        "warmup_seconds": plan.warmup_seconds,
        "workers": plan.workers, "report_bytes": sample(templates[-1].whole),
        "compact_report_bytes": sample(templates[-1].compact),
        "target_reports_per_second": round(plan.nodes / plan.interval_seconds, 1),
        "sent": sent, "accepted": accepted, "late_sends": generator["late_sends"],
        "accepted_by_form": {form: by_form[form] for form in FORMS}, "rebased": sum(r.rebased for r in results),
        # What the generator actually sent at (the plan's rate only when it kept its schedule).
        "offered_reports_per_second": generator["sent_reports_per_second"],
        "accepted_reports_per_second": round(accepted / plan.duration_seconds, 1),
        "latency_seconds": {"p50": percentile(latencies, 0.50), "p90": percentile(latencies, 0.90),
                            "p99": percentile(latencies, 0.99), "max": latencies[-1] if latencies else 0.0},
        "errors": dict(errors), "elapsed_seconds": round(elapsed, 2),
        "warmup_errors": dict(sum((r.warmup_errors for r in results), Counter())),
        "loadgen_cpu_seconds": round(loadgen_cpu, 2),
        "loadgen_cores": round(loadgen_cpu / plan.duration_seconds, 2),
        "fleet_nodes": fleet_nodes(target, plan),
        "shed": sum(r.shed for r in results), "deferred": sum(r.deferred for r in results),
        "timeline": merged_timeline(results),
        "measured_from_wall": results[0].measured_from_wall if plan.warmup_seconds else None,
        "generator": generator,
        # False: the generator fell behind its schedule, so the figures measure it, not the aggregator.
        "valid": not generator["behind_schedule"],
    }
    if before is not None and after is not None and measured_from is not None:
        cpu = after.cpu_seconds - measured_from.cpu_seconds
        per_report = cpu / accepted if accepted else 0.0
        main_cpu = after.main_thread_cpu_seconds - measured_from.main_thread_cpu_seconds
        summary["aggregator"] = {
            "pid": target.pid, "cpu_seconds": round(cpu, 2),
            "cores": round(cpu / (elapsed - plan.warmup_seconds), 2),
            "cpu_seconds_per_report": per_report,
            "main_thread_cpu_seconds_per_report": main_cpu / accepted if accepted else 0.0,
            "other_threads_cpu_seconds_per_report": (cpu - main_cpu) / accepted if accepted else 0.0,
            "reports_per_second_per_core": round(1 / per_report, 0) if per_report else 0.0,
            "rss_bytes_before": before.rss_bytes, "rss_bytes": after.rss_bytes, "peak_rss_bytes": after.peak_rss_bytes,
            "rss_bytes_per_node": round((after.rss_bytes - before.rss_bytes) / plan.nodes),
        }
    return summary


def merged_timeline(results: list[WorkerResult]) -> list[dict[str, Any]]:
    """The workers' timelines summed, one entry per TIMELINE_SECONDS span of the measured duration:
    its start (seconds), TIMELINE_KEYS counts and the accepted fraction of the reports due in it."""
    spans: dict[int, Counter[str]] = {}
    for r in results:
        for span, counts in r.timeline.items():
            spans.setdefault(span, Counter()).update(counts)
    return [{"start_seconds": span * TIMELINE_SECONDS, **{k: spans[span][k] for k in TIMELINE_KEYS},
             "accepted_fraction": round(spans[span]["accepted"] / spans[span]["due"], 4) if spans[span]["due"] else 0.0}
            for span in sorted(spans) if span >= 0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SpawnedAggregator:
    """``vigil aggregator`` as a child process in dry run, with a site secret and a read token of
    its own under ``root``; started bounded in time, stopped by pid."""

    def __init__(self, root: Path, extra_config: dict[str, Any] | None = None) -> None:
        self.root = root
        self.site_secret = secrets.token_hex(32)
        self.read_token = secrets.token_hex(32)
        for name, text in (("site.secret", self.site_secret), ("read.token", self.read_token)):
            problem = create_private(root / name, text + "\n")  # the aggregator refuses one others may read
            if problem is not None:
                raise OSError(problem)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"listen": f"127.0.0.1:{self.port}", "dry_run": True, "store_path": str(root / "decisions.sqlite"),
                  "auth": {"site_secret_file": str(root / "site.secret"), "read_token_file": str(root / "read.token")},
                  **(extra_config or {})}
        self.config_path = root / "aggregator.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = root / "aggregator.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, clock: Callable[[], float] = time.monotonic) -> None:
        with self.log_path.open("ab") as log:
            argv = [sys.executable, "-m", "vigil", "aggregator", "--config", str(self.config_path)]
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=raise_nofile)
        deadline = clock() + START_TIMEOUT_SECONDS
        while "listening on" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or clock() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"the aggregator did not start:\n{tail}")
            time.sleep(0.05)

    def target(self) -> Target:
        assert self.proc is not None
        return Target(self.url, self.site_secret.encode(), self.read_token, self.proc.pid)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_TIMEOUT_SECONDS)
        return proc.returncode


def run_spawned(plan: Plan, hca_template: Path | None = None) -> dict[str, Any]:
    """Start an aggregator of its own, run ``plan`` against it, stop it."""
    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below: the child is stopped

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with tempfile.TemporaryDirectory(prefix="vigil-loadgen-") as d:
            aggregator = SpawnedAggregator(Path(d))
            aggregator.start()
            try:
                return run_load(aggregator.target(), plan, hca_template)
            finally:
                aggregator.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)


def summary_lines(s: dict[str, Any]) -> list[str]:
    lat = s["latency_seconds"]
    ms = lambda v: f"{v * 1000:.1f} ms"  # noqa: E731
    lines = [
        f"nodes {s['nodes']} every {s['interval_seconds']:g} s for {s['duration_seconds']:g} s "
        + (f"after a {s['warmup_seconds']:g} s warm-up " if s.get("warmup_seconds") else "") +
        f"({s['workers']} worker(s)), {s['report_bytes'] / 1024:.1f} KiB reports",
        f"offered {s['offered_reports_per_second']:,.1f} reports/s (target {s['target_reports_per_second']:,.1f}), "
        f"accepted {s['accepted_reports_per_second']:,.1f} reports/s; sent {s['sent']}, accepted {s['accepted']}, "
        f"late sends {s['late_sends']}",
        "accepted by form: " + ", ".join(f"{k} {v}" for k, v in s["accepted_by_form"].items())
        + f"; compact {s['compact_report_bytes'] / 1024:.1f} KiB; rebased (409 delta_base, resent whole) "
          f"{s['rebased']}",
        f"intake latency p50 {ms(lat['p50'])}, p90 {ms(lat['p90'])}, p99 {ms(lat['p99'])}, max {ms(lat['max'])}",
        f"shed (503/429, resent after Retry-After) {s.get('shed', 0)}, slots deferred while backing off "
        f"{s.get('deferred', 0)}",
        "errors: " + (", ".join(f"{k} x{v}" for k, v in sorted(s["errors"].items())) or "none")
        + ("; in the warm-up: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["warmup_errors"].items()))
           if s.get("warmup_errors") else ""),
        f"loadgen CPU {s['loadgen_cpu_seconds']:.1f} s ({s['loadgen_cores']:.2f} cores)",
    ]
    if s.get("generator"):
        lines.insert(2, pace_line(s["generator"]))
    if s.get("fleet_nodes") is not None:
        lines.append(f"aggregator fleet lists {s['fleet_nodes']} of the {s['nodes']} nodes")
    agg = s.get("aggregator")
    if agg:
        lines.append(
            f"aggregator pid {agg['pid']}: CPU {agg['cpu_seconds']:.1f} s ({agg['cores']:.2f} cores), "
            f"{agg['cpu_seconds_per_report'] * 1e6:,.0f} us/report (~{agg['reports_per_second_per_core']:,.0f} "
            f"reports/s per core: main thread {agg.get('main_thread_cpu_seconds_per_report', 0) * 1e6:,.0f} us, "
            f"other threads (judging) {agg.get('other_threads_cpu_seconds_per_report', 0) * 1e6:,.0f} us); "
            f"RSS {agg['rss_bytes'] / 2**20:,.0f} MiB "
            f"(peak {agg['peak_rss_bytes'] / 2**20:,.0f}), "
            f"{agg['rss_bytes_per_node'] / 1024:,.0f} KiB per node")
    return lines
