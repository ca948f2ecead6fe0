"""Every scenario the commands look up ships in the wheel (fast check; test_wheel.py builds one).

The lookups go through ``importlib.resources`` on the ``vigil`` package, whose ``scenarios`` entry
links to the repository's ``scenarios/``; the package-data globs in pyproject.toml must cover
every YAML there, or an installed ``vigil sim``/``vigil agent --scenario`` would not find it.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from vigil.agent.nvml.scenario import SCENARIO_DIR as NODE_DIR
from vigil.sim.scenario import SCENARIO_DIR as FLEET_DIR

REPO = Path(__file__).resolve().parents[2]


def test_lookups_resolve_to_the_repository_scenarios() -> None:
    assert FLEET_DIR.resolve() == (REPO / "scenarios").resolve()
    assert NODE_DIR.resolve() == (REPO / "scenarios" / "node").resolve()


def test_package_data_globs_cover_every_shipped_yaml() -> None:
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vigil"]
    shipped = [p.relative_to(REPO).as_posix() for p in (REPO / "scenarios").rglob("*") if p.is_file()]
    assert shipped
    missed = [f for f in shipped if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert missed == []
