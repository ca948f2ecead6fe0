"""The operator door names one node exactly: a Slurm hostlist or a glob (``vnode[1-5]``) is refused
400 ``bad_node`` and counted at the API, and refused before any request by ``vigil aggregator``;
ordinary names that merely look busy (dots, hyphens, digits) are held as before."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.aggregator.test_history import OPERATOR, READ, Bench, bench
from vigil.cli import main

__all__ = ["bench"]  # the fixture, imported for these tests

HOSTLISTS_AND_GLOBS = ("vnode[1-5]", "vnode[01-04,07]", "vnode1,vnode2", "vnode*", "gpu-?")


async def refused_count(b: Bench, door: str) -> float:
    text = await (await b.client.get("/metrics", headers=READ)).text()
    line = f'vigil_aggregator_refusals_total{{door="{door}",reason="bad_node"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


async def test_a_hostlist_or_glob_is_refused_400_and_counted_and_holds_nothing(bench: Bench) -> None:
    b = bench
    assert await refused_count(b, "operator") == 0  # the series exists before the first refusal
    for i, name in enumerate(HOSTLISTS_AND_GLOBS, start=1):
        for route in ("hold", "resume"):
            resp = await b.client.post(f"/v1/nodes/{quote(name, safe='')}/{route}", json={"note": "x"},
                                       headers=OPERATOR)
            doc = await resp.json()
            assert resp.status == 400 and doc["error"] == "bad_node", (name, route, doc)
            assert "hostlist or a glob" in doc["detail"] and "nothing is expanded" in doc["detail"]
        assert await refused_count(b, "operator") == 2 * i
    resp = await b.client.get("/v1/nodes/vnode[1-5]/history", headers=READ)
    assert resp.status == 400 and (await resp.json())["error"] == "bad_node"
    assert await refused_count(b, "read") == 1
    # another bad name gets the naming rule itself, not the hostlist hint
    resp = await b.client.post("/v1/nodes/bad name/hold", headers=OPERATOR)
    assert resp.status == 400 and "dot-separated labels" in (await resp.json())["detail"]
    assert b.ledger.gate_state(b.clock.now, 10)["holds"] == {}


async def test_lookalike_names_are_held_exactly(bench: Bench) -> None:
    b = bench
    for name in ("vnode1", "vnode-1-5", "gpu-node-01.cluster.example"):
        resp = await b.client.post(f"/v1/nodes/{name}/hold", headers=OPERATOR)
        assert resp.status == 200 and (await resp.json())["node"] == name
    holds: dict[str, object] = b.ledger.gate_state(b.clock.now, 10)["holds"]  # type: ignore[assignment]
    assert set(holds) == {"vnode1", "vnode-1-5",
                                                                    "gpu-node-01.cluster.example"}
    assert await refused_count(b, "operator") == 0


@pytest.mark.parametrize("command", ["hold", "resume", "history", "isolate"])
async def test_the_cli_refuses_a_hostlist_before_any_request(bench: Bench, tmp_path: Path, command: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "operator.token"
    token.write_text(OPERATOR["Authorization"][7:])
    url = str(bench.client.make_url("")).rstrip("/")
    with pytest.raises(SystemExit) as exit_:
        await asyncio.to_thread(main, ["aggregator", command, "vnode[1-5]", "--url", url,
                                       "--token-file", str(token)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'vnode[1-5]' is not a node name, it looks like a Slurm hostlist" in err
    assert "$(scontrol show hostnames 'vnode[1-5]')" in err
    assert (f'vigil aggregator {command} "$n"' in err) if command != "isolate" else "isolate $(scontrol" in err
    # nothing reached the aggregator: not even a refusal there
    assert await refused_count(bench, "operator") == 0 and await refused_count(bench, "read") == 0
