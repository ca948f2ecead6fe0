"""Kubernetes names (namespace, pod, container) of a container, from its OCI runtime bundle.

The container runtime writes each container's bundle ``config.json`` with the CRI annotations the
kubelet passed it: containerd's CRI plugin ``io.kubernetes.cri.sandbox-namespace``, ``-name``,
``-uid`` and ``io.kubernetes.cri.container-name`` (/run/containerd/io.containerd.runtime.v2.task/
k8s.io/<id>/config.json); CRI-O ``io.kubernetes.pod.namespace``, ``.name``, ``.uid`` and
``io.kubernetes.container.name`` (/run/containers/storage/overlay-containers/<id>/userdata/
config.json). ``BundlePodNames`` is attribution's ``PodResolver``: given the pod uid and container
id the process's cgroup names (the kernel's word, not the pod's), it reads that container's bundle
and answers its names only where the bundle's pod uid is the cgroup's. It asks no API server and
decides nothing; dcgm-exporter gets the same names from the kubelet's pod-resources socket.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from vigil.agent.attribution import PodNames

log = logging.getLogger(__name__)

# Where containerd's runc shim (v2) and CRI-O keep a running container's bundle; {id} is the
# 64-hex container id of the process's cgroup.
BUNDLE_TEMPLATES = ("/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
                    "/run/containers/storage/overlay-containers/{id}/userdata/config.json")
# (pod uid, namespace, pod, container) annotation keys: containerd's CRI plugin
# (internal/cri/annotations), then CRI-O's (kubelet's annotation names).
_ANNOTATIONS = (("io.kubernetes.cri.sandbox-uid", "io.kubernetes.cri.sandbox-namespace",
                 "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name"),
                ("io.kubernetes.pod.uid", "io.kubernetes.pod.namespace", "io.kubernetes.pod.name",
                 "io.kubernetes.container.name"))
# An OCI config.json is 5-30 KB; a bound keeps a broken one cheap.
MAX_BUNDLE_BYTES = 1 << 20
# Kubernetes names: a DNS-1123 label or subdomain, at most 253 characters. Anything else is not a
# name the kubelet gave and is not served as a label.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")


class BundlePodNames:
    """``PodResolver`` over the runtime bundles at ``templates``; a container's names are cached
    by (pod uid, container id) (they never change for it), at most ``max_entries``."""

    def __init__(self, templates: Sequence[str] = BUNDLE_TEMPLATES, *, max_entries: int = 1024) -> None:
        self._templates = tuple(templates)
        self._max = max_entries
        self._cache: OrderedDict[tuple[str, str], PodNames] = OrderedDict()

    def __call__(self, pod_uid: str, container_id: str | None) -> PodNames | None:
        if container_id is None or not _CONTAINER_ID.fullmatch(container_id):
            return None
        key = (pod_uid, container_id)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        for template in self._templates:
            names = _names(Path(template.format(id=container_id)), pod_uid)
            if names is not None:
                self._cache[key] = names
                if len(self._cache) > self._max:
                    self._cache.popitem(last=False)
                return names
        return None


def _names(path: Path, pod_uid: str) -> PodNames | None:
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_BUNDLE_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_BUNDLE_BYTES:
        log.debug("runtime bundle %s is over %d bytes: ignored", path, MAX_BUNDLE_BYTES)
        return None
    try:
        annotations = json.loads(raw).get("annotations")
    except (ValueError, AttributeError):
        return None
    if not isinstance(annotations, dict):
        return None
    for uid_key, namespace_key, pod_key, container_key in _ANNOTATIONS:
        if uid_key not in annotations:
            continue
        if annotations[uid_key] != pod_uid:  # another pod's bundle: its names are not this process's
            return None
        values = [annotations.get(k) for k in (namespace_key, pod_key, container_key)]
        if not all(isinstance(v, str) and _NAME.fullmatch(v) for v in values):
            return None
        namespace, pod, container = values
        assert isinstance(namespace, str) and isinstance(pod, str) and isinstance(container, str)
        return PodNames(namespace=namespace, pod=pod, container=container)
    return None
