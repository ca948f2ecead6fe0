"""How the agent and the aggregator log: ``--log-format text`` (the default, for a terminal and the
journal) or ``json`` (one JSON object per line, for Loki/Elasticsearch/Fluent Bit pipelines).

A JSON line carries ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``message`` and, for an
exception, ``exc``. It configures the root logger only; it decides nothing about what is logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def add_log_args(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` on a command's parser."""
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--log-format", default="text", choices=FORMATS, help="text (default) or json: one object per line")
