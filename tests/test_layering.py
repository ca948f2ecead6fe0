"""The layers of the tree, from the code's own imports: the agent and the aggregator each import only
the neutral contract package (vigil.contract) beside their own modules, the contract imports neither
service, the command line (vigil.cli) may import anything and nothing shipped imports it; the
simulator drives both services. Checked statically over every module and at run time."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# layer (a repository folder, imported as vigil.<layer>) -> the vigil subpackages it may import
MAY_IMPORT: dict[str, frozenset[str]] = {
    "contract": frozenset({"contract"}),
    "agent": frozenset({"agent", "contract"}),
    "aggregator": frozenset({"aggregator", "contract"}),
    "sim": frozenset({"sim", "agent", "aggregator", "contract"}),
}


def _vigil_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import of a vigil module in ``path``, at any depth
    (function-level imports included); ``from vigil import x`` counts as ``vigil.x``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "vigil"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vigil":
                found += [(node.lineno, f"vigil.{a.name}") for a in node.names]
            elif node.module.startswith("vigil."):
                found.append((node.lineno, node.module))
    return found


def _violations(layer: str) -> list[str]:
    allowed = MAY_IMPORT[layer]
    return [f"{path.relative_to(REPO)}:{line}: {name}"
            for path in sorted((REPO / layer).rglob("*.py"))
            for line, name in _vigil_imports(path)
            if name == "vigil" or name.split(".")[1] not in allowed]


def test_each_layer_imports_only_what_it_may() -> None:
    assert {layer: _violations(layer) for layer in MAY_IMPORT} == {layer: [] for layer in MAY_IMPORT}


def test_the_rule_sees_a_violation() -> None:
    """The checker itself: an aggregator module importing the agent, at any depth, is caught."""
    tree = REPO / "tests" / "fixtures" / "layering"
    names = sorted(name for _, name in _vigil_imports(tree / "aggregator_importing_agent.py"))
    assert names == ["vigil.agent.nvml.backend", "vigil.cli", "vigil.contract.wire"]
    refused = [name for name in names if name.split(".")[1] not in MAY_IMPORT["aggregator"]]
    assert refused == ["vigil.agent.nvml.backend", "vigil.cli"]


def test_nothing_shipped_imports_the_command_line() -> None:
    """vigil.cli sits on top: the services, the contract, the simulator and the package root never import it."""
    roots = [REPO / layer for layer in MAY_IMPORT] + [REPO / "vigil" / "__init__.py", REPO / "vigil" / "__main__.py"]
    files = [p for root in roots for p in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    offenders = [f"{p.relative_to(REPO)}:{line}: {name}" for p in files for line, name in _vigil_imports(p)
                 if name.startswith("vigil.cli") and p.name != "__main__.py"]
    assert offenders == []
    assert [name for _, name in _vigil_imports(REPO / "vigil" / "__init__.py")] == ["vigil.contract.version"]


def test_importing_the_aggregator_loads_nothing_of_the_agent() -> None:
    code = ("import json, sys; import vigil.aggregator.app, vigil.aggregator.detectors, vigil.cli.aggregator_cmd; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert "vigil.aggregator.detectors.hang" in loaded  # the probe itself works
    leaked = [m for m in loaded if m.startswith(("vigil.agent", "pynvml"))]
    assert leaked == [], leaked


def test_importing_the_agent_loads_nothing_of_the_aggregator() -> None:
    code = ("import json, sys; import vigil.agent.daemon, vigil.cli.agent_cmd; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert "vigil.agent.runner" in loaded
    leaked = [m for m in loaded if m.startswith(("vigil.aggregator", "vigil.sim"))]
    assert leaked == [], leaked


TOP_LEVEL_FOLDERS = ("agent", "aggregator", "sim", "contract")  # importable only as vigil.<name>


def test_everything_is_imported_through_the_vigil_package() -> None:
    """The repository keeps agent/, aggregator/, sim/ and contract/ at its top (vigil/ links to them),
    but nothing imports them by those bare names: an installed vigil must not claim generic top-level
    packages, and a module imported under two names would hold two copies of its state."""
    code = ("import json, sys; import vigil.cli, vigil.agent.daemon, vigil.aggregator.app, vigil.sim.run, "
            "vigil.cli.demo_cmd; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert "vigil.sim.run" in loaded
    bare = [m for m in loaded if m.split(".")[0] in TOP_LEVEL_FOLDERS]
    assert bare == [], bare
    pattern = re.compile(r"^\s*(from|import)\s+(agent|aggregator|sim|contract)(\.|\s|$)", re.MULTILINE)
    sources = {p.resolve() for d in ("agent", "aggregator", "sim", "contract", "vigil", "tests", "bench", "scripts",
                                     "clients", "examples") for p in (REPO / d).rglob("*.py")}
    offenders = sorted(str(p.relative_to(REPO)) for p in sources if pattern.search(p.read_text(encoding="utf-8")))
    assert offenders == [], offenders
