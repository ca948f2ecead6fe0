"""Runs tests/deploy/test_image.py last in a session: under `make test` it waits for the image
build started in the background before pytest, so the rest of the suite runs meanwhile."""

from __future__ import annotations

import pytest

IMAGE_TESTS = "tests/deploy/test_image.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's collection hook sees the whole session's items, not only this directory's.
    image = [item for item in items if item.nodeid.startswith(IMAGE_TESTS)]
    if image:
        items[:] = [item for item in items if not item.nodeid.startswith(IMAGE_TESTS)] + image
