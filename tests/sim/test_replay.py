"""``vigil replay`` (sim/replay.py): a simulated run recorded as a trace (``vigil sim --trace``)
replays to exactly its decisions; a changed threshold yields the expected diff; a damaged trace is
named and the rest still replays."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vigil.aggregator.config import parse_config
from vigil.aggregator.trace import read_trace, segments
from vigil.cli import main
from vigil.cli.replay_cmd import SCHEDULE_CHOICES
from vigil.sim.replay import SCHEDULES, diff, load_run, record_run, replay_directory
from vigil.sim.run import run_scenario
from vigil.sim.scenario import load_scenario

# scenarios/port-down.yaml: 16 nodes, node-0005's port goes down at 90 s; the network detector
# drains it after detectors.network.down_seconds (10 s, seen at the next 5 s report: 110 s).
SCENARIO = "port-down"
NODE = "node-0005"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run recorded the way an operator records one: ``vigil sim --trace``."""
    directory = tmp_path_factory.mktemp("trace")
    assert main(["sim", "--scenario", SCENARIO, "--trace", str(directory), "--json", "--progress-every", "-1"]) == 0
    return directory


def test_the_trace_is_the_services_own(tmp_path: Path) -> None:
    """run_scenario's trace_dir: the same records as the command's (one writer, the service's hook)."""
    result = run_scenario(load_scenario(SCENARIO), trace_dir=tmp_path)
    record_run(result, tmp_path)
    reading = read_trace(tmp_path)
    assert reading.headers[0]["source"] == "sim" and not reading.problems
    assert sum(1 for r in reading.records if r.kind == "report") == result.reports


def network(**over: object) -> dict[str, object]:
    return {"detectors": {"network": over}}


def test_a_simulated_run_replays_to_exactly_its_decisions(trace: Path) -> None:
    run = load_run(trace)
    assert run is not None
    assert [(d["node"], d["action"], d["t"]) for d in run.decisions] == [(NODE, "drain", 110.0)]
    report = replay_directory(trace)
    assert report.replayed.schedule == "recorded"
    assert [d.to_json() for d in report.replayed.decisions] == run.decisions  # ids, times, evidence: all of it
    assert report.changes == []
    assert report.replayed.refused == {} and report.replayed.problems == []
    assert report.quality["replayed"] == report.quality["recorded"]
    assert report.quality["replayed"]["recall"] == 1.0 and report.quality["replayed"]["precision"] == 1.0


def test_a_threshold_raised_past_the_fault_removes_the_drain(trace: Path) -> None:
    run = load_run(trace)
    assert run is not None
    config = parse_config({**run.aggregator, **network(down_seconds=600.0)})
    report = replay_directory(trace, config)
    assert [(c.kind, c.node, c.detector) for c in report.changes] == [("removed", NODE, "network")]
    assert report.changes[0].before is not None and report.changes[0].before["t"] == 110.0
    assert report.quality["replayed"]["recall"] == 0.0
    assert report.quality["recorded"]["recall"] == 1.0


def test_a_threshold_lowered_moves_the_drain_earlier(trace: Path) -> None:
    run = load_run(trace)
    assert run is not None
    report = replay_directory(trace, parse_config({**run.aggregator, **network(down_seconds=0.0)}))
    assert [(c.kind, c.node) for c in report.changes] == [("changed_timing", NODE)]
    change = report.changes[0]
    assert change.before is not None and change.after is not None
    assert change.after["t"] < change.before["t"] == 110.0
    # Within the tolerance it is no change.
    assert replay_directory(trace, parse_config({**run.aggregator, **network(down_seconds=0.0)}),
                            tolerance_seconds=60.0).changes == []


def test_an_action_changed_by_the_configuration(trace: Path) -> None:
    run = load_run(trace)
    assert run is not None
    report = replay_directory(trace, parse_config({**run.aggregator, **network(down_action="alert")}))
    assert [(c.kind, c.node) for c in report.changes] == [("changed_action", NODE)]
    assert report.changes[0].after is not None and report.changes[0].after["action"] == "alert"


def test_diff_names_added_and_removed() -> None:
    a = {"id": "a", "node": "n1", "gpu": None, "job": None, "detector": "xid", "action": "drain", "t": 10.0,
         "admitted": True}
    b = {**a, "id": "b", "node": "n2"}
    assert [(c.kind, c.node) for c in diff([a], [b])] == [("removed", "n1"), ("added", "n2")]
    assert [c.kind for c in diff([a], [{**a, "admitted": False, "verdict": "cooldown"}])] == ["changed_verdict"]


def test_a_damaged_segment_is_named_and_the_rest_replays(trace: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(trace, damaged)
    seg = segments(damaged)[0]
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) * 3 // 4])  # the aggregator stopped mid-write
    report = replay_directory(damaged)
    assert len(report.replayed.problems) == 1 and "truncated" in report.replayed.problems[0].reason
    assert 0 < report.replayed.reports < 960
    assert main(["replay", str(damaged), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] and seg.name in out["problems"][0]


def test_a_directory_without_a_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "trace-0-0-000001.vtr").write_bytes(b"garbage")
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no readable trace records" in err and "bad magic" in err
    assert main(["replay", str(tmp_path / "missing")]) == 2
    assert "no such trace directory" in capsys.readouterr().err


def test_the_command_prints_the_diff(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "raised.yaml"
    cfg.write_text("detectors:\n  network:\n    down_seconds: 600\n")
    assert main(["replay", str(trace), "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "1 changes against the 1 recorded decisions" in out
    assert "removed" in out and NODE in out and "port DOWN" in out
    assert "replayed  precision None, recall 0.0" in out


def test_sim_trace_refuses_a_used_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x").write_text("")
    assert main(["sim", "--scenario", SCENARIO, "--trace", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_a_live_services_trace_replays_to_its_stores_decisions(tmp_path: Path) -> None:
    """The aggregator's path (not the simulator's): reports, an urgent Xid, an Alertmanager batch,
    evaluations on the service's clock; replayed with the same configuration, the decisions are the
    store's, an Alertmanager proposal included."""
    from tests.aggregator.conftest import FakeNode
    from vigil.aggregator.decision import Action, Decision
    from vigil.aggregator.gate import GateConfig
    from vigil.aggregator.service import AggregatorService, trace_header
    from vigil.aggregator.trace import TraceWriter
    from vigil.contract.wire import Event
    from vigil.sim.replay import ReplayClock, recorded_from_store, replay, trace_span

    config = parse_config({"trace": {"enabled": True, "directory": str(tmp_path)}})
    clock = ReplayClock(1_800_000_000.0)
    writer = TraceWriter(config.trace, trace_header(config, clock.now, clock.now), background=False)
    service = AggregatorService.in_memory(config, GateConfig(), clock=clock, started=clock.now, trace=writer)
    nodes = [FakeNode(f"node-{i}") for i in range(4)]
    for step in range(40):
        clock.now += 2.5
        for node in nodes:
            events = []
            if step == 20 and node.name == "node-2":
                events = [Event(kind="xid", ts=clock.now, code=79, gpu=3, urgent=True, source="kmsg",
                                message="NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.")]
            service.take(node.report(clock.now, events=events, urgent=bool(events)))
        if step == 30:
            service.alert_sink.submit([Decision(id="am-1", ts=clock.now, node="node-1", action=Action.DRAIN,
                                                reason="NodeDiskFull", detector="alertmanager")],
                                      clock.now, service.reporting())
        service.evaluate_now()
    writer.close()
    reading = read_trace(tmp_path)
    recorded = recorded_from_store(service.ledger.store.decisions(limit=1000), *trace_span(reading))
    assert {(d["node"], d["detector"]) for d in recorded} >= {("node-2", "xid"), ("node-1", "alertmanager")}
    replayed = replay(reading, config, GateConfig())
    assert [d.to_json() for d in replayed.decisions] == recorded
    assert diff(recorded, [d.to_json() for d in replayed.decisions]) == []
    assert replayed.alerts == 1 and replayed.evaluations == 40 and replayed.refused == {}


def test_a_stores_outcome_labels_score_both_configurations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vigil replay --store``: the traced aggregator's SQLite store holds its decisions and the outcome
    labels of its removals (aggregator/precision.py). A configuration that turns two Xid codes into
    alerts drops a confirmed removal (a lost true positive) and an unconfirmed one (an avoided false
    removal); the two Alertmanager drains stay, one confirmed, one nobody labelled (counted apart)."""
    from tests.aggregator.conftest import FakeNode
    from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision
    from vigil.aggregator.engine import Engine
    from vigil.aggregator.gate import Gate, GateConfig
    from vigil.aggregator.ledger import Ledger
    from vigil.aggregator.service import AggregatorService, trace_header
    from vigil.aggregator.store import Store
    from vigil.aggregator.trace import TraceWriter
    from vigil.contract.wire import Event
    from vigil.sim.replay import ReplayClock, outcome_quality

    directory = tmp_path / "trace"
    directory.mkdir()
    db = tmp_path / "vigil.db"
    config = parse_config({"trace": {"enabled": True, "directory": str(directory)}})
    gate = GateConfig(dry_run=False, breaker_floor_nodes=10)  # four removals of six nodes: no breaker here
    clock = ReplayClock(1_800_000_000.0)
    writer = TraceWriter(config.trace, trace_header(config, clock.now, clock.now), background=False)
    ledger = Ledger(Gate(gate, started=None), Store(db), actuators={})
    service = AggregatorService(config, Engine(config, ledger), ledger, clock=clock, trace=writer)
    nodes = [FakeNode(f"node-{i}") for i in range(6)]
    xids = {(10, "node-2"): 79, (14, "node-3"): 48}
    for step in range(40):
        clock.now += 2.5
        for node in nodes:
            events = []
            code = xids.get((step, node.name))
            if code is not None:
                events = [Event(kind="xid", ts=clock.now, code=code, gpu=3, urgent=True, source="kmsg",
                                message=f"NVRM: Xid (PCI:0000:1b:00): {code}, pid=0, fault.")]
            service.take(node.report(clock.now, events=events, urgent=bool(events)))
        if step in (20, 24):
            name = "node-1" if step == 20 else "node-0"
            service.alert_sink.submit([Decision(id=f"am-{name}", ts=clock.now, node=name, action=Action.DRAIN,
                                                reason="NodeDiskFull", detector="alertmanager")],
                                      clock.now, service.reporting())
        service.evaluate_now()
    writer.close()
    store = ledger.store
    removals = {r.decision.node: r.decision for r in store.decisions(limit=1000, admitted_only=True)
                if r.decision.action in REMOVING_ACTIONS}
    assert set(removals) == {"node-0", "node-1", "node-2", "node-3"}
    # What happened next: node-2's Xid 79 and node-1's disk confirmed, node-3's Xid not; node-0 still followed.
    for node, label in (("node-2", "confirmed"), ("node-1", "confirmed"), ("node-3", "not_confirmed"),
                        ("node-0", "")):
        d = removals[node]
        store.write_outcome(d.id, d.ts, node, d.detector, d.action.value, label, {})
    store.close()

    cfg = tmp_path / "alert.yaml"
    cfg.write_text("detectors:\n  xid:\n    overrides: {79: alert, 48: alert}\n"
                   "gate:\n  dry_run: false\n  breaker_floor_nodes: 10\n")
    assert main(["replay", str(directory), "--store", str(db), "--config", str(cfg), "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)["outcomes"]
    assert scored["recorded"] == {"removals": 4, "confirmed": 2, "not_confirmed": 1, "unlabelled": 1,
                                  "precision": 2 / 3}
    assert scored["replayed"] == {"removals": 2, "confirmed": 1, "not_confirmed": 0, "unlabelled": 1,
                                  "precision": 1.0, "recall": 0.5}
    assert scored["dropped"] == {"removals": 2, "confirmed": 1, "not_confirmed": 1, "unlabelled": 0}
    assert scored["added"] == {"removals": 0}

    # The same configuration: the same removals, the same figures, nothing dropped.
    plain = tmp_path / "plain.yaml"
    plain.write_text("gate:\n  dry_run: false\n  breaker_floor_nodes: 10\n")
    assert main(["replay", str(directory), "--store", str(db), "--config", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "recorded  precision 0.667 over 4 removals: 2 / 1 / 1" in out
    assert "replayed  precision 0.667 over 4 removals: 2 / 1 / 1, recall of the confirmed 1.000" in out
    assert "dropped   0 removals" in out

    # A removal the recording did not make is nobody's to label; a refused one is no removal.
    a = {"id": "a", "node": "n1", "gpu": None, "job": None, "detector": "xid", "action": "drain", "t": 1.0,
         "admitted": True}
    b = {**a, "id": "b", "node": "n2"}
    q = outcome_quality([a, {**b, "admitted": False}], [a, b], {"a": "not_confirmed", "b": "confirmed"})
    assert q["recorded"]["precision"] == 0.0 and q["recorded"]["removals"] == 1
    assert q["replayed"]["removals"] == 2 and q["replayed"]["unlabelled"] == 1 and q["added"] == {"removals": 0}


def test_building_the_cli_imports_no_simulator_code() -> None:
    # The aggregator's image has no numpy and `vigil --version` builds every subcommand's parser:
    # `vigil replay`'s may not import the simulator to get its choices.
    assert SCHEDULE_CHOICES == SCHEDULES
    code = ("import sys\nfrom vigil.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('vigil.sim', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
