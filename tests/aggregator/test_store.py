"""The durable decision log: what is written before acting, and what survives a restart."""

from __future__ import annotations

import sqlite3
from typing import cast

from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store, decisions_as_dicts

T0 = 1_700_000_000.0


class Takes:
    """An actuator stand-in for routing only: the store needs names and dry-run flags."""

    def __init__(self, name: str, notify_in_dry_run: bool = False) -> None:
        self.name = name
        self.notify_in_dry_run = notify_in_dry_run
        self.timeout_seconds = 1.0

    def handles(self, decision: Decision) -> bool:
        return decision.action is not Action.OBSERVE

    def deliver(self, decision: Decision) -> str:
        raise AssertionError("the store tests never deliver")

    def check(self) -> str:
        return "reachable"

    def close(self) -> None:
        pass


def dec(node: str, action: Action, id: str, ts: float = T0) -> Decision:
    return Decision(id=id, ts=ts, node=node, action=action, reason="r", detector="xid", dry_run=False)


def test_sqlite_runs_in_wal_mode(tmp_path) -> None:
    store = Store(tmp_path / "d.db")
    mode = sqlite3.connect(tmp_path / "d.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    store.close()


def test_decision_written_with_verdict_and_pending_deliveries(open_store) -> None:
    store = open_store()
    sink = Ledger(Gate(GateConfig(dry_run=False)), store, {"slurm": Takes("slurm"), "hook": Takes("hook")})
    sink.submit([dec("n1", Action.DRAIN, "a1")], T0, 10)
    [row] = store.decisions()
    assert row.admitted and row.verdict == "admitted" and row.decision.id == "a1"
    assert {(x.actuator, x.state) for x in row.deliveries} == {("slurm", "pending"), ("hook", "pending")}
    store.close()


def test_dry_run_records_what_would_be_done_and_only_notifiers_are_pending(open_store) -> None:
    store = open_store()
    actuators = {"slurm": Takes("slurm"), "am": Takes("am", notify_in_dry_run=True)}
    Ledger(Gate(GateConfig(dry_run=True)), store, actuators).submit([dec("n1", Action.DRAIN, "a1")], T0, 10)
    [row] = store.decisions()
    assert row.decision.dry_run
    assert {(x.actuator, x.state) for x in row.deliveries} == {("slurm", "dry_run"), ("am", "pending")}
    assert [d.actuator for d, _ in store.due(T0)] == ["am"]
    store.close()


def test_refusals_are_recorded_once_with_their_reason(open_store) -> None:
    store = open_store()
    sink = Ledger(Gate(GateConfig(dry_run=False, opt_out_nodes=["n9"])), store, {"slurm": Takes("slurm")})
    for i in range(5):  # a detector re-proposes its episode every cycle
        assert sink.submit([dec("n9", Action.DRAIN, "same-episode", T0 + i)], T0 + i, 10) == []
    [row] = store.decisions()
    assert (row.admitted, row.verdict, row.deliveries) == (False, "opt_out", ())
    assert sink.verdicts["opt_out"] == 5
    out = decisions_as_dicts([row])[0]
    assert out["verdict"] == "opt_out" and "opted out" in cast(str, out["detail"])  # StoredDecision.detail: str
    store.close()


def test_a_refused_episode_is_admitted_when_proposed_again_after_the_cooldown(open_store) -> None:
    store = open_store()
    cfg = GateConfig(dry_run=False, cooldown_seconds=600, dedup_seconds=10)
    sink = Ledger(Gate(cfg), store, {"slurm": Takes("slurm")})
    sink.submit([dec("n1", Action.RESET_GPU, "first")], T0, 10)
    assert sink.submit([dec("n1", Action.REBOOT_NODE, "second")], T0 + 60, 10) == []
    [again] = sink.submit([dec("n1", Action.REBOOT_NODE, "second")], T0 + 700, 10)
    assert again.id == "second" and again.action is Action.REBOOT_NODE
    rows = store.decisions()
    assert [(r.decision.id, r.admitted) for r in rows] == [("second", True), ("first", True)]
    store.close()


def test_node_state_escalation_history_and_dedup_survive_restart(open_store) -> None:
    cfg = GateConfig(dry_run=False, cooldown_seconds=60, dedup_seconds=30)
    store = open_store()
    Ledger(Gate(cfg), store, {}).submit([dec("n1", Action.RESET_GPU, "r1")], T0, 10)
    store.close()

    store = open_store()
    sink = Ledger(Gate(cfg), store, {})
    assert store.state.node("n1").condition == "removed"
    assert sink.submit([dec("n1", Action.RESET_GPU, "r1")], T0 + 5, 10) == []  # same id: delivered once
    assert sink.verdicts["duplicate"] == 1
    [escalated] = sink.submit([dec("n1", Action.RESET_GPU, "r2", T0 + 100)], T0 + 100, 10)
    assert escalated.action is Action.REBOOT_NODE  # the history before the restart counts
    store.close()


def test_deliveries_of_one_node_are_handed_out_in_order(open_store) -> None:
    store = open_store()
    cfg = GateConfig(dry_run=False, min_removed_seconds=0)
    sink = Ledger(Gate(cfg), store, {"slurm": Takes("slurm")})
    sink.submit([dec("n1", Action.DRAIN, "drain")], T0, 100)
    sink.submit([dec("n1", Action.RESUME, "resume")], T0 + 1, 100)
    sink.submit([dec("n2", Action.DRAIN, "other")], T0 + 2, 100)
    assert [d.id for _, d in store.due(T0 + 10)] == ["drain", "other"]
    store.mark("drain", "slurm", "failed", T0 + 10, next_attempt_ts=T0 + 50, error="boom")
    assert [d.id for _, d in store.due(T0 + 20)] == ["other"]  # the resume waits behind the drain
    assert store.next_due_ts() == T0 + 2
    store.mark("drain", "slurm", "delivered", T0 + 51)
    assert [d.id for _, d in store.due(T0 + 60)] == ["resume", "other"]
    [drain] = store.deliveries("drain")
    assert (drain.state, drain.attempts, drain.last_error) == ("delivered", 2, "")
    store.close()
