"""docs/configuration.md is what scripts/config_reference.py generates from the config models.

The test regenerates the reference and compares: a key, default or threshold comment changed
in a model without regenerating the document fails here, naming the one command that fixes it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "config_reference.py"


def test_configuration_reference_is_current() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_reference_lists_every_key_of_both_services() -> None:
    from vigil.agent.config import AgentConfig
    from vigil.aggregator.config import AggregatorConfig

    text = (REPO / "docs" / "configuration.md").read_text()
    for model in (AgentConfig, AggregatorConfig):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, name
    assert "| `detectors.xid.window_seconds` |" in text and "| `gate." in text
