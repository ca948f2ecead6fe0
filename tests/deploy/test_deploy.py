"""deploy/: Kubernetes manifests (kubernetes-validate --strict; the overlays and the
prometheus-operator component: test_kubernetes_overlays.py), systemd units (systemd-analyze verify), Prometheus and
Alertmanager configs (promtool, amtool), and the example agent/aggregator configs (the real
config models)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vigil.agent.config import parse_config as parse_agent_config
from vigil.aggregator.config import parse_config as parse_aggregator_config
from vigil_heartbeat.client import DEFAULT_UNIX_PATH

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "kubernetes" / "base").glob("*.yaml"))
KUBERNETES_VALIDATE = Path(sys.executable).parent / "kubernetes-validate"


def documents() -> list[dict[str, Any]]:
    return [d for path in K8S for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.external
@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(), reason="kubernetes-validate missing (pip install '.[test]')")
def test_manifests_validate_strictly() -> None:
    done = run([str(KUBERNETES_VALIDATE), "--strict", *map(str, K8S)])
    assert done.returncode == 0, done.stdout + done.stderr
    # Every kind in the base has a schema: none is a CRD, so it applies on a cluster without
    # prometheus-operator (its objects: components/prometheus-operator, test_kubernetes_overlays.py).
    assert "Couldn't find schema" not in done.stdout + done.stderr


@pytest.mark.external
@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(), reason="kubernetes-validate missing (pip install '.[test]')")
def test_the_validator_rejects_an_unknown_field(tmp_path: Path) -> None:
    bad = yaml.safe_load((DEPLOY / "kubernetes" / "base" / "namespace.yaml").read_text())
    bad["spec"] = {"finalizerz": []}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert run([str(KUBERNETES_VALIDATE), "--strict", str(path)]).returncode != 0


def test_agent_daemonset_has_only_the_access_it_needs() -> None:
    ds = by_kind("DaemonSet")["vigil-agent"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["hostNetwork"] is True and pod["runtimeClassName"] == "nvidia"
    assert pod["automountServiceAccountToken"] is False
    # Watches every GPU without taking one from the scheduler.
    assert "nvidia.com/gpu" not in str(container.get("resources", {}))
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/host/sys"]["readOnly"] and mounts["/dev/kmsg"]["readOnly"]
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"/sys", "/dev/kmsg", "/var/lib/vigil-agent", "/run/vigil"}  # /run/vigil: heartbeats
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # privileged is there for /dev/kmsg alone, and the manifest says why.
    text = (DEPLOY / "kubernetes" / "base" / "agent-daemonset.yaml").read_text()
    assert container["securityContext"]["privileged"] is True and "device cgroup" in text
    assert "--node=$(NODE_NAME)" in container["args"] and "--sysfs-root=/host/sys" in container["args"]


def test_aggregator_rbac_can_cordon_and_evict_and_nothing_else() -> None:
    role = by_kind("ClusterRole")["vigil-aggregator"]
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    for need in [("nodes", "patch"), ("nodes/status", "patch"), ("pods", "list"), ("pods/eviction", "create"),
                 ("tokenreviews", "create"), ("pods", "get")]:  # the last two: agents' tokens (auth.kubernetes)
        assert need in granted
    assert not {v for _, v in granted} & {"delete", "*", "escalate", "bind", "impersonate"}
    assert not {r for r, _ in granted} & {"secrets", "*", "configmaps"}
    binding = by_kind("ClusterRoleBinding")["vigil-aggregator"]
    assert binding["subjects"][0]["name"] == by_kind("Deployment")["vigil-aggregator"]["spec"]["template"][
        "spec"]["serviceAccountName"]


def test_shipped_configs_parse_with_the_real_models() -> None:
    cms = by_kind("ConfigMap")
    agent_cm = parse_agent_config(yaml.safe_load(cms["vigil-agent"]["data"]["agent.yml"]))
    assert agent_cm.listen == "0.0.0.0:19400" and agent_cm.collectors.training.udp_listen == "127.0.0.1:9401"
    aggregator_cm = parse_aggregator_config(yaml.safe_load(cms["vigil-aggregator"]["data"]["aggregator.yml"]))
    assert aggregator_cm.dry_run is True and aggregator_cm.port == 9500
    agent = parse_agent_config(yaml.safe_load((DEPLOY / "config" / "agent.yml").read_text()))
    assert agent.aggregator.url and agent.nvml.backend == "nvml"
    assert agent.aggregator.url.startswith("https://") and agent.aggregator.ca_file
    aggregator = parse_aggregator_config(yaml.safe_load((DEPLOY / "config" / "aggregator.yml").read_text()))
    assert aggregator.dry_run is True
    # The agent pushes to the aggregator's Service on its port.
    svc_port = by_kind("Service")["vigil-aggregator"]["spec"]["ports"][0]["port"]
    assert agent_cm.aggregator.url == f"http://vigil-aggregator.vigil.svc:{svc_port}"


def test_deployed_agents_take_heartbeats_from_their_own_node_only() -> None:
    """/metrics on every address for Prometheus; heartbeats on loopback and a Unix socket that
    only the node's processes (or pods given the hostPath) can reach (issue 12 point 4)."""
    ds = by_kind("DaemonSet")["vigil-agent"]
    pod = ds["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    unit = (DEPLOY / "systemd" / "vigil-agent.service").read_text()
    configs = {
        "kubernetes": parse_agent_config(yaml.safe_load(by_kind("ConfigMap")["vigil-agent"]["data"]["agent.yml"])),
        "systemd": parse_agent_config(yaml.safe_load((DEPLOY / "config" / "agent.yml").read_text())),
    }
    for where, cfg in configs.items():
        training = cfg.collectors.training
        assert cfg.listen == "0.0.0.0:19400", where
        assert training.udp_listen == "127.0.0.1:9401", where
        assert training.unix_socket, where
    assert Path(configs["kubernetes"].collectors.training.unix_socket or "").parent == Path(mounts["heartbeat-socket"])
    assert "RuntimeDirectory=vigil\n" in unit
    # Both at the heartbeat client's default path (clients/heartbeat), so training code needs no setting.
    assert {c.collectors.training.unix_socket for c in configs.values()} == {DEFAULT_UNIX_PATH}
    assert not any(c.collectors.training.accept_unverified for c in configs.values())
    # No heartbeat port is published for the node's address.
    assert {p["containerPort"] for p in pod["containers"][0]["ports"]} == {19400}


def test_aggregator_unit_has_open_files_for_a_12500_node_fleet() -> None:
    text = (DEPLOY / "systemd" / "vigil-aggregator.service").read_text()
    (limit,) = [int(line.split("=", 1)[1]) for line in text.splitlines() if line.startswith("LimitNOFILE=")]
    assert limit >= 2 * 12_500 + 1_000  # a connection per agent, doubled across a reconnect, plus the rest
    for hardening in ("NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=", "PrivateDevices=yes"):
        assert hardening in text


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.external
@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze missing (apt-get install systemd)")
def test_systemd_units_verify(tmp_path: Path) -> None:
    # verify insists ExecStart exists: point it at this checkout's vigil instead of /opt/vigil.
    vigil = Path(sys.executable).parent / "vigil"
    units = []
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        path = tmp_path / unit.name
        path.write_text(unit.read_text().replace("/opt/vigil/bin/vigil", str(vigil)))
        units.append(str(path))
    done = run([str(SYSTEMD_ANALYZE), "verify", *units])
    # Unknown keys and bad values are warnings on stderr with rc 0, so stderr must be clean too.
    complaints = [line for line in done.stderr.splitlines() if "vigil-" in line]
    assert done.returncode == 0 and not complaints, done.stderr


def test_agent_unit_is_notify_with_a_watchdog() -> None:
    text = (DEPLOY / "systemd" / "vigil-agent.service").read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "NotifyAccess=main" in text


PROMTOOL = shutil.which("promtool")


@pytest.mark.external
@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")
@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-shard.yml", "prometheus-global.yml"])
def test_prometheus_configs_check(tmp_path: Path, name: str) -> None:
    # As installed: the config in /etc/prometheus, vigil's rules in /etc/prometheus/rules.
    shutil.copy(DEPLOY / "prometheus" / name, tmp_path / name)
    (tmp_path / "rules").mkdir()
    for rules in (ROOT / "rules").glob("*.rules.yml"):
        shutil.copy(rules, tmp_path / "rules" / rules.name)
    done = run([str(PROMTOOL), "check", "config", name], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    if name != "prometheus-global.yml":
        assert "vigil-alerts.rules.yml" in done.stdout


def test_scale_out_shards_and_writes_remotely() -> None:
    shard = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-shard.yml").read_text())
    relabel = shard["scrape_configs"][0]["relabel_configs"]
    assert any(r.get("action") == "hashmod" for r in relabel) and any(r.get("action") == "keep" for r in relabel)
    assert shard["remote_write"][0]["url"].endswith("/api/v1/write")
    fed = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-global.yml").read_text())
    assert fed["scrape_configs"][0]["metrics_path"] == "/federate"


AMTOOL = shutil.which("amtool")


@pytest.mark.external
@pytest.mark.skipif(AMTOOL is None, reason="amtool missing (apt-get install prometheus-alertmanager)")
def test_alertmanager_config_checks() -> None:
    done = run([str(AMTOOL), "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml")])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.external
@pytest.mark.skipif(AMTOOL is None, reason="amtool missing (apt-get install prometheus-alertmanager)")
def test_alertmanager_routes_actions_to_the_aggregator_and_tickets_to_people() -> None:
    config = str(DEPLOY / "alertmanager" / "alertmanager.yml")

    def receivers(*labels: str) -> str:
        return run([str(AMTOOL), "config", "routes", "test", f"--config.file={config}", *labels]).stdout.strip()

    assert receivers("alertname=VigilGpuLost", "severity=page", "vigil_action=drain", "node=n1") == \
        "vigil-aggregator,pager"
    assert receivers("alertname=VigilGpuPowerBrake", "severity=ticket", "node=n1") == "tickets"


@pytest.mark.external
@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")
def test_local_prometheus_config_loads_the_checkouts_rules() -> None:
    # The README's try-it config reads rules/ in place, relative to deploy/prometheus/.
    done = run([str(PROMTOOL), "check", "config", str(DEPLOY / "prometheus" / "prometheus-local.yml")])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vigil-alerts.rules.yml" in done.stdout and "vigil-recording.rules.yml" in done.stdout


KUBECTL = shutil.which("kubectl")
OVERLAYS = sorted(p for p in (DEPLOY / "kubernetes" / "overlays").iterdir() if p.is_dir())


@pytest.mark.external
@pytest.mark.skipif(KUBECTL is None, reason="kubectl missing (Debian package kubernetes-client)")
@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(), reason="kubernetes-validate missing (pip install '.[test]')")
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_each_overlay_builds_and_validates_strictly(tmp_path: Path, overlay: Path) -> None:
    assert KUBECTL is not None
    built = run([KUBECTL, "kustomize", str(overlay)])
    assert built.returncode == 0, built.stderr
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(built.stdout)
    done = run([str(KUBERNETES_VALIDATE), "--strict", str(rendered)])
    assert done.returncode == 0, done.stdout + done.stderr
    objects = [d for d in yaml.safe_load_all(built.stdout) if d]
    kinds = {d["kind"] for d in objects}
    assert {"DaemonSet", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert kinds & {"Deployment", "StatefulSet"}  # one aggregator, or the HA pair (overlays/ha)
    for d in objects:  # the recommended labels on every object
        labels = d["metadata"]["labels"] if d["kind"] != "Namespace" else d["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "vigil", d["metadata"]["name"]
        assert labels.get("app.kubernetes.io/version") and labels.get("app.kubernetes.io/managed-by") == "kustomize"
    images = {c["image"] for d in objects if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert len(images) == 1 and "example" not in next(iter(images))  # one image, set in one place


@pytest.mark.external
@pytest.mark.skipif(KUBECTL is None, reason="kubectl missing (Debian package kubernetes-client)")
def test_the_ha_overlay_runs_two_replicas_on_postgresql_with_agents_reporting_to_both() -> None:
    assert KUBECTL is not None
    built = run([KUBECTL, "kustomize", str(DEPLOY / "kubernetes" / "overlays" / "ha")])
    assert built.returncode == 0, built.stderr
    objects = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(built.stdout) if d}
    assert ("Deployment", "vigil-aggregator") not in objects  # no single-writer SQLite aggregator left
    pair = objects[("StatefulSet", "vigil-aggregator")]
    assert pair["spec"]["replicas"] == 2
    service = objects[("Service", pair["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"
    aggregator = parse_aggregator_config(yaml.safe_load(objects[("ConfigMap", "vigil-aggregator")]["data"]
                                                        ["aggregator.yml"]))
    assert aggregator.store.backend == "postgresql" and aggregator.store.dsn_file
    agent = parse_agent_config(yaml.safe_load(objects[("ConfigMap", "vigil-agent")]["data"]["agent.yml"]))
    names = [f"http://vigil-aggregator-{i}.{pair['spec']['serviceName']}.vigil.svc:9500" for i in range(2)]
    assert agent.aggregator.targets == names
    assert objects[("PodDisruptionBudget", "vigil-aggregator")]["spec"]["minAvailable"] == 1


def _agent_and_aggregator(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], Any, Any]:
    by = {(d["kind"], d["metadata"]["name"]): d for d in objects}
    pod = by[("DaemonSet", "vigil-agent")]["spec"]["template"]["spec"]
    agent = parse_agent_config(yaml.safe_load(by[("ConfigMap", "vigil-agent")]["data"]["agent.yml"]))
    aggregator = parse_aggregator_config(yaml.safe_load(by[("ConfigMap", "vigil-aggregator")]["data"]
                                                        ["aggregator.yml"]))
    return pod, agent, aggregator


@pytest.mark.external
@pytest.mark.skipif(KUBECTL is None, reason="kubectl missing (Debian package kubernetes-client)")
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_no_overlay_gives_the_agent_a_secret_only_its_own_projected_token(overlay: Path) -> None:
    """Each agent holds its own node's credential and nothing of the aggregator's (issue 37, 6): no
    Secret in any form, a projected token for the aggregator's audience, bound to the pod, of the
    service account the aggregator accepts, which has no rights in the Kubernetes API."""
    assert KUBECTL is not None
    built = run([KUBECTL, "kustomize", str(overlay)])
    assert built.returncode == 0, built.stderr
    objects = [d for d in yaml.safe_load_all(built.stdout) if d]
    pod, agent, aggregator = _agent_and_aggregator(objects)
    (container,) = pod["containers"]
    assert not [v for v in pod["volumes"] if "secret" in v]
    assert "secret" not in yaml.safe_dump(container.get("env", [])).lower() and "envFrom" not in container
    projected = [v for v in pod["volumes"] if "projected" in v]
    assert [list(src) for v in projected for src in v["projected"]["sources"]] == [["serviceAccountToken"]]
    (volume,) = projected
    (source,) = volume["projected"]["sources"]
    token = source["serviceAccountToken"]
    kube = aggregator.auth.kubernetes
    assert kube.enabled and aggregator.auth.site_secret_file is None  # no site secret to leak on Kubernetes
    assert token["audience"] == kube.audience and 600 <= token["expirationSeconds"] <= 3600
    assert not volume["projected"]["defaultMode"] & 0o077  # root only (the agent warns otherwise)
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert agent.aggregator.token_file == f"{mount['mountPath']}/{token['path']}" and mount["readOnly"]
    assert pod["serviceAccountName"] == kube.service_account and pod["automountServiceAccountToken"] is False
    ds_namespace = next(d for d in objects if d["kind"] == "DaemonSet")["metadata"]["namespace"]
    assert ds_namespace == kube.namespace
    # The agents' account is bound to nothing: its token is worth something to vigil only.
    subjects = [s for d in objects if d["kind"] in ("RoleBinding", "ClusterRoleBinding") for s in d["subjects"]]
    assert {"kind": "ServiceAccount", "name": kube.service_account, "namespace": kube.namespace} not in subjects
    assert ("ServiceAccount", kube.service_account) in {(d["kind"], d["metadata"]["name"]) for d in objects}
    # The aggregator's Secrets: never readable by others in its pod (it refuses such a file).
    for d in objects:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for v in d["spec"]["template"]["spec"]["volumes"]:
                if "secret" in v:
                    assert not v["secret"].get("defaultMode", 0o644) & 0o007, (d["metadata"]["name"], v)
