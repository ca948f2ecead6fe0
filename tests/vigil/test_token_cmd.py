"""``vigil token``: node tokens derived from the site secret are what the aggregator accepts."""

from __future__ import annotations

import hashlib
import hmac

from vigil.aggregator.auth import Credentials, Role
from vigil.cli import main


def test_create_prints_the_nodes_derived_token(tmp_path, capsys) -> None:
    assert main(["token", "secret"]) == 0
    secret = capsys.readouterr().out.strip()
    assert len(secret) == 64
    path = tmp_path / "site.secret"
    path.write_text(secret + "\n")
    assert main(["token", "create", "--secret-file", str(path), "--node", "gpu-001", "--node", "gpu-002.dc1"]) == 0
    first, second = capsys.readouterr().out.split()
    mac = hmac.new(secret.encode(), b"gpu-001", hashlib.sha256).hexdigest()
    assert first == f"gpu-001~{mac}"
    creds = Credentials(site_secret=secret.encode())
    assert creds.roles_of(first.encode()) == ({Role.NODE}, "gpu-001")
    assert creds.roles_of(second.encode()) == ({Role.NODE}, "gpu-002.dc1")
    # A token is bound to its name: another name with the same MAC is nobody.
    assert creds.roles_of(f"gpu-002~{mac}".encode()) == (set(), None)


def test_create_refuses_a_name_that_is_not_a_hostname_and_a_short_secret(tmp_path, capsys) -> None:
    path = tmp_path / "site.secret"
    path.write_text("x" * 40)
    assert main(["token", "create", "--secret-file", str(path), "--node", "vnode[1-5]"]) == 2
    assert "hostname" in capsys.readouterr().err
    path.write_text("short")
    assert main(["token", "create", "--secret-file", str(path), "--node", "gpu-1"]) == 2
    assert "at least 32" in capsys.readouterr().err


def test_create_refuses_a_name_in_loadgens_reserved_namespace(tmp_path, capsys) -> None:
    """A loadgen-* node is never judged: no token is minted for one (vigil loadgen derives its own)."""
    path = tmp_path / "site.secret"
    path.write_text("x" * 40)
    assert main(["token", "create", "--secret-file", str(path), "--node", "loadgen-00001"]) == 2
    assert "reserved for vigil loadgen" in capsys.readouterr().err
    assert main(["token", "create", "--secret-file", str(path), "--node", "loadgen1"]) == 0
