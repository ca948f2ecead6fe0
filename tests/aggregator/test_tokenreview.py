"""Kubernetes node credentials: an agent pod's projected token speaks for the node its pod runs on,
and for nothing else (aggregator/tokenreview.py, docs/kubernetes.md), against a fake API server
that answers TokenReview and Pod reads in the API's own shapes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.aggregator.conftest import proposals_ledger
from tests.aggregator.fake_kubernetes import FakeKubernetes
from vigil.aggregator.app import make_app
from vigil.aggregator.auth import Credentials, node_token
from vigil.aggregator.config import parse_config
from vigil.aggregator.engine import Engine
from vigil.aggregator.tokenreview import KubernetesAuthConfig, TokenReviewer
from vigil.contract.wire import Report, encode

SECRET = b"site-secret-of-the-tokenreview-test-0123456789"
CACHE_SECONDS = 300.0
TIMEOUT_SECONDS = 0.5  # the total deadline of one review in these tests


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kube() -> Iterator[FakeKubernetes]:
    fake = FakeKubernetes()
    try:
        yield fake
    finally:
        fake.close()


def reviewer_for(kube: FakeKubernetes, tmp_path: Path, *, clock: Clock | None = None, wall: Clock | None = None,
                 max_cached: int = 1 << 16, max_in_flight: int = 16, api_url: str | None = None,
                 timeout_seconds: float = TIMEOUT_SECONDS) -> TokenReviewer:
    own = tmp_path / "aggregator-sa.token"
    own.write_text(kube.aggregator_token + "\n")
    config = KubernetesAuthConfig(enabled=True, api_url=api_url or kube.url, token_file=str(own), ca_file=None,
                                  cache_seconds=CACHE_SECONDS, timeout_seconds=timeout_seconds,
                                  max_in_flight=max_in_flight)
    return TokenReviewer(config, clock=clock or Clock(1000.0), wall_clock=wall or time.time, max_cached=max_cached)


async def client_for(reviewer: TokenReviewer) -> TestClient:
    config = parse_config({"listen": "0.0.0.0:9500", "dry_run": True})  # beyond loopback: nothing is open
    sink = proposals_ledger()
    credentials = Credentials(site_secret=SECRET, operator=b"operator-token-0123456789", kubernetes=reviewer)
    client = TestClient(TestServer(make_app(config, Engine(config, sink), sink, credentials=credentials),
                                   host="127.0.0.1"))
    await client.start_server()
    return client


SEQ: dict[str, int] = {}


def report(node: str) -> bytes:
    SEQ[node] = SEQ.get(node, 0) + 1
    return encode(Report(node=node, boot_id=f"boot-{node}", seq=SEQ[node], ts=time.time(), interval_seconds=2.5))


async def post(client: TestClient, node: str, token: str) -> tuple[int, str]:
    resp = await client.post("/v1/reports", data=report(node), headers={"Authorization": f"Bearer {token}",
                                                                         "Content-Type": "application/json"})
    body = await resp.json()
    return resp.status, body.get("error", "")


async def refusals(client: TestClient, reason: str) -> float:
    text = await (await client.get("/metrics")).text()
    line = f'vigil_aggregator_refusals_total{{door="reports",reason="{reason}"}} '
    (value,) = [float(row[len(line):]) for row in text.splitlines() if row.startswith(line)]
    return value


async def test_a_projected_token_reports_for_its_pods_node_and_no_other(kube: FakeKubernetes, tmp_path: Path) -> None:
    token = kube.mint("gpu-001")
    client = await client_for(reviewer_for(kube, tmp_path))
    try:
        assert await post(client, "gpu-001", token) == (202, "")
        # The node of another pod: the token's own node is what it speaks for, not the report's claim.
        assert await post(client, "gpu-002", token) == (403, "node_mismatch")
        assert await refusals(client, "node_mismatch") == 1
        assert await post(client, "gpu-001", token) == (202, "")
        assert kube.reviews == [token]  # reviewed once, then cached
        metrics = await (await client.get("/metrics")).text()
        assert 'vigil_aggregator_token_reviews_total{outcome="accepted"} 1.0' in metrics
        assert 'vigil_aggregator_token_reviews_total{outcome="cached"} 2.0' in metrics
    finally:
        await client.close()


async def test_before_kubernetes_1_30_the_pods_node_comes_from_the_pod(kube: FakeKubernetes, tmp_path: Path) -> None:
    token = kube.mint("gpu-003", node_claim=False)
    replaced = kube.mint("gpu-004", node_claim=False)
    pod = next(p for (ns, name), p in kube.pods.items() if name == kube.tokens[replaced].pod)
    pod["metadata"]["uid"] = "a-new-pod-of-the-same-name"
    client = await client_for(reviewer_for(kube, tmp_path))
    try:
        assert await post(client, "gpu-003", token) == (202, "")
        assert await post(client, "gpu-004", token) == (403, "node_mismatch")
        assert kube.pod_reads == 1
        # A pod of that name now, but not the token's pod: nobody.
        assert await post(client, "gpu-004", replaced) == (403, "not_pod_bound")
    finally:
        await client.close()


async def test_other_service_accounts_namespaces_and_unbound_tokens_are_refused(kube: FakeKubernetes,
                                                                                tmp_path: Path) -> None:
    other_account = kube.mint("gpu-005", service_account="default")
    other_namespace = kube.mint("gpu-005", namespace="team-a")
    unbound = kube.mint("gpu-005", bound_to_pod=False)  # e.g. a long-lived token made by hand
    client = await client_for(reviewer_for(kube, tmp_path))
    try:
        assert await post(client, "gpu-005", other_account) == (403, "wrong_service_account")
        assert await post(client, "gpu-005", other_namespace) == (403, "wrong_service_account")
        assert await post(client, "gpu-005", unbound) == (403, "not_pod_bound")
        assert await refusals(client, "wrong_service_account") == 2
        assert await refusals(client, "not_pod_bound") == 1
    finally:
        await client.close()


async def test_tokens_for_another_audience_or_forged_are_refused(kube: FakeKubernetes, tmp_path: Path) -> None:
    api_token = kube.mint("gpu-006", audiences=("https://kubernetes.default.svc.cluster.local",))
    lying = kube.mint("gpu-006")
    kube.tokens[lying].audiences = ["something-else"]  # its payload says vigil's audience; the API knows better
    forged = kube.mint("gpu-006")
    del kube.tokens[forged]  # same claims, but the API server never signed it
    client = await client_for(reviewer_for(kube, tmp_path))
    try:
        assert await post(client, "gpu-006", api_token) == (401, "wrong_audience")
        assert kube.reviews == []  # refused before asking the API server
        assert await post(client, "gpu-006", lying) == (401, "token_review_failed")
        assert await post(client, "gpu-006", forged) == (401, "token_review_failed")
        assert await post(client, "gpu-006", "not-a-jwt-and-not-a-node-token") == (401, "bad_credential")
        assert kube.reviews == [lying, forged]
        # A pod token opens the reports door only: never an operator's.
        token = kube.mint("gpu-006")
        resp = await client.post("/v1/breaker/reset", headers={"Authorization": f"Bearer {token}"})
        assert resp.status == 401 and (await resp.json())["error"] == "bad_credential"
        assert token not in kube.reviews
    finally:
        await client.close()


@pytest.mark.parametrize("outage", ["hang", "error", "down"])
async def test_an_api_server_that_cannot_answer_refuses_with_401_within_the_deadline(
        kube: FakeKubernetes, tmp_path: Path, outage: str) -> None:
    token = kube.mint("gpu-007")
    closed = f"http://127.0.0.1:{_closed_port()}" if outage == "down" else None
    kube.mode = outage if outage != "down" else "up"
    client = await client_for(reviewer_for(kube, tmp_path, api_url=closed))
    try:
        # "hang": the fake never answers; only the review's own deadline ends the request.
        assert await asyncio.wait_for(post(client, "gpu-007", token), 30) == (401, "token_review_unavailable")
        assert await refusals(client, "token_review_unavailable") == 1
        metrics = await (await client.get("/metrics")).text()
        assert 'vigil_aggregator_token_reviews_total{outcome="unavailable"} 1.0' in metrics
        assert (await client.get("/healthz")).status == 200  # the aggregator itself is fine
    finally:
        await client.close()


def _closed_port() -> int:
    from tests.loopback import free_port

    return free_port()  # nothing listens there


async def test_a_verified_token_rides_out_an_outage_but_not_past_its_expiry(kube: FakeKubernetes,
                                                                            tmp_path: Path) -> None:
    token = kube.mint("gpu-008", expiration_seconds=3600)
    clock, wall = Clock(1000.0), Clock(time.time())
    client = await client_for(reviewer_for(kube, tmp_path, clock=clock, wall=wall))
    try:
        assert await post(client, "gpu-008", token) == (202, "")
        clock.now += CACHE_SECONDS + 1  # due for a review again
        kube.mode = "hang"
        assert await asyncio.wait_for(post(client, "gpu-008", token), 30) == (202, "")
        # The API is known to be down: the next report does not wait for the deadline again.
        assert await post(client, "gpu-008", token) == (202, "")
        assert kube.most_in_flight == 1
        metrics = await (await client.get("/metrics")).text()
        assert 'vigil_aggregator_token_reviews_total{outcome="stale"} 2.0' in metrics
        wall.now += 3600 + 1  # the token has expired: the cache never outlives it
        assert await post(client, "gpu-008", token) == (401, "token_review_unavailable")
    finally:
        await client.close()


async def test_reviews_again_after_cache_seconds_so_a_deleted_pod_loses_its_node(kube: FakeKubernetes,
                                                                                tmp_path: Path) -> None:
    token = kube.mint("gpu-009")
    clock = Clock(1000.0)
    client = await client_for(reviewer_for(kube, tmp_path, clock=clock))
    try:
        assert await post(client, "gpu-009", token) == (202, "")
        kube.delete_pod(token)
        clock.now += CACHE_SECONDS - 1
        assert await post(client, "gpu-009", token) == (202, "")  # within the documented window
        clock.now += 2
        assert await post(client, "gpu-009", token) == (401, "token_review_failed")
        assert kube.reviews == [token, token]
    finally:
        await client.close()


async def test_the_cache_is_bounded(kube: FakeKubernetes, tmp_path: Path) -> None:
    reviewer = reviewer_for(kube, tmp_path, max_cached=2)
    tokens = [kube.mint(f"gpu-01{i}") for i in range(3)]
    try:
        for token in tokens:
            assert (await reviewer.review(token.encode())).node is not None
        assert len(reviewer._cache) == 2
        await reviewer.review(tokens[2].encode())  # still cached
        assert kube.reviews == tokens
        await reviewer.review(tokens[0].encode())  # the oldest went: reviewed again
        assert kube.reviews == [*tokens, tokens[0]]
    finally:
        await reviewer.close()


async def test_forged_tokens_hold_at_most_max_in_flight_reviews(kube: FakeKubernetes, tmp_path: Path) -> None:
    reviewer = reviewer_for(kube, tmp_path, max_in_flight=2, timeout_seconds=30)
    kube.mode = "hang"
    forged = []
    for i in range(6):
        token = kube.mint(f"gpu-02{i}")
        del kube.tokens[token]
        forged.append(token.encode())
    try:
        reviews = asyncio.gather(*(reviewer.review(t) for t in forged))
        for _ in range(3000):  # until all six are under way (bounded: 30 s)
            if kube.in_flight == 2 and reviewer.waiting == 4:
                break
            await asyncio.sleep(0.01)
        # Two at the API server, four waiting for a slot here: nothing more reaches the API.
        assert (kube.in_flight, reviewer.waiting) == (2, 4)
        kube.release()
        verdicts = await asyncio.wait_for(reviews, 30)
        assert {v.reason for v in verdicts} == {"token_review_failed"}
        assert kube.most_in_flight == 2 and len(kube.reviews) == 6
    finally:
        await reviewer.close()


async def test_node_tokens_of_the_site_secret_still_work_beside_it(kube: FakeKubernetes, tmp_path: Path) -> None:
    client = await client_for(reviewer_for(kube, tmp_path))
    try:
        assert await post(client, "bare-metal-1", node_token(SECRET, "bare-metal-1")) == (202, "")
        assert await post(client, "bare-metal-2", node_token(SECRET, "bare-metal-1")) == (403, "node_mismatch")
        assert kube.reviews == []
    finally:
        await client.close()


def test_the_aggregator_needs_its_own_token_and_an_api_address(tmp_path: Path) -> None:
    from vigil.contract.validation import ConfigError

    config = KubernetesAuthConfig(enabled=True, token_file=str(tmp_path / "missing"), ca_file=None)
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        TokenReviewer(config, env={})
    with pytest.raises(ConfigError, match=r"auth\.kubernetes\.token_file: cannot read"):
        TokenReviewer(config, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
