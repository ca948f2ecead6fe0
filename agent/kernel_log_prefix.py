"""Kernel-log line prefixes: what the transport put in front of the driver's message.

Reads one line in any of the forms the kernel log reaches us in (raw /dev/kmsg records,
``dmesg``, ``dmesg -T``, ``dmesg --time-format=iso``, ISO 8601, journald/syslog, any of these
behind a pdsh/clush "<host>: " prefix) and splits it into timestamp, message, kmsg sequence and
host. It does not look at the message: ``agent.kernel_log`` does.
"""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime
from typing import NamedTuple

# /dev/kmsg record: "<prio>,<seq>,<usec since boot>,<flags>[,...];<message>" (Documentation/ABI/
# testing/dev-kmsg). Continuation lines of a record start with a space and carry KEY=value pairs.
KMSG_RE = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<msg>.*)$")
# Timestamp prefixes, tried in order; each strips what it matches and keeps the text as written.
_PREFIXES = (
    # dmesg --decode --time-format=iso: "kern  :warn  : 2025-01-21T04:41:44,283302+00:00 "
    re.compile(r"^(?P<fac>[a-z]+)\s*:(?P<lvl>[a-z]+)\s*:\s+(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[,.]?\d*"
               r"(?:[+-]\d\d:?\d\d|Z)?)\s+"),
    # ISO 8601 (journalctl -o short-iso[-precise], rsyslog RFC 3339): "2025-01-21T04:41:44+0000 "
    re.compile(r"^(?P<ts>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:[+-]\d\d:?\d\d|Z)?)\s+"),
    # classic syslog / journalctl -o short: "Aug 17 06:18:01 "
    re.compile(r"^(?P<ts>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d)\s+"),
    # dmesg -T: "[Sun Feb 23 16:24:18 2025] "
    re.compile(r"^\[(?P<ts>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]?\d \d\d:\d\d:\d\d \d{4})\]\s?"),
    # dmesg: "[ 1234.567890] "
    re.compile(r"^\[\s*(?P<ts>\d+(?:\.\d+)?)\]\s?"),
)
# After an ISO/syslog timestamp comes "<host> <ident>[pid]: " (e.g. "node7 kernel: ").
_HOST_IDENT_RE = re.compile(r"^(?P<host>\S+)\s+(?P<ident>[\w.\-/]+)(?:\[\d+\])?:\s")
# A bare "kernel: " ident (journald exports without host) and a following uptime bracket.
_IDENT_RE = re.compile(r"^kernel:\s")
_UPTIME_RE = re.compile(r"^\[\s*(?P<ts>\d+(?:\.\d+)?)\]\s?")
# A log collected from many hosts by pdsh/clush ("pdsh -w gpu[001-512] dmesg") has "<host>: " in front
# of each host's line as that host wrote it. Accepted only when what follows is itself a kernel-log
# line (a timestamp or a driver's tag), so "NVRM: ..." or "nvidia-nvswitch0: SXid ..." is never
# mistaken for a host.
_COLLECTED_HOST_RE = re.compile(
    r"^(?P<host>[A-Za-z0-9][\w.\-]*):[ \t]+"
    r"(?=\[|\d|[A-Z][a-z]{2} [ \d]\d |[a-z]+\s*:\s*[a-z]+\s*:|<\d+>|NVRM:|nvidia-nvswitch\d+:|mlx5_core|amdgpu|kernel:)"
)
_NOT_A_HOST_RE = re.compile(r"^(?:NVRM|kernel|mlx5_core|amdgpu|nvidia-nvswitch\d+)$")


@functools.lru_cache(maxsize=4096)
def timestamp_seconds(ts_text: str) -> float | None:
    """A line's timestamp as seconds on its own clock (uptime for dmesg and kmsg, wall time for the
    others; syslog has no year), for measuring the distance between lines of one log; None when
    the text is no timestamp we know."""
    if not ts_text:
        return None
    try:
        if ts_text[0].isdigit() and ("-" not in ts_text[:5]):
            return float(ts_text)
        if ts_text[0].isdigit():
            text = ts_text.replace(",", ".")
            if text.endswith(("Z", "z")):
                text = text[:-1] + "+00:00"
            return datetime.fromisoformat(text).timestamp()
        for fmt in ("%a %b %d %H:%M:%S %Y", "%b %d %H:%M:%S"):
            try:
                return datetime.strptime(" ".join(ts_text.split()), fmt).replace(tzinfo=UTC).timestamp()
            except ValueError:
                continue
    except ValueError:
        return None
    return None


class SplitLine(NamedTuple):
    ts_text: str
    msg: str
    seq: int | None
    host: str | None


def split_line(line: str) -> SplitLine:
    """Strip the transport's prefixes: a collecting tool's "<host>: ", then the timestamp, the
    syslog host and ident, the uptime bracket; returns what they said and the message."""
    host: str | None = None
    cm = _COLLECTED_HOST_RE.match(line)
    if cm and not _NOT_A_HOST_RE.match(cm.group("host")):
        host = cm.group("host")
        line = line[cm.end():]
    m = KMSG_RE.match(line)
    if m:
        usec = int(m.group("usec"))
        return SplitLine(f"{usec // 1_000_000}.{usec % 1_000_000:06d}", m.group("msg"), int(m.group("seq")), host)
    ts_text = ""
    rest = line
    for prefix in _PREFIXES:
        pm = prefix.match(rest)
        if pm:
            ts_text = pm.group("ts")
            rest = rest[pm.end():]
            break
    hm = _HOST_IDENT_RE.match(rest)
    if hm and ts_text:
        rest = rest[hm.end():]
        if host is None:
            host = hm.group("host")
    else:
        im = _IDENT_RE.match(rest)
        if im:
            rest = rest[im.end():]
    um = _UPTIME_RE.match(rest)
    if um:
        if not ts_text:
            ts_text = um.group("ts")
        rest = rest[um.end():]
    return SplitLine(ts_text, rest, None, host)


def split_prefix(line: str) -> tuple[str, str, int | None]:
    """Strip the transport's prefix: returns (timestamp as written, message, kmsg sequence)."""
    ts_text, msg, seq, _host = split_line(line)
    return ts_text, msg, seq
