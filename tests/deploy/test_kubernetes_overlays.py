"""Every shipped Kubernetes overlay, alone and with the prometheus-operator component, as `kubectl
kustomize` renders it: strictly valid (kubernetes-validate --strict for the built-in kinds; the
prometheus-operator CRDs' own openAPIV3Schema, unknown fields an error, for theirs), and
consistent with itself and with the documented install: every file a shipped config names is in a
volume mounted there that has that key, each Secret docs/kubernetes.md tells the operator to
create has exactly the keys the manifests read, and the agent holds its own node's projected token,
never a Secret. No real API server can be installed here (docs/kubernetes.md, "How the manifests
are validated")."""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from vigil.agent.config import parse_config as parse_agent_config
from vigil.aggregator.config import parse_config as parse_aggregator_config

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
PROMETHEUS_OPERATOR = KUBE / "components" / "prometheus-operator"
CRDS = ROOT / "tests" / "fixtures" / "prometheus-operator-crds"
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
DOCS = ROOT / "docs" / "kubernetes.md"
KUBECTL = shutil.which("kubectl")
KUBERNETES_VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
# Every overlay, and every overlay with the optional component (what a prometheus-operator site runs).
COMBINATIONS = [(o, c) for o in OVERLAYS for c in (False, True)]
# Where the kubelet mounts a pod's own API token unless automountServiceAccountToken is false.
SERVICE_ACCOUNT_DIR = PurePosixPath("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_ACCOUNT_KEYS = {"token", "ca.crt", "namespace"}
# Config keys naming a path the process writes (a file or socket it creates, a directory it fills).
WRITTEN = {"state_dir", "store_path", "unix_socket", "reboot_sentinel_path"}
# Paths the process reads from the container itself, not from a volume.
FROM_THE_CONTAINER = ("/proc/",)

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(KUBECTL is None, reason="kubectl missing (Debian package kubernetes-client)"),
]


@functools.cache
def render(overlay: str, with_prometheus_operator: bool) -> str:
    assert KUBECTL is not None
    target = KUBE / "overlays" / overlay
    if with_prometheus_operator:  # a site's overlay: the shipped one plus the component
        site = ROOT / "build" / "kustomize" / f"{overlay}+prometheus-operator"
        site.mkdir(parents=True, exist_ok=True)
        (site / "kustomization.yml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(target, site)],
            "components": [os.path.relpath(PROMETHEUS_OPERATOR, site)]}))
        target = site
    done = subprocess.run([KUBECTL, "kustomize", str(target)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def objects(overlay: str, with_prometheus_operator: bool = False) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(overlay, with_prometheus_operator)) if d]


def ids(combination: tuple[str, bool]) -> str:
    return combination[0] + ("+prometheus-operator" if combination[1] else "")


# --- strict validation -------------------------------------------------------------------------

@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(), reason="kubernetes-validate missing (pip install '.[test]')")
def test_every_combination_validates_strictly(tmp_path: Path) -> None:
    files = []
    for overlay, component in COMBINATIONS:
        path = tmp_path / f"{ids((overlay, component))}.yaml"
        path.write_text(render(overlay, component))
        files.append(path)
    done = subprocess.run([str(KUBERNETES_VALIDATE), "--strict", *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # The only kinds it has no schema for are prometheus-operator's, checked below with theirs.
    unschemaed = {m.group(1) for m in re.finditer(r"Couldn't find schema for kind (\w+)", out)}
    assert unschemaed == CRD_KINDS, out


def strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation: an object that
    lists its properties admits no other field (unless it says x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    for path in CRDS.glob("monitoring.coreos.com_*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            schema = strict(version["schema"]["openAPIV3Schema"])
            # metadata is the API server's ObjectMeta, not the CRD's to describe: the fields used here.
            schema["properties"]["metadata"] = {"type": "object", "additionalProperties": False, "properties": {
                "name": {"type": "string"}, "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
                "required": ["name"]}
            return jsonschema.Draft4Validator(schema)
    raise AssertionError(f"no CRD for {kind} in {CRDS}")


def crd_errors(document: dict[str, Any]) -> list[str]:
    assert document["apiVersion"] == "monitoring.coreos.com/v1"
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(document["kind"]).iter_errors(document)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_operator_objects_validate_against_their_crds(overlay: str) -> None:
    shipped = [d for d in objects(overlay, True) if d["kind"] in CRD_KINDS]
    assert {d["kind"] for d in shipped} == CRD_KINDS
    for document in shipped:
        assert crd_errors(document) == [], document["kind"]


@pytest.mark.parametrize("where", ["spec", "group", "rule"])
def test_an_unknown_field_in_a_prometheus_rule_is_rejected(where: str) -> None:
    (rule,) = [d for d in objects("default", True) if d["kind"] == "PrometheusRule"]
    assert crd_errors(rule) == []
    target = {"spec": rule["spec"], "group": rule["spec"]["groups"][0],
              "rule": rule["spec"]["groups"][0]["rules"][0]}[where]
    target["recordz"] = "typo"
    assert any("recordz" in e for e in crd_errors(rule))


def test_a_wrong_type_in_a_pod_monitor_is_rejected() -> None:
    (monitor,) = [d for d in objects("default", True) if d["kind"] == "PodMonitor"]
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = 15  # a duration is a string
    assert crd_errors(monitor)


def test_the_base_needs_no_crd_and_the_component_adds_them() -> None:
    for overlay in OVERLAYS:
        assert not {d["kind"] for d in objects(overlay)} & CRD_KINDS, overlay
        assert not [d for d in objects(overlay) if d["apiVersion"].startswith("monitoring.coreos.com/")]


# --- the PrometheusRule is rules/, unchanged ---------------------------------------------------

def test_the_committed_prometheus_rule_is_generated_from_rules() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "prometheus_rule.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (rule,) = [d for d in objects("default", True) if d["kind"] == "PrometheusRule"]
    groups = [g for name in ("vigil-recording.rules.yml", "vigil-alerts.rules.yml")
              for g in yaml.safe_load((ROOT / "rules" / name).read_text())["groups"]]
    assert rule["spec"]["groups"] == groups and any("alert" in r for g in groups for r in g["rules"])


def test_monitors_select_the_workloads_and_give_the_jobs_the_rules_match() -> None:
    by = {(d["kind"], d["metadata"]["name"]): d for d in objects("default", True)}
    ds, pm = by[("DaemonSet", "vigil-agent")], by[("PodMonitor", "vigil-agent")]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]
    sm, svc = by[("ServiceMonitor", "vigil-aggregator")], by[("Service", "vigil-aggregator")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # The rules' job matchers: the PodMonitor's job is its pods' jobLabel value, the
    # ServiceMonitor's the Service's name.
    rules = (ROOT / "rules" / "vigil-alerts.rules.yml").read_text()
    jobs = {pod_labels[pm["spec"]["jobLabel"]], svc["metadata"]["name"]}
    for pattern in re.findall(r'job=~"([^"]+)"', rules):
        assert any(re.fullmatch(pattern, job) for job in jobs), pattern


# --- what the manifests mount, the configs read and the docs create ----------------------------

def documented_secrets() -> dict[str, set[str]]:
    """`kubectl create secret generic NAME --from-file=... --from-literal=...` in docs/kubernetes.md's
    shell blocks: each Secret's name and keys."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S)
    secrets: dict[str, set[str]] = {}
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] != ["kubectl"] or "secret" not in words:
            continue
        name = words[words.index("generic") + 1]
        keys = set()
        for word in words:
            if word.startswith("--from-literal="):
                keys.add(word.removeprefix("--from-literal=").split("=", 1)[0])
            elif word.startswith("--from-file="):
                spec = word.removeprefix("--from-file=")
                keys.add(spec.split("=", 1)[0] if "=" in spec else PurePosixPath(spec).name)
        assert name not in secrets, f"{name} is created twice in {DOCS}"
        secrets[name] = keys
    return secrets


def commented_secrets() -> dict[str, set[str]]:
    """The same commands where a manifest's comment repeats them."""
    found: dict[str, set[str]] = {}
    for path in KUBE.rglob("*.y*ml"):
        comment = "\n".join(re.sub(r"^\s*#\s?", "", line) for line in path.read_text().splitlines()
                            if line.lstrip().startswith("#"))
        for match in re.finditer(r"kubectl (?:-n \S+ )?create secret generic (\S+)((?:[^\n]*\\\n)*[^\n]*)",
                                 comment):
            args = shlex.split(match.group(2).replace("\\\n", " "))
            found[match.group(1)] = {a.split("=", 2)[1] if a.startswith("--from-literal=")
                                     else PurePosixPath(a.removeprefix("--from-file=")).name for a in args}
    return found


def set_paths(node: Any, key: str = "") -> list[tuple[str, str]]:
    """(config key, absolute path) for every path an operator's config sets."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in set_paths(v, str(k))]
    if isinstance(node, list):
        return [p for v in node for p in set_paths(v, key)]
    if isinstance(node, str) and node.startswith("/") and not node.startswith(FROM_THE_CONTAINER):
        return [(key, node)]
    return []


def provided(path: str, writes: bool, pod: dict[str, Any], container: dict[str, Any],
             configmaps: dict[str, dict[str, Any]], secrets: dict[str, set[str]]) -> str | None:
    """None if the pod provides `path` (the key inside the volume mounted deepest above it), else why not."""
    target = PurePosixPath(path)
    mounts = [m for m in container["volumeMounts"]
              if target == PurePosixPath(m["mountPath"]) or PurePosixPath(m["mountPath"]) in target.parents]
    if not mounts:
        if target.parent == SERVICE_ACCOUNT_DIR and pod.get("automountServiceAccountToken") is not False:
            return None if target.name in SERVICE_ACCOUNT_KEYS else f"{path}: not in the pod's API token mount"
        return f"{path}: no volume is mounted there (the root filesystem is read-only)"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    key = str(target.relative_to(mount["mountPath"]))
    if writes:
        if mount.get("readOnly") or not {"hostPath", "persistentVolumeClaim", "emptyDir"} & volume.keys():
            return f"{path}: written, but its volume {mount['name']} is read-only"
        return None
    if "configMap" in volume:
        have = set(configmaps[volume["configMap"]["name"]].get("data", {}))
    elif "secret" in volume:
        name = volume["secret"]["secretName"]
        if name not in secrets:
            return f"{path}: Secret {name} is not created in {DOCS.name}"
        have = secrets[name]
    elif "projected" in volume:
        have = {src["serviceAccountToken"]["path"] for src in volume["projected"]["sources"]}
    elif "hostPath" in volume:  # the host provides one file (or device) at exactly this path
        kind = volume["hostPath"].get("type")
        return None if key == "." and kind in ("File", "CharDevice") else f"{path}: hostPath {kind} {key}"
    else:
        return f"{path}: volume {mount['name']} has no files of its own"
    return None if key in have else f"{path}: volume {mount['name']} has keys {sorted(have)}, not {key}"


def workloads(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(config key in the ConfigMap, pod spec, container) for the agent and the aggregator(s)."""
    out = []
    for d in docs:
        if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            pod = d["spec"]["template"]["spec"]
            for container in pod["containers"]:
                config = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--config="))
                out.append((config, pod, container))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_path_a_shipped_config_reads_is_mounted_with_that_key(overlay: str) -> None:
    docs = objects(overlay)
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    secrets = documented_secrets()
    read_keys: dict[str, set[str]] = {}
    checked = 0
    for config_path, pod, container in workloads(docs):
        mount = next(m for m in container["volumeMounts"]
                     if PurePosixPath(m["mountPath"]) == PurePosixPath(config_path).parent)
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        text = configmaps[volume["configMap"]["name"]]["data"][PurePosixPath(config_path).name]
        raw = yaml.safe_load(text)
        if container["args"][0] == "agent":
            parse_agent_config(raw)  # the real model takes it
        else:
            config = parse_aggregator_config(raw)
            if config.auth.kubernetes.enabled:  # its in-cluster defaults are read too
                raw.setdefault("_defaults", [config.auth.kubernetes.token_file, config.auth.kubernetes.ca_file])
        for key, path in set_paths(raw):
            why = provided(path, key in WRITTEN, pod, container, configmaps, secrets)
            assert why is None, f"{overlay}: {container['args'][0]} {key}: {why}"
            checked += 1
        for v in pod["volumes"]:
            if "secret" in v:  # which keys of each Secret a config reads
                mount_path = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == v["name"])
                read_keys.setdefault(v["secret"]["secretName"], set()).update(
                    str(PurePosixPath(p).relative_to(mount_path)) for _, p in set_paths(raw)
                    if PurePosixPath(mount_path) in PurePosixPath(p).parents)
    assert checked >= 10
    # Each Secret mounted here is documented with exactly the keys read: none missing, none unused.
    for name, keys in read_keys.items():
        assert secrets[name] == keys, (overlay, name)


def test_the_documented_secrets_are_the_ones_the_overlays_mount() -> None:
    secrets = documented_secrets()
    mounted = {v["secret"]["secretName"] for o in OVERLAYS for _, pod, _ in workloads(objects(o))
               for v in pod["volumes"] if "secret" in v}
    assert set(secrets) == mounted == {"vigil-token", "vigil-aggregator-postgres", "vigil-node-action-master"}
    # Where a manifest's comment repeats a command, it is the same command.
    for name, keys in commented_secrets().items():
        assert secrets[name] == keys, name


def test_the_path_check_catches_a_key_the_secret_does_not_have() -> None:
    """The lookalike of the issue's crash loop: a config naming a key no documented Secret has."""
    docs = objects("ha")
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    (_, pod, container) = next(w for w in workloads(docs) if w[2]["args"][0] == "aggregator")
    secrets = documented_secrets()
    assert provided("/etc/vigil/postgres/dsn", False, pod, container, configmaps, secrets) is None
    assert "not token" in str(provided("/etc/vigil/postgres/token", False, pod, container, configmaps, secrets))
    assert "no volume" in str(provided("/etc/vigil-missing/x", False, pod, container, configmaps, secrets))
    assert "read-only" in str(provided("/etc/vigil/state.db", True, pod, container, configmaps, secrets))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_agent_uses_its_own_projected_token_and_no_secret(overlay: str) -> None:
    (ds,) = [d for d in objects(overlay, True) if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert not [v for v in pod["volumes"] if "secret" in v]
    assert "envFrom" not in container and "secret" not in yaml.safe_dump(container.get("env", [])).lower()
    agent = parse_agent_config(yaml.safe_load(next(
        d for d in objects(overlay) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vigil-agent"
    )["data"]["agent.yml"]))
    token = PurePosixPath(agent.aggregator.token_file or "")
    mount = max((m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) in token.parents),
                key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["path"] == str(token.relative_to(mount["mountPath"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_keeps_the_agents_probes(overlay: str) -> None:
    (ds,) = [d for d in objects(overlay, True) if d["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    ports = {p["name"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz" and container[probe]["httpGet"]["port"] in ports
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60  # NVML init and the kmsg replay
