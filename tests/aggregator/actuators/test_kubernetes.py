"""Kubernetes actuator against a local fake API server that answers as the real one does.

The fake (aiohttp on 127.0.0.1, a random port) keeps Nodes and Pods, applies strategic-merge
patches to a node and to its status subresource (conditions merge by ``type``, taints replace
the list), lists pods by ``fieldSelector=spec.nodeName=`` and ``labelSelector``, and answers a
policy/v1 Eviction with 201, or with 429 when a PodDisruptionBudget protects the pod (409 when the
Eviction's ``deleteOptions.preconditions.uid`` names another pod than the one of that name). It keeps
the core/v1 Events created in a namespace (checking what the API server's validation checks:
the namespace in the URL and the body agree, a name, an involved object, a reason), or refuses
them with ``events_fail_with`` (an RBAC slip, a full etcd) while everything else works. The
actuator talks to it through the official ``kubernetes`` client, unmodified.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.actuators.kubernetes import KubernetesActuator, KubernetesConfig
from vigil.aggregator.decision import Action, Decision

pytest.importorskip("kubernetes", reason="the Kubernetes actuator needs the kubernetes client (pip install vigil[k8s])")

T0 = 1_700_000_000.0
NODE = "gpu-node-7"
PATCH_TYPES = (
    "application/strategic-merge-patch+json",
    "application/merge-patch+json",
    "application/json-patch+json",
    "application/apply-patch+yaml",
)
# The API server's message for a PDB-blocked eviction (k8s.io/kubernetes pkg/registry/core/pod/storage/eviction.go).
PDB_MESSAGE = "Cannot evict pod as it would violate the pod's disruption budget."


def status(code: int, reason: str, message: str, **details: Any) -> web.Response:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    headers = {"Retry-After": "10"} if code == 429 else None
    return web.json_response(body, status=code, headers=headers)


def make_node(name: str, taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "1000",
            "creationTimestamp": "2024-05-01T00:00:00Z",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        },
        "spec": {"podCIDR": "10.0.7.0/24", **({"taints": taints} if taints else {})},
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": "2024-05-01T00:00:00Z",
                    "lastTransitionTime": "2024-05-01T00:00:00Z",
                }
            ],
            "capacity": {"nvidia.com/gpu": "8"},
        },
    }


def pod_uid(namespace: str, name: str) -> str:
    """A pod's uid as the API server assigns it (a UUID), fixed per name for the tests."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"pod/{namespace}/{name}"))


def make_pod(
    name: str,
    node: str,
    namespace: str = "training",
    labels: dict[str, str] | None = None,
    owner_kind: str | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": pod_uid(namespace, name),
        "resourceVersion": "2000",
        "labels": labels or {},
    }
    if owner_kind:
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": owner_kind, "name": f"{name}-owner", "uid": "uid-owner",
             "controller": True}
        ]
    if annotations:
        meta["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "trainer:1"}]},
        "status": {"phase": "Running"},
    }


@dataclass
class FakeApiServer:
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    pdb_protected: set[str] = field(default_factory=set)  # "namespace/name"
    requests: list[dict[str, Any]] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    fail_with: int | None = None  # answer every request with this status (an API server outage)
    events: list[dict[str, Any]] = field(default_factory=list)
    events_fail_with: int | None = None  # answer only Event creation with this status

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/api/v1/nodes", self.list_nodes)
        app.router.add_get("/api/v1/nodes/{name}", self.get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self.patch_node)
        app.router.add_patch("/api/v1/nodes/{name}/status", self.patch_node_status)
        app.router.add_get("/api/v1/pods", self.list_pods)
        app.router.add_post("/api/v1/namespaces/{namespace}/pods/{name}/eviction", self.evict)
        app.router.add_post("/api/v1/namespaces/{namespace}/events", self.create_event)
        return app

    def of(self, method: str, path_end: str = "") -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method and r["path"].endswith(path_end)]

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "content_type": request.headers.get("Content-Type", ""),
                "body": json.loads(raw) if raw else None,
            }
        )
        if self.fail_with is not None:
            return status(self.fail_with, "InternalError", "etcdserver: request timed out")
        return await handler(request)

    def _node(self, request: web.Request) -> dict[str, Any] | None:
        return self.nodes.get(request.match_info["name"])

    def _not_found(self, kind: str, name: str) -> web.Response:
        return status(404, "NotFound", f'{kind} "{name}" not found', name=name, kind=kind.lower() + "s")

    async def get_node(self, request: web.Request) -> web.Response:
        node = self._node(request)
        if node is None:
            return self._not_found("nodes", request.match_info["name"])
        return web.json_response(node)

    def _check_patch(self, request: web.Request) -> web.Response | None:
        if request.content_type not in PATCH_TYPES:
            return status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                          f"accepted media types include: {', '.join(PATCH_TYPES)}")
        if request.content_type != "application/strategic-merge-patch+json":
            return status(400, "BadRequest", "this fake only applies strategic merge patches")
        return None

    async def patch_node(self, request: web.Request) -> web.Response:
        node = self._node(request)
        if node is None:
            return self._not_found("nodes", request.match_info["name"])
        if (bad := self._check_patch(request)) is not None:
            return bad
        patch = await request.json()
        spec = node["spec"]
        for key, value in patch.get("spec", {}).items():
            # Node.spec.taints has no patchMergeKey: a strategic merge replaces the whole list.
            if value is None or value is False or value == []:
                spec.pop(key, None)  # omitempty: false and empty are not serialised
            else:
                spec[key] = copy.deepcopy(value)
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        return web.json_response(node)

    async def patch_node_status(self, request: web.Request) -> web.Response:
        node = self._node(request)
        if node is None:
            return self._not_found("nodes", request.match_info["name"])
        if (bad := self._check_patch(request)) is not None:
            return bad
        patch = await request.json()
        if set(patch) - {"status"}:
            return status(400, "BadRequest", "the status subresource only takes status")
        conditions = node["status"]["conditions"]
        # NodeStatus.conditions: patchMergeKey "type", so each condition replaces its namesake.
        for cond in patch["status"].get("conditions", []):
            for i, old in enumerate(conditions):
                if old["type"] == cond["type"]:
                    conditions[i] = {**old, **cond}
                    break
            else:
                conditions.append(dict(cond))
        return web.json_response(node)

    async def list_nodes(self, request: web.Request) -> web.Response:
        items = list(self.nodes.values())
        for term in filter(None, request.query.get("labelSelector", "").split(",")):
            key, _, value = term.partition("=")
            items = [n for n in items if n["metadata"]["labels"].get(key) == value]
        return web.json_response(
            {"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "3000"}, "items": items})

    async def list_pods(self, request: web.Request) -> web.Response:
        field_selector = request.query.get("fieldSelector", "")
        items = self.pods
        if field_selector:
            key, sep, value = field_selector.partition("=")
            if key != "spec.nodeName" or not sep:
                return status(400, "BadRequest", f'field label not supported: "{key}"')
            items = [p for p in items if p["spec"]["nodeName"] == value]
        for term in filter(None, request.query.get("labelSelector", "").split(",")):
            key, _, value = term.partition("=")
            items = [p for p in items if p["metadata"]["labels"].get(key) == value]
        return web.json_response(
            {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "3000"}, "items": items}
        )

    async def evict(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        body = await request.json()
        # The API server defaults a missing apiVersion/kind to the endpoint's; it refuses others.
        if body.get("apiVersion", "policy/v1") not in ("policy/v1", "policy/v1beta1") or body.get(
            "kind", "Eviction"
        ) != "Eviction":
            return status(400, "BadRequest", f"unexpected eviction {body.get('apiVersion')}/{body.get('kind')}")
        if body.get("metadata", {}).get("name") != name:
            return status(400, "BadRequest", "name in URL does not match name in Eviction object")
        pod = next(
            (p for p in self.pods if p["metadata"]["name"] == name and p["metadata"]["namespace"] == ns), None
        )
        if pod is None:
            return self._not_found("pods", name)
        want_uid = ((body.get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
        if want_uid is not None and want_uid != pod["metadata"]["uid"]:
            return status(409, "Conflict", f"Precondition failed: UID in precondition: {want_uid}, UID in object "
                                           f"meta: {pod['metadata']['uid']}")
        if f"{ns}/{name}" in self.pdb_protected:
            return status(
                429,
                "TooManyRequests",
                PDB_MESSAGE,
                causes=[
                    {
                        "reason": "DisruptionBudget",
                        "message": "The disruption budget trainers needs 4 healthy pods and has 4 currently",
                    }
                ],
            )
        # The API server deletes the pod gracefully: it stays listed with a deletionTimestamp.
        pod["metadata"]["deletionTimestamp"] = "2024-05-01T00:10:00Z"
        self.evicted.append(f"{ns}/{name}")
        return status(201, "", "")


    async def create_event(self, request: web.Request) -> web.Response:
        if self.events_fail_with is not None:
            return status(self.events_fail_with, "Forbidden" if self.events_fail_with == 403 else "InternalError",
                          'events is forbidden: User "system:serviceaccount:vigil:vigil-aggregator" cannot '
                          'create resource "events" in API group "" in the namespace "default"')
        ns = request.match_info["namespace"]
        body = await request.json()
        meta = body.get("metadata", {})
        if meta.get("namespace", ns) != ns:
            return status(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                          "sent on the request")
        missing = [f for f in ("involvedObject", "reason") if not body.get(f)]
        if not meta.get("name") or missing:
            return status(422, "Invalid", f"Event is invalid: missing {missing or ['metadata.name']}")
        if body.get("type") not in ("Normal", "Warning"):
            return status(422, "Invalid", f"Event is invalid: type: Unsupported value: {body.get('type')!r}")
        event = {**body, "apiVersion": "v1", "kind": "Event", "metadata": {**meta, "namespace": ns}}
        self.events.append(event)
        return web.json_response(event, status=201)


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApiServer, str]]:
    fake = FakeApiServer()
    fake.nodes[NODE] = make_node(NODE, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    fake.nodes["gpu-node-8"] = make_node("gpu-node-8")
    fake.pods = [
        make_pod("trainer-0", NODE, labels={"vigil.io/job": "llm-7b"}),
        make_pod("trainer-1", NODE, labels={"vigil.io/job": "llm-7b"}),
        make_pod("eval-0", NODE, namespace="eval", labels={"vigil.io/job": "eval-3"}),
        make_pod("dcgm-exporter-x1", NODE, namespace="gpu-operator", owner_kind="DaemonSet"),
        make_pod(f"kube-proxy-{NODE}", NODE, namespace="kube-system",
                 annotations={"kubernetes.io/config.mirror": "abc123"}),
        make_pod("trainer-2", "gpu-node-8", labels={"vigil.io/job": "llm-7b"}),
    ]
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield fake, f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def actuator(url: str, **kw: Any) -> KubernetesActuator:
    return KubernetesActuator(KubernetesConfig(**{"enabled": True, "api_url": url, "timeout_seconds": 5.0, **kw}))


def dec(action: Action, node: str = NODE, id: str = "d-0123456789abcdef01", job: str | None = None) -> Decision:
    return Decision(
        id=id, ts=T0, node=node, action=action, reason="Xid 79: GPU has fallen off the bus",
        detector="xid", job=job, dry_run=False,
    )


async def deliver(act: KubernetesActuator, decision: Decision) -> str:
    # The client is blocking (urllib3); the fake server needs this event loop free meanwhile.
    return await asyncio.to_thread(act.deliver, decision)


def vigil_taints(node: dict[str, Any]) -> list[dict[str, str]]:
    return [t for t in node["spec"].get("taints", []) if t["key"] == "vigil.io/unhealthy"]


def condition(node: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in node["status"]["conditions"] if c["type"] == type_), None)


async def test_drain_cordons_taints_marks_and_evicts_the_nodes_own_pods(api) -> None:
    fake, url = api
    act = actuator(url)
    try:
        out = await deliver(act, dec(Action.DRAIN))
    finally:
        act.close()
    node = fake.nodes[NODE]
    assert node["spec"]["unschedulable"] is True
    # Ours added, the GPU operator's taint kept.
    assert node["spec"]["taints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "vigil.io/unhealthy", "value": "drain", "effect": "NoSchedule"},
    ]
    cond = condition(node, "VigilUnhealthy")
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "VigilDrain"
    assert "d-0123456789abcdef01" in cond["message"]
    assert condition(node, "Ready") == make_node(NODE)["status"]["conditions"][0]  # the kubelet's, untouched
    # Pods scheduled elsewhere, DaemonSet pods and static (mirror) pods stay.
    assert sorted(fake.evicted) == ["eval/eval-0", "training/trainer-0", "training/trainer-1"]
    listing = fake.of("GET", "/api/v1/pods")
    assert listing and listing[0]["query"]["fieldSelector"] == f"spec.nodeName={NODE}"
    patches = fake.of("PATCH")
    assert [p["path"] for p in patches] == [f"/api/v1/nodes/{NODE}", f"/api/v1/nodes/{NODE}/status"]
    assert {p["content_type"] for p in patches} == {"application/strategic-merge-patch+json"}
    eviction = fake.of("POST", "/eviction")[0]
    assert eviction["body"]["apiVersion"] == "policy/v1" and eviction["body"]["kind"] == "Eviction"
    assert "evicted 3 pod(s)" in out and NODE in out
    assert fake.nodes["gpu-node-8"] == make_node("gpu-node-8")


async def test_a_second_drain_replaces_the_vigil_taint_instead_of_stacking_it(api) -> None:
    fake, url = api
    act = actuator(url, evict_pods=False)
    try:
        await deliver(act, dec(Action.RESET_GPU, id="d-first"))
        await deliver(act, dec(Action.REBOOT_NODE, id="d-second"))
    finally:
        act.close()
    node = fake.nodes[NODE]
    assert vigil_taints(node) == [{"key": "vigil.io/unhealthy", "value": "reboot_node", "effect": "NoSchedule"}]
    assert len(node["spec"]["taints"]) == 2
    conds = [c for c in node["status"]["conditions"] if c["type"] == "VigilUnhealthy"]
    assert len(conds) == 1 and conds[0]["reason"] == "VigilRebootNode" and "d-second" in conds[0]["message"]
    assert fake.evicted == [] and not fake.of("GET", "/api/v1/pods")


async def test_pdb_429_is_a_retryable_delivery_error_and_the_retry_finishes_the_job(api) -> None:
    fake, url = api
    fake.pdb_protected.add("training/trainer-1")
    act = actuator(url)
    try:
        with pytest.raises(DeliveryError) as err:
            await deliver(act, dec(Action.DRAIN))
        assert err.value.retryable
        assert "training/trainer-1" in str(err.value) and "PodDisruptionBudget" in str(err.value)
        # The node is already out of scheduling and the unprotected pods are gone.
        assert fake.nodes[NODE]["spec"]["unschedulable"] is True
        assert sorted(fake.evicted) == ["eval/eval-0", "training/trainer-0"]
        assert len(fake.of("POST", "/eviction")) == 3

        # The budget allows it later (a replacement became healthy): the dispatcher's retry.
        fake.pdb_protected.clear()
        out = await deliver(act, dec(Action.DRAIN))
    finally:
        act.close()
    assert sorted(fake.evicted) == ["eval/eval-0", "training/trainer-0", "training/trainer-1"]
    # Pods already terminating are not asked again: exactly one more eviction request.
    assert len(fake.of("POST", "/eviction")) == 4
    assert "evicted 1 pod(s)" in out
    assert len(vigil_taints(fake.nodes[NODE])) == 1


async def test_resume_uncordons_removes_only_our_taint_and_clears_the_condition(api) -> None:
    fake, url = api
    act = actuator(url)
    try:
        await deliver(act, dec(Action.DRAIN))
        evictions = len(fake.of("POST", "/eviction"))
        out = await deliver(act, dec(Action.RESUME, id="d-resume"))
    finally:
        act.close()
    node = fake.nodes[NODE]
    assert "unschedulable" not in node["spec"]  # false is not serialised: schedulable again
    assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    cond = condition(node, "VigilUnhealthy")
    assert cond is not None and cond["status"] == "False" and "d-resume" in cond["message"]
    assert condition(node, "Ready") is not None and condition(node, "Ready")["status"] == "True"  # type: ignore[index]
    assert len(fake.of("POST", "/eviction")) == evictions  # resuming evicts nothing
    assert out == f"uncordoned {NODE}"


async def test_restart_job_evicts_only_the_pod_its_uid_names_on_that_node(api) -> None:
    fake, url = api
    job = f"pod/{pod_uid('training', 'trainer-0')}"
    act = actuator(url)
    try:
        out = await deliver(act, dec(Action.RESTART_JOB, job=job))
        again = await deliver(act, dec(Action.RESTART_JOB, job=job))  # delivered again after a crash
    finally:
        act.close()
    assert fake.evicted == ["training/trainer-0"]  # not trainer-1 (same job label), not gpu-node-8's trainer-2
    listing = fake.of("GET", "/api/v1/pods")[0]["query"]
    assert listing == {"fieldSelector": f"spec.nodeName={NODE}"}  # by node, never a name or label pattern
    eviction = fake.of("POST", "/eviction")[0]["body"]
    assert eviction["deleteOptions"]["preconditions"] == {"uid": pod_uid("training", "trainer-0")}
    node = fake.nodes[NODE]
    assert "unschedulable" not in node["spec"] and not vigil_taints(node)  # the node stays in service
    assert out == f"evicted pod training/trainer-0 (job {job}) on {NODE}"
    assert "already terminating" in again and len(fake.evicted) == 1


async def test_a_job_level_restart_evicts_the_pod_on_a_node_that_reported_it_and_nothing_else(api) -> None:
    # Issue 38: a job stopped everywhere names no node; its evidence lists the nodes that reported it.
    fake, url = api
    job = f"pod/{pod_uid('training', 'trainer-2')}"  # runs on gpu-node-8
    whole = Decision(id="d-job", ts=T0, node=None, job=job, action=Action.RESTART_JOB, reason="every rank stopped",
                     detector="hang", evidence={"job_nodes": [NODE, "gpu-node-8"]}, dry_run=False)
    elsewhere = whole.model_copy(update={"id": "d-else", "evidence": {"job_nodes": [NODE]}})
    act = actuator(url)
    try:
        out = await deliver(act, whole)
        with pytest.raises(DeliveryError, match="no pod with uid"):
            await deliver(act, elsewhere)
    finally:
        act.close()
    assert fake.evicted == ["training/trainer-2"]
    assert out == f"evicted pod training/trainer-2 (job {job}) on gpu-node-8"
    for node in fake.nodes.values():
        assert "unschedulable" not in node["spec"] and not vigil_taints(node)  # no node cordoned
    assert act.refusals["job_not_on_node"] == 1


UID0 = pod_uid("training", "trainer-0")


@pytest.mark.parametrize("job, refused, reason", [
    ("llm-7b", "not a pod identity", "job_not_a_pod"),  # a name: the old actuator evicted its label's pods
    ("pod/*", "not a pod identity", "job_not_a_pod"),
    ("pod/", "not a pod identity", "job_not_a_pod"),
    (f"pod/{UID0.upper()}", "not a pod identity", "job_not_a_pod"),
    (f"pod/{UID0},x", "not a pod identity", "job_not_a_pod"),
    (UID0, "not a pod identity", "job_not_a_pod"),  # a bare uid: the key says what it is
    (f"pod/{pod_uid('training', 'trainer-2')}", "no pod with uid", "job_not_on_node"),  # real, on gpu-node-8
])
async def test_restart_job_refuses_what_is_not_a_pod_on_that_node(api, job: str, refused: str, reason: str) -> None:
    fake, url = api
    act = actuator(url)
    try:
        with pytest.raises(DeliveryError, match=refused) as info:
            await deliver(act, dec(Action.RESTART_JOB, job=job))
    finally:
        act.close()
    assert info.value.retryable is False and act.refusals == Counter({reason: 1})
    assert fake.evicted == []
    if reason == "job_not_a_pod":
        assert not fake.of("GET", "/api/v1/pods")  # refused before the API server was asked anything


async def test_restart_job_leaves_a_pod_recreated_under_the_same_name(api) -> None:
    """The uid precondition: between the listing and the eviction the pod was replaced by one of
    the same name (another job's): the API server answers 409 and nothing is evicted."""
    fake, _ = api
    job = f"pod/{pod_uid('training', 'trainer-0')}"
    original = fake.evict

    async def replaced_then_evict(request: web.Request) -> web.Response:
        fake.pods[0]["metadata"]["uid"] = str(uuid.uuid4())
        return await original(request)

    fake.evict = replaced_then_evict  # type: ignore[method-assign]
    app = fake.app()  # routes bound to the replaced handler
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    act = actuator(f"http://127.0.0.1:{server.port}")
    try:
        with pytest.raises(DeliveryError, match="409") as info:
            await deliver(act, dec(Action.RESTART_JOB, job=job))
    finally:
        act.close()
        await server.close()
    assert info.value.retryable is False and fake.evicted == []


async def test_unknown_node_is_a_permanent_error(api) -> None:
    fake, url = api
    act = actuator(url)
    try:
        with pytest.raises(DeliveryError) as err:
            await deliver(act, dec(Action.DRAIN, node="no-such-node"))
    finally:
        act.close()
    assert not err.value.retryable and "404" in str(err.value) and 'nodes "no-such-node" not found' in str(err.value)
    assert not fake.of("PATCH") and not fake.evicted


async def test_api_server_errors_are_retryable(api) -> None:
    fake, url = api
    fake.fail_with = 503
    act = actuator(url)
    try:
        with pytest.raises(DeliveryError) as err:
            await deliver(act, dec(Action.DRAIN))
    finally:
        act.close()
    assert err.value.retryable and "503" in str(err.value)


async def test_an_unreachable_api_server_is_a_retryable_delivery_error() -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    act = actuator(f"http://127.0.0.1:{port}", timeout_seconds=2.0)
    try:
        with pytest.raises(DeliveryError) as err:
            await deliver(act, dec(Action.DRAIN))
    finally:
        act.close()
    assert err.value.retryable and "kubernetes" in str(err.value)


def test_handles_removing_actions_resume_and_restart_job_with_a_job_only() -> None:
    act = actuator("http://127.0.0.1:1")
    try:
        assert act.handles(dec(Action.DRAIN)) and act.handles(dec(Action.RESUME))
        assert act.handles(dec(Action.INSPECT_HARDWARE)) and act.handles(dec(Action.RESTART_JOB, job="j"))
        assert not act.handles(dec(Action.RESTART_JOB)) and not act.handles(dec(Action.ALERT))
        assert not act.handles(dec(Action.OBSERVE))
    finally:
        act.close()


async def test_a_name_that_is_not_one_node_never_reaches_the_api_server(api) -> None:
    fake, url = api
    act = actuator(url)
    for name in (f"{NODE},gpu-node-8", "gpu-node-[7-8]", f"{NODE}/status", ""):
        with pytest.raises(DeliveryError) as info:
            await deliver(act, dec(Action.DRAIN, node=name))
        assert info.value.retryable is False
    assert fake.requests == []


def node_events(fake: FakeApiServer, node: str = NODE) -> list[dict[str, Any]]:
    return [e for e in fake.events if e["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": node,
                                                               "uid": node}]


async def test_each_action_is_recorded_as_an_event_on_the_node(api) -> None:
    fake, url = api
    act = actuator(url)
    try:
        drained = await deliver(act, dec(Action.DRAIN, id="d-drain"))
        await deliver(act, dec(Action.RESUME, id="d-resume"))
        await deliver(act, dec(Action.RESTART_JOB, id="d-restart", job=f"pod/{pod_uid('training', 'trainer-1')}"))
    finally:
        act.close()
    events = node_events(fake)
    assert [(e["reason"], e["type"], e["action"]) for e in events] == [
        ("VigilDrain", "Normal", "drain"), ("VigilResume", "Normal", "resume"),
        ("VigilRestartJob", "Normal", "restart_job"),
    ]
    drain = events[0]
    assert drain["metadata"]["namespace"] == "default" and drain["metadata"]["name"].startswith(f"{NODE}.")
    assert "decision d-drain" in drain["message"] and "Xid 79: GPU has fallen off the bus" in drain["message"]
    assert "evicted 3 pod(s)" in drain["message"]
    assert drain["source"] == {"component": "vigil-aggregator"} and drain["reportingComponent"] == "vigil-aggregator"
    assert drain["count"] == 1 and drain["firstTimestamp"] == drain["lastTimestamp"]
    assert "decision d-resume" in events[1]["message"] and "decision d-restart" in events[2]["message"]
    assert len({e["metadata"]["name"] for e in events}) == 3  # one Event each, none overwritten
    assert drained == f"cordoned and tainted {NODE}, evicted 3 pod(s)"  # nothing to report about the Event
    assert act.events_not_recorded == 0
    assert fake.nodes["gpu-node-8"] == make_node("gpu-node-8") and not node_events(fake, "gpu-node-8")


async def test_a_failed_action_is_recorded_as_a_warning_and_still_fails(api) -> None:
    fake, url = api
    fake.pdb_protected.add("training/trainer-1")
    act = actuator(url)
    try:
        with pytest.raises(DeliveryError) as err:
            await deliver(act, dec(Action.DRAIN, id="d-held"))
        with pytest.raises(DeliveryError):
            await deliver(act, dec(Action.DRAIN, node="no-such-node", id="d-unknown"))
    finally:
        act.close()
    assert err.value.retryable  # the Event changes nothing about the outcome
    held, unknown = fake.events
    assert held["type"] == "Warning" and held["reason"] == "VigilActionFailed" and held["action"] == "drain"
    assert "decision d-held" in held["message"] and "training/trainer-1" in held["message"]
    assert "PodDisruptionBudget" in held["message"]
    assert unknown["involvedObject"]["name"] == "no-such-node" and "404" in unknown["message"]
    assert "decision d-unknown" in unknown["message"]


@pytest.mark.parametrize("code", [403, 500])
async def test_an_event_the_api_server_refuses_does_not_fail_the_action(api, code: int, caplog) -> None:
    fake, url = api
    fake.events_fail_with = code
    act = actuator(url)
    try:
        out = await deliver(act, dec(Action.DRAIN, id="d-drain"))
        # A failed action still raises its own error, not the Event's.
        fake.pdb_protected.add("training/trainer-1")
        fake.nodes[NODE] = make_node(NODE)
        for pod in fake.pods:
            pod["metadata"].pop("deletionTimestamp", None)
        with pytest.raises(DeliveryError) as err:
            await deliver(act, dec(Action.DRAIN, id="d-held"))
    finally:
        act.close()
    node = fake.nodes[NODE]
    assert node["spec"]["unschedulable"] is True and len(fake.evicted) == 5  # 3, then 2 of the 3 again
    assert out.startswith(f"cordoned and tainted {NODE}, evicted 3 pod(s) (Event not recorded: HTTP {code}")
    assert "PodDisruptionBudget" in str(err.value) and err.value.retryable
    assert fake.events == [] and act.events_not_recorded == 2
    warnings = [r for r in caplog.records if r.name == "vigil.aggregator.kubernetes"]
    assert len(warnings) == 2 and "d-drain" in warnings[0].getMessage() and "VigilDrain" in warnings[0].getMessage()


async def test_an_api_server_outage_fails_the_action_and_counts_the_lost_event(api) -> None:
    fake, url = api
    fake.fail_with = 503
    act = actuator(url)
    try:
        with pytest.raises(DeliveryError) as err:
            await deliver(act, dec(Action.DRAIN))
    finally:
        act.close()
    assert err.value.retryable and "503" in str(err.value) and "Event" not in str(err.value)
    assert act.events_not_recorded == 1
    assert [r["path"] for r in fake.of("POST")] == ["/api/v1/namespaces/default/events"]


# Reboots and GPU resets through the node's agent (outbox.FOLLOW_UPS): the actuator cordons and
# evicts; once that is delivered, the outbox holds a signed request for the node's agent.

MASTER = bytes(range(64, 96))


def _k8s_config(tmp_path: Any, url: str, **kube: Any) -> Any:
    from vigil.aggregator.config import parse_config

    key = tmp_path / "master.key"
    key.write_text(MASTER.hex() + "\n")
    return parse_config({
        "dry_run": False,
        "actuators": {"kubernetes": {"enabled": True, "api_url": url, "timeout_seconds": 5.0, **kube}},
        "node_actions": {"key_file": str(key), "request_ttl_seconds": 600}})


def _outbox_for(config: Any) -> Any:
    from tests.aggregator.conftest import FakeNode
    from vigil.aggregator.fleet import Fleet
    from vigil.aggregator.outbox import Outbox

    fleet = Fleet()
    fleet.ingest(FakeNode(NODE).report(T0), T0)
    return Outbox.from_config(config, fleet)


def _removal(action: Action, gpu: int | None = None, id: str = "d-remove") -> Decision:
    return Decision(id=id, ts=T0, node=NODE, action=action, reason="Xid 79: GPU has fallen off the bus",
                    detector="xid", gpu=gpu, dry_run=False)


@pytest.mark.parametrize("action, switch, gpu, node_action", [
    (Action.REBOOT_NODE, "reboot", None, "request_reboot"),
    (Action.RESET_GPU, "reset_gpu", 3, "reset_gpu")])
async def test_on_cordon_and_evict_then_a_signed_request_for_the_nodes_agent(
        api, tmp_path, action: Action, switch: str, gpu: int | None, node_action: str) -> None:
    from vigil.contract.node_actions import node_key, signature_ok

    fake, url = api
    config = _k8s_config(tmp_path, url, **{switch: True})
    box = _outbox_for(config)
    act = KubernetesActuator(config.actuators.kubernetes)
    decision = _removal(action, gpu)
    try:
        out = await deliver(act, decision)
    finally:
        act.close()
    node = fake.nodes[NODE]
    assert node["spec"]["unschedulable"] is True and vigil_taints(node)[0]["value"] == action.value
    assert sorted(fake.evicted) == ["eval/eval-0", "training/trainer-0", "training/trainer-1"]
    assert "the node's agent is asked" in out
    assert box.due(NODE, T0 + 1) == []  # nothing before the delivery is reported
    box.on_delivered("kubernetes", decision, T0 + 1)
    [request] = box.due(NODE, T0 + 2, f"boot-{NODE}-1")
    assert (request.id, request.action, request.node, request.boot_id) == \
        ("d-remove", node_action, NODE, f"boot-{NODE}-1")
    assert (request.gpu, request.gpu_uuid) == ((3, f"GPU-{NODE}-3") if gpu is not None else (None, None))
    assert signature_ok(request, node_key(MASTER, NODE))
    assert not signature_ok(request, node_key(MASTER, "gpu-node-8"))
    box.on_delivered("slurm", _removal(action, gpu, id="d-other"), T0 + 1)  # not a followed pair
    assert box.pending() == 1


@pytest.mark.parametrize("action, gpu", [(Action.REBOOT_NODE, None), (Action.RESET_GPU, 3)])
async def test_off_only_cordons_and_evicts(api, tmp_path, action: Action, gpu: int | None) -> None:
    fake, url = api
    config = _k8s_config(tmp_path, url)  # the key is there, both switches off (the default)
    assert not config.actuators.kubernetes.reboot and not config.actuators.kubernetes.reset_gpu
    box = _outbox_for(config)
    act = KubernetesActuator(config.actuators.kubernetes)
    decision = _removal(action, gpu)
    try:
        out = await deliver(act, decision)
    finally:
        act.close()
    assert out == f"cordoned and tainted {NODE}, evicted 3 pod(s)"
    assert fake.nodes[NODE]["spec"]["unschedulable"] is True and len(fake.evicted) == 3
    box.on_delivered("kubernetes", decision, T0 + 1)
    assert not box.enabled and box.pending() == 0 and box.due(NODE, T0 + 2) == []


def test_one_switch_on_follows_only_its_own_action(tmp_path) -> None:
    from vigil.aggregator.outbox import agent_resets_enabled, followed

    reboot = _k8s_config(tmp_path, "http://127.0.0.1:1", reboot=True)
    assert followed(reboot) == {("kubernetes", Action.REBOOT_NODE)} and not agent_resets_enabled(reboot)
    reset = _k8s_config(tmp_path, "http://127.0.0.1:1", reset_gpu=True)
    assert followed(reset) == {("kubernetes", Action.RESET_GPU)} and agent_resets_enabled(reset)
    box = _outbox_for(reboot)
    box.on_delivered("kubernetes", _removal(Action.RESET_GPU, 3), T0)
    assert box.pending() == 0


@pytest.mark.parametrize("kube, named", [
    ({"reboot": True}, "actuators.kubernetes.reboot needs"),
    ({"reset_gpu": True}, "actuators.kubernetes.reset_gpu needs"),
    ({"reboot": True, "reset_gpu": True}, "actuators.kubernetes.reset_gpu and actuators.kubernetes.reboot need")])
def test_a_switch_without_the_master_key_is_refused(kube: dict[str, Any], named: str) -> None:
    from vigil.aggregator.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=f"{named} node_actions.key_file"):
        parse_config({"actuators": {"kubernetes": {"enabled": True, **kube}}})


async def test_after_the_reboot_is_verified_resume_uncordons(api, tmp_path) -> None:
    """The agent's `done` for request_reboot is not the reboot: no resume until the new boot has
    been clean for the persistence period; then the resume uncordons the node."""
    from tests.aggregator.conftest import FakeNode
    from vigil.aggregator.detectors.recovery import RecoveryConfig, RecoveryDetector
    from vigil.aggregator.fleet import Fleet, Removal
    from vigil.contract.wire import NodeActionResult

    fake, url = api
    config = _k8s_config(tmp_path, url, reboot=True)
    fleet, node = Fleet(), FakeNode(NODE)
    fleet.ingest(node.report(T0), T0)
    from vigil.aggregator.outbox import Outbox

    box = Outbox.from_config(config, fleet)
    act = KubernetesActuator(config.actuators.kubernetes)
    decision = _removal(Action.REBOOT_NODE)
    removed = {NODE: Removal(Action.REBOOT_NODE, T0, decision.id, None, held=False)}
    detector = RecoveryDetector(RecoveryConfig(enabled=True, unverified_alert_seconds=1800))
    try:
        await deliver(act, decision)
        box.on_delivered("kubernetes", decision, T0 + 1)
        [request] = box.due(NODE, T0 + 2.5, node.boot_id)
        t = T0 + 5.0
        fleet.ingest(node.report(t), t)
        box.record(NODE, [NodeActionResult(id=request.id, action="request_reboot", outcome="done",
                                           reason="done", ts=t)], t)
        for _ in range(40):  # 100 s after the sentinel was written: kured has not rebooted it yet
            t += 2.5
            fleet.ingest(node.report(t), t)
        assert detector.evaluate(fleet.view(removed), t) == []  # done is not the reboot
        node.reboot()
        boot_at = t + 60.0
        t = boot_at
        for _ in range(30):  # 72.5 s clean in the new boot
            fleet.ingest(node.report(t), t)
            t += 2.5
        [finding] = detector.evaluate(fleet.view(removed), t - 2.5)
        assert finding.action is Action.RESUME and finding.evidence["new_boot"] is True
        assert finding.since == fleet.view().nodes[NODE].kernel_boot_started
        out = await deliver(act, Decision(id="d-resume", ts=t, node=NODE, action=Action.RESUME,
                                          reason=finding.reason, detector="recovery", dry_run=False))
    finally:
        act.close()
    assert out == f"uncordoned {NODE}"
    assert "unschedulable" not in fake.nodes[NODE]["spec"] and not vigil_taints(fake.nodes[NODE])


def test_a_failed_reboot_request_alerts_at_once() -> None:
    from tests.aggregator.conftest import FakeNode
    from vigil.aggregator.detectors.recovery import RecoveryConfig, RecoveryDetector
    from vigil.aggregator.fleet import Fleet, Removal
    from vigil.contract.wire import NodeActionRequest, NodeActionResult

    fleet, node = Fleet(), FakeNode(NODE)
    fleet.ingest(node.report(T0), T0)
    removed = {NODE: Removal(Action.REBOOT_NODE, T0, "d-remove", None, held=False)}
    detector = RecoveryDetector(RecoveryConfig(enabled=True))
    fleet.note_action_request(NodeActionRequest(id="d-remove", action="request_reboot", node=NODE,
                                                boot_id=node.boot_id, issued_at=T0, expires_at=T0 + 600))
    fleet.ingest(node.report(T0 + 2.5), T0 + 2.5)
    assert detector.evaluate(fleet.view(removed), T0 + 2.5) == []  # no result yet: waiting
    fleet.record_action_results(NODE, [NodeActionResult(
        id="d-remove", action="request_reboot", outcome="failed", reason="write_failed",
        detail="Read-only file system", ts=T0 + 3)], T0 + 5)
    [finding] = detector.evaluate(fleet.view(removed), T0 + 5)
    assert finding.action is Action.ALERT and finding.key == "reboot_request_failed"
    assert "failed write_failed" in finding.reason and finding.evidence["detail"] == "Read-only file system"


async def test_spare_nodes_are_ready_schedulable_nodes_with_the_pool_label(api) -> None:
    fake, url = api
    for name, ready, cordoned in (("spare-1", "True", False), ("spare-2", "True", True), ("spare-3", "False", False)):
        node = make_node(name)
        node["metadata"]["labels"]["vigil.io/spare"] = "true"
        node["spec"]["unschedulable"] = cordoned
        node["status"]["conditions"][0]["status"] = ready
        fake.nodes[name] = node
    act = actuator(url)
    try:
        spares = await asyncio.to_thread(act.spare_nodes, "vigil.io/spare=true")
    finally:
        act.close()
    # Cordoned (vigil's own drain, or a person's) and NotReady nodes are no spares; unlabelled ones neither.
    assert spares == ["spare-1"]
    assert fake.of("GET", "/api/v1/nodes")[0]["query"]["labelSelector"] == "vigil.io/spare=true"


async def test_hold_job_is_refused_for_good_and_touches_nothing(api) -> None:
    fake, url = api
    act = actuator(url)
    hold = Decision(id="h-0123456789abcdef01", ts=T0, node=None, action=Action.HOLD_JOB, reason="crash loop",
                    detector="crash_loop", job=f"pod/{pod_uid('training', 'trainer-0')}", dry_run=False,
                    evidence={"job_nodes": [NODE]})
    try:
        assert act.handles(hold)
        with pytest.raises(DeliveryError) as refused:
            await deliver(act, hold)
    finally:
        act.close()
    assert not refused.value.retryable and "spec.suspend" in str(refused.value)
    assert act.refusals["hold_not_supported"] == 1 and fake.requests == [] and fake.evicted == []
