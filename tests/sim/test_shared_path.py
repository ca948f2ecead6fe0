"""The simulator drives the service operators run (aggregator/service.py), not a pipeline of its
own: statically, no module of the simulator builds the engine, the ledger, a fleet, the outbox or
the prober, nor calls what the service's intake and evaluation call; at run time, every report a
simulated agent sends goes through the service's intake, and its evaluations forget departed
nodes into the store as the service's do."""

from __future__ import annotations

import ast
from pathlib import Path

from vigil.aggregator.service import AggregatorService
from vigil.sim.run import Simulation
from vigil.sim.scenario import parse_scenario

SIM = Path(__file__).resolve().parents[2] / "sim"
# The aggregator's modules whose objects the service owns: a simulator module that imports one
# and calls what it imported (``Engine(...)``, ``Ledger.in_memory(...)``) builds a pipeline beside it.
SERVICE_PARTS = frozenset({"engine", "ledger", "fleet", "outbox", "prober", "gate", "store", "admission", "sink"})
# What the service's intake and evaluation call on those parts, by the names the service gives them:
# the simulator calls the service instead. (It plays the dispatcher, outside the service: an
# admitted reset_gpu it "delivers" goes to the outbox with ``enqueue``.)
SERVICE_CALLS = frozenset({"ingest", "evaluate", "prepare", "decide", "judge", "submit", "refusal",
                           "forget_departed", "record", "due", "plan"})
DRIVEN = frozenset({"engine", "ledger", "sink", "fleet", "synthetic", "outbox", "node_actions", "prober"})


def _violations(path: Path) -> list[str]:
    """Each call in ``path`` of something imported from one of the service's parts, and each call of
    SERVICE_CALLS on an object named as one (``self.engine.ingest(...)``, ``outbox.due(...)``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts: set[str] = set()
    for node in ast.walk(tree):
        module = node.module if isinstance(node, ast.ImportFrom) else None
        if module is not None and module.startswith("vigil.aggregator.") and module.split(".")[2] in SERVICE_PARTS:
            parts.update(a.asname or a.name for a in node.names)  # type: ignore[attr-defined]
    out: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        base = func
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in parts and not base.id.endswith("Config"):  # config is data
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(func)}")
        elif isinstance(func, ast.Attribute) and func.attr in SERVICE_CALLS:
            receiver = func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if name in DRIVEN:
                out.append(f"{path.name}:{node.lineno}: {ast.unparse(func)}")
    return out


def test_no_simulator_module_builds_or_drives_the_aggregators_parts_itself() -> None:
    assert [v for path in sorted(SIM.glob("*.py")) for v in _violations(path)] == []
    # ... and it builds the service (the one way in).
    assert "AggregatorService.in_memory" in (SIM / "run.py").read_text(encoding="utf-8")


def test_the_checker_sees_a_pipeline_of_its_own(tmp_path: Path) -> None:
    own = tmp_path / "own.py"
    own.write_text("from vigil.aggregator.engine import Engine\n"
                   "from vigil.aggregator.ledger import Ledger as L\n"
                   "def build(config, report, now, outbox, node):\n"
                   "    engine = Engine(config, L.in_memory())\n"
                   "    engine.ingest(report, now)\n"
                   "    node.ingest_heartbeat(b'', now)\n"
                   "    outbox.due(report.node, now)\n"
                   "    return engine.evaluate(now)\n")
    assert sorted(v.split(": ", 1)[1] for v in _violations(own)) == [
        "Engine", "L.in_memory", "engine.evaluate", "engine.ingest", "outbox.due"]


def test_every_report_of_a_run_goes_through_the_services_intake_and_departed_nodes_are_forgotten() -> None:
    sc = parse_scenario({"name": "shared-path", "duration_seconds": 150, "report_interval_seconds": 5,
                         "fleet": {"nodes": 3, "gpus_per_node": 2},
                         "aggregator": {"fleet": {"forget_after_seconds": 60}},
                         "faults": [{"kind": "silence", "node": "node-0001", "at_seconds": 20}]})
    sim = Simulation(sc)
    result = sim.run()
    assert isinstance(sim.service, AggregatorService)
    assert sim.engine is sim.service.engine and sim.ledger is sim.service.ledger
    assert result.reports > 0 and sim.service.reports_taken == result.reports
    # node-0001 went silent at 20 s: the service's evaluation forgot it after 60 s into the store's
    # archive; the others still report.
    assert [name for name, _, _ in sim.ledger.store.departed_nodes()] == ["node-0001"]
    assert sorted(sim.engine.fleet.view().nodes) == ["node-0000", "node-0002"]
