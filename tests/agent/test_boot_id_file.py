"""The agent's boot id seam: ``Agent(boot_id_path=)`` and ``vigil agent --boot-id-file`` read the
kernel boot id from a file a drill or test rewrites to stand for a reboot (tests/e2e/test_reboot_loop.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.loopback import free_port
from vigil.agent.config import parse_config
from vigil.agent.daemon import Agent
from vigil.contract.seams import Seams

REPO = Path(__file__).resolve().parents[2]
BOOT_A = "0b6f1c2e-9d4a-4f3b-8e21-5a7c9d0e1f23"
BOOT_B = "7e3d2c1b-0a9f-4e8d-b7c6-1f2e3d4c5b6a"


def _agent(tmp_path: Path, boot_id_path: Path) -> Agent:
    config = parse_config({"node": "gpu-node-17", "collectors": {name: {"enabled": False} for name in
                                                                 ("gpu", "host", "rdma", "xid", "training")}})
    return Agent(config, Seams(clock=time.time, sysfs_root=tmp_path / "no-sysfs"), boot_id_path=boot_id_path)


def test_the_boot_id_comes_from_the_file_given_and_changes_with_it(tmp_path: Path) -> None:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    first = _agent(tmp_path, path).boot_id
    assert first.startswith(BOOT_A.replace("-", "")[:16] + "-")
    path.write_text(BOOT_B + "\n")  # "rebooted"
    assert _agent(tmp_path, path).boot_id.startswith(BOOT_B.replace("-", "")[:16] + "-")
    # A restart without a reboot keeps the kernel part and changes only the per-start suffix.
    path.write_text(BOOT_A + "\n")
    again = _agent(tmp_path, path).boot_id
    assert again.split("-")[0] == first.split("-")[0] and again != first


def test_an_unreadable_boot_id_file_reads_as_unknown(tmp_path: Path) -> None:
    assert _agent(tmp_path, tmp_path / "absent").boot_id.startswith("unknown-")


def test_vigil_agent_boot_id_file_flag(tmp_path: Path) -> None:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_B + "\n")
    port = free_port()
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vigil", "agent", "--backend", "fake", "--node", "gpu-node-17",
         "--listen", f"127.0.0.1:{port}", "--heartbeat-listen", f"127.0.0.1:{free_port()}",
         "--boot-id-file", str(path)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    log.close()
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in (tmp_path / "agent.log").read_text():
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/state", timeout=10) as resp:
            state = json.loads(resp.read())
        assert state["boot_id"].startswith(BOOT_B.replace("-", "")[:16] + "-")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
