"""Test-wide hygiene: each test leaves the root logger as it found it. The commands' in-process
``main()`` installs a handler on sys.stderr (vigil/cli/log_format.py, ``force=True``); under pytest
that is the test's capture stream, closed when the test ends, and a later test's log line would
then fail with "I/O operation on closed file" in its own stderr."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    # Only plain stream handlers the test added (pytest's own capture handlers are subclasses,
    # added and removed by pytest per phase).
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
