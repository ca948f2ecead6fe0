"""Issue 12's property: no report and no Alertmanager payload, however malformed, gets a 5xx from
the aggregator, and a refused one leaves the fleet exactly as it was; an accepted one does not
break the detectors; no decision names a node that is not a reporting member of the fleet.

Inputs are a valid report or payload with random parts replaced by arbitrary JSON (NaN,
Infinity, 1e400, huge integers, wrong types, deep nesting, unknown keys), plus raw bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.aggregator.conftest import FakeNode, proposals_ledger
from vigil.aggregator.app import EVALUATE_KEY, METRICS_KEY, make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.contract.wire import encode as wire_encode
from vigil.contract.wire import to_readable

NOW = 1_800_000_000.0
SECRET = b"site-secret-of-the-property-test-0123456789"
AM_TOKEN = b"alertmanager-token-0123456789"
MEMBERS = ("p1", "p2")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["vnode[1-5]", "a,b", "a b", "", "-x", "x" * 300, "p1", "p2", "1e400", "NaN"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)


def leaf_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += leaf_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += leaf_paths(v, (*prefix, i))
    return out


def replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """``value`` with the part at ``path`` replaced by ``new`` (where an earlier replacement
    removed the path, the part where it ends instead)."""
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict) and head in value:
        return {**value, head: replace(value[head], tuple(rest), new)}
    if isinstance(value, list) and isinstance(head, int) and head < len(value):
        copy = list(value)
        copy[head] = replace(copy[head], tuple(rest), new)
        return copy
    return new


def mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    paths = leaf_paths(base)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body: Any = base
        for _ in range(draw(st.integers(1, 3))):
            body = replace(body, draw(st.sampled_from(paths)), draw(json_values))
        if draw(st.booleans()) and isinstance(body, dict):
            body = {**body, draw(st.text(min_size=1, max_size=8)): draw(json_values)}
        return body

    return build()


def get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def same_type_value(example: Any) -> st.SearchStrategy[Any]:
    """A value of ``example``'s JSON type from its whole range: what a report that validates may
    still carry (extreme counters, timestamps, temperatures, odd strings)."""
    if isinstance(example, bool):
        return st.booleans()
    if isinstance(example, int):
        return st.integers(min_value=-1, max_value=2**64)
    if isinstance(example, float):
        return st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**63), 2**63))
    if isinstance(example, str):
        return st.text(max_size=300)
    return json_values


def plausible(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    paths = [p for p in leaf_paths(base) if not isinstance(get(base, p), dict | list)]

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body: Any = base
        for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=6)):
            body = replace(body, path, draw(same_type_value(get(base, path))))
        return body

    return build()


def every_field(value: Any) -> Any:
    """``value`` (a wire Struct) as JSON-ready data with every field, those at their default (None
    included) too, as a client may send them: each is a part to mutate."""
    return to_readable(value, absent=True)


def encode(body: Any) -> bytes:
    # Python's json writes NaN, Infinity and -Infinity literals, as a hostile client would.
    return json.dumps(body, allow_nan=True).encode()


class Harness:
    def __init__(self) -> None:
        config = parse_config({"evaluate_interval_seconds": 3600, "dry_run": False})
        self.sink = proposals_ledger()
        self.engine = Engine(config, self.sink)
        credentials = Credentials(site_secret=SECRET, alertmanager=AM_TOKEN)
        self.app = make_app(config, self.engine, self.sink, clock=lambda: NOW, credentials=credentials)
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(self.app, host="127.0.0.1"), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())
        self.nodes = {n: FakeNode(n, gpus=2, ports=1) for n in MEMBERS}
        for node in self.nodes.values():
            status, _ = self.post("/v1/reports", wire_encode(node.report(NOW)),
                                  node_token(SECRET, node.name))
            assert status == 202

    def post(self, path: str, body: bytes, bearer: str) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            resp = await self.client.post(path, data=body, headers={"Authorization": f"Bearer {bearer}"})
            return resp.status, await resp.json()
        return self.loop.run_until_complete(go())

    def fleet_state(self) -> dict[str, tuple[Any, ...]]:
        return {n.name: (n.seq, n.reports, n.last_seen, n.boot_id, sorted(n.gpus), sorted(n.ports), len(n.events),
                         n.seq_gaps, n.reboots, dict(n.topology))
                for n in self.engine.fleet.view().nodes.values()}

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        h.close()


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def refused_cleanly_or_judged(harness: Harness, before: Any, status: int, answer: Any) -> None:
    """A report body's outcome: refused with a 4xx and a reason, the fleet exactly as before; or
    accepted, and every detector still runs over it. Never a 5xx, never a node that is not a member."""
    event(f"status {status}")  # --hypothesis-show-statistics shows how many got in
    assert status < 500, answer
    if status != 202:
        assert 400 <= status < 500 and answer["error"]
        assert harness.fleet_state() == before
    else:
        harness.app[EVALUATE_KEY]()
    assert set(harness.fleet_state()) <= set(MEMBERS)


def test_no_report_yields_a_5xx_and_a_refused_one_changes_nothing(harness: Harness) -> None:
    base = every_field(harness.nodes["p1"].report(NOW))
    assert harness.post("/v1/reports", encode(base), node_token(SECRET, "p1"))[0] == 202  # valid as it is

    @PROPERTY
    @given(st.one_of(mutated(base).map(encode), plausible(base).map(encode), st.binary(max_size=200)))
    def check(body: bytes) -> None:
        before = harness.fleet_state()
        status, answer = harness.post("/v1/reports", body, node_token(SECRET, "p1"))
        refused_cleanly_or_judged(harness, before, status, answer)

    check()


# A compact body's base_seq left as this is replaced by the node's current seq when posted, so
# that the mutations, not a stale base, decide what happens.
CURRENT_BASE = 10**9


def compact(harness: Harness, name: str) -> dict[str, Any]:
    """A compact report of ``name``: one GPU field and one counter moved since its last report."""
    node = harness.engine.fleet.view().nodes[name]
    gpu, port = node.gpus[0].last, next(iter(node.ports.values())).last
    return {"version": 3, "node": name, "boot_id": node.boot_id, "seq": node.seq + 1, "ts": NOW,
            "interval_seconds": 2.5, "base_seq": CURRENT_BASE,
            "gpus": [{"index": 0, "uuid": gpu.uuid, "temperature_celsius": 63.5},
                     {"index": 1, "uuid": node.gpus[1].uuid}],
            "ports": [{"device": port.device, "port": port.port, "counters": {"symbol_error": 1}}]}


def post_compact(harness: Harness, name: str, body: Any) -> tuple[int, Any]:
    if isinstance(body, dict):
        node = harness.engine.fleet.view().nodes[name]
        if body.get("base_seq") == CURRENT_BASE:
            body = {**body, "base_seq": node.seq}
        if body.get("seq") == CURRENT_BASE:
            body = {**body, "seq": node.seq + 1}
    return harness.post("/v1/reports", encode(body) if not isinstance(body, bytes) else body,
                        node_token(SECRET, name))


def test_a_compact_report_completes_the_nodes_state(harness: Harness) -> None:
    status, answer = post_compact(harness, "p2", compact(harness, "p2"))
    assert status == 202 and answer["report_versions"] == [3]
    node = harness.engine.fleet.view().nodes["p2"]
    assert node.gpus[0].last.temperature_celsius == 63.5 and node.gpus[0].last.power_watts == 650.0
    assert node.gpus[1].last.temperature_celsius == 62.0
    assert next(iter(node.ports.values())).last.counters["symbol_error"] == 1
    assert next(iter(node.ports.values())).last.counters["link_downed"] == 0


def test_a_version_3_report_keeps_what_it_leaves_out_and_clears_what_it_names(harness: Harness) -> None:
    sick = {**compact(harness, "p2"), "version": 3}
    sick["gpus"][1] = {**sick["gpus"][1], "health": "reset_required", "clock_event_reasons": ["hw_slowdown"]}
    assert post_compact(harness, "p2", sick)[0] == 202
    same = {**compact(harness, "p2"), "version": 3}  # GPU 1 as its identity only: unchanged
    assert post_compact(harness, "p2", same)[0] == 202
    gpu = harness.engine.fleet.view().nodes["p2"].gpus[1].last
    assert (gpu.health, gpu.clock_event_reasons) == ("reset_required", ("hw_slowdown",))
    cleared = [["gpus", 0, "power_watts"], ["gpus", 1, "health"], ["gpus", 1, "clock_event_reasons"]]
    well = {**compact(harness, "p2"), "version": 3, "cleared": cleared}
    assert post_compact(harness, "p2", well)[0] == 202
    node = harness.engine.fleet.view().nodes["p2"]
    assert node.gpus[0].last.power_watts is None and node.gpus[0].last.temperature_celsius == 63.5
    assert (node.gpus[1].last.health, node.gpus[1].last.clock_event_reasons) == ("ok", ())
    assert node.gpus[1].last.temperature_celsius == 62.0


@pytest.mark.parametrize("change, status, reason", [
    ({"base_seq": 3}, 409, "delta_base"),  # not the node's last accepted report
    ({"boot_id": "another-boot"}, 409, "delta_base"),  # a new boot has no base
    ({"node": "p9"}, 403, "node_mismatch"),
    # Versions removed before the first release (1 whole, 2 compact), and one not known yet: named.
    ({"version": 1}, 422, "unsupported_report_version"),
    ({"version": 2}, 422, "unsupported_report_version"),
    ({"version": 4}, 422, "unsupported_report_version"),
    ({"version": 3, "cleared": [["ports", 0, "counters"]]}, 400, "schema"),  # a port's counters are never cleared
    ({"version": 3, "cleared": [["gpus", 2, "health"]]}, 400, "schema"),  # no such entry
    ({"base_seq": -1}, 400, "schema"),
    ({"base_seq": 1.0}, 400, "schema"),
    ({"gpus": [{"index": 0, "temperature_celsius": 1.0}]}, 400, "schema"),  # an entry without its identity
    # NaN and Infinity literals are not JSON: the decoder refuses the body as such.
    ({"gpus": [{"index": 0, "uuid": "u", "temperature_celsius": float("nan")}]}, 400, "invalid_json"),
    ({"gpus": [{"index": 0, "uuid": "u", "power_watts": float("inf")}]}, 400, "invalid_json"),
    ({"gpus": [{"index": 0, "uuid": "u", "bogus_field": 1}]}, 400, "schema"),
    ({"ports": [{"device": "mlx5_0", "port": 1, "counters": {"symbol_error": 2**64}}]}, 400, "schema"),
    ({"ports": [{"device": "mlx5_0", "port": 1, "counters": [1, 2, 3]}]}, 400, "schema"),
    ({"ports": [{"device": "mlx5_0", "port": 1, "counters": {"symbol_error": 1.5}}]}, 400, "schema"),
])
def test_a_malformed_or_baseless_compact_report_is_refused_counted_and_changes_nothing(
        harness: Harness, change: dict[str, Any], status: int, reason: str) -> None:
    before = harness.fleet_state()
    got, answer = post_compact(harness, "p2", {**compact(harness, "p2"), **change})
    assert (got, answer["error"]) == (status, reason), answer
    assert harness.fleet_state() == before
    assert harness.engine.fleet.view().nodes["p2"].gpus[0].last.temperature_celsius == 62.0
    metrics = harness.app[METRICS_KEY].render().decode()
    assert f'vigil_aggregator_refusals_total{{door="reports",reason="{reason}"}} 1.0' in metrics


def test_no_compact_report_yields_a_5xx_and_a_refused_one_changes_nothing(harness: Harness) -> None:
    # With a cleared field of each kind it allows (a state word, a list, an optional one).
    extra = {"cleared": [["gpus", 0, "health"], ["gpus", 1, "clock_event_reasons"], ["gpus", 0, "power_watts"],
                         ["ports", 0, "flags"]]}
    base = {**compact(harness, "p2"), **extra}

    @PROPERTY
    @given(st.one_of(mutated(base), plausible(base), st.binary(max_size=200)))
    def check(body: Any) -> None:
        before = harness.fleet_state()
        status, answer = post_compact(harness, "p2", body)
        refused_cleanly_or_judged(harness, before, status, answer)

    check()


def alert(node: str, action: str = "alert") -> dict[str, Any]:
    return {"status": "firing", "labels": {"alertname": "A", "node": node, "vigil_action": action, "gpu": "1"},
            "annotations": {"summary": "s"}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "f"}


def test_no_alertmanager_payload_yields_a_5xx_or_names_a_non_member(harness: Harness) -> None:
    base = {"version": "4", "status": "firing", "receiver": "vigil", "groupKey": "{}",
            "alerts": [alert("p1"), alert("p2", "drain"), alert("p1", "reset_gpu")]}

    @PROPERTY
    @given(st.one_of(mutated(base).map(encode), st.binary(max_size=200)))
    def check(body: bytes) -> None:
        before = harness.fleet_state()
        status, answer = harness.post("/v1/alertmanager", body, AM_TOKEN.decode())
        event(f"status {status}, {answer.get('proposed', 0)} proposed")
        assert status < 500, answer
        assert status in (200, 400, 413), answer
        if status == 200:
            assert len(answer["refused"]) + answer["proposed"] + sum(answer["skipped"].values()) \
                == len(json.loads(body)["alerts"])
        assert harness.fleet_state() == before
        assert {d.node for d in harness.sink.recent(10_000)} <= set(MEMBERS)

    check()
