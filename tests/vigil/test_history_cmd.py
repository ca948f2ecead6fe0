"""``vigil aggregator history NODE``: the node's history as a table (oldest first) or the API's JSON,
read through a running aggregator's API on loopback with the read token."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.aggregator.test_history import READ, Bench, bench, live_a_day
from vigil.cli import main

__all__ = ["bench"]  # the fixture, imported for these tests


def token_file(tmp_path: Path) -> str:
    path = tmp_path / "read.token"
    path.write_text(READ["Authorization"][7:] + "\n")
    return str(path)


async def history(b: Bench, tmp_path: Path, *extra: str) -> int:
    url = str(b.client.make_url("")).rstrip("/")
    return await asyncio.to_thread(main, ["aggregator", "history", "n0", "--url", url,
                                          "--token-file", token_file(tmp_path), *extra])


async def test_the_table_lists_the_history_oldest_first_with_actors(bench: Bench, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    await live_a_day(bench)
    assert await history(bench, tmp_path) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "n0: in service"
    assert out[1].split() == ["TIME", "(UTC)", "KIND", "ACTION", "OUTCOME", "ACTOR", "DETAIL"]
    rows = out[2:]
    kinds = [(r.split()[1], r.split()[2]) for r in rows]
    assert kinds == [("proposed", "drain"), ("verdict", "drain"), ("delivery", "drain"), ("delivery", "drain"),
                     ("proposed", "resume"), ("verdict", "resume"), ("hold", "-"), ("release", "-"),
                     ("proposed", "resume"), ("verdict", "resume"), ("delivery", "resume")]
    assert rows[0].startswith("2023-11-14T22:13:20Z") and rows[0].rstrip().endswith("xid says drain [xid=79 gpu=3]")
    assert "failed (attempt 1)" in rows[2] and " rec " in rows[2] and rows[2].endswith("attempt 1 refused")
    assert "refused: hysteresis" in rows[5] and " gate " in rows[5]
    assert "held" in rows[6] and " operator " in rows[6] and rows[6].endswith("RMA 4411")
    assert " recovery " in rows[4] and " operator " in rows[8]


async def test_json_and_limit_pass_the_api_answer_through(bench: Bench, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    await live_a_day(bench)
    assert await history(bench, tmp_path, "--json", "--limit", "2") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["limit"] == 2 and doc["truncated"] and [e["kind"] for e in doc["entries"]] == ["delivery", "verdict"]


async def test_a_bad_limit_or_a_refused_request_is_one_line_on_stderr(bench: Bench, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert await history(bench, tmp_path, "--limit", "0") == 2
    assert "--limit must be in 1..1000" in capsys.readouterr().err
    url = str(bench.client.make_url("")).rstrip("/")
    no_token = await asyncio.to_thread(main, ["aggregator", "history", "n0", "--url", url])
    err = capsys.readouterr().err
    assert no_token == 1 and "HTTP 401 unauthenticated" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as bad_name:  # refused before any request
        await asyncio.to_thread(main, ["aggregator", "history", "n_0", "--url", url,
                                       "--token-file", token_file(tmp_path)])
    assert bad_name.value.code == 2 and "a node name is a hostname" in capsys.readouterr().err
