"""NCCL RAS reports in a followed log: the processes and ranks NCCL's RAS says it cannot hear from.

Reads, line by line as the training collector's log followers hand them over, the text report of
NCCL's RAS client (NCCL >= 2.24: the ``ncclras`` tool or a query of the RAS port, 28028 by default,
whose output a sidecar or the job appends to a followed log), and yields one signal per process or
rank listed under a report's INCOMPLETE (no data: unresponsive) or DEAD (unreachable) heading, with
the node address NCCL prints. The format is NCCL's own (src/ras/client_support.cc), matched whole
line by whole line; anything else inside such a section ends it and is counted as refused. It does
not read MISMATCH outliers (the minority NCCL lists may be the ranks ahead of the rest, not the one
behind: NVIDIA/nccl issue 1911) nor error breakdowns, connects to nothing and blames no one.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# Why a line inside a RAS section was refused: the label values of the training collector's
# vigil_training_log_errors_total{reason}.
REFUSALS = ("ras_malformed", "ras_bad_host", "ras_bad_rank", "ras_too_many")
# Ranks and processes listed per section: NCCL prints the details only for outliers (at most
# RAS_CLIENT_DETAIL_THRESHOLD = 10, or under half of the job with -v); more is not NCCL's output.
MAX_DETAIL_LINES = 64
_RANK_MAX = 1 << 20  # wire Index
_PID_MAX = 1 << 22  # Linux pid_max limit (PID_MAX_LIMIT, 4194304)

# Headings and the count line that must follow each (printf formats of rasClientRunComms).
_HEADINGS: tuple[tuple[str, re.Pattern[str], re.Pattern[str]], ...] = (
    # "INCOMPLETE" / "  Missing communicator data from 1 job process"
    ("missing_process", re.compile(r"INCOMPLETE"),
     re.compile(r"  Missing communicator data from \d{1,9} job process(?:es)?")),
    # "DEAD" / "  2 job processes are considered dead (unreachable via the RAS network)"
    ("dead", re.compile(r"DEAD"),
     re.compile(r"  \d{1,9} job process(?:es are| is) considered dead \(unreachable via the RAS network\)")),
    # "#0-0 (b3398875b8b2a063) INCOMPLETE" / "  Missing communicator data from 1 rank"
    ("missing_rank", re.compile(r"#\d{1,6}-\d{1,6} \((?P<comm>[0-9a-f]{16})\) INCOMPLETE"),
     re.compile(r"  Missing communicator data from \d{1,9} ranks?")),
)
# "  Process 60004 on node 10.4.109.13 managing GPU 0" (GPUs "0-3,5" or "0 (NVML 2)" style lists)
_PROCESS = re.compile(r"  Process (?P<pid>\d{1,10}) on node (?P<host>\S{1,253}) "
                      r"managing GPUs? (?P<gpu>[\w ,()-]{1,64})")
# "  Rank 1 -- GPU 0 managed by process 60004 on node 10.4.109.13"
_RANK = re.compile(r"  Rank (?P<rank>\d{1,10}) -- GPU (?P<gpu>[\w ()]{1,32}) managed by process (?P<pid>\d{1,10}) "
                   r"on node (?P<host>\S{1,253})")
# "  Rank 7 -- [process information not found]", "  [could not find information on 2 processes]"
_RANK_UNKNOWN = re.compile(r"  Rank (?P<rank>\d{1,10}) -- \[process information not found\]")
_UNKNOWN_PROCESSES = re.compile(r"  \[could not find information on \d{1,9} process(?:es)?\]")
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*")


@dataclass(frozen=True, slots=True)
class RasSignal:
    """A process or rank RAS has no data from (``section`` missing_process / missing_rank) or
    considers dead, the node it runs on as NCCL prints it, and a message built from the parsed fields."""

    section: str
    rank: int | None
    host: str | None
    message: str


def valid_host(host: str) -> bool:
    """An IP address (an IPv6 one with its ``%interface``) or a DNS name: what ncclSocketToHost prints."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return len(host) <= 253 and _HOSTNAME.fullmatch(host) is not None


class RasReportReader:
    """One followed log's RAS sections: ``feed`` each line; ``refused`` counts by reason."""

    def __init__(self, *, max_detail_lines: int = MAX_DETAIL_LINES) -> None:
        self._max_detail = max_detail_lines
        self._section: str | None = None
        self._comm = ""
        self._expect_count: re.Pattern[str] | None = None
        self._details = 0
        self.refused = dict.fromkeys(REFUSALS, 0)

    def feed(self, line: str) -> tuple[bool, RasSignal | None]:
        """(whether the line belongs to a RAS section, the signal it carries)."""
        text = line.rstrip("\r\n")
        if self._section is None:
            for section, heading, count in _HEADINGS:
                m = heading.fullmatch(text)
                if m is not None:
                    self._section, self._expect_count, self._details = section, count, 0
                    self._comm = m.groupdict().get("comm") or ""
                    return True, None
            return False, None
        if self._expect_count is not None:
            if self._expect_count.fullmatch(text) is None:
                return self._refuse("ras_malformed", text)  # a lone word "DEAD" in a log is no heading
            self._expect_count = None
            return True, None
        if not text.strip():
            self._section = None  # NCCL ends each section with a blank line
            return True, None
        self._details += 1
        if self._details > self._max_detail:
            return self._refuse("ras_too_many", text)
        return self._detail(text)

    def _detail(self, text: str) -> tuple[bool, RasSignal | None]:
        section = self._section
        if _UNKNOWN_PROCESSES.fullmatch(text) is not None:
            return True, None
        if section == "missing_rank":
            m = _RANK.fullmatch(text) or _RANK_UNKNOWN.fullmatch(text)
        else:
            m = _PROCESS.fullmatch(text)
        if m is None:
            return self._refuse("ras_malformed", text)
        fields = m.groupdict()
        rank = int(fields["rank"]) if fields.get("rank") is not None else None
        if rank is not None and rank > _RANK_MAX:
            return self._refuse("ras_bad_rank", text)
        if fields.get("pid") is not None and int(fields["pid"]) > _PID_MAX:
            return self._refuse("ras_malformed", text)
        host = fields.get("host")
        if host is not None and not valid_host(host):
            return self._refuse("ras_bad_host", text)
        where = f"process {fields.get('pid')} on node {host} (GPU {fields.get('gpu')})" if host else "process unknown"
        if section == "dead":
            message = f"NCCL RAS: {where} is considered dead (unreachable via the RAS network)"
        elif section == "missing_process":
            message = f"NCCL RAS: no communicator data from {where}"
        else:
            message = f"NCCL RAS: no data from rank {rank}, {where}, of communicator {self._comm}"
        return True, RasSignal(section=section or "", rank=rank, host=host, message=message)

    def _refuse(self, reason: str, text: str) -> tuple[bool, RasSignal | None]:
        """Count the line; a line of NCCL's shape with a value out of bounds (a rank, a host) is
        skipped within its section, anything else ends the section and is read as an ordinary
        line (it may be a heading of its own, or a training log's line after a lone word)."""
        self.refused[reason] += 1
        if reason in ("ras_bad_rank", "ras_bad_host"):
            return True, None
        self._section = None
        self._expect_count = None
        return self.feed(text) if reason == "ras_malformed" else (True, None)
