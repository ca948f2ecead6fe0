"""Kubernetes actuator: cordons, taints and marks a node, and evicts its pods, through the API server.

It reads the node's pods from the API server and acts with the official ``kubernetes`` client: a removing
action cordons, taints (``vigil.io/unhealthy``), sets the ``VigilUnhealthy`` condition and evicts; ``resume``
undoes it; ``restart_job`` evicts only the pod whose ``metadata.uid`` the job key names; each action is also
recorded as a Node Event. It decides nothing, refuses ``hold_job``, and never reboots or resets anything
itself (the outbox asks the agent) (docs/kubernetes.md, "Reboots and GPU resets" and "The actuator's other
actions"; docs/gate.md, "What the actuators verify before they act").
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import Field

from vigil.aggregator.actuators.actuator import ActuatorConfig, DeadlineExceeded, DeliveryError, job_nodes
from vigil.aggregator.decision import REMOVING_ACTIONS, Action, Decision

# 429: the eviction would violate a PodDisruptionBudget; 404: the pod is already gone
# (Kubernetes docs, "API-initiated Eviction").
PDB_BLOCKED, GONE = 429, 404

log = logging.getLogger("vigil.aggregator.kubernetes")

EVENT_COMPONENT = "vigil-aggregator"
# Node events live in "default": Nodes have no namespace, and the kubelet and node controller
# record theirs there (kubectl describe node lists events from every namespace).
EVENT_NAMESPACE = "default"
FAILED_REASON = "VigilActionFailed"
# An Event is a record, not the action: its request gets a short timeout of its own so that a slow
# events endpoint cannot push the delivery past the dispatcher's deadline (timeout_seconds).
EVENT_TIMEOUT_SECONDS = 2.0
# The API server's limit on an Event's message (k8s.io/api events validation: 1 kB for the note).
EVENT_MESSAGE_MAX_CHARS = 1024
# A Kubernetes job key: the pod's uid (metadata.uid, an RFC 4122 UUID the API server assigns).
POD_JOB = re.compile(r"pod/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
# Reasons a delivery was refused before anything was changed (the `refusals` counter).
REFUSAL_REASONS = ("job_not_a_pod", "job_not_on_node", "hold_not_supported")


class KubernetesConfig(ActuatorConfig):
    # None: in-cluster service account, or the kubeconfig when running outside a cluster.
    api_url: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    verify_tls: bool = True
    taint_key: str = "vigil.io/unhealthy"
    condition_type: str = "VigilUnhealthy"
    evict_pods: bool = True
    notify_in_dry_run: bool = False
    evict_timeout_seconds: float = Field(default=10.0, gt=0)
    # reboot_node: cordon and evict as always, then (once delivered) ask the node's agent to write
    # the reboot daemon's sentinel (kured --reboot-sentinel; agent node_actions.allow: [request_reboot]);
    # the recovery detector verifies the new boot and resume uncordons. Needs node_actions.key_file.
    # False: reboot_node only cordons and evicts, and the site reboots (docs/kubernetes.md).
    reboot: bool = False
    # reset_gpu: cordon and evict, then ask the node's agent to reset the GPU (signed request;
    # agent node_actions.allow: [reset_gpu]); resumed after the agent's `done` and a clean period.
    # Needs node_actions.key_file. False: reset_gpu only cordons and evicts.
    reset_gpu: bool = False


def _status_message(body: object) -> str:
    """The API server's own explanation from its Status body (": node \"x\" not found"), if any."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str) or not body:
        return ""
    try:
        message = json.loads(body).get("message", "")
    except (ValueError, AttributeError):
        return ""
    return f": {message}" if isinstance(message, str) and message else ""


def _now_iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _action_reason(decision: Decision) -> str:
    """``drain`` -> ``VigilDrain``, ``reset_gpu`` -> ``VigilResetGpu``: the node condition's and
    the Event's reason (CamelCase, as Kubernetes reasons are)."""
    return "Vigil" + "".join(p.title() for p in decision.action.value.split("_"))


class KubernetesActuator:
    name = "kubernetes"

    def __init__(self, config: KubernetesConfig, api_client: Any = None, *,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        from kubernetes import client  # optional dependency: loaded when used
        from kubernetes import config as kube_config

        self.config = config
        self.notify_in_dry_run = config.notify_in_dry_run
        self.timeout_seconds = config.timeout_seconds
        # One delivery's API calls share its total deadline (each call gets what is left of it);
        # deliveries run on several worker threads at once, hence per thread.
        self._monotonic = monotonic
        self._deadline = threading.local()
        from urllib3.exceptions import HTTPError as Urllib3Error  # the client's transport

        self._client = client
        self._urllib3_error = Urllib3Error
        # Events the API server did not take (the action itself was unaffected); deliveries run
        # in the dispatcher's threads, hence the lock.
        self.events_not_recorded = 0
        # reason -> deliveries refused before anything changed (REFUSAL_REASONS), same lock.
        self.refusals: Counter[str] = Counter(dict.fromkeys(REFUSAL_REASONS, 0))
        self._events_lock = threading.Lock()
        self._instance = socket.gethostname()
        if api_client is None:
            if config.api_url:
                conf = client.Configuration()
                conf.host = config.api_url
                conf.verify_ssl = config.verify_tls
                # The dispatcher owns retries (with backoff, across restarts); none inside a delivery.
                conf.retries = 0
                if config.ca_file:
                    conf.ssl_ca_cert = config.ca_file
                if config.token_file:
                    conf.api_key = {"authorization": "Bearer " + Path(config.token_file).read_text().strip()}
                api_client = client.ApiClient(conf)
            else:
                try:
                    kube_config.load_incluster_config()
                except kube_config.ConfigException:
                    kube_config.load_kube_config()
                api_client = client.ApiClient()
        # Any: the client's models type every field Optional; the API server fills the ones we read.
        self.api: Any = client.CoreV1Api(api_client)

    def handles(self, decision: Decision) -> bool:
        if decision.action in (Action.RESTART_JOB, Action.HOLD_JOB):
            return decision.job is not None
        return decision.action in REMOVING_ACTIONS or decision.action is Action.RESUME

    def deliver(self, decision: Decision) -> str:
        if decision.action is Action.HOLD_JOB:
            # A job key here is a pod; what restarts it (a Job, a JobSet, an operator) is not
            # vigil's to suspend safely. Refused, counted and dead-lettered; the page goes out
            # through Alertmanager or the webhook.
            raise self._refuse(decision, "hold_not_supported", "hold_job is not supported on Kubernetes: the "
                               "pod's controller restarts it; suspend its Job by hand (spec.suspend: true)")
        # One Node object per call, by its exact name; a job-level restart names none (job_nodes
        # checks each node it reads), and its Event is recorded on the node its pod ran on.
        try:
            where = job_nodes(decision)
        except DeliveryError as exc:
            if decision.node is not None:
                raise  # not a node name: refused as before, by one_node
            raise self._refuse(decision, "job_not_on_node", str(exc)) from None
        self._deadline.at = self._monotonic() + self.timeout_seconds
        try:
            done, node = self._act(decision, where)
        except DeliveryError as exc:
            if decision.node is not None:
                self._record_event(decision, decision.node, FAILED_REASON, "Warning",
                                   f"{decision.action.value} failed: {exc}")
            raise
        if node is None:
            return done
        not_recorded = self._record_event(decision, node, _action_reason(decision), "Normal", done)
        return done if not_recorded is None else f"{done} (Event not recorded: {not_recorded})"

    def _act(self, decision: Decision, where: list[str]) -> tuple[str, str | None]:
        """What was done, and the node to record its Event on (None: none, the job was not found)."""
        try:
            if decision.action is Action.RESTART_JOB:
                return self._evict_job(decision, where)
            node = where[0]
            if decision.action is Action.RESUME:
                self._mark(decision, unhealthy=False)
                return f"uncordoned {node}", node
            self._mark(decision, unhealthy=True)
            n = self._evict(node) if self.config.evict_pods else 0
            done = f"cordoned and tainted {node}, evicted {n} pod(s)"
            if decision.action is Action.REBOOT_NODE and self.config.reboot:
                return f"{done}; the node's agent is asked to request a reboot (reboot daemon's sentinel)", node
            if decision.action is Action.RESET_GPU and self.config.reset_gpu:
                return f"{done}; the node's agent is asked to reset GPU {decision.gpu}", node
            return done, node
        except self._client.ApiException as exc:
            raise DeliveryError(
                f"kubernetes: HTTP {exc.status} {exc.reason}{_status_message(exc.body)}",
                retryable=exc.status >= 500 or exc.status == 429,
            ) from exc
        except (self._urllib3_error, OSError) as exc:
            # Connection refused/reset and timeouts reach us as urllib3's MaxRetryError (not an OSError).
            raise DeliveryError(f"kubernetes: {exc}") from exc

    def _left(self, cap: float | None = None) -> float:
        """What is left of this delivery's total deadline (at most ``cap``), for the next API call.
        The client turns it into urllib3's ``Timeout(total=...)``, which bounds the connect and
        each read: a server trickling one answer can still hold a call past it, and then the
        dispatcher stops waiting at the deadline (aggregator/dispatch.py) and counts the stall."""
        at = getattr(self._deadline, "at", None)
        left = self.timeout_seconds if at is None else at - self._monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"kubernetes: the delivery's deadline of {self.timeout_seconds:g} s passed")
        return left if cap is None else min(cap, left)

    def _record_event(self, decision: Decision, node: str, reason: str, type_: str, outcome: str) -> str | None:
        """Records a core/v1 Event on ``node`` (the decision's, or where its job's pod ran); returns
        None, or why it could not (the caller's action stands either way: this never raises for an
        API or transport failure)."""
        c = self._client
        now = datetime.now(UTC)
        message = f"{outcome}; decision {decision.id} ({decision.detector}): {decision.reason}"
        event = c.CoreV1Event(
            # client-go's naming (<object>.<hex nanoseconds>): unique per attempt, so every retry
            # of a failing action is on the record too.
            metadata=c.V1ObjectMeta(name=f"{node}.{time.time_ns():x}", namespace=EVENT_NAMESPACE),
            # uid = the node's name, as the kubelet sets it for node events (kubectl describe node
            # looks events up by either the node's uid or its name).
            involved_object=c.V1ObjectReference(api_version="v1", kind="Node", name=node, uid=node),
            reason=reason,
            type=type_,
            action=decision.action.value,
            message=message[:EVENT_MESSAGE_MAX_CHARS],
            source=c.V1EventSource(component=EVENT_COMPONENT),
            reporting_component=EVENT_COMPONENT,
            reporting_instance=self._instance[:128],
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self.api.create_namespaced_event(
                EVENT_NAMESPACE, event, _request_timeout=min(EVENT_TIMEOUT_SECONDS, self.timeout_seconds)
            )
        except c.ApiException as exc:
            why = f"HTTP {exc.status} {exc.reason}{_status_message(exc.body)}"
        except (self._urllib3_error, OSError) as exc:
            why = str(exc)
        else:
            return None
        with self._events_lock:
            self.events_not_recorded += 1
        log.warning("kubernetes: could not record the %s Event on node %s for decision %s: %s",
                    reason, decision.node, decision.id, why)
        return why

    def close(self) -> None:
        self.api.api_client.close()

    def check(self) -> str:
        """The API server's ``/version``: reachable, and our credentials accepted."""
        try:
            info = self._client.VersionApi(self.api.api_client).get_code(_request_timeout=self.timeout_seconds)
        except self._client.ApiException as exc:
            raise DeliveryError(f"kubernetes: HTTP {exc.status} {exc.reason}{_status_message(exc.body)}") from exc
        except (self._urllib3_error, OSError) as exc:
            raise DeliveryError(f"kubernetes: {exc}") from exc
        return f"kubernetes API {getattr(info, 'git_version', '?')}"

    def spare_nodes(self, label: str) -> list[str]:
        """The spare pool: Ready, schedulable (not cordoned) nodes with ``label`` (key=value)."""
        self._deadline.at = self._monotonic() + self.timeout_seconds
        try:
            items = self.api.list_node(label_selector=label, _request_timeout=self._left()).items
        except self._client.ApiException as exc:
            raise DeliveryError(f"kubernetes: HTTP {exc.status} {exc.reason}{_status_message(exc.body)}") from exc
        except (self._urllib3_error, OSError) as exc:
            raise DeliveryError(f"kubernetes: {exc}") from exc
        out = []
        for node in items:
            if node.spec is not None and node.spec.unschedulable:
                continue
            conditions = (node.status.conditions if node.status is not None else None) or []
            if any(c.type == "Ready" and c.status == "True" for c in conditions):
                out.append(node.metadata.name)
        return sorted(out)

    def _mark(self, decision: Decision, unhealthy: bool) -> None:
        node = self.api.read_node(decision.node, _request_timeout=self._left())
        taints = [t for t in (node.spec.taints or []) if t.key != self.config.taint_key]
        body_taints = [{"key": t.key, "value": t.value, "effect": t.effect} for t in taints]
        if unhealthy:
            body_taints.append({"key": self.config.taint_key, "value": decision.action.value, "effect": "NoSchedule"})
        # Taints have no merge key: the whole list is written back, ours replaced, others kept.
        self.api.patch_node(
            decision.node,
            {"spec": {"unschedulable": unhealthy, "taints": body_taints}},
            _request_timeout=self._left(),
        )
        condition = {
            "type": self.config.condition_type,
            "status": "True" if unhealthy else "False",
            "reason": _action_reason(decision),
            "message": f"{decision.reason} (decision {decision.id})",
            "lastTransitionTime": _now_iso(decision.ts),
            "lastHeartbeatTime": _now_iso(decision.ts),
        }
        # Strategic merge on conditions (merge key "type") keeps the kubelet's own conditions.
        self.api.patch_node_status(
            decision.node,
            {"status": {"conditions": [condition]}},
            _content_type="application/strategic-merge-patch+json",
            _request_timeout=self._left(),
        )

    def _refuse(self, decision: Decision, reason: str, message: str) -> DeliveryError:
        """A permanent DeliveryError for ``decision``, counted under ``reason`` and logged."""
        with self._events_lock:
            self.refusals[reason] += 1
        log.error("kubernetes: refusing %s %s on %s (%s): %s", decision.action.value, decision.id, decision.subject,
                  reason, message)
        return DeliveryError(message, retryable=False)

    def _pods_on(self, node: str) -> list[Any]:
        return list(self.api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _request_timeout=self._left()).items)

    def _evict_job(self, decision: Decision, where: list[str]) -> tuple[str, str]:
        """Evict the one pod ``decision.job`` names (``pod/<uid>``), if it runs on one of ``where``
        (the decision's node, or a job-level decision's job_nodes); returns what was done and where."""
        job = decision.job or ""
        key = POD_JOB.fullmatch(job)
        if key is None:
            raise self._refuse(decision, "job_not_a_pod",
                               f"job {job[:80]!r} is not a pod identity (pod/<uid>); only a pod is evicted")
        uid = key.group(1)
        found = next(((node, p) for node in where for p in self._pods_on(node) if p.metadata.uid == uid), None)
        if found is None:
            raise self._refuse(decision, "job_not_on_node",
                               f"no pod with uid {uid} on {', '.join(where)}; nothing evicted")
        node, pod = found
        meta = pod.metadata
        if meta.deletion_timestamp is not None:  # evicted by an earlier delivery, or leaving anyway
            return f"pod {meta.namespace}/{meta.name} (job {job}) on {node} is already terminating", node
        if not self._evict_pods(node, [pod], uid_precondition=True):
            return f"pod {meta.namespace}/{meta.name} (job {job}) on {node} is already gone", node
        return f"evicted pod {meta.namespace}/{meta.name} (job {job}) on {node}", node

    def _evict(self, node: str) -> int:
        """Evict every pod on ``node`` but DaemonSet and mirror pods and those already leaving."""
        pods = []
        for pod in self._pods_on(node):
            meta = pod.metadata
            if meta.deletion_timestamp is not None:
                continue
            if any(ref.kind == "DaemonSet" for ref in meta.owner_references or []):
                continue  # the DaemonSet controller would put it straight back
            if "kubernetes.io/config.mirror" in (meta.annotations or {}):
                continue  # static pods are the kubelet's, not the API server's
            pods.append(pod)
        return self._evict_pods(node, pods)

    def _evict_pods(self, node: str, pods: list[Any], uid_precondition: bool = False) -> int:
        """Ask for an Eviction of each pod; ``uid_precondition``: only of that very pod (its uid),
        not of one created since under the same name. Returns how many were evicted."""
        blocked, evicted = [], 0
        for pod in pods:
            meta = pod.metadata
            # apiVersion and kind as kubectl drain sends them: policy/v1 is the served version
            # since Kubernetes 1.22 (policy/v1beta1 was removed in 1.25).
            eviction = self._client.V1Eviction(
                api_version="policy/v1",
                kind="Eviction",
                metadata=self._client.V1ObjectMeta(name=meta.name, namespace=meta.namespace),
                delete_options=self._client.V1DeleteOptions(
                    preconditions=self._client.V1Preconditions(uid=meta.uid)) if uid_precondition else None,
            )
            try:
                self.api.create_namespaced_pod_eviction(
                    meta.name, meta.namespace, eviction, _request_timeout=self._left(self.config.evict_timeout_seconds)
                )
                evicted += 1
            except self._client.ApiException as exc:
                if exc.status == GONE:
                    continue
                if exc.status == PDB_BLOCKED:
                    blocked.append(f"{meta.namespace}/{meta.name}")
                    continue
                raise
        if blocked:
            raise DeliveryError(
                f"kubernetes: {len(blocked)} pod(s) on {node} held by a PodDisruptionBudget: {', '.join(blocked)}"
                f" ({evicted} evicted); will retry",
                retryable=True,
            )
        return evicted


def build(config: KubernetesConfig) -> KubernetesActuator:
    return KubernetesActuator(config)
