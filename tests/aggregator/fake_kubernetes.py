"""A fake Kubernetes API server on loopback: TokenReview and Pod reads, in the API's own shapes.

It answers ``POST /apis/authentication.k8s.io/v1/tokenreviews`` and ``GET
/api/v1/namespaces/{ns}/pods/{name}`` as kube-apiserver does (the JSON of the Kubernetes API
reference: TokenReview v1, Pod v1, Status for errors), for the service-account tokens it minted
itself (``mint``: a JWT whose claims are those of a projected, pod-bound token), and only for the
caller presenting the aggregator's own token. ``mode`` stands for an outage: ``hang`` (never
answers until closed) or ``error`` (500). It runs in a thread of its own with its own event loop,
so a test may block (waiting on a subprocess) while it serves; ``close`` stops it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

ISSUER = "https://kubernetes.default.svc.cluster.local"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class Minted:
    token: str
    username: str
    pod: str
    uid: str
    node: str
    audiences: list[str]
    node_claim: bool  # Kubernetes >= 1.30 puts the node's name in the token (and the review's extra)
    bound_to_pod: bool = True


@dataclass
class FakeKubernetes:
    aggregator_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    mode: str = "up"  # up | hang | error
    tokens: dict[str, Minted] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    reviews: list[str] = field(default_factory=list)  # each token reviewed, in order
    pod_reads: int = 0
    in_flight: int = 0
    most_in_flight: int = 0  # the most requests it held at once

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._release = asyncio.Event()
        self._started = threading.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._serve, name="fake-kubernetes", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise AssertionError("the fake Kubernetes API did not start")

    # --- the cluster's state --------------------------------------------------------------------

    def mint(self, node: str, *, namespace: str = "vigil", service_account: str = "vigil-agent",
             audiences: tuple[str, ...] = ("vigil-aggregator",), node_claim: bool = True,
             bound_to_pod: bool = True, expiration_seconds: int = 3600) -> str:
        """A projected token for a new pod of ``service_account`` on ``node`` (and that pod)."""
        pod = f"{service_account}-{secrets.token_hex(3)}"
        uid = str(uuid.uuid4())
        now = int(time.time())
        claims: dict[str, Any] = {
            "aud": list(audiences), "exp": now + expiration_seconds, "iat": now, "nbf": now, "iss": ISSUER,
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
            "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": service_account,
                                                                         "uid": str(uuid.uuid4())}},
        }
        if bound_to_pod:
            claims["kubernetes.io"]["pod"] = {"name": pod, "uid": uid}
            if node_claim:
                claims["kubernetes.io"]["node"] = {"name": node, "uid": str(uuid.uuid4())}
        header = {"alg": "RS256", "kid": "fake-signing-key"}
        token = ".".join((_b64(json.dumps(header).encode()), _b64(json.dumps(claims).encode()),
                          _b64(secrets.token_bytes(256))))
        self.tokens[token] = Minted(token, claims["sub"], pod, uid, node, list(audiences), node_claim, bound_to_pod)
        if bound_to_pod:
            self.pods[(namespace, pod)] = {
                "kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": pod, "namespace": namespace, "uid": uid,
                             "labels": {"app.kubernetes.io/name": "vigil-agent"}},
                "spec": {"nodeName": node, "serviceAccountName": service_account,
                         "containers": [{"name": "agent", "image": "localhost/vigil:0.1.0"}]},
                "status": {"phase": "Running"},
            }
        return token

    def delete_pod(self, token: str) -> None:
        """The token's pod is deleted: its bound token is no longer valid."""
        minted = self.tokens[token]
        namespace = minted.username.split(":")[2]
        del self.pods[(namespace, minted.pod)]

    # --- the API ----------------------------------------------------------------------------------

    async def _gate(self, request: web.Request) -> web.Response | None:
        if self.mode == "hang":
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await self._release.wait()
            finally:
                self.in_flight -= 1
        if self.mode == "error":
            return web.json_response(_status(500, "InternalError", "etcdserver: request timed out"), status=500)
        if request.headers.get("Authorization") != f"Bearer {self.aggregator_token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        return None

    async def _token_review(self, request: web.Request) -> web.Response:
        refused = await self._gate(request)
        if refused is not None:
            return refused
        review = await request.json()
        spec = review["spec"]
        self.reviews.append(spec["token"])
        wanted = spec.get("audiences") or [ISSUER]
        minted = self.tokens.get(spec["token"])
        status: dict[str, Any]
        if minted is None:
            status = {"user": {}, "error": "[invalid bearer token, square/go-jose: error in cryptographic primitive]"}
        elif not set(wanted) & set(minted.audiences):
            status = {"user": {}, "error": f"[invalid bearer token, token audiences {json.dumps(minted.audiences)} "
                                           f"is invalid for the target audiences {json.dumps(wanted)}]"}
        elif minted.bound_to_pod and (minted.username.split(":")[2], minted.pod) not in self.pods:
            status = {"user": {}, "error": f"[invalid bearer token, pod \"{minted.pod}\" not found]"}
        else:
            extra: dict[str, list[str]] = {"authentication.kubernetes.io/credential-id": [f"JTI={uuid.uuid4()}"]}
            if minted.bound_to_pod:
                extra["authentication.kubernetes.io/pod-name"] = [minted.pod]
                extra["authentication.kubernetes.io/pod-uid"] = [minted.uid]
                if minted.node_claim:
                    extra["authentication.kubernetes.io/node-name"] = [minted.node]
                    extra["authentication.kubernetes.io/node-uid"] = [str(uuid.uuid4())]
            namespace = minted.username.split(":")[2]
            status = {"authenticated": True, "audiences": [a for a in wanted if a in minted.audiences],
                      "user": {"username": minted.username, "uid": str(uuid.uuid4()),
                               "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                                          "system:authenticated"],
                               "extra": extra}}
        answer = {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                  "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}
        return web.json_response(answer, status=201)

    async def _pod(self, request: web.Request) -> web.Response:
        refused = await self._gate(request)
        if refused is not None:
            return refused
        self.pod_reads += 1
        key = (request.match_info["namespace"], request.match_info["name"])
        pod = self.pods.get(key)
        if pod is None:
            body = _status(404, "NotFound", f"pods \"{key[1]}\" not found")
            body["details"] = {"name": key[1], "kind": "pods"}
            return web.json_response(body, status=404)
        return web.json_response(pod)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", self._token_review)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}", self._pod)
        self._runner = web.AppRunner(app, handle_signals=False)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def release(self) -> None:
        """Answer every request held (and every later one) at once."""
        self._loop.call_soon_threadsafe(self._release.set)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
