"""The container image (Containerfile, built by scripts/build-image.sh with buildah, no registry):
``vigil --version`` runs in it, as a non-root user, and the fake-backend agent inside serves
/metrics that the host scrapes. Each component starts in it with its shipped Kubernetes config
(rendered by kubectl kustomize; only what the host lacks is adapted: ports, the API server's
address, the fake NVML): the Kubernetes actuator's client imports and the kured-reboots
aggregator config passes ``--check``; the ha overlay's aggregator reaches a real PostgreSQL; the
agent, with the DaemonSet's config, authenticates with its own node's projected token (a fake
TokenReview API on loopback) and is accepted for its node, refused for another. One container
serves all (buildah runs with host networking, so loopback is shared).

A cold build takes about 3 min on 2 shared cores (measured 175-177 s, of which the Debian base
by debootstrap 1 min 54 s to 2 min 32 s; 40 s with the base already built), so `make test` and
`make test-all` start it in the background before pytest (``scripts/build-image.sh
--background``: niced, bounded by ``timeout 900``, log in build/image.log) and name its status
file in ``VIGIL_IMAGE_BUILD_STATUS``; these tests run last (tests/deploy/conftest.py) and wait
for that file, with a deadline, while the rest of the suite has kept the other core busy. Run
directly (``pytest tests/deploy/test_image.py``, no such variable) the fixture builds the image
itself, as before. A failed or overdue build fails these tests (an error, never a skip); they
skip only without buildah, debootstrap or root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import postgres
from tests.aggregator.fake_kubernetes import FakeKubernetes
from tests.aggregator.test_tls import self_signed
from tests.deploy.test_kubernetes_overlays import KUBECTL, objects
from tests.loopback import free_port
from vigil.contract.version import __version__
from vigil.contract.wire import Report, encode

REPO = Path(__file__).resolve().parents[2]
BUILDAH = shutil.which("buildah")
STORAGE = ["--storage-driver", os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")]
# VIGIL_IMAGE: another tag (a helper's own build beside the shared one); scripts/build-image.sh's IMAGE.
IMAGE = os.environ.get("VIGIL_IMAGE", f"localhost/vigil:{__version__}")
UID = 65532  # the image's USER
BUILD_TIMEOUT_S = 900  # scripts/build-image.sh's own bound, for the build started here
# Set by `make test`: the file scripts/build-image.sh --background writes the build's exit status to.
STATUS_ENV = "VIGIL_IMAGE_BUILD_STATUS"
# The background build ends within 900 s + 30 s (timeout -k 30) of its start, which came before pytest's.
WAIT_DEADLINE_S = 960

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(BUILDAH is None or shutil.which("debootstrap") is None,
                       reason="buildah and debootstrap missing (scripts/ensure-system-packages.sh)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the Debian base is built with debootstrap, which needs root"),
    pytest.mark.skipif(KUBECTL is None, reason="kubectl missing (the shipped configs are rendered with it)"),
]


def _build_here() -> None:
    subprocess.run([str(REPO / "scripts" / "build-image.sh")], cwd=REPO, check=True, timeout=BUILD_TIMEOUT_S,
                   env={**os.environ, "PYTHON": str(REPO / ".venv" / "bin" / "python"), "IMAGE": IMAGE})


def _wait_for_background_build(status: Path) -> None:
    """Waits for the build `make` started; a failed, missing or overdue build fails the test."""
    log = status.parent / "image.log"

    def tail() -> str:
        return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else "(no log)"

    if not status.exists() and not (status.parent / "image.pid").exists():
        pytest.fail(f"{STATUS_ENV}={status} but no background build was started:\n{tail()}")
    deadline = time.monotonic() + WAIT_DEADLINE_S
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the background image build wrote no {status} within {WAIT_DEADLINE_S} s:\n{tail()}")
        time.sleep(1.0)
    rc = status.read_text().strip()
    if rc.startswith("skip:"):  # no Debian mirror reachable: the only environment reason not to build
        pytest.skip(rc.removeprefix("skip:").strip())
    if rc != "0":
        pytest.fail(f"scripts/build-image.sh --background failed (exit status {rc}; 124: timed out):\n{tail()}")


@pytest.fixture(scope="module")
def container() -> Iterator[str]:
    assert BUILDAH is not None
    status = os.environ.get(STATUS_ENV)
    if status:
        _wait_for_background_build(REPO / status)  # an absolute path stays as it is
    else:
        _build_here()
    name = subprocess.run([BUILDAH, *STORAGE, "from", IMAGE], check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()
    yield name
    subprocess.run([BUILDAH, *STORAGE, "rm", name], capture_output=True, timeout=120)


def _run(name: str, *argv: str, volumes: dict[Path, str] | None = None,
         env: dict[str, str] | None = None) -> list[str]:
    assert BUILDAH is not None
    binds = [f"--volume={host}:{inside}" for host, inside in (volumes or {}).items()]
    envs = [f"--env={key}={value}" for key, value in (env or {}).items()]
    return [BUILDAH, *STORAGE, "run", "--isolation", "chroot", *binds, *envs, name, "--", *argv]


def test_version_runs_as_non_root(container: str) -> None:
    out = subprocess.run(_run(container, "vigil", "--version"), capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == f"vigil {__version__}", out.stderr
    ident = subprocess.run(_run(container, "id", "-u"), capture_output=True, text=True, timeout=120)
    assert ident.stdout.strip() == "65532"


def test_fake_agent_inside_serves_metrics_to_the_host(container: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "agent.log"
    with log.open("w") as err, subprocess.Popen(
            _run(container, "vigil", "agent", "--backend", "fake", "--node", "in-image",
                 "--listen", f"127.0.0.1:{port}", "--heartbeat-listen", f"127.0.0.1:{free_port()}"),
            stdout=err, stderr=err) as proc:
        try:
            body, deadline = "", time.monotonic() + 60
            while "vigil_gpu_info" not in body and time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                        body = resp.read().decode()
                except OSError:
                    pass  # not listening yet
                time.sleep(0.25)
            assert "vigil_gpu_info" in body, log.read_text()
            assert 'vigil_build_info{component="agent",python="3.11' in body
        finally:
            proc.terminate()  # buildah stops the process it runs when it is stopped
            proc.wait(timeout=30)


def _shipped(overlay: str, configmap: str, key: str) -> dict[str, Any]:
    """A config as the overlay ships it (kubectl kustomize), parsed."""
    (cm,) = [d for d in objects(overlay) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == configmap]
    loaded: dict[str, Any] = yaml.safe_load(cm["data"][key])
    return loaded


def _own(path: Path, text: str | None = None, mode: int = 0o400) -> Path:
    """A file (or, text None, a directory) owned by the image's user, as kubelet's volumes are to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if text is None:
        path.mkdir(exist_ok=True)
        mode = 0o755
    else:
        path.write_text(text)
    os.chown(path, UID, UID)
    path.chmod(mode)
    return path


def _aggregator_tree(root: Path, config: dict[str, Any]) -> dict[Path, str]:
    """/etc/vigil as the aggregator's pod has it: the ConfigMap's file and the vigil-token Secret's keys."""
    etc = _own(root / "etc-vigil")
    _own(etc / "aggregator.yml", yaml.safe_dump(config), 0o444)
    _own(etc / "token")
    for name in ("alertmanager", "operator", "read"):  # docs/kubernetes.md "Install": vigil-token
        _own(etc / "token" / f"{name}.token", f"{name}-{'x' * 40}\n", 0o440)
    return {etc: "/etc/vigil"}


def test_the_kubernetes_actuator_imports_and_the_kured_config_checks(container: str, tmp_path: Path) -> None:
    out = subprocess.run(_run(container, "python3", "-c", "from kubernetes import client, config; import psycopg; "
                              "import grpc; import vigil.aggregator.actuators.kubernetes"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The kured-reboots overlay's aggregator config, unchanged, with its Secrets and in-cluster token.
    config = _shipped("kured-reboots", "vigil-aggregator", "aggregator.yml")
    assert config["actuators"]["kubernetes"]["enabled"] is True
    volumes = _aggregator_tree(tmp_path, config)
    master = _own(tmp_path / "master")
    _own(master / "master.key", "ab" * 32 + "\n")  # vigil token master-key's form: 64 hex digits
    account = _own(tmp_path / "serviceaccount")
    _own(account / "token", "aggregator-api-token\n")
    ca, _ = self_signed(tmp_path)  # the cluster's CA, as kubelet projects it (the clients load it at start)
    _own(account / "ca.crt", ca.read_text(), 0o444)
    _own(tmp_path / "store")
    volumes |= {master: "/etc/vigil-master", account: "/run/secrets/kubernetes.io/serviceaccount",
                tmp_path / "store": "/var/lib/vigil-aggregator"}
    # In a pod, kubelet sets these; the check builds the clients (nothing is asked of the API server).
    in_pod = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(free_port())}
    check = subprocess.run(_run(container, "vigil", "aggregator", "--config", "/etc/vigil/aggregator.yml", "--check",
                                volumes=volumes, env=in_pod), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def _get(url: str, token: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.skipif(postgres.skip_reason() is not None, reason=str(postgres.skip_reason()))
def test_ha_aggregator_on_postgresql_takes_the_agents_report_for_its_own_node_only(
        container: str, tmp_path: Path) -> None:
    kube = FakeKubernetes()
    server = postgres.PostgresServer()
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    node = "gpu-node-7"
    try:
        # The ha overlay's aggregator config; adapted: a free loopback port (host networking) and
        # the fake API server's http address (in a pod: https://$KUBERNETES_SERVICE_HOST, its CA).
        config = _shipped("ha", "vigil-aggregator", "aggregator.yml")
        assert config["store"] == {"backend": "postgresql", "dsn_file": "/etc/vigil/postgres/dsn"}
        port = free_port()
        config["listen"] = f"127.0.0.1:{port}"
        config["auth"]["kubernetes"] |= {"api_url": kube.url, "ca_file": None}
        volumes = _aggregator_tree(tmp_path, config)
        _own(tmp_path / "etc-vigil" / "postgres")
        _own(tmp_path / "etc-vigil" / "postgres" / "dsn", server.dsn + "\n")  # vigil-aggregator-postgres: dsn
        account = _own(tmp_path / "serviceaccount")
        _own(account / "token", kube.aggregator_token + "\n")
        # Debian's /var/run is a link to /run, which buildah's bind would not follow.
        volumes[account] = "/run/secrets/kubernetes.io/serviceaccount"
        log = (tmp_path / "aggregator.log").open("wb")
        logs.append(log)
        procs.append(subprocess.Popen(_run(container, "vigil", "aggregator", "--config", "/etc/vigil/aggregator.yml",
                                           volumes=volumes), stdout=log, stderr=subprocess.STDOUT))
        url, read = f"http://127.0.0.1:{port}", (tmp_path / "etc-vigil" / "token" / "read.token").read_text().strip()

        def wait(what: str, check: Any, timeout_s: float = 60) -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                assert all(p.poll() is None for p in procs), (tmp_path / "aggregator.log").read_text()[-3000:]
                try:
                    if check():
                        return
                except (OSError, ValueError):
                    pass  # not listening yet
                time.sleep(0.25)
            pytest.fail(f"{what}: not within {timeout_s} s\n" + (tmp_path / "aggregator.log").read_text()[-3000:])

        wait("the HA aggregator up", lambda: _get(f"{url}/healthz", read)["status"] == "ok")
        tables = server.psql("SELECT tablename FROM pg_tables WHERE schemaname = 'public'", dbname="vigil").split()
        assert {"decisions", "nodes"} <= set(tables)  # it reached PostgreSQL and made its store there

        # The DaemonSet's agent config (ha: it reports to every replica; here the one running), its
        # token where the projected volume puts it. Adapted: fake NVML, free loopback ports, and the
        # kernel log from a file (the host's /dev/kmsg is not this test's).
        agent = _shipped("ha", "vigil-agent", "agent.yml")
        assert agent["aggregator"]["token_file"] == "/etc/vigil/token/token"
        agent["aggregator"] = {**agent["aggregator"], "urls": [url], "interval_seconds": 0.5}
        agent["listen"] = f"127.0.0.1:{free_port()}"
        agent["collectors"]["training"]["udp_listen"] = f"127.0.0.1:{free_port()}"
        agent["collectors"]["xid"] = {"source": "file", "path": "/var/log/kern.log"}
        etc = _own(tmp_path / "etc-vigil-agent")
        _own(etc / "agent.yml", yaml.safe_dump(agent), 0o444)
        _own(etc / "token")
        token = kube.mint(node)
        _own(etc / "token" / "token", token)
        for name in ("state", "run"):
            _own(tmp_path / name)
        _own(tmp_path / "kern.log", "", 0o444)
        agent_log = (tmp_path / "agent.log").open("wb")
        logs.append(agent_log)
        procs.append(subprocess.Popen(_run(
            container, "vigil", "agent", "--config=/etc/vigil/agent.yml", f"--node={node}", "--backend", "fake",
            volumes={etc: "/etc/vigil", tmp_path / "state": "/var/lib/vigil-agent", tmp_path / "run": "/run/vigil",
                     tmp_path / "kern.log": "/var/log/kern.log"}), stdout=agent_log, stderr=subprocess.STDOUT))
        wait("the agent's report accepted for its node",
             lambda: node in {n["node"] for n in _get(f"{url}/v1/nodes", read)["nodes"]})
        assert token in kube.reviews

        # The same credential naming another node: refused.
        body = encode(Report(node="gpu-node-8", boot_id="b", seq=1, ts=time.time(), interval_seconds=2.5))
        request = urllib.request.Request(f"{url}/v1/reports", data=body, method="POST",
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 403 and json.loads(refused.value.read())["error"] == "node_mismatch"
        assert "gpu-node-8" not in {n["node"] for n in _get(f"{url}/v1/nodes", read)["nodes"]}
    finally:
        for proc in reversed(procs):
            proc.terminate()  # buildah stops the process it runs when it is stopped
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for log_file in logs:
            log_file.close()
        server.stop()
        kube.close()
