"""The container image (Containerfile, built by scripts/build-image.sh with buildah, no registry):
``vigil --version`` runs in it, as a non-root user, and the fake-backend agent inside serves
/metrics that the host scrapes.

Slow: on a fresh machine the Debian base (debootstrap minbase + python3) took 2 min 08 s here and
the image 38 s on top (2 shared cores), beyond what `make test` can spend; `make test-all` runs it.
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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.external,
    pytest.mark.skipif(BUILDAH is None or shutil.which("debootstrap") is None,
                       reason="buildah and debootstrap missing (scripts/ensure-system-packages.sh)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the Debian base is built with debootstrap, which needs root"),
]


@pytest.fixture(scope="module")
def container() -> Iterator[str]:
    assert BUILDAH is not None
    subprocess.run([str(REPO / "scripts" / "build-image.sh")], cwd=REPO, check=True, timeout=900,
                   env={**os.environ, "PYTHON": str(REPO / ".venv" / "bin" / "python")})
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
