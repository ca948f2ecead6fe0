"""Xid collector cost: an idle cycle on a followed file, and kernel-log flood throughput.

An idle cycle (nothing new in the log, 8 GPUs with earlier Xids) is what the agent pays every
0.5 s; flood throughput says how fast a burst like the real 800k-line Xid 95 storm is absorbed
(lines parsed, counted and collapsed into events per second of CPU).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.measure import Measurement
from vigil.agent.collectors.xid import XidCollector, XidConfig
from vigil.agent.file_follower import FileFollower

GPUS = 8
CYCLES = 500
FLOOD_LINES = 200_000
# DESIGN.md section 9: the whole agent cycle (8 GPUs + 8 HCAs + 8 ranks) gets 2 ms.
AGENT_CYCLE_BUDGET_MS = 2.0
XID = "[ {t}.000000] NVRM: Xid (PCI:0000:{bus:02x}:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB.\n"


@dataclass(frozen=True)
class _Identity:
    index: int
    uuid: str
    pci_bus_id: str


class _Gpus:
    def device_count(self) -> int:
        return GPUS

    def identity(self, index: int) -> _Identity:
        return _Identity(index, f"GPU-{index:08x}", f"00000000:{0x10 + index:02X}:00.0")


def measure() -> list[Measurement]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "kern.log"
        log.write_text("".join(XID.format(t=i, bus=0x10 + i) for i in range(GPUS)))
        cfg = XidConfig(max_lines_per_cycle=FLOOD_LINES)
        collector = XidCollector(cfg, open_source=lambda: FileFollower(log, start="beginning"), nvml=_Gpus())
        now = 1000.0
        collector.collect(now)
        idle_ms: list[float] = []
        for _ in range(CYCLES):
            now += 0.5
            start = time.process_time()
            collector.collect(now)
            idle_ms.append((time.process_time() - start) * 1e3)
        with log.open("a") as fh:
            fh.write("".join(XID.format(t=i, bus=0x10 + i % 29) for i in range(FLOOD_LINES)))
        start = time.process_time()
        flood = collector.collect(now + 0.5)
        flood_s = time.process_time() - start
        collector.close()
    idle_ms.sort()
    return [
        Measurement("xid collector CPU per idle cycle, 8 GPUs (median)", statistics.median(idle_ms), "ms",
                    AGENT_CYCLE_BUDGET_MS, note="followed file, nothing new; budget is the whole agent's"),
        Measurement("xid collector CPU per idle cycle, 8 GPUs (p99)", idle_ms[int(len(idle_ms) * 0.99)], "ms", None),
        Measurement("kernel-log flood absorbed (Xid 95 lines, 29 GPUs)", FLOOD_LINES / flood_s, "lines/s", None,
                    higher_is_better=True, note=f"{len(flood.events)} events forwarded for {FLOOD_LINES} lines"),
    ]


if __name__ == "__main__":
    for m in measure():
        print(f"{m.what}: {m.value:.3f} {m.unit} (budget {m.budget}) {m.note}")
