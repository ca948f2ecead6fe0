"""The aggregator stands apart from the agent's internals: importing the aggregator (its app, every
detector, the gate, store and actuators) loads none of the agent's collectors, its NVML code or its
config model; only the shared modules (wire types, validation, limits, seams)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENT_INTERNALS = ("agent.collectors", "agent.nvml", "agent.config", "agent.runner", "pynvml")


def test_importing_the_aggregator_loads_no_agent_internals() -> None:
    code = ("import json, sys; import aggregator.app, aggregator.detectors, vigil.aggregator_cmd; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert "aggregator.detectors.hang" in loaded  # the probe itself works
    leaked = [m for m in loaded if m.startswith(AGENT_INTERNALS)]
    assert leaked == [], leaked
