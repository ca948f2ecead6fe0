"""``vigil aggregator --check`` refuses what the service refuses (issue 41): it runs the service's
own start-up checks (aggregator/preflight.py), so each refusal is asserted on the real CLI, and
for the same config the service itself exits 2 with the same line.

An optional package is made unimportable without uninstalling it: a directory first on the
subprocess's PYTHONPATH holds a package of that name whose import fails as a missing one does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.aggregator.test_tls import OPENSSL, self_signed
from vigil.aggregator.config import parse_config
from vigil.aggregator.preflight import startup_problems
from vigil.aggregator.store import PG_ERRORS

REPO = Path(__file__).resolve().parents[2]


def _cli(tmp_path: Path, config: dict[str, Any], *, check: bool = True,
         unimportable: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    blocked = tmp_path / "unimportable"
    for module in unimportable:
        (blocked / module).mkdir(parents=True, exist_ok=True)
        (blocked / module / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name={module!r})\n")
    path = tmp_path / "aggregator.yml"
    path.write_text(yaml.safe_dump({"listen": "127.0.0.1:0", "store_path": str(tmp_path / "d.sqlite"), **config}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked), str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "vigil", "aggregator", "--config", str(path),
                           *(["--check"] if check else [])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def _secret(tmp_path: Path, mode: int = 0o600) -> str:
    secret = tmp_path / "site.secret"
    secret.write_text("s" * 64 + "\n")
    secret.chmod(mode)
    return str(secret)


def _refused_by_both(tmp_path: Path, config: dict[str, Any], line: str, unimportable: tuple[str, ...] = ()) -> None:
    checked = _cli(tmp_path, config, unimportable=unimportable)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert f"\n  {line}" in checked.stdout and "config OK" not in checked.stdout
    served = _cli(tmp_path, config, check=False, unimportable=unimportable)
    assert served.returncode == 2 and line in served.stderr, served.stdout + served.stderr
    assert "Traceback" not in served.stderr and "listening" not in served.stdout


def test_refuses_acting_without_credentials(tmp_path: Path) -> None:
    _refused_by_both(tmp_path, {"dry_run": False}, "dry_run is false but no credentials are configured")


def test_refuses_the_kubernetes_actuator_without_its_package(tmp_path: Path) -> None:
    config = {"auth": {"site_secret_file": _secret(tmp_path)},
              "actuators": {"kubernetes": {"enabled": True, "api_url": "https://127.0.0.1:6443"}}}
    _refused_by_both(tmp_path, config, "actuators.kubernetes: needs the kubernetes package, which cannot be imported "
                     "(No module named 'kubernetes'): pip install 'vigil-fleet[k8s]'", unimportable=("kubernetes",))


def test_refuses_postgresql_without_psycopg(tmp_path: Path) -> None:
    dsn = tmp_path / "dsn"
    dsn.write_text("host=127.0.0.1 port=1 dbname=vigil connect_timeout=1\n")
    config = {"store": {"backend": "postgresql", "dsn_file": str(dsn)}}
    _refused_by_both(tmp_path, config, "store.backend: needs the psycopg package, which cannot be imported "
                     "(No module named 'psycopg'): pip install 'vigil-fleet[postgres]'", unimportable=("psycopg",))


def test_refuses_a_credential_others_may_read(tmp_path: Path) -> None:
    config = {"dry_run": False, "auth": {"site_secret_file": _secret(tmp_path, 0o644)}}
    _refused_by_both(tmp_path, config, "auth.site_secret_file: ")


@pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed")
def test_a_startable_config_passes(tmp_path: Path) -> None:
    """Acting, a group-readable secret (root:vigil 0640 as the Slurm guide makes it), https and the
    Kubernetes actuator with its package: config OK."""
    cert, key = self_signed(tmp_path)
    config = {"dry_run": False, "auth": {"site_secret_file": _secret(tmp_path, 0o640)},
              "tls": {"cert_file": str(cert), "key_file": str(key)},
              "actuators": {"kubernetes": {"enabled": True, "api_url": "https://127.0.0.1:6443"}}}
    checked = _cli(tmp_path, config)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip().endswith("aggregator.yml: config OK")


def test_each_problem_is_its_own_line_and_postgresql_must_answer(tmp_path: Path) -> None:
    """In process, through the import and connect boundaries: a missing package is named once,
    and with psycopg present an unreachable server is the store's problem."""
    dsn = tmp_path / "dsn"
    dsn.write_text("host=127.0.0.1 port=1 dbname=vigil\n")
    config = parse_config({"store_path": str(tmp_path / "d.sqlite"), "dry_run": False,
                           "store": {"backend": "postgresql", "dsn_file": str(dsn)},
                           "actuators": {"kubernetes": {"enabled": True, "api_url": "https://127.0.0.1:6443"}}})
    imported: list[str] = []

    def without_kubernetes(name: str) -> object:
        imported.append(name)
        if name == "kubernetes":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return object()

    def refused(dsn_text: str) -> object:
        assert dsn_text == "host=127.0.0.1 port=1 dbname=vigil"
        raise (PG_ERRORS[0] if PG_ERRORS else OSError)("connection refused\n\tIs the server running?")

    problems = startup_problems(config, import_module=without_kubernetes, connect=refused)
    assert [p.split(":")[0] for p in problems] == ["actuators.kubernetes", "dry_run is false but no credentials are "
                                                  "configured (auth.site_secret_file, auth.alertmanager_token_file, "
                                                  "auth.operator_token_file)", "store.dsn_file"]
    assert problems[2] == "store.dsn_file: cannot connect to PostgreSQL: connection refused Is the server running?"
    assert "kubernetes" in imported and "psycopg" in imported


def test_agent_check_builds_the_reporters_tls_context(tmp_path: Path) -> None:
    """``vigil agent --check``: a CA file that is no certificate fails as the agent's start would."""
    ca, token = tmp_path / "ca.pem", tmp_path / "token"
    ca.write_text("not a certificate\n")
    token.write_text("n1.abc\n")
    token.chmod(0o600)
    path = tmp_path / "agent.yml"
    path.write_text(yaml.safe_dump({"node": "n1", "state_dir": str(tmp_path / "state"), "aggregator": {
        "url": "https://127.0.0.1:9500", "ca_file": str(ca), "token_file": str(token)}}))
    checked = subprocess.run([sys.executable, "-m", "vigil", "agent", "--config", str(path), "--check"], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                 str(REPO), os.environ.get("PYTHONPATH")]))},
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "aggregator: TLS for https://127.0.0.1:9500 (ca_file, cert_file, key_file): " in checked.stdout
