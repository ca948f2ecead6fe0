"""The aggregator stands apart from the agent's internals: importing the aggregator (its app, every
detector, the gate, store and actuators) loads none of the agent's collectors, its NVML code or its
config model; only the shared modules (wire types, validation, limits, seams)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENT_INTERNALS = ("vigil.agent.collectors", "vigil.agent.nvml", "vigil.agent.config", "vigil.agent.runner", "pynvml")


def test_importing_the_aggregator_loads_no_agent_internals() -> None:
    code = ("import json, sys; import vigil.aggregator.app, vigil.aggregator.detectors, vigil.aggregator_cmd; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert "vigil.aggregator.detectors.hang" in loaded  # the probe itself works
    leaked = [m for m in loaded if m.startswith(AGENT_INTERNALS)]
    assert leaked == [], leaked


TOP_LEVEL_FOLDERS = ("agent", "aggregator", "sim")  # the repository's folders; importable only as vigil.<name>


def test_everything_is_imported_through_the_vigil_package() -> None:
    """The repository keeps agent/, aggregator/ and sim/ at its top (vigil/ links to them), but nothing
    imports them by those bare names: an installed vigil must not claim generic top-level packages, and
    a module imported under two names would hold two copies of its state."""
    code = ("import json, sys; import vigil.cli, vigil.agent.daemon, vigil.aggregator.app, vigil.sim.run, "
            "vigil.demo_cmd; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert "vigil.sim.run" in loaded
    bare = [m for m in loaded if m.split(".")[0] in TOP_LEVEL_FOLDERS]
    assert bare == [], bare
    pattern = re.compile(r"^\s*(from|import)\s+(agent|aggregator|sim)(\.|\s|$)", re.MULTILINE)
    sources = {p.resolve() for d in ("agent", "aggregator", "sim", "vigil", "tests", "bench", "scripts", "clients",
                                     "examples") for p in (REPO / d).rglob("*.py")}
    offenders = sorted(str(p.relative_to(REPO)) for p in sources if pattern.search(p.read_text(encoding="utf-8")))
    assert offenders == [], offenders
