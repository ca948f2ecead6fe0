"""The ledger: one owner of the decision state; a decision is made only once stored, a refused one
is proposed again, repeats climb the ladder, and the breaker's budget follows the reporting fleet."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.aggregator.conftest import FakeNode
from tests.aggregator.test_store import Takes
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import OPERATOR, Gate, GateConfig, GateState
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import SCHEMA_VERSION, Store, StoreConfig, StoreError
from vigil.contract.wire import Event

T0 = 1_700_000_000.0


def dec(node: str, action: Action, id: str, ts: float = T0, gpu: int | None = None, since: float | None = None,
        detector: str = "xid") -> Decision:
    return Decision(id=id, ts=ts, node=node, action=action, reason="r", detector=detector, gpu=gpu, since=since,
                    dry_run=False)


def ledger(path: Path, **gate: object) -> Ledger:
    cfg = GateConfig.model_validate({"dry_run": False, **gate})
    return Ledger(Gate(cfg), Store(path, busy_timeout_seconds=0.05), {"slurm": Takes("slurm")},
                  config=StoreConfig(retry_base_seconds=1, retry_max_seconds=8))


def test_a_locked_store_makes_nothing_retries_with_backoff_and_loses_nothing(tmp_path: Path) -> None:
    book = ledger(tmp_path / "d.db")
    other = sqlite3.connect(tmp_path / "d.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # a backup or a second writer holds the lock past the timeout
    assert book.submit([dec("n1", Action.DRAIN, "a")], T0, 100) == []
    problem = book.problem()
    assert problem is not None and "locked" in problem
    assert book.store_errors["write"] == 1 and book.unstored == 1
    assert book.submit([], T0 + 0.5, 100) == []  # within the backoff: not even tried
    assert book.store_errors["write"] == 1
    assert book.submit([], T0 + 1.0, 100) == []  # tried again, still locked: backoff doubles
    assert book.store_errors["write"] == 2
    assert book.submit([], T0 + 2.5, 100) == []
    other.execute("ROLLBACK")
    other.close()
    [made] = book.submit([], T0 + 3.0, 100)  # the store works again: the decision is made now
    assert made.id == "a" and book.problem() is None and book.unstored == 0
    assert book.store.verdict_of("a") == (True, "admitted")
    assert [d.id for _, d in book.store.due(T0 + 3)] == ["a"]
    book.store.close()


def test_a_finding_refused_while_the_breaker_is_open_is_made_after_the_reset_and_alerted_meanwhile(
        tmp_path: Path) -> None:
    book = ledger(tmp_path / "d.db", breaker_max_nodes=1, breaker_floor_nodes=1)
    book.submit([dec("n1", Action.DRAIN, "first")], T0, 100)
    trip = book.submit([dec("n2", Action.DRAIN, "lost-gpu")], T0 + 1, 100)
    # The trip's alert, and one for the fault it refused, that a person must hear about ...
    assert [d.detector for d in trip] == ["gate", "gate"] and book.store.state.breaker.tripped
    assert trip[0].reason.startswith("vigil circuit breaker tripped")
    assert trip[1].node == "n2" and trip[1].reason.startswith("vigil did not drain n2 (circuit breaker open)")
    # ... then quiet while the same fault is proposed again each cycle with the breaker open.
    assert book.submit([dec("n2", Action.DRAIN, "lost-gpu")], T0 + 2, 100) == []
    assert book.submit([dec("n2", Action.DRAIN, "lost-gpu")], T0 + 3, 100) == []
    assert book.reset_breaker() is True
    [made] = book.submit([dec("n2", Action.DRAIN, "lost-gpu")], T0 + 4000, 100)
    assert (made.id, made.action) == ("lost-gpu", Action.DRAIN)
    book.store.close()


def test_a_finding_refused_in_a_maintenance_window_is_made_when_the_window_ends(tmp_path: Path) -> None:
    start, end = datetime.fromtimestamp(T0 - 60, UTC), datetime.fromtimestamp(T0 + 600, UTC)
    book = ledger(tmp_path / "d.db", maintenance=[{"nodes": ["n1"], "start": start, "end": end, "note": "fw"}])
    lost = dec("n1", Action.DRAIN, "lost", gpu=0, since=T0)
    assert book.submit([lost], T0, 100) == []
    assert book.store.verdict_of("lost") == (False, "maintenance")
    assert book.submit([lost], T0 + 300, 100) == []  # still in the window: judged again, still refused
    [made] = book.submit([lost], T0 + 601, 100)  # the fault persists past the window: proposed again, made
    assert made.id == "lost" and book.store.verdict_of("lost") == (True, "admitted")
    book.store.close()


def test_hold_refuses_automation_and_an_operator_resume_needs_no_hysteresis(tmp_path: Path) -> None:
    book = ledger(tmp_path / "d.db")
    book.submit([dec("n1", Action.DRAIN, "d1")], T0, 100)
    book.hold("n2", True, T0, "cabling work")
    assert book.submit([dec("n2", Action.DRAIN, "d2")], T0 + 1, 100) == []
    assert book.store.verdict_of("d2") == (False, "held")
    resume = Decision(id="r1", ts=T0 + 2, node="n1", action=Action.RESUME, reason="by hand", detector=OPERATOR,
                      dry_run=False)
    assert [d.id for d in book.submit([resume], T0 + 2, 100)] == ["r1"]
    assert book.store.state.node("n1").condition == "in_service"
    book.store.close()
    reopened = Store(tmp_path / "d.db")  # holds are durable
    assert "n2" in reopened.state.holds
    reopened.close()


def test_the_same_gpu_failing_again_climbs_the_ladder_and_says_which_episodes_it_counted(tmp_path: Path) -> None:
    book = ledger(tmp_path / "d.db", cooldown_seconds=600)
    [first] = book.submit([dec("n1", Action.DRAIN, "ecc-1", gpu=3, since=T0, detector="memory")], T0, 100)
    assert first.action is Action.DRAIN
    # The same event read by another detector a second later is not a repeat.
    assert book.submit([dec("n1", Action.DRAIN, "xid48", T0 + 1, gpu=3, since=T0)], T0 + 1, 100) == []
    assert book.store.verdict_of("xid48") == (False, "duplicate")
    later = T0 + 23 * 60
    [second] = book.submit([dec("n1", Action.DRAIN, "ecc-2", later, gpu=3, since=later, detector="memory")], later,
                           100)
    assert second.action is Action.REBOOT_NODE
    assert [e["id"] for e in second.evidence["earlier_episodes"]] == ["ecc-1"]
    third_t = later + 3600
    [third] = book.submit([dec("n1", Action.DRAIN, "ecc-3", third_t, gpu=3, since=third_t, detector="memory")],
                          third_t, 100)
    assert third.action is Action.INSPECT_HARDWARE
    assert [e["id"] for e in third.evidence["earlier_episodes"]] == ["ecc-1", "ecc-2"]
    # Another GPU on the node is its own history (it waits for the cooldown, but is not escalated).
    [other] = book.submit([dec("n2", Action.DRAIN, "n2-gpu1", third_t, gpu=1, since=third_t)], third_t, 100)
    assert other.action is Action.DRAIN and other.evidence["earlier_episodes"] == []
    book.store.close()


def test_a_second_reading_of_one_event_is_settled_not_acted_on_after_the_cooldown(tmp_path: Path) -> None:
    book = ledger(tmp_path / "d.db", cooldown_seconds=60, dedup_seconds=30)
    [first] = book.submit([dec("n1", Action.RESET_GPU, "xid", gpu=2, since=T0)], T0, 100)
    assert first.action is Action.RESET_GPU
    assert book.submit([dec("n1", Action.RESET_GPU, "memory", T0 + 1, gpu=2, since=T0)], T0 + 1, 100) == []
    # Both detectors keep proposing their episode while it is in their windows: nothing more happens.
    for t in (T0 + 120, T0 + 600):
        assert book.submit([dec("n1", Action.RESET_GPU, "xid", gpu=2, since=T0),
                            dec("n1", Action.RESET_GPU, "memory", T0 + 1, gpu=2, since=T0)], t, 100) == []
    assert book.store.verdict_of("memory") == (False, "duplicate")
    book.store.close()


def test_history_outside_the_horizon_does_not_escalate(tmp_path: Path) -> None:
    book = ledger(tmp_path / "d.db", history_horizon_seconds=3600, min_removed_seconds=0)
    book.submit([dec("n1", Action.RESET_GPU, "a", gpu=0, since=T0)], T0, 100)
    book.submit([dec("n1", Action.RESUME, "back", T0 + 10)], T0 + 10, 100)
    later = T0 + 2 * 86400 + 1
    [again] = book.submit([dec("n1", Action.RESET_GPU, "b", later, gpu=0, since=later)], later, 100)
    assert again.action is Action.RESET_GPU
    book.store.close()


def test_breaker_budget_floor_grace_and_restart_budget() -> None:
    cfg = GateConfig()
    assert cfg.breaker_budget(10) == 3  # a 10-node pilot can lose more than one node an hour
    assert cfg.breaker_budget(1000) == 50
    assert cfg.breaker_budget(1000, in_grace=True) == 3
    gate = Gate(GateConfig(dry_run=False, restart_job_budget=1, breaker_startup_grace_seconds=120), started=T0)
    state = GateState()
    for i in range(3):
        v = gate.judge(dec(f"n{i}", Action.DRAIN, f"d{i}"), T0 + 1, 1000, state)
        state.apply(v, T0 + 1)
    v = gate.judge(dec("n9", Action.DRAIN, "d9"), T0 + 2, 1000, state)
    assert (v.admitted, v.reason, v.trip) == (False, "startup_grace", False)
    assert gate.judge(dec("n9", Action.DRAIN, "d9"), T0 + 121, 1000, state).admitted
    job = Decision(id="j1", ts=T0, node="n5", action=Action.RESTART_JOB, job="train", reason="r", detector="hang",
                   dry_run=False)
    state.apply(gate.judge(job, T0, 1000, state), T0)
    again = gate.judge(job.model_copy(update={"id": "j2", "node": "n6"}), T0 + 5, 1000, state)
    assert (again.admitted, again.reason) == (False, "restart_budget")


def xid(code: int, ts: float, gpu: int = 0) -> Event:
    return Event(kind="xid", ts=ts, code=code, gpu=gpu, urgent=True, message=f"Xid {code}")


def test_a_repeated_xid_within_the_hour_is_decided_again_and_escalated(tmp_path: Path) -> None:
    config = parse_config({"dry_run": False})
    book = Ledger(Gate(config.gate), Store(tmp_path / "d.db"), {})
    engine = Engine(config, book)
    node = FakeNode("n1")
    engine.ingest(node.report(T0), T0)
    engine.ingest(node.report(T0 + 2.5, events=[xid(48, T0 + 2)], urgent=True), T0 + 2.5)
    [first] = [d for d in engine.evaluate(T0 + 2.6) if d.detector == "xid"]
    later = T0 + 20 * 60
    engine.ingest(node.report(later, events=[xid(48, later - 1)], urgent=True), later)
    [second] = [d for d in engine.evaluate(later + 0.1) if d.detector == "xid"]
    assert second.id != first.id
    assert second.evidence["earlier_episodes"][0]["id"] == first.id
    assert second.action.value in ("reboot_node", "inspect_hardware") and second.action is not first.action
    book.store.close()


def test_after_a_reboot_a_gpu_still_missing_and_a_new_xid_79_escalate(tmp_path: Path) -> None:
    config = parse_config({"dry_run": False, "gate": {"cooldown_seconds": 60}})
    book = Ledger(Gate(config.gate), Store(tmp_path / "d.db"), {})
    engine = Engine(config, book)
    node = FakeNode("n1")
    engine.ingest(node.report(T0), T0)
    engine.ingest(node.report(T0 + 2.5, events=[xid(79, T0 + 2, gpu=5)], urgent=True, drop_gpus=(5,)), T0 + 2.5)
    first = engine.evaluate(T0 + 2.6)
    assert {d.action for d in first} & {Action.REBOOT_NODE, Action.DRAIN}
    node.reboot()
    t = T0 + 600
    engine.ingest(node.report(t, drop_gpus=(5,)), t)
    engine.ingest(node.report(t + 2.5, events=[xid(79, t + 2, gpu=5)], urgent=True, drop_gpus=(5,)), t + 2.5)
    after = engine.evaluate(t + 2.6)
    assert [d.action for d in after if d.node == "n1"] == [Action.INSPECT_HARDWARE]
    assert after[0].evidence["earlier_episodes"]
    book.store.close()


def test_an_old_store_migrates_in_order_and_keeps_its_decisions(tmp_path: Path) -> None:
    from vigil.aggregator.store import MIGRATIONS

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])  # the schema before versions existed (user_version 0)
    db.execute("INSERT INTO removals VALUES (?, ?)", (T0, "n1"))
    db.execute("INSERT INTO decisions (id, ts, node, action, proposed_action, detector, admitted, verdict, detail,"
               " dry_run, body) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
               ("old", T0, "n1", "drain", "drain", "xid", 1, "admitted", "", 0,
                dec("n1", Action.DRAIN, "old").model_dump_json()))
    db.commit()
    db.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION == 4
    assert store.state.removals == [(T0, "n1")] and store.verdict_of("old") == (True, "admitted")
    assert [e.id for e in store.state.history["n1"]] == ["old"]
    store.close()


def test_a_corrupt_or_newer_store_is_one_line_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database, just bytes " * 400)
    with pytest.raises(StoreError) as info:
        Store(bad)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)
    newer = tmp_path / "newer.db"
    sqlite3.connect(newer).execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}").connection.close()
    with pytest.raises(StoreError, match="newer"):
        Store(newer)


def test_retention_deletes_finished_decisions_and_keeps_open_ones(tmp_path: Path) -> None:
    book = ledger(tmp_path / "d.db")
    book.submit([dec("n1", Action.DRAIN, "done")], T0, 100)
    book.submit([dec("n2", Action.DRAIN, "open")], T0, 100)
    book.store.mark("done", "slurm", "delivered", T0 + 1)
    book.store.archive_node("n9", T0, {"last_seen": T0 - 600, "boot_id": "b1"})
    book.store.archive_node("n8", T0 + 89 * 86400, {"last_seen": T0})
    gone = book.store.apply_retention(T0 + 91 * 86400, StoreConfig())
    assert gone == 1 and book.store.verdict_of("done") is None
    assert book.store.archived_nodes() == ["n8"]  # archived nodes have their own, longer retention
    assert book.store.verdict_of("open") == (True, "admitted") and book.store.deliveries("open")
    book.store.close()


def test_a_deleted_store_file_is_noticed_and_restored_while_running(tmp_path: Path) -> None:
    path = tmp_path / "d.db"
    book = ledger(path)
    book.submit([dec("n1", Action.DRAIN, "before")], T0, 100)
    for p in tmp_path.glob("d.db*"):
        p.unlink()
    [made] = book.submit([dec("n2", Action.DRAIN, "after")], T0 + 1, 100)
    assert made.id == "after" and book.store_errors["file"] == 1 and book.problem() is None
    book.store.close()
    reopened = Store(path)  # what a restart finds: nothing written before or after is lost
    assert reopened.verdict_of("before") == (True, "admitted") and reopened.verdict_of("after") == (True, "admitted")
    reopened.close()
