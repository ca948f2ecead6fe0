"""dcgm_diag: NVIDIA's own diagnostic, ``dcgmi diag -r <probes.dcgm_level> -i <gpus>``, run through
the command seam where DCGM is installed, and its table parsed into a verdict per test.

It reads the table dcgmi prints (not ``-j``: the table's shape is the same across the recordings
in tests/fixtures/dcgm/, DCGM 3.3 to 4.4, where the JSON's keys changed between major versions):
one row per test with Pass, Fail, Skip, Warn or Not Run, in 3.x as "Fail - GPU: 1" /
"Pass - GPUs: 0, 2, 3" / "Fail - All", in 4.x as "Fail" with "GPU0: Pass" rows under it, and
Warning/Info/Error rows whose text wraps over several rows. One node-wide result: fail names each
failing test with its GPUs and first warning. It repairs nothing; dcgmi absent is ``skipped``.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

from vigil.agent.probes.context import ProbeContext
from vigil.contract.wire import ProbeResult, ProbeStatus

# Rows that carry text about the test above them rather than a test of their own.
_MESSAGE_ROWS = ("Warning", "Info", "Error")
# Result words dcgmi prints (DCGM's Diag.cpp: Pass, Skip, Warn, Fail, Not Run).
_RESULT = re.compile(r"^(Pass|Fail|Skip|Warn|Not Run)\b(.*)$")
# 3.x per-GPU continuation: "Fail - GPU: 0", "Pass - GPUs: 1, 2, 3"; 4.x: "GPU0: Pass".
_GPUS_3X = re.compile(r"^(Pass|Fail|Skip|Warn|Not Run)\s*-\s*GPUs?:?\s*([\d,\s]+)$")
_GPU_4X = re.compile(r"^GPU\s*(\d+):\s*(Pass|Fail|Skip|Warn|Not Run)\b")
_SECTION = re.compile(r"^[|+]-+\s+(\w[\w ]*?)\s+-+[+|]")
_FIRST_MESSAGE_CHARS = 160  # of each failing test's first message, in the detail


@dataclass
class DiagTest:
    """One test of the table: its overall word, the GPUs each per-GPU word names, its messages."""

    name: str
    section: str
    result: str  # Pass | Fail | Skip | Warn | Not Run
    failed_gpus: list[int] = field(default_factory=list)
    all_gpus_failed: bool = False
    messages: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.result == "Fail" or self.all_gpus_failed or bool(self.failed_gpus)


@dataclass
class DiagTable:
    tests: list[DiagTest]
    errors: list[str]  # Error rows (a failure whether or not a test row says so)
    version: str = ""


def _gpus(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _chunk(cell: str) -> str:
    """A message cell's text as dcgmi cut it: it wraps messages every 45 characters, mid-word,
    after one space of padding, so the pieces join without a separator."""
    return cell[1:46] if len(cell) > 1 else ""


def parse_diag_table(text: str) -> DiagTable:
    """The tests of ``dcgmi diag``'s table output. Rows of the Metadata section are not tests."""
    tests: list[DiagTest] = []
    errors: list[str] = []
    version = ""
    section = ""
    # The Warning/Info/Error message being continued: the lists it goes to and its index in each.
    message: list[tuple[list[str], int]] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        header = _SECTION.match(line)
        if header:
            section, message = header.group(1).strip(), []
            continue
        if not line.startswith("|"):
            continue
        cells = line[1:].split("|", 1)
        name = cells[0].strip()
        cell = cells[1].rstrip("|") if len(cells) > 1 else ""
        value = cell.strip()
        if (name == "Diagnostic" and value == "Result") or section == "Metadata":
            if name == "DCGM Version":
                version = value
            continue
        test = tests[-1] if tests else None
        if not name:
            per_gpu = _GPUS_3X.match(value)
            gpu4 = _GPU_4X.match(value)
            if test is not None and (per_gpu or gpu4):
                if per_gpu and per_gpu.group(1) == "Fail":
                    test.failed_gpus.extend(_gpus(per_gpu.group(2)))
                if gpu4 and gpu4.group(2) == "Fail":
                    test.failed_gpus.append(int(gpu4.group(1)))
                message = []
            else:
                for target, index in message:
                    target[index] += _chunk(cell)
            continue
        if name in _MESSAGE_ROWS:
            targets = [test.messages] if test is not None else []
            if name == "Error":
                targets.append(errors)
            message = []
            for target in targets:
                target.append(_chunk(cell))
                message.append((target, len(target) - 1))
            continue
        message = []
        word = _RESULT.match(value)
        if not word:
            continue
        test = DiagTest(name=name, section=section, result=word.group(1))
        scope = word.group(2).strip().lstrip("-").strip()
        if test.result == "Fail" and scope == "All":
            test.all_gpus_failed = True
        elif test.result == "Fail":
            test.failed_gpus.extend(_gpus(scope))
        tests.append(test)
    for test in tests:
        test.messages = [" ".join(m.split()) for m in test.messages]
    return DiagTable(tests=tests, errors=[" ".join(e.split()) for e in errors], version=version)


def run(ctx: ProbeContext) -> list[ProbeResult]:
    level = 1 if ctx.quick else ctx.config.dcgm_level
    argv = ["dcgmi", "diag", "-r", str(level)]
    if ctx.gpus:
        argv += ["-i", ",".join(str(g) for g in ctx.gpus)]
    started = ctx.clock()
    budget = ctx.deadline - started
    if budget <= 0:
        return [ProbeResult(probe="dcgm_diag", status="error", reason="timeout", detail="no time left to run dcgmi")]
    try:
        output = ctx.run(argv, budget)
        exit_detail = ""
    except FileNotFoundError:
        return [ProbeResult(probe="dcgm_diag", status="skipped", reason="not_installed",
                            detail="dcgmi is not installed on this node", seconds=ctx.clock() - started)]
    except subprocess.TimeoutExpired:
        return [ProbeResult(probe="dcgm_diag", status="error", reason="timeout", seconds=ctx.clock() - started,
                            detail=f"dcgmi diag -r {level} did not finish within {budget:.0f} s")]
    except subprocess.CalledProcessError as exc:  # dcgmi exits non-zero when a test fails: read its table
        output = exc.output if isinstance(exc.output, str) else ""
        exit_detail = f"dcgmi exited {exc.returncode}"
        if not output.strip():
            stderr = exc.stderr if isinstance(exc.stderr, str) else ""
            return [ProbeResult(probe="dcgm_diag", status="error", reason="dcgmi_failed", seconds=ctx.clock() - started,
                                detail=f"{exit_detail}: {stderr.strip()[:_FIRST_MESSAGE_CHARS]}")]
    except OSError as exc:  # present but not runnable (permissions): a node to fix, not one without DCGM
        return [ProbeResult(probe="dcgm_diag", status="error", reason="exec_failed", seconds=ctx.clock() - started,
                            detail=f"dcgmi could not be run: {exc}")]
    return [verdict(parse_diag_table(output), level, ctx.clock() - started, exit_detail, output)]


def verdict(table: DiagTable, level: int, seconds: float, exit_detail: str = "", output: str = "") -> ProbeResult:
    """One result for the node from a parsed table: fail when a test failed or an Error row
    appeared; error when dcgmi printed no test at all (it could not reach its host engine...)."""
    failed = [t for t in table.tests if t.failed]
    counts = {word: sum(1 for t in table.tests if t.result == word and not t.failed)
              for word in ("Pass", "Skip", "Warn")}
    metrics = {"level": float(level), "tests": float(len(table.tests)), "tests_passed": float(counts["Pass"]),
               "tests_failed": float(len(failed)), "tests_skipped": float(counts["Skip"]),
               "tests_warned": float(counts["Warn"]), "errors": float(len(table.errors))}

    def result(status: ProbeStatus, reason: str, detail: str) -> ProbeResult:
        return ProbeResult(probe="dcgm_diag", status=status, reason=reason, detail=detail, metrics=metrics,
                           seconds=seconds)

    version = f"DCGM {table.version}, " if table.version else ""
    if not table.tests and not table.errors:
        first = next((line.strip() for line in output.splitlines() if line.strip()), "")
        return result("error", "unparseable",
                      f"dcgmi diag -r {level} printed no test ({exit_detail or 'exit 0'}): "
                      f"{first[:_FIRST_MESSAGE_CHARS]}")
    if failed or table.errors:
        parts = []
        for t in failed:
            gpus = "all GPUs" if t.all_gpus_failed else (
                "GPU " + ",".join(str(g) for g in sorted(set(t.failed_gpus))) if t.failed_gpus else "")
            why = t.messages[0][:_FIRST_MESSAGE_CHARS] if t.messages else ""
            parts.append(t.name + (f" ({gpus})" if gpus else "") + (f": {why}" if why else ""))
        parts += [f"Error: {e[:_FIRST_MESSAGE_CHARS]}" for e in table.errors]
        return result("fail", "diag_failed",
                      f"{version}dcgmi diag -r {level} failed: " + "; ".join(parts))
    return result("pass", "ok", f"{version}dcgmi diag -r {level}: {counts['Pass']} passed, "
                                f"{counts['Skip']} skipped, {counts['Warn']} warned")
