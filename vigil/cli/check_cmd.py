"""``vigil check``: the node's own probe set, run once on this node and judged against the same
baselines the aggregator uses, with the exit codes a scheduler's health check expects.

It reads the agent's configuration (the NVML backend, real or ``nvml: fake``, and its ``probes``
section) and a baselines file (contract/probe_baselines.py ``ProbeBaselines``), runs the probes of
agent/probes/PROBES that need no other node through the ``ProbeContext`` a ``run_probes`` request
gets, and prints one line per result, a summary and (``--json``) a report. It exits 0 healthy, 1
unhealthy, 2 cannot judge (usage, configuration, GPUs held by a job). With ``--drain`` it drains its
own Slurm node on a failure, and undrains only a drain it set itself (LBNL NHC's rule), as a
``HealthCheckProgram`` must (docs/slurm.md "vigil check"). It talks to no aggregator and learns no
baseline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml
from pynvml import NVMLError

from vigil.agent.probes import PROBES, ProbeSpec
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.agent.probes.engine import ComputeEngine
from vigil.contract.probe_baselines import ProbeBaselines, Verdict, judge
from vigil.contract.seams import Clock, CommandRunner, run_command
from vigil.contract.wire import ProbeName, ProbeResult

# Exit codes. LBNL NHC and Slurm read any non-zero as "unhealthy" (a non-zero Prolog drains the
# node and requeues the job; slurm.conf(5), "PROLOG AND EPILOG SCRIPTS"); 2 is kept apart for a
# check that could not judge (usage, configuration, GPUs busy) so a script can tell "broken node"
# from "broken check" and --drain never drains for the latter.
EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_CANNOT_JUDGE = 2

# The reason prefix of a drain vigil check sets: it undrains only a node whose reason starts so
# (NHC's node-mark-online does the same with "NHC:"), and never overwrites another reason.
DRAIN_REASON_PREFIX = "vigil check:"
# Slurm keeps a node's reason as free text; a short one stays readable in `sinfo -R` columns.
DRAIN_REASON_MAX_CHARS = 120
# scontrol show + update together, all attempts: slurmd kills a HealthCheckProgram after 60 s
# (slurm.conf(5) HealthCheckProgram); scontrol's own MessageTimeout defaults to 10 s.
DRAIN_DEADLINE_SECONDS = 15.0
# The Slurm node states (scontrol show node's State=, "+"-joined flags) that already keep jobs away.
_OFFLINE_STATES = ("DRAIN", "DOWN", "FAIL", "MAINT")


class CheckUsageError(Exception):
    """A request vigil check cannot carry out at all (exit 2): unknown probe, bad file, bad name."""


@dataclass(frozen=True)
class CheckOptions:
    node: str
    probes: tuple[ProbeName, ...]
    quick: bool
    timeout_seconds: float  # every probe together; a probe past it is reported error/timeout


@dataclass
class Judged:
    result: ProbeResult
    verdict: Verdict


@dataclass
class DrainOutcome:
    # none (nothing to do), drained, undrained, left_alone (another reason holds the node), failed
    action: str
    detail: str = ""


@dataclass
class CheckReport:
    node: str
    hardware_class: str | None
    engine: str | None
    quick: bool
    exit_code: int
    judged: list[Judged] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # node-level failures (NVML, identity, timeout)
    cannot_judge: list[str] = field(default_factory=list)
    seconds: float = 0.0
    checked_at: float = 0.0
    drain: DrainOutcome | None = None
    baselines_sha256: str | None = None  # of the --baselines file's bytes (None: no file)

    @property
    def outcome(self) -> str:
        return {EXIT_HEALTHY: "healthy", EXIT_UNHEALTHY: "unhealthy"}.get(self.exit_code, "cannot_judge")

    def failures(self) -> list[str]:
        return [*self.problems, *(j.verdict.detail for j in self.judged if not j.verdict.passed)]

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node, "outcome": self.outcome, "exit_code": self.exit_code,
            "hardware_class": self.hardware_class, "engine": self.engine, "quick": self.quick,
            "checked_at": self.checked_at, "seconds": round(self.seconds, 3),
            "baselines_sha256": self.baselines_sha256,
            "failures": self.failures(), "cannot_judge": self.cannot_judge,
            "results": [{**msgspec.to_builtins(j.result),
                         "verdict": {"passed": j.verdict.passed, "reason": j.verdict.reason,
                                     "detail": j.verdict.detail, "floor": j.verdict.floor}}
                        for j in self.judged],
            "drain": None if self.drain is None else {"action": self.drain.action, "detail": self.drain.detail},
        }


def local_probes(table: Mapping[ProbeName, ProbeSpec], *, quick: bool,
                 names: Sequence[str] | None = None) -> tuple[ProbeName, ...]:
    """The probes one node runs alone, in the table's order: all of them, the quick ones, or those
    named (each must exist and need no other node)."""
    if names is None:
        return tuple(n for n, spec in table.items() if not spec.needs_group and (spec.quick or not quick))
    for name in names:
        spec = next((s for n, s in table.items() if n == name), None)
        if spec is None:
            raise CheckUsageError(f"unknown probe {name!r} (one of {', '.join(table)})")
        if spec.needs_group:
            raise CheckUsageError(f"probe {name!r} needs other nodes (a probe group): the aggregator runs it")
    return tuple(n for n in table if n in names)


def _judge(result: ProbeResult, baselines: ProbeBaselines, hardware_class: str | None) -> Verdict:
    """judge(), and one rule of a health check's own: a probe the baselines hold to a figure on this
    hardware class that came back skipped (no engine, not installed) did not show the node meets
    it, so the node is not passed on no evidence."""
    verdict = judge(result, baselines, hardware_class)
    base = baselines.baseline(hardware_class, result.probe)
    if result.status == "skipped" and base is not None and (base.min_value is not None or base.max_metrics):
        where = f"{result.probe}" + (f" on GPU {result.gpu}" if result.gpu is not None else "")
        return Verdict(False, "unverified", f"{where}: skipped ({result.reason or 'not run'}) but the baseline "
                                            f"of {hardware_class or 'default'} demands a figure", base.min_value)
    return verdict


def _probe_thread(ctx_for: Callable[[], ProbeContext], probes: Sequence[ProbeName],
                  table: Mapping[ProbeName, ProbeSpec], out: list[ProbeResult], current: list[ProbeName],
                  clock: Clock) -> None:
    for name in probes:
        current[:] = [name]
        started = clock()
        try:
            results = table[name].run(ctx_for())
        except Exception as exc:  # noqa: BLE001 - a probe's crash is this probe's error, never the check's
            results = [ProbeResult(probe=name, status="error", reason="exception",
                                   detail=f"{type(exc).__name__}: {exc}"[:500], seconds=max(0.0, clock() - started))]
        out.extend(results or [ProbeResult(probe=name, status="error", reason="no_result")])
    current[:] = []


def run_check(options: CheckOptions, baselines: ProbeBaselines, probes_config: ProbesConfig, *,
              nvml: Any, engine: ComputeEngine | None, run: CommandRunner = run_command,
              clock: Clock = time.monotonic, wall_clock: Clock = time.time,
              table: Mapping[ProbeName, ProbeSpec] = PROBES) -> CheckReport:
    """Run ``options.probes`` on this node and judge every result; the exit code is in the report.
    ``nvml`` is the opened backend (None: NVML unavailable, itself a failure); ``engine`` the
    compute seam (agent/probes/engine.py build_engine). Probes run in one worker thread so that a
    stuck GPU cannot hold the check past ``options.timeout_seconds``."""
    started = clock()
    report = CheckReport(node=options.node, hardware_class=None, engine=engine.kind if engine else None,
                         quick=options.quick, exit_code=EXIT_HEALTHY, checked_at=wall_clock())
    gpus: list[int] = []
    busy: dict[int, list[int]] = {}
    if nvml is None:
        report.problems.append("nvml: unavailable (the driver or NVML library cannot be loaded)")
    else:
        try:
            gpus = list(range(nvml.device_count()))
        except NVMLError as exc:
            report.problems.append(f"nvml: cannot count GPUs: {type(exc).__name__}: {exc}")
        names: list[str] = []
        for index in gpus:
            try:
                names.append(nvml.identity(index).name)
                pids = nvml.running_pids(index)
            except NVMLError as exc:  # lost, reset required: the node is not healthy
                report.problems.append(f"GPU {index}: cannot be identified: {type(exc).__name__}: {exc}")
                continue
            if pids:
                busy[index] = pids
        report.hardware_class = names[0] if names else None
        if len(set(names)) > 1:
            report.problems.append(f"GPUs of different models on one node: {sorted(set(names))}")
    allowed_with_job = set(probes_config.allow_with_job)
    to_run: list[ProbeName] = []
    for name in options.probes:
        # Intrusive probes never run beside a job; a non-intrusive one only where the config allows.
        if busy and (table[name].intrusive or name not in allowed_with_job):
            held = ", ".join(f"GPU {i}: pids {p}" for i, p in sorted(busy.items()))
            report.cannot_judge.append(f"{name}: not run, a job holds the GPUs ({held})")
        else:
            to_run.append(name)
    results: list[ProbeResult] = []
    if to_run and not report.problems:
        deadline = started + options.timeout_seconds

        def ctx_for() -> ProbeContext:
            return ProbeContext(config=probes_config, gpus=gpus, nvml=nvml, engine=engine, run=run, clock=clock,
                                deadline=deadline, group=None, quick=options.quick)

        current: list[ProbeName] = []
        worker = threading.Thread(target=_probe_thread, name="vigil-check-probes", daemon=True,
                                  args=(ctx_for, to_run, table, results, current, clock))
        worker.start()
        worker.join(max(0.0, deadline - clock()))
        if worker.is_alive():  # abandoned: a daemon thread does not hold the exit
            stuck = current[0] if current else to_run[0]
            done = list(results)
            results = [*done, ProbeResult(probe=stuck, status="error", reason="timeout",
                                          detail=f"{stuck} still running after {options.timeout_seconds:g} s")]
    report.judged = [Judged(r, _judge(r, baselines, report.hardware_class)) for r in results]
    if report.failures():
        report.exit_code = EXIT_UNHEALTHY
    elif report.cannot_judge:
        report.exit_code = EXIT_CANNOT_JUDGE
    report.seconds = clock() - started
    return report


# --- Slurm ---------------------------------------------------------------------------------------

def _node_fields(text: str) -> dict[str, str]:
    """``scontrol show node -o``'s one line as key -> value; Reason= runs to the end of the line
    ("Reason=vigil check: x [root@2024-...]") because it may hold spaces."""
    head, _, reason = text.partition(" Reason=")
    found = {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", head)}
    if reason:
        found["Reason"] = reason.strip()
    return found


def drain_reason(report: CheckReport) -> str:
    first = report.failures()[0] if report.failures() else "failed"
    text = f"{DRAIN_REASON_PREFIX} {first}"
    # scontrol takes the reason as one argv word; keep it printable and short.
    text = re.sub(r"\s+", " ", text.replace("=", ":"))
    return text if len(text) <= DRAIN_REASON_MAX_CHARS else text[: DRAIN_REASON_MAX_CHARS - 3] + "..."


def apply_to_slurm(report: CheckReport, *, run: CommandRunner, clock: Clock = time.monotonic,
                   scontrol: str = "scontrol", deadline_seconds: float = DRAIN_DEADLINE_SECONDS) -> DrainOutcome:
    """Drain the node on a failure; undrain a drain of our own on a pass; nothing when the check
    could not judge. Another reason on an offline node is left as it is (someone else's drain)."""
    if report.exit_code == EXIT_CANNOT_JUDGE:
        return DrainOutcome("none", "the check could not judge: Slurm left as it is")
    end = clock() + deadline_seconds

    def call(argv: list[str]) -> str:
        remaining = end - clock()
        if remaining <= 0:
            raise subprocess.TimeoutExpired(argv, deadline_seconds)
        return run(argv, remaining)

    node = report.node
    try:
        fields = _node_fields(call([scontrol, "-o", "show", "node", node]))
        state = fields.get("State", "").upper()
        reason = fields.get("Reason", "")
        ours = reason.startswith(DRAIN_REASON_PREFIX)
        offline = any(flag in state for flag in _OFFLINE_STATES)
        if report.exit_code == EXIT_UNHEALTHY:
            if offline and reason and not ours:
                return DrainOutcome("left_alone", f"{node} is {state} for another reason: {reason}")
            new_reason = drain_reason(report)
            call([scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={new_reason}"])
            return DrainOutcome("drained", new_reason)
        if "DRAIN" in state and ours:
            # UNDRAIN clears only the drain flag: a node also DOWN for some other cause stays down.
            call([scontrol, "update", f"NodeName={node}", "State=UNDRAIN"])
            return DrainOutcome("undrained", f"cleared {reason!r}")
        return DrainOutcome("none", f"{node} is {state or 'in an unknown state'}" + (f" ({reason})" if reason else ""))
    except subprocess.CalledProcessError as exc:
        stderr = (exc.stderr or "").strip() if isinstance(exc.stderr, str) else ""
        return DrainOutcome("failed", f"{' '.join(map(str, exc.cmd[:3]))} exited {exc.returncode}: {stderr}"[:300])
    except (OSError, subprocess.SubprocessError) as exc:
        return DrainOutcome("failed", f"{type(exc).__name__}: {exc}"[:300])


# --- output --------------------------------------------------------------------------------------

def result_line(judged: Judged) -> str:
    r, v = judged.result, judged.verdict
    what = f"{r.probe}{'' if r.gpu is None else f' gpu{r.gpu}'}"
    if not v.passed:
        return f"FAIL  {what}  {v.reason}: {v.detail}"
    if r.status == "skipped":
        return f"SKIP  {what}  {r.reason or 'not applicable'}"
    value = "" if r.value is None else f"  {r.value:.4g} {r.unit}".rstrip()
    floor = "" if v.floor is None else f" (floor {v.floor:.4g})"
    return f"PASS  {what}{value}{floor}"


def print_report(report: CheckReport, out: Any) -> None:
    for judged in report.judged:
        print(result_line(judged), file=out)
    for problem in report.problems:
        print(f"FAIL  {problem}", file=out)
    for note in report.cannot_judge:
        print(f"BUSY  {note}", file=out)
    failed = len(report.failures())
    print(f"vigil check: {report.node}: {report.outcome} ({len(report.judged)} result(s), {failed} failure(s), "
          f"class {report.hardware_class or '-'}, engine {report.engine or '-'}, {report.seconds:.1f} s)", file=out)
    if report.drain is not None and report.drain.action != "none":
        print(f"vigil check: slurm: {report.drain.action}: {report.drain.detail}", file=out)


def write_json(report: CheckReport, path: str) -> None:
    text = json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)  # a reader never sees half a report


# --- the command ---------------------------------------------------------------------------------

def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "check", help="run this node's probes once and exit 0 healthy, 1 unhealthy, 2 cannot judge",
        description="Run the node's local probe set (or --quick's subset) through the agent's probe code, "
                    "judge each result against the baselines the aggregator uses, and exit with the codes "
                    "a Slurm HealthCheckProgram, Prolog or Epilog, or a Kubernetes init container expects: "
                    "0 healthy, 1 unhealthy, 2 cannot judge (usage, configuration, GPUs held by a job).")
    p.add_argument("--config", metavar="AGENT_YAML", help="the agent's configuration (nvml backend, probes section)")
    p.add_argument("--baselines", metavar="FILE",
                   help="probe baselines (YAML: the aggregator's probes.baselines, alone or inside an aggregator "
                        "config); without it only the probes' own absolute checks apply")
    p.add_argument("--quick", action="store_true", help="only the quick probes, their short variants (seconds)")
    p.add_argument("--probes", metavar="A,B", help=f"these probes only (of {', '.join(PROBES)}; no group ones)")
    p.add_argument("--json", metavar="PATH|-", help="write the report as JSON to PATH (- for stdout)")
    p.add_argument("--drain", action="store_true",
                   help="on a failure drain this node in Slurm (reason 'vigil check: ...'); on a pass undrain "
                        "only a drain vigil check set itself (for HealthCheckProgram)")
    p.add_argument("--node", help="the Slurm node name (default: the agent config's node, i.e. the hostname)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="all probes together (default: probes.run_timeout_seconds; HealthCheckProgram is killed "
                        "after 60 s, so give it about 40)")


def load_baselines(path: str | None) -> tuple[ProbeBaselines, str | None]:
    """The baselines in ``path`` (ProbeBaselines alone, or an aggregator config's probes.baselines)
    and the SHA-256 of the bytes they were read from, which the report names: which version of a
    shared file judged this node."""
    from vigil.contract.validation import ConfigError, validate_config

    if path is None:
        return ProbeBaselines(), None
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read baselines {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(raw) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse baselines {path}: {exc}") from None
    if isinstance(data, dict) and "probes" in data:  # an aggregator configuration: its probes.baselines
        probes = data["probes"]
        if not isinstance(probes, dict):
            raise ConfigError(f"{path}: probes: must be a mapping")
        data = probes.get("baselines") or {}
    return validate_config(ProbeBaselines, data), hashlib.sha256(raw).hexdigest()


def run(args: argparse.Namespace) -> int:
    from vigil.agent.config import load_config
    from vigil.contract.validation import ConfigError
    from vigil.contract.wire import check_node_name

    def refuse(why: str) -> int:
        print(f"vigil check: cannot judge: {why}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE

    try:
        config = load_config(args.config)
        baselines, baselines_sha256 = load_baselines(args.baselines)
        # The agent's probes section where its configuration has one; the defaults otherwise.
        probes_config = getattr(config, "probes", None) or ProbesConfig()
        names = None if args.probes is None else [n.strip() for n in args.probes.split(",") if n.strip()]
        node = args.node or config.node
        check_node_name(node)
        timeout = probes_config.run_timeout_seconds if args.timeout is None else args.timeout
        if not 0 < timeout <= 7200:
            raise CheckUsageError(f"--timeout {timeout:g}: must be in (0, 7200] seconds")
        options = CheckOptions(node=node, probes=local_probes(PROBES, quick=args.quick, names=names),
                               quick=args.quick, timeout_seconds=timeout)
    except (ConfigError, CheckUsageError, ValueError) as exc:
        return refuse(str(exc))
    if not options.probes:
        return refuse("no probe selected")
    human = sys.stderr if args.json == "-" else sys.stdout
    try:
        from vigil.agent.daemon import open_nvml
        from vigil.agent.nvml.scenario import ScenarioError
        from vigil.agent.probes.engine import build_engine

        nvml = open_nvml(config, time.time)
    except (ScenarioError, OSError, ValueError) as exc:
        return refuse(f"cannot open NVML ({config.nvml.backend}): {exc}")
    try:
        try:
            engine = build_engine(nvml)
        except Exception as exc:  # noqa: BLE001 - torch's import and CUDA's init fail in many ways
            return refuse(f"cannot build the compute engine: {type(exc).__name__}: {exc}")
        report = run_check(options, baselines, probes_config, nvml=nvml, engine=engine)
        report.baselines_sha256 = baselines_sha256
    finally:
        if nvml is not None:
            nvml.shutdown()
    if args.drain:
        report.drain = apply_to_slurm(report, run=run_command)  # print_report says what it did
    print_report(report, human)
    if args.json:
        try:
            write_json(report, args.json)
        except OSError as exc:
            print(f"vigil check: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
    return report.exit_code
