"""Placeholder for the gpu_compute probe (issue 39 foundation): reports ``skipped`` until written."""

from __future__ import annotations

from vigil.agent.probes.context import ProbeContext
from vigil.agent.wire import ProbeResult


def run(ctx: ProbeContext) -> list[ProbeResult]:
    return [ProbeResult(probe="gpu_compute", status="skipped", reason="not_implemented")]
