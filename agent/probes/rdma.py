"""The RDMA fabric probe: perftest's ``ib_write_bw`` per HCA between this node and a known-healthy
partner, judged against the port's line rate.

It reads the HCAs and their ports' rates from sysfs (``class/infiniband/<hca>/ports/<port>/rate``,
e.g. "400 Gb/sec (4X NDR)") and runs ``ib_write_bw -d <hca> --report_gbits -D <seconds>`` through
the command seam: as the server when the request's ``ProbeGroup.serve`` is set, else as the client
of ``ProbeGroup.partner``. It emits one ``ProbeResult`` per HCA: ``value`` the average bandwidth in
Gb/s, ``metrics`` the peak, the line rate and their ratio; ``fail`` below
``probes.rdma_min_line_rate_ratio`` of the line rate. It does not pick the partner, nor start the
partner's server (the aggregator asks the partner to serve first).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vigil.agent.probes.context import ProbeContext
from vigil.contract.wire import ProbeResult

IB_WRITE_BW = "ib_write_bw"
# perftest's default TCP port for the out-of-band exchange is 18515; HCA number i uses 18515 + i
# on both sides, so a server still finishing one HCA never answers the client of the next.
BASE_PORT = 18515
# The client's run: -D seconds, plus this long to connect and exchange (seconds on a healthy fabric).
CONNECT_SECONDS = 30.0
# A quick run (a screen): this fraction of probes.rdma_seconds, at least one second.
QUICK_DIVISOR = 5
# The table's header with --report_gbits (perftest's write_bw output, tests/fixtures/perftest/):
#  #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
_HEADER = re.compile(r"#bytes\s+#iterations\s+BW peak\[(?P<unit>[^\]]+)\]\s+BW average\[(?P=unit)\]")
_ROW = re.compile(r"^\s*(?P<bytes>\d+)\s+(?P<iterations>\d+)\s+(?P<peak>[\d.]+)\s+(?P<average>[\d.]+)"
                  r"\s+(?P<msg_rate>[\d.]+)\s*$")
# sysfs's port rate: "400 Gb/sec (4X NDR)", "100 Gb/sec (4X EDR)", "25 Gb/sec (1X EDR)"
_RATE = re.compile(r"^\s*(?P<gbit>[\d.]+)\s*Gb/sec")


@dataclass(frozen=True)
class WriteBw:
    """One row of ib_write_bw's table (Gb/s with --report_gbits)."""

    message_bytes: int
    iterations: int
    peak_gbit: float
    average_gbit: float
    msg_rate_mpps: float


class Unparsable(ValueError):
    """Output that holds no --report_gbits bandwidth table."""


def parse_write_bw(output: str) -> WriteBw:
    """The bandwidth row of ``ib_write_bw --report_gbits`` output (the last, with ``-a``); lines
    perftest interleaves in the table (CPU frequency warnings) are passed over."""
    lines = output.splitlines()
    header = next((i for i, line in enumerate(lines) if _HEADER.search(line)), None)
    if header is None:
        raise Unparsable("no '#bytes #iterations BW peak[..] BW average[..]' table in the output")
    unit = _HEADER.search(lines[header]).group("unit")  # type: ignore[union-attr]
    if unit != "Gb/sec":
        raise Unparsable(f"the table is in {unit}, not Gb/sec (run without --report_gbits?)")
    rows = [m for line in lines[header + 1:] if (m := _ROW.match(line))]
    if not rows:
        raise Unparsable("the bandwidth table has no row")
    m = rows[-1]
    return WriteBw(int(m["bytes"]), int(m["iterations"]), float(m["peak"]), float(m["average"]),
                   float(m["msg_rate"]))


def hcas(sysfs_root: Path) -> list[str]:
    """The node's RDMA devices (class/infiniband), sorted."""
    try:
        return sorted(p.name for p in (sysfs_root / "class" / "infiniband").iterdir())
    except OSError:
        return []


def line_rate_gbit(sysfs_root: Path, hca: str) -> tuple[int, float] | None:
    """(port, Gb/s) of the HCA's first port (perftest's default ``-i 1``) from sysfs, or None."""
    ports = sysfs_root / "class" / "infiniband" / hca / "ports"
    try:
        names = sorted((p.name for p in ports.iterdir() if p.name.isdigit()), key=int)
    except OSError:
        return None
    for name in names:
        try:
            match = _RATE.match((ports / name / "rate").read_text())
        except OSError:
            continue
        if match:
            return int(name), float(match["gbit"])
    return None


def run(ctx: ProbeContext) -> list[ProbeResult]:
    group = ctx.group
    if group is None or (not group.serve and not group.partner):
        return [ProbeResult(probe="rdma_bw", status="error", reason="no_group",
                            detail="the request names no partner to test against, and does not ask to serve")]
    devices = hcas(ctx.sysfs_root)
    if not devices:
        return [ProbeResult(probe="rdma_bw", status="skipped", reason="no_hca",
                            detail=f"no RDMA device under {ctx.sysfs_root / 'class' / 'infiniband'}")]
    seconds = ctx.config.rdma_seconds
    if ctx.quick:
        seconds = max(1.0, seconds / QUICK_DIVISOR)
    results = []
    for index, hca in enumerate(devices):
        result = _one(ctx, hca, BASE_PORT + index, seconds)
        results.append(result)
        if result.reason == "not_installed":
            break
    return results


def _one(ctx: ProbeContext, hca: str, port: int, seconds: float) -> ProbeResult:
    group = ctx.group
    assert group is not None
    started = ctx.clock()
    argv = [IB_WRITE_BW, "-d", hca, "-p", str(port), "--report_gbits", "-D", f"{seconds:g}"]
    if not group.serve:
        assert group.partner is not None
        argv.append(group.partner)
    role = "server" if group.serve else f"client of {group.partner}"
    remaining = ctx.deadline - started
    # The server waits for its client however long the deadline allows; the client connects at once.
    timeout = remaining if group.serve else min(remaining, seconds + CONNECT_SECONDS)

    def result(status: str, reason: str, detail: str, **fields: object) -> ProbeResult:
        return ProbeResult(probe="rdma_bw", status=status, reason=reason, detail=f"{hca} ({role}): {detail}",  # type: ignore[arg-type]
                           unit="gbit_per_s", seconds=max(0.0, ctx.clock() - started), **fields)  # type: ignore[arg-type]

    if timeout <= 0:
        return result("error", "timeout", "no time left before the deadline")
    try:
        output = ctx.run(argv, timeout)
    except FileNotFoundError:
        return result("skipped", "not_installed", f"{IB_WRITE_BW} (perftest) is not installed")
    except subprocess.TimeoutExpired:
        return result("error", "timeout", f"{IB_WRITE_BW} did not finish in {timeout:.0f} s")
    except subprocess.CalledProcessError as exc:
        said = " ".join(str(part).strip() for part in (exc.stderr, exc.output) if part)[-500:]
        return result("error", "command_failed", f"exit {exc.returncode}: {said}")
    except OSError as exc:
        return result("error", "command_failed", str(exc))
    try:
        row = parse_write_bw(output)
    except Unparsable as exc:
        if group.serve:  # the server side of a write test may print no table: the client measures
            return result("skipped", "served", f"served the partner's test ({exc})")
        return result("error", "unparsable", str(exc))
    metrics = {"peak_gbit": row.peak_gbit, "message_bytes": float(row.message_bytes)}
    rate = line_rate_gbit(ctx.sysfs_root, hca)
    if rate is None:
        return result("pass", "ok", f"{row.average_gbit:g} Gb/s (no line rate in sysfs)",
                      value=row.average_gbit, metrics=metrics)
    ib_port, line = rate
    ratio = row.average_gbit / line if line > 0 else 0.0
    metrics.update(line_rate_gbit=line, ratio=ratio, ib_port=float(ib_port))
    floor = ctx.config.rdma_min_line_rate_ratio
    if ratio < floor:
        return result("fail", "below_line_rate", f"{row.average_gbit:g} Gb/s is {ratio:.0%} of port {ib_port}'s "
                                                 f"{line:g} Gb/s line rate (below {floor:.0%})",
                      value=row.average_gbit, metrics=metrics)
    return result("pass", "ok", f"{row.average_gbit:g} Gb/s, {ratio:.0%} of port {ib_port}'s {line:g} Gb/s",
                  value=row.average_gbit, metrics=metrics)
