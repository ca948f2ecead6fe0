"""How the agent and the aggregator log: ``--log-format text`` (the default, for a terminal and the
journal) or ``json`` (one JSON object per line, for Loki/Elasticsearch/Fluent Bit pipelines).

A JSON line carries ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``message`` and, for an
exception, ``exc``. Whatever the format, what a record quotes (a job name, a drain reason, an
agent's detail: text an outsider chose) cannot forge a line or reach a terminal as a control
sequence: in text, control characters in the message (its arguments included) are written as
escapes (``\\n``, ``\\x1b``, ``\\u2028``) and a traceback's lines are indented under its record; in
JSON they are JSON escapes. The commands' own console lines (the "listening on" line a supervisor
waits for on stdout, a fatal start-up error) take the same format through ``console_line``. It
configures the root logger only; it decides nothing about what is logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What must not reach a log line raw: C0 controls (newline, carriage return, ESC...), DEL and
# C1 controls (U+0085 is a line break to some readers, U+009B a CSI to some terminals), the
# Unicode line and paragraph separators, the bidirectional overrides and isolates (text that
# reads differently than it is), and surrogates (a str holds one only unpaired; UTF-8 cannot
# encode it, so the handler would drop the whole record).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# Unsafe characters json.dumps(ensure_ascii=False) leaves as they are (it escapes only C0).
_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# A traceback's lines start with this: a line a quoted exception message forged cannot pass for a
# record (each starts at column 0 with its timestamp).
TRACEBACK_INDENT = "  | "


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in _SHORT:
        return _SHORT[ch]
    return f"\\x{ord(ch):02x}" if ord(ch) <= 0xFF else f"\\u{ord(ch):04x}"


def escape_controls(text: str) -> str:
    """``text`` on one line, every unsafe character written as a Python-style escape."""
    return _UNSAFE.sub(_escape, text) if _UNSAFE.search(text) else text


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` with the message escaped (one line per record) and a traceback's (or stack's)
    lines each indented by ``TRACEBACK_INDENT`` and escaped: every unindented line is a record."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        raw = record.getMessage()
        record.message = escape_controls(raw)
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        try:
            out = self.formatMessage(record)
        finally:
            record.message = raw  # as logging leaves it, for any other handler
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)  # cached raw, as logging does
        if record.exc_text:
            out += "\n" + self._block(record.exc_text)
        if record.stack_info:
            out += "\n" + self._block(self.formatStack(record.stack_info))
        return out

    @staticmethod
    def _block(text: str) -> str:
        return "\n".join(TRACEBACK_INDENT + escape_controls(line) for line in text.rstrip("\n").split("\n"))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        text = json.dumps(line, ensure_ascii=False)
        # They can only be inside strings there, where \uXXXX stands for the same character.
        return _UNSAFE_IN_JSON.sub(_json_escape, text) if _UNSAFE_IN_JSON.search(text) else text


def console_line(fmt: str, message: str, *, logger: str, level: int = logging.INFO) -> str:
    """``message`` as the command prints it outside logging (``--log-format text``: as it is, the
    line operators and scripts know) or, with ``json``, as one JSON object like every log line: a
    pipeline reading the output in JSON never meets a plain-text line."""
    if fmt != "json":
        return message
    record = logging.LogRecord(logger, level, __file__, 0, message, None, None)
    return JsonFormatter().format(record)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


def add_log_args(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` on a command's parser."""
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--log-format", default="text", choices=FORMATS, help="text (default) or json: one object per line")
