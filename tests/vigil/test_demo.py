"""`make demo` is the first thing a newcomer runs: it must end with the right decisions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_decides_each_injected_fault_and_leaves_the_healthy_node_alone(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "vigil", "demo", "--seconds", "50", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu-node-03 GPUs:" in done.stdout and "NVIDIA H100 80GB HBM3" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    by_node: dict[str, set[str]] = {}
    for d in summary["decisions"]:
        by_node.setdefault(d["node"], set()).add(d["action"])
    assert "gpu-node-01" not in by_node  # healthy
    assert by_node["gpu-node-02"] & {"reboot_node", "reset_gpu", "drain"}  # Xid 79 from the kernel log
    assert "inspect_hardware" in by_node["gpu-node-03"]  # row-remap failure
    assert "drain" in by_node["gpu-node-04"]  # the straggler
    assert by_node["gpu-node-05"] & {"reboot_node", "reset_gpu", "drain"}  # GPU off the bus
