"""Credential files: ``vigil token ... --out`` creates them 0600 (never over a file, never through a
link, whatever the umask); the aggregator refuses at start one that other users may read, the
agent warns and exports it; a token file is re-read when replaced (contract/credential_file.py)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vigil.agent.credential_exposure import ExposedFiles
from vigil.aggregator.auth import AuthConfig, Credentials, node_token
from vigil.cli import main
from vigil.contract.credential_file import TokenFile, exposure
from vigil.contract.validation import ConfigError

REPO = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secret_and_create_write_0600_files_and_never_overwrite(tmp_path: Path, capsys) -> None:
    secret, token = tmp_path / "site.secret", tmp_path / "gpu-001.token"
    old = os.umask(0)  # the recipe's file is private whatever the operator's umask
    try:
        assert main(["token", "secret", "--out", str(secret)]) == 0
        assert main(["token", "create", "--secret-file", str(secret), "--node", "gpu-001", "--out", str(token)]) == 0
    finally:
        os.umask(old)
    assert mode(secret) == 0o600 and mode(token) == 0o600
    assert len(secret.read_text().strip()) == 64
    assert token.read_text().strip() == node_token(secret.read_text().strip().encode(), "gpu-001")
    capsys.readouterr()
    before = secret.read_text()
    assert main(["token", "secret", "--out", str(secret)]) == 2
    assert secret.read_text() == before and "not overwritten" in capsys.readouterr().err
    # One file per node.
    assert main(["token", "create", "--secret-file", str(secret), "--node", "a", "--node", "b",
                 "--out", str(tmp_path / "two")]) == 2
    assert not (tmp_path / "two").exists()


def test_out_never_writes_through_a_link(tmp_path: Path, capsys) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / "link").symlink_to(target)
    assert main(["token", "secret", "--out", str(tmp_path / "link")]) == 2
    assert not target.exists() and "exists" in capsys.readouterr().err


def test_create_warns_about_an_exposed_site_secret(tmp_path: Path, capsys) -> None:
    secret = tmp_path / "site.secret"
    secret.write_text("s" * 64 + "\n")
    secret.chmod(0o644)  # what the README's old recipe (shell redirection) left
    assert main(["token", "create", "--secret-file", str(secret), "--node", "gpu-1"]) == 0
    assert "readable or writable by other users (mode 0644)" in capsys.readouterr().err


@pytest.mark.parametrize(("bits", "refused"), [(0o600, False), (0o640, False), (0o400, False), (0o644, True),
                                               (0o604, True), (0o602, True), (0o660, True)])
def test_exposure_allows_owner_and_group_readers_only(tmp_path: Path, bits: int, refused: bool) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    path.chmod(bits)
    assert (exposure(path) is not None) is refused


@pytest.mark.parametrize("key", ["site_secret_file", "alertmanager_token_file", "operator_token_file",
                                 "read_token_file"])
def test_the_aggregator_refuses_a_credential_file_others_may_read(tmp_path: Path, key: str) -> None:
    path = tmp_path / key
    path.write_text("c" * 64 + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"auth.{key}: .* \(mode 0644\); chmod 600"):
        Credentials.load(AuthConfig(**{key: str(path)}))
    path.chmod(0o640)  # shared with the service's group: fine
    assert Credentials.load(AuthConfig(**{key: str(path)})).any


def test_the_aggregator_process_will_not_start_on_an_exposed_site_secret(tmp_path: Path) -> None:
    secret = tmp_path / "site.secret"
    secret.write_text("s" * 64 + "\n")
    secret.chmod(0o644)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "vigil", "aggregator", "--listen", "127.0.0.1:0", "--site-secret-file",
            str(secret), "--store", str(tmp_path / "d.sqlite")]
    checked = subprocess.run([*argv, "--check"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert checked.returncode == 2 and "auth.site_secret_file" in checked.stdout and "0644" in checked.stdout
    started = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert started.returncode == 2 and "chmod 600" in started.stderr and "listening" not in started.stdout
    secret.chmod(0o600)
    checked = subprocess.run([*argv, "--check"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert checked.returncode == 0, checked.stdout


def test_the_agent_warns_and_exports_an_exposed_token(tmp_path: Path, caplog) -> None:
    token = tmp_path / "token"
    token.write_text("gpu-1~abc\n")
    token.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="vigil.credentials"):
        files = ExposedFiles({"aggregator.token_file": str(token), "node_actions.key_file": None})
    assert "aggregator.token_file" in caplog.text and "report as this node" in caplog.text
    (sample,) = files.samples()
    assert sample.name == "vigil_agent_credential_file_exposed" and sample.value == 1.0
    token.chmod(0o600)  # seen at the next scrape
    assert [s.value for s in files.samples()] == [0.0]


def test_a_token_file_is_read_again_once_replaced(tmp_path: Path, caplog) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    token = TokenFile(path)
    assert token.current() == "first"
    new = tmp_path / "token.new"
    new.write_text("second\n")
    os.replace(new, path)  # kubelet's atomic swap: a new inode under the same name
    assert token.current() == "second"
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="vigil.credentials"):
        assert token.current() == "second"  # kept, and said once
        assert token.current() == "second"
    assert caplog.text.count("cannot re-read token file") == 1
    path.write_text("")
    assert token.current() is None
    with pytest.raises(FileNotFoundError):
        TokenFile(tmp_path / "missing")
