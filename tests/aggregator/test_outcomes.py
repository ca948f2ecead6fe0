"""Outcomes over HTTP: the operator's ticket verdict and promote calls, authenticated, validated, counted
when refused (never a 5xx); a label is final."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from vigil.aggregator.app import make_app
from vigil.aggregator.auth import Credentials
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Action, Decision
from vigil.aggregator.engine import Engine
from vigil.aggregator.gate import Gate
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.store import Store

OPERATOR = b"o" * 40
READ = b"r" * 40
T0 = 1_700_000_000.0


async def test_ticket_and_promote_calls(tmp_path: Path) -> None:
    config = parse_config({"dry_run": False, "evaluate_interval_seconds": 3600,
                           "precision": {"enabled": True, "prior_confirmed": 1, "prior_unconfirmed": 1}})
    store = Store(tmp_path / "decisions.sqlite")
    ledger = Ledger(Gate(config.gate), store, {})
    app = make_app(config, Engine(config, ledger), ledger, clock=lambda: T0,
                   credentials=Credentials(operator=OPERATOR, read=READ))
    assert ledger.precision is not None
    drain = Decision(id="d-noisy-1", ts=T0, node="gpu-1", action=Action.DRAIN, reason="HBM hot", detector="thermal",
                     evidence={"signal": "memory_temperature_celsius"}, dry_run=False)
    assert ledger.submit([drain], T0, 10)
    op = {"Authorization": f"Bearer {OPERATOR.decode()}"}
    route = "/v1/decisions/d-noisy-1/outcome"
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            assert (await client.post(route, json={"fault": False})).status == 401
            reader = {"Authorization": f"Bearer {READ.decode()}"}
            assert (await client.post(route, json={"fault": False}, headers=reader)).status == 403
            for body, reason in (({"fault": "no"}, "bad_fault"), ({"fault": False, "x": 1}, "unknown_field"),
                                 ({"fault": True, "note": "n" * 501}, "bad_note")):
                resp = await client.post(route, json=body, headers=op)
                assert (resp.status, (await resp.json())["error"]) == (400, reason)
            resp = await client.post(route, data=b"{", headers=op)
            assert (resp.status, (await resp.json())["error"]) == (400, "invalid_json")
            resp = await client.post("/v1/decisions/nope/outcome", json={"fault": True}, headers=op)
            assert (resp.status, (await resp.json())["error"]) == (404, "unknown_decision")
            resp = await client.post(route, json={"fault": False, "note": "nothing found, HBM fine"}, headers=op)
            assert resp.status == 200
            assert (await resp.json())["label"] == "not_confirmed"
            resp = await client.post(route, json={"fault": True}, headers=op)  # a label is final
            assert (resp.status, (await resp.json())["error"]) == (409, "already_labelled")
            # Beta(1, 1) and one unconfirmed removal: P(p < 0.8) = 0.96, the rule is demoted.
            rules = (await (await client.get("/v1/precision", headers=reader)).json())["rules"]
            assert [(r["rule"], r["unconfirmed"], r["demoted"]) for r in rules] == \
                [("memory_temperature_celsius", 1, True)]
            promote = "/v1/precision/thermal/memory_temperature_celsius/promote"
            assert (await client.post(promote, json={"note": "threshold fixed"}, headers=reader)).status == 403
            assert (await client.post(promote, json={"note": "threshold fixed"}, headers=op)).status == 200
            resp = await client.post(promote, headers=op)
            assert (resp.status, (await resp.json())["error"]) == (409, "not_demoted")
            metrics = await (await client.get("/metrics")).text()
            assert 'vigil_aggregator_refusals_total{door="operator",reason="already_labelled"} 1.0' in metrics
            assert 'vigil_detector_demoted{detector="thermal",rule="memory_temperature_celsius"} 0.0' in metrics
    finally:
        store.close()
    # Both changes of standing are on record.
    again = Store(tmp_path / "decisions.sqlite")
    try:
        assert again.rule_standings()[("thermal", "memory_temperature_celsius")][0] is False
        assert [r[3] for r in again._q("SELECT * FROM rule_changes ORDER BY ts").fetchall()] == [1, 0]
    finally:
        again.close()
