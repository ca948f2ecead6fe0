"""`make demo` is the first thing a newcomer runs: it must end with the right decisions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vigil.cli.demo_cmd import DRY_RUN_BANNER, WRAP_COLUMNS, decision_lines

LONG_REASON = ("GPU 2 on gpu-node-03: uncorrectable ECC errors (volatile 3) and a row-remap failure "
               "(remapping resources exhausted); the GPU cannot retire more rows, so it needs hardware "
               "inspection before it serves again [ecc_uncorrected=3 remap_failure=true]")


def test_demo_decides_each_injected_fault_and_leaves_the_healthy_node_alone(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "vigil", "demo", "--seconds", "50", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu-node-03 GPUs:" in done.stdout and "NVIDIA H100 80GB HBM3" in done.stdout
    assert done.stdout.startswith(DRY_RUN_BANNER)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # every decision is shown marked dry run, with its reason in full (wrapped, never cut off)
    shown = " ".join(done.stdout.split())
    assert summary["decisions"] and all(" ".join(d["reason"].split()) in shown for d in summary["decisions"])
    assert shown.count("(dry run, not acted on)") >= len(summary["decisions"]) and "ACTED ON" not in shown
    assert "uncorrectable ECC + row-remap failure on GPU 2 at ~10 s" in done.stdout  # the fault, uncut
    by_node: dict[str, set[str]] = {}
    for d in summary["decisions"]:
        by_node.setdefault(d["node"], set()).add(d["action"])
    assert "gpu-node-01" not in by_node  # healthy
    assert by_node["gpu-node-02"] & {"reboot_node", "reset_gpu", "drain"}  # Xid 79 from the kernel log
    assert "inspect_hardware" in by_node["gpu-node-03"]  # row-remap failure
    assert "drain" in by_node["gpu-node-04"]  # the straggler
    assert by_node["gpu-node-05"] & {"reboot_node", "reset_gpu", "drain"}  # GPU off the bus


def test_a_decision_is_marked_dry_run_and_its_long_reason_wraps_in_full() -> None:
    lines = decision_lines([{"ts": 1.7e9, "node": "gpu-node-03", "gpu": 2, "action": "inspect_hardware",
                             "detector": "gpu_health", "reason": LONG_REASON, "dry_run": True}])
    assert lines[0].endswith("[gpu_health] (dry run, not acted on)") and "gpu-node-03 gpu 2" in lines[0]
    body = lines[1:]
    assert len(body) > 1 and all(len(line) <= WRAP_COLUMNS for line in body)
    assert " ".join(" ".join(body).split()) == LONG_REASON


def test_a_decision_that_was_acted_on_is_not_called_a_dry_run() -> None:
    lines = decision_lines([{"ts": 1.7e9, "node": None, "job": "llm-7", "action": "restart_job",
                             "detector": "training", "reason": "x", "dry_run": False}])
    assert "job llm-7" in lines[0] and lines[0].endswith("(ACTED ON)") and "dry run" not in lines[0]
    assert decision_lines([]) == ["  (none yet)"]
