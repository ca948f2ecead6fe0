"""Kubernetes node credentials: a projected service-account token, verified by the API server.

``TokenReviewer`` reads an agent pod's audience-bound token and asks the API server (TokenReview) whether it
is valid, caching successes for a bounded time and number and keeping a verified token through an API outage
until its own expiry. It returns a verdict (the node the pod runs on, or a refusal with its status and
reason); the auth middleware counts and answers it (docs/kubernetes.md, "Node credentials").
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
import ssl
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import Field

from vigil.contract.credential_file import TokenFile
from vigil.contract.validation import ConfigError, StrictModel
from vigil.contract.wire import check_node_name

log = logging.getLogger("vigil.aggregator.tokenreview")

# Where a pod finds its own service account's credentials (Kubernetes docs, "Accessing the
# Kubernetes API from a Pod").
IN_CLUSTER_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
IN_CLUSTER_CA_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
TOKEN_REVIEWS_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
# status.user.extra keys of a pod-bound service-account token (Kubernetes API reference,
# TokenReview; node-name since 1.30, feature ServiceAccountTokenPodNodeInfo).
POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
POD_UID_KEY = "authentication.kubernetes.io/pod-uid"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"

# A service-account JWT is 1-2 KiB; anything far larger is not one, and never goes to the API.
MAX_TOKEN_BYTES = 8 * 1024
# A TokenReview answer is ~1 KiB, a Pod a few tens of KiB; an answer past this is not one.
MAX_ANSWER_BYTES = 1024 * 1024
# Verified tokens kept: above any fleet (a node has one or two live tokens at a time); when full
# the oldest entry goes (its node is reviewed again at its next report).
MAX_CACHED_TOKENS = 1 << 16
# After the API server failed to answer, reviews wait this long before asking again (tokens
# verified before are accepted meanwhile), so an outage costs one deadline, not one per report.
UNAVAILABLE_BACKOFF_SECONDS = 5.0

# Refusal reasons (vigil_aggregator_refusals_total{door="reports", reason}).
REVIEW_REASONS = ("wrong_audience", "token_review_failed", "wrong_service_account", "not_pod_bound",
                  "token_review_unavailable")
OUTCOMES = ("accepted", "cached", "stale", "refused", "unavailable")


class KubernetesAuthConfig(StrictModel):
    """Node credentials on Kubernetes: the agent's projected service-account token (docs/kubernetes.md)."""

    # Accept agents' projected tokens at the reports door (beside site_secret_file's node tokens).
    enabled: bool = False
    # The token's audience (the agent DaemonSet's serviceAccountToken.audience): a token made for
    # vigil is worthless to the API server and to anything else, and vice versa.
    audience: str = Field(default="vigil-aggregator", min_length=1, max_length=253)
    # Only tokens of this service account in this namespace speak for nodes.
    namespace: str = Field(default="vigil", min_length=1, max_length=63)
    service_account: str = Field(default="vigil-agent", min_length=1, max_length=253)
    # A verified token is trusted this long before it is reviewed again (never past its expiry).
    # 300 s: at 12,500 nodes ~42 reviews/s, each a cheap call (kube-apiserver caches webhook token
    # reviews 2 min by default, --authentication-token-webhook-cache-ttl); a deleted agent pod's
    # token is honoured at most this long after the deletion.
    cache_seconds: float = Field(default=300.0, gt=0, le=3600)
    # Total deadline of one review (queueing, TokenReview and, before Kubernetes 1.30, the pod lookup).
    timeout_seconds: float = Field(default=3.0, gt=0, le=30)
    # Reviews in flight at once: bounds what a stream of forged tokens can ask of the API server.
    max_in_flight: int = Field(default=16, ge=1, le=256)
    # None: in-cluster (https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT).
    api_url: str | None = None
    # The aggregator's own service-account token (re-read when kubelet rotates it) and the CA of
    # the API server's certificate (None with https: the system's CAs).
    token_file: str = IN_CLUSTER_TOKEN_FILE
    ca_file: str | None = IN_CLUSTER_CA_FILE


@dataclass(frozen=True)
class Verdict:
    """A review's answer: the node the token speaks for, or why not (status, reason, detail)."""

    node: str | None
    status: int = 0
    reason: str = ""
    detail: str = ""


def _refused(status: int, reason: str, detail: str) -> Verdict:
    return Verdict(None, status, reason, detail)


class _Unavailable(Exception):
    """The API server gave no usable answer (unreachable, slow, 5xx, RBAC, not JSON)."""


@dataclass
class _Entry:
    node: str
    fresh_until: float  # monotonic: reviewed again after this
    expires_at: float | None  # the token's exp claim (Unix time): never accepted after it


def unverified_claims(token: bytes) -> dict[str, Any] | None:
    """The payload of a JWT, NOT verified: used only to refuse early (wrong audience, not a JWT)
    and to bound caching by ``exp`` after the API server verified the token. None: not a JWT."""
    if len(token) > MAX_TOKEN_BYTES:
        return None
    parts = token.split(b".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + b"=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError):
        return None
    return claims if isinstance(claims, dict) else None


def _audiences(claims: Mapping[str, Any]) -> list[str]:
    aud = claims.get("aud")
    if isinstance(aud, str):
        return [aud]
    return [a for a in aud if isinstance(a, str)] if isinstance(aud, list) else []


def _one(extra: Mapping[str, Any], key: str) -> str | None:
    values = extra.get(key)
    if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str) and values[0]:
        return values[0]
    return None


def _printable(text: object, limit: int = 200) -> str:
    return "".join(c if c.isprintable() else "?" for c in str(text))[:limit]


def in_cluster_url(env: Mapping[str, str]) -> str:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("auth.kubernetes: no api_url and KUBERNETES_SERVICE_HOST is not set (not in a pod?)")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def review_families(outcomes: Mapping[str, int], cache_entries: int,
                    waiting: int) -> list[CounterMetricFamily | GaugeMetricFamily]:
    """The reviewer's series (its collector's; tests/rules lists the names from here)."""
    family = CounterMetricFamily(
        "vigil_aggregator_token_reviews", "Agents' Kubernetes tokens judged, by outcome: accepted (TokenReview "
        "said yes), cached (verified recently), stale (verified before, accepted while the API server could not "
        "answer), refused, unavailable (the API server could not answer and the token was not verified before).",
        labels=["outcome"])
    for outcome in OUTCOMES:
        family.add_metric([outcome], outcomes.get(outcome, 0))
    return [family, GaugeMetricFamily("vigil_aggregator_token_review_cache_entries",
                                      "Verified agent tokens kept (bounded).", value=cache_entries),
            GaugeMetricFamily("vigil_aggregator_token_reviews_waiting", "Reviews waiting for one of "
                              "auth.kubernetes.max_in_flight slots (a flood of unknown tokens queues here).",
                              value=waiting)]


class TokenReviewer:
    """Verifies agents' projected tokens through the API server and names the node each speaks
    for. ``clock`` (monotonic) times the cache and the backoff; ``wall_clock`` compares with a
    token's ``exp``; ``env`` gives the in-cluster API address."""

    def __init__(self, config: KubernetesAuthConfig, *, env: Mapping[str, str] = os.environ,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 max_cached: int = MAX_CACHED_TOKENS) -> None:
        self.config = config
        self.url = (config.api_url or in_cluster_url(env)).rstrip("/")
        try:
            self._own_token = TokenFile(config.token_file)
        except OSError as exc:
            raise ConfigError(f"auth.kubernetes.token_file: cannot read {config.token_file}: "
                              f"{exc.strerror or exc}") from None
        self._ssl: ssl.SSLContext | bool = True
        if self.url.startswith("https://"):
            try:
                self._ssl = ssl.create_default_context(cafile=config.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"auth.kubernetes.ca_file: {config.ca_file}: {exc}") from None
        self.username = f"system:serviceaccount:{config.namespace}:{config.service_account}"
        self._clock = clock
        self._wall = wall_clock
        self._max_cached = max_cached
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._down_until = float("-inf")
        self._session: aiohttp.ClientSession | None = None
        self.outcomes: Counter[str] = Counter(dict.fromkeys(OUTCOMES, 0))
        self.waiting = 0  # reviews waiting for a slot

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def collector(self) -> Collector:
        reviewer = self

        class _Reviews(Collector):
            def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
                yield from review_families(reviewer.outcomes, len(reviewer._cache), reviewer.waiting)

        return _Reviews()

    async def review(self, token: bytes) -> Verdict:
        """The node ``token`` speaks for, or the refusal: never raises for anything the sender or
        the API server does."""
        key = hashlib.sha256(token).digest()
        now, wall = self._clock(), self._wall()
        entry = self._cache.get(key)
        if entry is not None and (entry.expires_at is not None and wall >= entry.expires_at):
            del self._cache[key]
            entry = None
        if entry is not None and now < entry.fresh_until:
            self.outcomes["cached"] += 1
            return Verdict(entry.node)
        claims = unverified_claims(token)
        if claims is None:
            return self._refuse(_refused(401, "bad_credential", "the bearer token is neither a node token nor "
                                         "a service-account token (JWT)"))
        if self.config.audience not in _audiences(claims):
            return self._refuse(_refused(401, "wrong_audience", f"the token is not for audience "
                                         f"{self.config.audience!r} (the agent's projected token sets it)"))
        try:
            if now < self._down_until:
                raise _Unavailable("it did not answer a moment ago")
            async with asyncio.timeout(self.config.timeout_seconds):
                self.waiting += 1
                try:
                    await self._slots.acquire()
                finally:
                    self.waiting -= 1
                try:
                    verdict = await self._review(token)
                finally:
                    self._slots.release()
        except (_Unavailable, TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            if now >= self._down_until:
                self._down_until = self._clock() + UNAVAILABLE_BACKOFF_SECONDS
                log.warning("Kubernetes API at %s cannot review agents' tokens: %s", self.url,
                            _printable(exc) or f"no answer within {self.config.timeout_seconds}s")
            if entry is not None:  # verified before and not expired (checked above)
                self.outcomes["stale"] += 1
                return Verdict(entry.node)
            self.outcomes["unavailable"] += 1
            return _refused(401, "token_review_unavailable", "the Kubernetes API server cannot review this "
                            "token now; the report is refused and may be sent again")
        if verdict.node is None:
            self._cache.pop(key, None)
            return self._refuse(verdict)
        self.outcomes["accepted"] += 1
        exp = claims.get("exp")
        self._cache[key] = _Entry(verdict.node, self._clock() + self.config.cache_seconds,
                                  float(exp) if isinstance(exp, int | float) else None)
        self._cache.move_to_end(key)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return verdict

    def _refuse(self, verdict: Verdict) -> Verdict:
        self.outcomes["refused"] += 1
        return verdict

    async def _review(self, token: bytes) -> Verdict:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token.decode(errors="replace"), "audiences": [self.config.audience]}}
        status, answer = await self._call("POST", TOKEN_REVIEWS_PATH, body)
        if status not in (200, 201):
            raise _Unavailable(f"TokenReview answered {status} {_printable(answer.get('message', ''))} "
                               "(may the aggregator's service account create tokenreviews?)")
        result = answer.get("status")
        if not isinstance(result, dict) or result.get("authenticated") is not True:
            error = result.get("error", "") if isinstance(result, dict) else ""
            return _refused(401, "token_review_failed", f"the API server did not authenticate the token: "
                            f"{_printable(error)}")
        audiences = result.get("audiences")
        if not isinstance(audiences, list) or self.config.audience not in audiences:
            return _refused(401, "wrong_audience", f"the API server did not confirm audience {self.config.audience!r}")
        user = result.get("user")
        user = user if isinstance(user, dict) else {}
        if user.get("username") != self.username:
            return _refused(403, "wrong_service_account", f"the token is {_printable(user.get('username'))!r}'s; "
                            f"reports need {self.username!r}'s")
        extra = user.get("extra")
        extra = extra if isinstance(extra, dict) else {}
        pod, uid = _one(extra, POD_NAME_KEY), _one(extra, POD_UID_KEY)
        if pod is None or uid is None:
            return _refused(403, "not_pod_bound", "the token is not bound to a pod (the agent sends its projected "
                            "serviceAccountToken, never a long-lived or kubectl-made token)")
        node = _one(extra, NODE_NAME_KEY)
        if node is None:  # before Kubernetes 1.30: the pod says where it runs
            node_or_refusal = await self._node_of_pod(pod, uid)
            if isinstance(node_or_refusal, Verdict):
                return node_or_refusal
            node = node_or_refusal
        try:
            check_node_name(node)
        except ValueError as exc:
            return _refused(403, "not_pod_bound", f"the pod's node name is not one vigil takes: {exc}")
        return Verdict(node)

    async def _node_of_pod(self, pod: str, uid: str) -> str | Verdict:
        path = f"/api/v1/namespaces/{quote(self.config.namespace, safe='')}/pods/{quote(pod, safe='')}"
        status, answer = await self._call("GET", path, None)
        if status == 404:
            return _refused(403, "not_pod_bound", f"the token's pod {pod!r} no longer exists")
        if status != 200:
            raise _Unavailable(f"GET pod answered {status} (may the aggregator's service account get pods?)")
        meta, spec = answer.get("metadata"), answer.get("spec")
        if not isinstance(meta, dict) or meta.get("uid") != uid:
            return _refused(403, "not_pod_bound", f"pod {pod!r} was replaced since the token was made")
        node = spec.get("nodeName") if isinstance(spec, dict) else None
        if not isinstance(node, str) or not node:
            return _refused(403, "not_pod_bound", f"pod {pod!r} is not scheduled on a node")
        return node

    async def _call(self, method: str, path: str, body: object) -> tuple[int, dict[str, Any]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl))
        headers = {"Accept": "application/json"}
        own = self._own_token.current()
        if own:
            headers["Authorization"] = f"Bearer {own}"
        async with self._session.request(method, self.url + path, json=body, headers=headers,
                                         allow_redirects=False) as resp:
            raw = await resp.content.read(MAX_ANSWER_BYTES + 1)
            if len(raw) > MAX_ANSWER_BYTES:
                raise _Unavailable(f"{method} {path}: an answer over {MAX_ANSWER_BYTES} bytes")
            if resp.status >= 500:
                raise _Unavailable(f"{method} {path} answered {resp.status}")
            try:
                answer = json.loads(raw) if raw else {}
            except ValueError:
                raise _Unavailable(f"{method} {path} answered {resp.status} with a body that is not JSON") from None
            return resp.status, answer if isinstance(answer, dict) else {}
