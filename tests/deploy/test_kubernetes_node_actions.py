"""deploy/kubernetes/components/node-actions (overlay kured-reboots): the configs it ships parse
with the real models and turn the Kubernetes reboot and reset on; the agent gets its own node key
and the sentinel's directory, and kured's path agrees; the master key reaches the aggregator
only. And ``vigil aggregator --check`` names an unusable node_actions.key_file."""

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
from vigil.aggregator.decision import Action
from vigil.aggregator.outbox import followed

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "kured-reboots"
KUBECTL = shutil.which("kubectl")


def _built() -> dict[tuple[str, str], dict[str, Any]]:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(done.stdout) if d}


@pytest.mark.external
@pytest.mark.skipif(KUBECTL is None, reason="kubectl missing (Debian package kubernetes-client)")
def test_the_component_wires_keys_sentinel_and_switches() -> None:
    objs = _built()
    agent = parse_agent_config(yaml.safe_load(objs[("ConfigMap", "vigil-agent")]["data"]["agent.yml"]))
    aggregator = parse_aggregator_config(
        yaml.safe_load(objs[("ConfigMap", "vigil-aggregator")]["data"]["aggregator.yml"]))
    assert sorted(agent.node_actions.allow) == ["request_reboot", "reset_gpu"]
    assert followed(aggregator) == {("kubernetes", Action.REBOOT_NODE), ("kubernetes", Action.RESET_GPU)}
    assert aggregator.detectors.recovery.enabled and aggregator.dry_run  # the site flips dry_run

    ds = objs[("DaemonSet", "vigil-agent")]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in ds["containers"][0]["volumeMounts"]}
    host = {v["name"]: v["hostPath"] for v in ds["volumes"] if "hostPath" in v}
    # The node key: one file from the host, read-only, where the agent's config reads it.
    key_mount = mounts[agent.node_actions.key_file or ""]
    assert key_mount["readOnly"] and host[key_mount["name"]] == {"path": "/etc/vigil-agent/node.key", "type": "File"}
    # The sentinel: written in a directory of its own, mounted at the host's path (kured's flag).
    sentinel_dir = str(Path(agent.node_actions.reboot_sentinel_path).parent)
    assert host[mounts[sentinel_dir]["name"]]["path"] == sentinel_dir == "/run/vigil-reboot"
    assert not mounts[sentinel_dir].get("readOnly")
    assert {h["path"] for h in host.values()} == {"/sys", "/dev/kmsg", "/var/lib/vigil-agent", "/run/vigil",
                                                  "/run/vigil-reboot", "/etc/vigil-agent/node.key"}
    assert not any("secret" in v and v["secret"]["secretName"] == "vigil-node-action-master" for v in ds["volumes"])

    dep = objs[("Deployment", "vigil-aggregator")]["spec"]["template"]["spec"]
    master = next(v for v in dep["volumes"] if v["name"] == "node-action-master")
    assert master["secret"]["secretName"] == "vigil-node-action-master"
    mount = next(m for m in dep["containers"][0]["volumeMounts"] if m["name"] == "node-action-master")
    assert aggregator.node_actions.key_file == f"{mount['mountPath']}/master.key" and mount["readOnly"]


def _check(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vigil", "aggregator", "--config", str(config), "--check"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_check_names_an_unusable_master_key(tmp_path: Path) -> None:
    key = tmp_path / "master.key"
    config = tmp_path / "aggregator.yml"
    config.write_text(yaml.safe_dump({
        "store_path": str(tmp_path / "d.sqlite"), "node_actions": {"key_file": str(key)},
        # api_url: without it (and without a kubeconfig) the actuator cannot be built and --check says so.
        "actuators": {"kubernetes": {"enabled": True, "reboot": True, "api_url": "https://127.0.0.1:6443"}}}))
    missing = _check(config)
    assert missing.returncode == 2 and "node_actions.key_file: cannot read node action master key" in missing.stdout
    key.write_text("abcd\n")
    short = _check(config)
    assert short.returncode == 2 and "holds 2 bytes" in short.stdout
    key.write_text(bytes(range(32)).hex() + "\n")
    ok = _check(config)
    assert ok.returncode == 0 and "config OK" in ok.stdout, ok.stdout + ok.stderr
