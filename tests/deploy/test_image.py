"""The container image (Containerfile, built by scripts/build-image.sh with buildah, no registry):
``vigil --version`` runs in it, as a non-root user, and the fake-backend agent inside serves
/metrics that the host scrapes.

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

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.loopback import free_port
from vigil import __version__

REPO = Path(__file__).resolve().parents[2]
BUILDAH = shutil.which("buildah")
STORAGE = ["--storage-driver", os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")]
IMAGE = f"localhost/vigil:{__version__}"
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
]


def _build_here() -> None:
    subprocess.run([str(REPO / "scripts" / "build-image.sh")], cwd=REPO, check=True, timeout=BUILD_TIMEOUT_S,
                   env={**os.environ, "PYTHON": str(REPO / ".venv" / "bin" / "python")})


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


def _run(name: str, *argv: str) -> list[str]:
    assert BUILDAH is not None
    return [BUILDAH, *STORAGE, "run", "--isolation", "chroot", name, "--", *argv]


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
                 "--listen", f"127.0.0.1:{port}"), stdout=err, stderr=err) as proc:
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
