"""`vigil aggregator decisions` and `breaker reset` read and reset the store an aggregator wrote."""

from __future__ import annotations

import argparse
import json

from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.gate import Gate, GateConfig
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store
from vigil.cli import decisions_cmd

T0 = 1_700_000_000.0


def fill(path) -> None:
    store = Store(path)
    sink = Ledger(Gate(GateConfig(breaker_max_nodes=1, max_remediation_attempts=1)), store, {})
    for i, node in enumerate(["n1", "n2"]):
        sink.submit(
            [
                Decision(
                    id=f"d{i}", ts=T0, node=node, action=Action.DRAIN, reason="Xid 79", detector="xid", dry_run=False
                )
            ],
            T0 + i,
            100,
        )
    store.close()


def test_lists_verdicts_and_explains_refusals(tmp_path, capsys) -> None:
    fill(tmp_path / "s.db")
    args = argparse.Namespace(store=str(tmp_path / "s.db"), limit=10, node=None, json=False)
    assert decisions_cmd.decisions(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("CIRCUIT BREAKER TRIPPED")
    assert "d0 n1 drain by xid: admitted" in out and "d1 n2 drain by xid: REFUSED breaker_tripped" in out
    args.json = True
    assert decisions_cmd.decisions(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["breaker"]["tripped"] is True
    assert [(d["decision"]["id"], d["admitted"]) for d in doc["decisions"]][-2:] == [("d1", False), ("d0", True)]


def test_missing_and_corrupt_stores_are_one_line_and_their_exit_status(tmp_path, capsys) -> None:
    args = argparse.Namespace(store=str(tmp_path / "none.db"), limit=10, node=None, json=False)
    assert decisions_cmd.decisions(args) == 1
    (tmp_path / "bad.db").write_bytes(b"this is not SQLite" * 100)
    args.store = str(tmp_path / "bad.db")
    assert decisions_cmd.decisions(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "bad.db" in err and "Traceback" not in err
