"""The lean report path (aggregator/report_door.py) against aiohttp's route: two identical aggregators,
one served as ``serve`` serves it (lean path in front of aiohttp), one by aiohttp alone, get the same
raw HTTP bytes; every answer (status, headers but Date, body) and every refusal counter must match,
for plain reports, refusals, odd framings, other routes on the same connection, shedding and slow bodies,
and over a randomized stream of reports cut into random segments and pipelined."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.aggregator.conftest import FakeNode, proposals_ledger
from vigil.aggregator.app import LINGERING_SECONDS, METRICS_KEY, make_app, report_door
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.aggregator.listener import ConnectionGuard
from vigil.aggregator.report_door import ReportDoor, parse_head
from vigil.contract.wire import encode

SECRET = b"site-secret-for-tests-0123456789abcdef"
COUNTED = re.compile(rb"^vigil_aggregator_(refusals|report_rejections|reports|reports_shed)_total\b.*$", re.M)


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Served:
    port: int
    app: web.Application
    door: ReportDoor | None


@dataclass
class Pair:
    lean: Served
    plain: Served
    clock: Clock

    async def both(self, chunks: list[bytes]) -> list[tuple[int, list[tuple[str, str]], bytes]]:
        """The same bytes to each, on one connection each; the answers, which must be the same."""
        lean, plain = await exchange(self.lean.port, chunks), await exchange(self.plain.port, chunks)
        assert lean == plain
        return lean

    def counters(self) -> None:
        """Every refusal, rejection, shed and report counter reads the same on both."""
        lean, plain = ([m[0] for m in COUNTED.finditer(s.app[METRICS_KEY].render())] for s in (self.lean, self.plain))
        assert lean == plain
        assert any(b"refusals_total" in line for line in lean)


async def start(config: Any, clock: Clock, credentials: Credentials, lean: bool) -> tuple[Served, web.AppRunner,
                                                                                        asyncio.Server]:
    sink = proposals_ledger()
    app = make_app(config, Engine(config, sink), sink, clock=clock, credentials=credentials)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           keepalive_timeout=config.server.keepalive_timeout_seconds, lingering_time=LINGERING_SECONDS)
    await runner.setup()
    assert runner.server is not None
    door = report_door(app, runner.server) if lean else None
    guard = ConnectionGuard(door or runner.server, config.server, lambda reason: None)
    server = await asyncio.get_running_loop().create_server(guard, "127.0.0.1", 0)
    return Served(server.sockets[0].getsockname()[1], app, door), runner, server


@pytest.fixture
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    extra = getattr(request, "param", {})
    config = parse_config({"evaluate_interval_seconds": 3600, "listen": "127.0.0.1:0", **extra})
    clock = Clock()
    credentials = Credentials(site_secret=SECRET, read=b"read-token-0123456789abcdef")
    lean, lean_runner, lean_server = await start(config, clock, credentials, lean=True)
    plain, plain_runner, plain_server = await start(config, clock, credentials, lean=False)
    try:
        yield Pair(lean, plain, clock)
    finally:
        for server, runner, served in ((lean_server, lean_runner, lean), (plain_server, plain_runner, plain)):
            server.close()
            if served.door is not None:
                served.door.close_all()
            await runner.cleanup()


async def exchange(port: int, chunks: list[bytes]) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    """Send ``chunks`` (each its own write, a moment apart), read every answer until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.002)
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    answers = []
    while raw:
        end = raw.index(b"\r\n\r\n")
        lines = raw[:end].decode().split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = sorted((k.lower(), v) for k, _, v in (line.partition(": ") for line in lines[1:]) if k != "Date")
        # aiohttp's answer to a message it cannot parse has no length: it runs to the close
        length = int(dict(headers).get("content-length", len(raw)))
        answers.append((status, headers, raw[end + 4:end + 4 + length]))
        raw = raw[end + 4 + length:]
    return answers


def post(body: bytes, token: str | None, *, close: bool = False, headers: str = "", line: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token is not None else ""
    return ((line or "POST /v1/reports HTTP/1.1") + f"\r\nHost: t\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n{headers}" + ("Connection: close\r\n" if close else "") + "\r\n"
            ).encode() + body


def tok(name: str) -> str:
    return node_token(SECRET, name)


async def test_plain_reports_and_their_refusals_answer_as_aiohttp_does(pair: Pair) -> None:
    a, b = FakeNode("a"), FakeNode("b")
    one = encode(a.report(1000.0))
    two = encode(a.report(1002.5))
    three = encode(a.report(1005.0))
    [first] = await pair.both([post(one, tok("a"), close=True)])
    assert first[0] == 202
    # pipelined, keep-alive, then a refusal of each kind the service makes, on one connection
    answers = await pair.both([
        post(two, tok("a")) + post(three, tok("a")),
        post(encode(b.report(1000.0)), tok("a")),  # node_mismatch
        post(b"{not json", tok("a")),
        post(b'{"node": "a"}', tok("a")),
        post(three, tok("a")),  # the last one again (a lost answer resent): acknowledged
        post(b"", tok("a"), close=True),
    ])
    assert [s for s, _, _ in answers] == [202, 202, 403, 400, 400, 202, 400]
    assert pair.lean.door is not None and pair.lean.door.answered == 8 and pair.lean.door.handed_over == 0
    pair.counters()


async def test_whatever_the_lean_path_does_not_take_is_aiohttps_and_answered_alike(pair: Pair) -> None:
    a = FakeNode("a")
    body = encode(a.report(1000.0))
    cases: list[list[bytes]] = [
        [post(body, None, close=True)],  # unauthenticated
        [post(body, "nope", close=True)],  # bad credential
        [post(body, node_token(b"another-site-secret-0123456789abcdef", "a"), close=True)],
        [post(body, "read-token-0123456789abcdef", close=True)],  # forbidden
        [post(b"x" * 64, tok("a"), close=True, headers=f"Content-Length: {10**8}\r\n")],  # two lengths
        [post(b"{}", tok("a"), close=True, line="POST /v1/reports?x=1 HTTP/1.1")],
        [post(b"{}", tok("a"), close=True, line="POST /v1/reports HTTP/1.0")],
        [post(b"{}", tok("a"), close=True, headers="Expect: 100-continue\r\n")],
        [post(b"{}", tok("a"), close=True, headers="X-Folded: a\r\n b\r\n")],
        [post(b"{}", tok("a"), close=True, headers="Bad Name: x\r\n")],
        [b"POST /v1/reports HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + tok("a").encode()
         + b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n4\r\n{not\r\n0\r\n\r\n"],
        [b"POST /v1/reports HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + tok("a").encode()
         + b"\r\nContent-Length: 99999999\r\nConnection: close\r\n\r\n" + b"x" * 1000],  # too large
        [post(body, tok("a")), b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"],
        # a credential taken once on a connection is not taken for another one after it
        [post(encode(FakeNode("b").report(1000.0)), tok("b")), post(encode(a.report(1002.5)), "nope", close=True)],
    ]
    for chunks in cases:
        answers = await pair.both(chunks)
        assert answers and all(s < 500 for s, _, _ in answers), (chunks, answers)
    assert pair.lean.door is not None and pair.lean.door.answered == 2
    assert pair.lean.door.handed_over == len(cases)
    pair.counters()


@pytest.mark.parametrize("pair", [{"server": {"admission": {"max_reports_per_second": 1}}}], indirect=True)
async def test_a_shed_report_is_answered_alike_and_the_connection_goes_on(pair: Pair) -> None:
    a = FakeNode("a")
    bodies = [encode(a.report(1000.0 + 2.5 * i)) for i in range(3)]
    # the first is taken, the next two shed (429, Retry-After), each body dropped, the connection kept
    answers = await pair.both([post(bodies[0], tok("a")), post(bodies[1], tok("a"))[:200],
                               post(bodies[1], tok("a"))[200:] + post(bodies[2], tok("a"), close=True)])
    assert [s for s, _, _ in answers] == [202, 429, 429]
    assert ("retry-after", "5") in answers[1][1]
    pair.counters()


@pytest.mark.parametrize("pair", [{"server": {"body_timeout_seconds": 0.2}}], indirect=True)
async def test_a_body_not_complete_in_time_is_408_alike(pair: Pair) -> None:
    body = encode(FakeNode("a").report(1000.0))
    answers = await pair.both([post(body, tok("a"))[:-100]])
    assert [(s, b[:30]) for s, _, b in answers] == [(408, b'{"error": "body_timeout", "det')]
    assert pair.lean.door is not None and pair.lean.door.answered == 1
    pair.counters()


async def test_random_streams_of_reports_cut_anywhere_answer_alike(pair: Pair) -> None:
    rng = random.Random(47)
    nodes = [FakeNode(f"n{i}", gpus=rng.randint(1, 8), ports=rng.randint(0, 4)) for i in range(6)]
    t = 1000.0
    for _ in range(12):  # connections
        stream = b""
        for _ in range(rng.randint(1, 6)):
            node = rng.choice(nodes)
            speaker = node.name if rng.random() < 0.9 else rng.choice(nodes).name
            pick = rng.random()
            body = b"{" if pick < 0.05 else encode(node.report(t)) if pick < 0.95 else encode(
                node.report(t - 50.0))
            stream += post(body, tok(speaker), headers=rng.choice(["", "connection: keep-alive\r\n",
                                                                     "X-Other: 1\r\n"]))
            t += rng.random()
        stream += b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" if rng.random() < 0.3 \
            else post(b"{", tok("n0"), close=True)
        cuts = sorted(rng.sample(range(1, len(stream)), k=min(len(stream) - 1, rng.randint(0, 5))))
        chunks = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        pair.clock.t = t
        await pair.both(chunks)
    assert pair.lean.door is not None and pair.lean.door.answered > 20
    pair.counters()


@pytest.mark.parametrize("pair", [{"server": {"keepalive_timeout_seconds": 0.2}}], indirect=True)
async def test_an_idle_keep_alive_connection_is_closed_alike(pair: Pair) -> None:
    a = FakeNode("a")
    # no Connection: close: each side ends the connection once it has been idle for the keep-alive time
    answers = await pair.both([post(encode(a.report(1000.0)), tok("a")), post(encode(a.report(1002.5)), tok("a"))])
    assert [s for s, _, _ in answers] == [202, 202]
    assert pair.lean.door is not None and pair.lean.door.answered == 2 and not pair.lean.door.connections


async def test_the_agents_own_http_client_is_served_on_the_lean_path(pair: Pair) -> None:
    """What the agent sends (aiohttp's client, agent/reporter.py: a keep-alive session, a JSON body, a
    bearer token) is taken by the lean path, none handed over: the saving reaches the real fleet."""
    a = FakeNode("a")
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {tok('a')}"}
    async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}) as session:
        for ts in (1000.0, 1002.5, 1005.0):
            async with session.post(f"http://127.0.0.1:{pair.lean.port}/v1/reports", data=encode(a.report(ts)),
                                    headers=headers) as resp:
                assert resp.status == 202, await resp.text()
    assert pair.lean.door is not None and pair.lean.door.answered == 3 and pair.lean.door.handed_over == 0


# parse_head as it was checked before issue 47's third round (one regular expression over the head, then
# the lines): the reference the bytes-operation checks are held to.
_REFERENCE_HEAD = re.compile(rb"POST /v1/reports HTTP/1\.1(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e]*)*")


def _reference_parse_head(head: bytes, max_body_bytes: int) -> tuple[int, bytes | None, bool] | None:
    if _REFERENCE_HEAD.fullmatch(head) is None:
        return None
    length: int | None = None
    authorization: bytes | None = None
    close = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.lower()
        if name == b"content-length":
            value = value.strip(b" \t")
            if length is not None or not value.isdigit() or len(value) > 12:
                return None
            length = int(value)
        elif name == b"authorization":
            if authorization is not None:
                return None
            authorization = value.strip(b" \t")
        elif name == b"connection":
            value = value.strip(b" \t").lower()
            if value == b"close":
                close = True
            elif value != b"keep-alive":
                return None
        elif name in (b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"):
            return None
    if length is None or length > max_body_bytes:
        return None
    return length, authorization, close


def test_parse_head_takes_and_refuses_what_the_regular_expression_did() -> None:
    rng = random.Random(4747)
    lines = [b"Host: 127.0.0.1:9500", b"Authorization: Bearer a.0123abcd", b"authorization:Bearer b.99",
             b"Content-Type: application/json", b"Accept: */*", b"User-Agent: Python/3.11 aiohttp/3.9",
             b"Content-Length: 2867", b"content-length:\t12 ", b"Content-Length: 99999999", b"Content-Length: -1",
             b"Content-Length: 1234567890123", b"Connection: keep-alive", b"Connection: close",
             b"connection: Close", b"Connection: upgrade", b"Transfer-Encoding: chunked", b"Expect: 100-continue",
             b"Content-Encoding: gzip", b"Upgrade: h2c", b"X-Empty:", b"X-Colons: a:b:c", b"Bad Name: x",
             b"Name : x", b": no name", b"no colon", b" folded", b"\tfolded", b"X-Ctl: a\x01b", b"X-High: \xc3\xa9",
             b"X-Cr: a\rb", b"X-Lf: a\nb", b"X-Del: \x7f", b"X-Tab:\tvalue\t", b"X~!#$%&'*+-.^_`|: ok", b""]
    firsts = [b"POST /v1/reports HTTP/1.1", b"POST /v1/reports HTTP/1.0", b"GET /v1/reports HTTP/1.1",
              b"POST /v1/reports?x=1 HTTP/1.1", b"POST /v1/reports HTTP/1.1 ", b"post /v1/reports HTTP/1.1"]
    seen = {True: 0, False: 0}
    for _ in range(20_000):
        picked = rng.choices(lines[:7], k=rng.randint(0, 5)) + rng.choices(lines, k=rng.choice([0, 0, 1, 2]))
        if rng.random() < 0.7:
            picked.append(b"Content-Length: 2867")
        rng.shuffle(picked)
        head = b"\r\n".join([rng.choice(firsts) if rng.random() < 0.2 else firsts[0], *picked])
        if rng.random() < 0.1:  # a byte anywhere
            i = rng.randrange(len(head) + 1)
            head = head[:i] + bytes([rng.randrange(256)]) + head[i:]
        limit = rng.choice([100, 1 << 20])
        got = parse_head(head, limit)
        expected = _reference_parse_head(head, limit)
        assert (None if got is None else tuple(got)) == expected, head
        seen[got is not None] += 1
    assert seen[True] > 1_000 and seen[False] > 1_000  # both outcomes exercised


def test_a_credential_verified_once_speaks_for_the_same_node_on_any_connection() -> None:
    """The door's table of verified credentials answers as the check itself: served and the node for
    the exact bytes that verified, nothing kept of one that did not."""
    rng = random.Random(7)
    credentials = Credentials(site_secret=SECRET)
    door = ReportDoor(None, credentials, lambda: asyncio.Protocol(), max_body_bytes=1 << 20,  # type: ignore[arg-type]
                      body_timeout_seconds=1, keepalive_timeout_seconds=1, lingering_seconds=1,
                      open_without_credential=False)
    candidates = [f"Bearer {tok(n)}".encode() for n in ("a", "b", "c")] + [
        f"bearer {tok('a')}".encode(), f"Bearer  {tok('b')} ".encode(), b"Bearer nope", b"Basic abc",
        f"Bearer {node_token(b'another-site-secret-0123456789abcdef', 'a')}".encode(), b"Bearer a.", b"", None]
    for _ in range(500):
        authorization = rng.choice(candidates)
        fresh = ReportDoor(None, Credentials(site_secret=SECRET), lambda: asyncio.Protocol(),  # type: ignore[arg-type]
                           max_body_bytes=1 << 20, body_timeout_seconds=1, keepalive_timeout_seconds=1,
                           lingering_seconds=1, open_without_credential=False)
        assert door.speaker(authorization) == fresh.speaker(authorization)
    assert set(door._speakers.values()) == {"a", "b", "c"} and len(door._speakers) == 5
