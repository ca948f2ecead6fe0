"""The Slurm guide's install steps, run as written, with the checks as the service user (issue 41).

Runs the shell blocks of deploy/slurm/README.md that carry a ``<!-- slurm-guide-test: NAME -->``
marker (steps 2, 3 and 4: credentials and TLS pair, then each ``--check`` through ``runuser``) as
root, with only these changes: ``/etc/vigil`` and ``/var/lib/`` moved under a temporary root,
``/opt/vigil/bin/vigil`` replaced by ``python -m vigil`` (this interpreter, or where the service
user cannot run it, as under a root-only pyenv, the system's of the same version given this
environment's packages), ``sudo`` dropped (the test is root), and the ``vigil`` user and group
replaced by a throwaway system user made here and removed after (the shipped configs are copied
with the same paths moved). The negative: the guide's old step 2 (the TLS key left 0600 and
root-owned, as OpenSSL 3 writes it whatever the umask) passes a check run as root and fails the
one run as the service's user.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import vigil
import vigil_heartbeat

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "deploy" / "slurm" / "README.md"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(p) for p in ("useradd", "userdel", "runuser", "openssl")),
    reason="follows the guide as root with a throwaway system user (useradd, runuser, openssl): run as root")


def guide_block(name: str) -> str:
    found = re.findall(rf"<!-- slurm-guide-test: {re.escape(name)} -->\n```sh\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(found) == 1, f"deploy/slurm/README.md has {len(found)} shell blocks marked {name}"
    return str(found[0])


# PYTHONPATH for an interpreter other than this one: this environment's packages, then the caller's.
# An editable install finds vigil and vigil_heartbeat through an import hook that a .pth file
# installs, and .pth files on PYTHONPATH are not read: their folders are named here.
_PACKAGES = os.pathsep.join([*dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                             str(Path(vigil.__file__).resolve().parents[1]),
                                             str(Path(vigil_heartbeat.__file__).resolve().parents[1]))),
                             *filter(None, [os.environ.get("PYTHONPATH")])])


def _moved(text: str, root: Path) -> str:
    return text.replace("/etc/vigil", f"{root}/etc/vigil").replace("/var/lib/", f"{root}/var/lib/")


def relocated(script: str, root: Path, user: str, python: str) -> str:
    """The guide's block with its paths under ``root`` (the shipped configs too: ``deploy/config/``
    is their copy with the same paths moved), ``sudo`` dropped and ``vigil`` the throwaway user."""
    for shipped in (REPO / "deploy" / "config").glob("*.yml"):
        copy = root / "src" / "deploy" / "config" / shipped.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(_moved(shipped.read_text(), root))
    script = (_moved(script, root).replace(" deploy/config/", f" {root}/src/deploy/config/")
              .replace("/opt/vigil/bin/vigil", f"{python} -m vigil").replace("sudo ", ""))
    return re.sub(r"(-g|-u|chgrp) vigil\b", rf"\1 {user}", script)


def run_as_root(script: str, python: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _PACKAGES} if python != sys.executable else None
    return subprocess.run(["sh", "-euc", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def _python_for(user: str) -> str | None:
    """An interpreter ``user`` can run that imports vigil and its dependencies."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, *(p for p in (f"/usr/bin/{version}", f"/usr/local/bin/{version}")
                                      if os.path.exists(p))):
        probe = run_as_root(f"runuser -u {user} -- {python} -c "
                            "'import vigil.aggregator.preflight, vigil.agent.daemon'", python)
        if probe.returncode == 0:
            return python
    return None


@pytest.fixture
def host() -> Iterator[tuple[Path, str, str]]:
    """A temporary root (its /var/lib made, as on a host), a system user and group of its own, and
    the interpreter that user runs vigil with."""
    user = f"vgt{os.getpid() % 100000}"
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", user], check=True, capture_output=True, timeout=30)
    root = Path(tempfile.mkdtemp(prefix="vigil-guide-"))
    try:
        python = _python_for(user)
        if python is None:
            pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} with vigil's packages that an "
                        "unprivileged user can run")
        root.chmod(0o755)  # any user may pass through, as through /
        (root / "var" / "lib").mkdir(parents=True)
        yield root, user, python
    finally:
        shutil.rmtree(root)
        subprocess.run(["userdel", user], check=True, capture_output=True, timeout=30)


def test_the_guide_as_written_passes_its_checks_as_the_service_user(host: tuple[Path, str, str]) -> None:
    root, user, python = host
    steps = {name: relocated(guide_block(name), root, user, python) for name in ("step-2", "step-3", "step-4")}
    for name in ("step-3", "step-4"):
        assert f"runuser -u {user} -- " in steps[name], f"{name} must run --check as the service user"
    made = run_as_root(steps["step-2"], python)
    assert made.returncode == 0, made.stderr
    key = root / "etc" / "vigil" / "tls" / "aggregator.key"
    assert (key.stat().st_mode & 0o777, key.group()) == (0o640, user)

    for name, command in (("step-3", "aggregator"), ("step-4", "agent")):
        checked = run_as_root(steps[name], python)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert f"vigil {command}: {root}/etc/vigil/{command}.yml: config OK" in checked.stdout


def test_the_old_step_leaves_the_key_to_root_and_only_the_service_users_check_sees_it(
        host: tuple[Path, str, str]) -> None:
    root, user, python = host
    step2 = relocated(guide_block("step-2"), root, user, python).splitlines()
    old_step2 = [line for line in step2 if not line.startswith("chmod 0640 ") or "aggregator.key" not in line]
    assert len(old_step2) == len(step2) - 1, "the guide's chmod of the TLS key has moved: update this test"
    assert run_as_root("\n".join(old_step2), python).returncode == 0
    key = root / "etc" / "vigil" / "tls" / "aggregator.key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.owner() == "root"  # OpenSSL 3, umask 027 or not

    step3 = relocated(guide_block("step-3"), root, user, python)
    as_root = run_as_root(step3.replace(f"runuser -u {user} -- ", ""), python)
    assert as_root.returncode == 0 and "config OK" in as_root.stdout, as_root.stdout + as_root.stderr

    as_service = run_as_root(step3, python)
    assert as_service.returncode == 2, as_service.stdout + as_service.stderr
    assert f"tls.key_file: cannot read {key} as uid" in as_service.stdout
    assert "Permission denied" in as_service.stdout and "config OK" not in as_service.stdout
