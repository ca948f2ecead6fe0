"""Test-wide hygiene: each test leaves the root logger as it found it, and no test can listen on a
shipped default port.

The commands' in-process ``main()`` installs a handler on sys.stderr (vigil/cli/log_format.py,
``force=True``); under pytest that is the test's capture stream, closed when the test ends, and a
later test's log line would then fail with "I/O operation on closed file" in its own stderr.

The default ports (the agent's /metrics, its heartbeat listener, the aggregator's, and the deployed
configs') are held for the whole session: under parallel workers (`make test`) two tests that
start a service on one of them collide now and then; held, such a test fails every time, naming
the address (every service must be given a port of its own, tests/loopback.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.loopback import hold_ports
from vigil.agent.collectors.training import TrainingConfig
from vigil.agent.config import AgentConfig
from vigil.aggregator.config import AggregatorConfig
from vigil.contract.validation import split_host_port

_DEPLOYED = Path(__file__).resolve().parent.parent / "deploy" / "config"


def default_ports() -> set[int]:
    """The ports vigil's services listen on unless told otherwise: the config models' defaults and
    the shipped deploy/config files' ``listen`` and heartbeat ``udp_listen``."""
    addresses = [AgentConfig.model_fields["listen"].default, TrainingConfig.model_fields["udp_listen"].default,
                 AggregatorConfig.model_fields["listen"].default]
    for name in ("agent.yml", "aggregator.yml"):
        data = yaml.safe_load((_DEPLOYED / name).read_text())
        addresses.append(data["listen"])
        training = (data.get("collectors") or {}).get("training") or {}
        if "udp_listen" in training:
            addresses.append(training["udp_listen"])
    return {split_host_port(a)[1] for a in addresses}


@pytest.fixture(scope="session", autouse=True)
def _default_ports_held() -> Iterator[None]:
    held = hold_ports(default_ports())
    yield
    for s in held:
        s.close()


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
