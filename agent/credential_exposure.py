"""The agent's credential files exposed to other users: warned about at start and exported on every scrape.

Reads each configured credential file's mode through ``contract.credential_file.exposure`` and emits
``vigil_agent_credential_file_exposed`` per config key; it refuses nothing (the aggregator's own
files are refused at its start, in aggregator/auth.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.contract.credential_file import exposure

log = logging.getLogger("vigil.credentials")

CREDENTIAL_FILE_EXPOSED = MetricSpec(
    "vigil_agent_credential_file_exposed", MetricKind.GAUGE,
    "1 when a credential file this agent reads (by its config key) may be read by users other than its owner "
    "and group, or changed by its group: chmod 600 it. 0 otherwise.", labels=("key",))



class ExposedFiles:
    """The agent's credential files by config key: warned about once at start, exported as
    ``vigil_agent_credential_file_exposed`` on every scrape (a chmod shows at once)."""

    specs = (CREDENTIAL_FILE_EXPOSED,)

    def __init__(self, files: Mapping[str, str | None]) -> None:
        self._files = {key: path for key, path in files.items() if path}
        for key, path in self._files.items():
            problem = exposure(path)
            if problem is not None:
                log.warning("%s: %s: anyone on this node who reads it can report as this node", key, problem)

    def samples(self) -> list[Sample]:
        return [Sample.of(CREDENTIAL_FILE_EXPOSED, 1.0 if exposure(path) else 0.0, key=key)
                for key, path in self._files.items()]
