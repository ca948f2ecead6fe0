"""The StepTimer inside a real data-parallel job (torch.distributed, gloo, 2 CPU processes), without
agents: with DDP (its comm hook accepted by DDP) and with FSDP2 (``watch`` on the fully_shard
blocks), the slowed rank reports the longest compute and the shortest collective wait. The fast
check of what the slow end-to-end test relies on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest

from tests.loopback import free_port

pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ddp_worker.py")


def _heartbeats_of_a_run(sock: socket.socket, tmp_path: Path) -> dict[tuple[str, int], list[dict[str, float]]]:
    """Runs the two ranks against ``sock`` as their agent and returns the heartbeats it received."""
    sock.bind(("127.0.0.1", 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    master = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "RANK": str(rank),
                   "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": "timer",
                   "VIGIL_HEARTBEAT_ADDR": f"127.0.0.1:{sock.getsockname()[1]}", "OMP_NUM_THREADS": "1"}
            log = (tmp_path / f"rank{rank}.log").open("wb")
            procs.append(subprocess.Popen([sys.executable, str(WORKER), "timed,fsdp", "4", "1", "0.1"], cwd=REPO,
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        for p in procs:
            assert p.wait(timeout=120) == 0, (tmp_path / f"rank{procs.index(p)}.log").read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    sock.settimeout(0.5)
    beats: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        while True:
            msg = json.loads(sock.recv(4096))
            if "compute_seconds" in msg:
                beats.setdefault((msg["job"], msg["rank"]), []).append(msg)
    except TimeoutError:
        pass
    return beats


def test_slowed_rank_has_longest_compute_and_shortest_wait(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # closed however the run ends
        beats = _heartbeats_of_a_run(sock, tmp_path)
    assert sorted(beats) == [(j, r) for j in ("timer-fsdp", "timer-timed") for r in (0, 1)]
    assert all(len(b) >= 5 for b in beats.values()), {k: len(b) for k, b in beats.items()}
    assert {m["timing"] for b in beats.values() for m in b} == {"cpu"}  # no CUDA here: marked as such
    for job in ("timer-timed", "timer-fsdp"):
        compute = {r: median(m["compute_seconds"] for m in beats[(job, r)]) for r in (0, 1)}
        comm = {r: median(m["comm_seconds"] for m in beats[(job, r)]) for r in (0, 1)}
        assert compute[1] > compute[0] + 0.05, (job, compute)
        assert comm[1] < comm[0], (job, comm)
