"""RDMA collector cost per cycle on an 8-HCA node: the real ConnectX-7 port copied eight times.

Reports CPU time of one ``collect`` (steady state, after the first cycle's directory scan) over
a temporary copy of tests/fixtures/sysfs/h100 whose data, packet and wait counters move every
cycle (the error counters stay still, as on a healthy port). Real sysfs costs more per file than tmpfs/ext4
(each counters/ read is a MAD to the HCA firmware), so this is the collector's own share only.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.measure import Measurement
from vigil.agent.collectors.rdma import RdmaCollector, RdmaConfig

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sysfs" / "h100" / "class" / "infiniband"
HCAS = 8
CYCLES = 300
# DESIGN.md section 9: the whole agent cycle (8 GPUs + 8 HCAs + 8 ranks) gets 2 ms.
AGENT_CYCLE_BUDGET_MS = 2.0
MOVING = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "unicast_xmit_packets",
          "unicast_rcv_packets", "port_xmit_wait")


def measure() -> list[Measurement]:
    with tempfile.TemporaryDirectory() as tmp:
        ib = Path(tmp) / "class" / "infiniband"
        for i in range(HCAS):
            shutil.copytree(FIXTURE / "mlx5_0", ib / f"mlx5_{i}")
        collector = RdmaCollector(RdmaConfig(), sysfs_root=Path(tmp))
        now = 1000.0
        collector.collect(now)
        cpu_ms: list[float] = []
        samples = 0
        moving = [ib / f"mlx5_{i}" / "ports" / "1" / "counters" / name for i in range(HCAS) for name in MOVING]
        for cycle in range(CYCLES):
            now += 1.0
            for path in moving:  # traffic: the data and packet counters move every cycle (untimed)
                path.write_text(f"{10**9 + cycle * 1000}\n")
            start = time.process_time()
            samples = len(collector.collect(now).samples)
            cpu_ms.append((time.process_time() - start) * 1e3)
        collector.close()
    cpu_ms.sort()
    return [
        Measurement("rdma collector CPU per cycle, 8 IB HCAs (median)", statistics.median(cpu_ms), "ms",
                    AGENT_CYCLE_BUDGET_MS, note=f"{samples} samples/cycle; budget is the whole agent's"),
        Measurement("rdma collector CPU per cycle, 8 IB HCAs (p99)", cpu_ms[int(len(cpu_ms) * 0.99)], "ms", None),
    ]


if __name__ == "__main__":
    for m in measure():
        print(f"{m.what}: {m.value:.3f} {m.unit} (budget {m.budget}) {m.note}")
