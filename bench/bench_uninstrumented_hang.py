"""Hangs with no instrumentation: detection time from telemetry, and the culprit named from the flight recorder.

Drills on a simulated clock through the aggregator's real engine (every detector, shipped defaults,
dry run), fed the reports a fleet of agents sends (every 2.5 s, at independent phases; utilisation,
clocks and power in every report, DRAM, PCIe and NVLink readings and the ports' data counters at the
agents' telemetry resolution, ``telemetry_seconds`` 30 s shipped, so they reach the aggregator up to
30 s late: docs/reports.md). No rank sends a heartbeat.

1. Telemetry (the ``telemetry_hang`` detector): a 16-node job, 8 GPUs and 8 InfiniBand ports per
   node, trains (readings with noise: utilisation, clock, power, DRAM, PCIe, NVLink; the ports move
   GB/s) and hangs at a random moment: every GPU busy-spins (resident kernels, boost clock, a fifth
   of the power limit, no DRAM or PCIe traffic) and the ports carry only subnet-management bytes.
   The figure: the time from the hang to the first decision (DESIGN.md section 9: an alert within
   60 s), p50 and max over the drills, and the same with the agents sending every reading in every
   report (``telemetry_seconds`` 0). Lookalikes on the same job, each 5 minutes: a checkpoint
   (GPUs idle, no RDMA data) and an evaluation (GPUs busy with DRAM traffic, no RDMA data): their
   decisions (budget 0).
2. Flight recorder (the ``collective_culprit`` detector): a 16-node job of 8 ranks per node; one
   random rank never enters the collective the others wait in (sequence id random); each node's
   agent reports its ranks' dumps (``CollectiveState``) at its own moment after the timeout, with
   noise: a second process group in step on every rank, dump times skewed by up to 10 s, and in a
   third of the drills one other node's dumps arrive a report late. The figure: culprit accuracy,
   drills whose first decision drains the culprit's node (and no other) over all drills (target
   >= 95%). Then the same drills with the culprit rank writing no dump (stopped whole), reported
   without a budget.
"""

from __future__ import annotations

import random
from statistics import median

from msgspec.structs import replace

from bench.measure import Measurement
from vigil.aggregator.config import parse_config
from vigil.aggregator.decision import Decision
from vigil.aggregator.engine import Engine
from vigil.aggregator.ledger import Ledger
from vigil.contract.wire import CollectiveState, GpuState, PortState, Report

NODES = 16
GPUS = 8  # and 8 ports, 8 ranks per node
REPORT_SECONDS = 2.5
EVALUATE_SECONDS = 2.5
TELEMETRY_SECONDS = 30.0  # the agents' shipped telemetry resolution (agent config aggregator.telemetry_seconds)
DRILLS = 20
JOB = "8812"
POWER_LIMIT_WATTS = 700.0  # H100 SXM
SM_CLOCK_MAX_HERTZ = 1980e6
PORT_BYTES_PER_SECOND = 12.5e9  # a quarter of NDR 400G, each way, while training
KEEPALIVE_BYTES_PER_SECOND = 2e3  # subnet management and keep-alives on an idle port
LOOKALIKE_SECONDS = 300.0
ALERT_BUDGET_SECONDS = 60.0
ACCURACY_TARGET = 0.95


def _gpu(node: int, index: int, mode: str, rng: random.Random) -> GpuState:
    """One GPU's readings in a mode: training, busy_spin, idle (checkpoint) or evaluating."""
    if mode == "training":
        u, clock, power, dram, pcie, nvlink = (rng.uniform(0.9, 1.0), rng.uniform(0.85, 1.0), rng.uniform(0.65, 0.98),
                                               rng.uniform(0.25, 0.6), rng.uniform(1e9, 6e9), rng.uniform(50e9, 200e9))
    elif mode == "busy_spin":
        u, clock, power, dram, pcie, nvlink = (rng.uniform(0.98, 1.0), rng.uniform(0.93, 1.0), rng.uniform(0.16, 0.27),
                                               rng.uniform(0.0, 0.02), rng.uniform(0.0, 8e6), rng.uniform(0.0, 4e6))
    elif mode == "evaluating":
        u, clock, power, dram, pcie, nvlink = (rng.uniform(0.85, 1.0), rng.uniform(0.85, 1.0), rng.uniform(0.45, 0.8),
                                               rng.uniform(0.3, 0.7), rng.uniform(0.2e9, 2e9), rng.uniform(0.0, 1e6))
    else:  # idle: the GPUs wait on the host writing a checkpoint
        u, clock, power, dram, pcie, nvlink = (rng.uniform(0.0, 0.1), rng.uniform(0.3, 1.0), rng.uniform(0.1, 0.15),
                                               rng.uniform(0.0, 0.02), rng.uniform(0.0, 50e6), 0.0)
    return GpuState(index=index, uuid=f"GPU-{node:04d}-{index}", job=JOB, utilization_gpu_ratio=u,
                    sm_clock_hertz=clock * SM_CLOCK_MAX_HERTZ, sm_clock_max_hertz=SM_CLOCK_MAX_HERTZ,
                    power_watts=power * POWER_LIMIT_WATTS, power_limit_watts=POWER_LIMIT_WATTS,
                    dram_active_ratio=dram, sm_active_ratio=u * 0.9, pcie_tx_bytes_per_second=pcie,
                    pcie_rx_bytes_per_second=pcie, nvlink_tx_bytes_per_second=nvlink,
                    nvlink_rx_bytes_per_second=nvlink)


def _ports(data_bytes: list[int]) -> list[PortState]:
    return [PortState(device=f"mlx5_{i}", port=1, state="4: ACTIVE", phys_state="5: LinkUp",
                      rate_bits_per_second=400e9, link_layer="InfiniBand",
                      counters={"port_xmit_data": b, "port_rcv_data": b}) for i, b in enumerate(data_bytes)]


class _Job:
    """The job's nodes as their agents report them: modes over simulated time, counters, phases."""

    def __init__(self, mode_at: list[tuple[float, str]], rng: random.Random,
                 telemetry_seconds: float = TELEMETRY_SECONDS) -> None:
        self.mode_at = mode_at  # (from t, mode), sorted
        self.rng = rng
        self.telemetry_seconds = telemetry_seconds
        self.report_phase = [rng.uniform(0, REPORT_SECONDS) for _ in range(NODES)]
        self.telemetry_phase = [rng.uniform(0, TELEMETRY_SECONDS) for _ in range(NODES)]
        self.gpus: list[list[GpuState]] = [[_gpu(n, i, "training", rng) for i in range(GPUS)] for n in range(NODES)]
        self.refreshed = [-1e9] * NODES
        self.counted = [[rng.randrange(1 << 40) for _ in range(GPUS)] for _ in range(NODES)]
        self.data = [list(c) for c in self.counted]  # as last sent
        self.seq = [0] * NODES

    def mode(self, t: float) -> str:
        return [m for start, m in self.mode_at if start <= t][-1]

    def advance(self, node: int, t: float, seconds: float) -> None:
        """Utilisation, clocks and power go in every report; DRAM, PCIe, NVLink and the ports' data
        counters (the report's telemetry fields, docs/reports.md) at the telemetry resolution."""
        mode = self.mode(t)
        rate = PORT_BYTES_PER_SECOND if mode == "training" else KEEPALIVE_BYTES_PER_SECOND
        self.counted[node] = [b + int(rate * seconds * self.rng.uniform(0.8, 1.2)) for b in self.counted[node]]
        fresh = [_gpu(node, i, mode, self.rng) for i in range(GPUS)]
        if t - self.refreshed[node] >= self.telemetry_seconds:
            self.gpus[node] = fresh
            self.data[node] = list(self.counted[node])
            self.refreshed[node] = t
        else:
            self.gpus[node] = [replace(g, dram_active_ratio=old.dram_active_ratio,
                                       pcie_tx_bytes_per_second=old.pcie_tx_bytes_per_second,
                                       pcie_rx_bytes_per_second=old.pcie_rx_bytes_per_second,
                                       nvlink_tx_bytes_per_second=old.nvlink_tx_bytes_per_second,
                                       nvlink_rx_bytes_per_second=old.nvlink_rx_bytes_per_second)
                               for g, old in zip(fresh, self.gpus[node], strict=True)]

    def report(self, node: int, t: float, collectives: list[CollectiveState] | None = None) -> Report:
        self.seq[node] += 1
        return Report(node=f"node-{node:04d}", boot_id=f"boot-{node}", seq=self.seq[node], ts=t,
                      interval_seconds=REPORT_SECONDS, gpus=self.gpus[node], ports=_ports(self.data[node]),
                      collectives=collectives or [])


def _drive(job: _Job, until: float, collectives: dict[int, tuple[float, list[CollectiveState]]] | None = None,
           ) -> list[tuple[float, Decision]]:
    """Every report and evaluation up to ``until``; the decisions with their time."""
    engine = Engine(parse_config({"dry_run": True}), Ledger.in_memory())
    events = sorted([(job.report_phase[n] + k * REPORT_SECONDS, 0, n)
                     for n in range(NODES) for k in range(int(until / REPORT_SECONDS) + 1)]
                    + [(k * EVALUATE_SECONDS, 1, -1) for k in range(int(until / EVALUATE_SECONDS) + 1)])
    last = [0.0] * NODES
    out: list[tuple[float, Decision]] = []
    for t, kind, node in events:
        if t > until:
            break
        if kind == 0:
            job.advance(node, t, t - last[node])
            last[node] = t
            dumped = (collectives or {}).get(node)
            engine.ingest(job.report(node, t, dumped[1] if dumped and t >= dumped[0] else None), t)
        else:
            out.extend((t, d) for d in engine.evaluate(t))
    return out


def telemetry_drills(rng: random.Random, telemetry_seconds: float = TELEMETRY_SECONDS) -> list[float]:
    """Seconds from the hang to the job's first decision, one per drill (inf: never)."""
    out = []
    for _ in range(DRILLS):
        stop = rng.uniform(120.0, 180.0)
        decisions = _drive(_Job([(0.0, "training"), (stop, "busy_spin")], rng, telemetry_seconds), stop + 240.0)
        hung = [t for t, d in decisions if d.job == JOB and d.detector == "telemetry_hang"]
        out.append(min(hung) - stop if hung else float("inf"))
    return out


def lookalike_decisions(mode: str, rng: random.Random) -> int:
    start = 120.0
    job = _Job([(0.0, "training"), (start, mode), (start + LOOKALIKE_SECONDS, "training")], rng)
    return sum(1 for _, d in _drive(job, start + LOOKALIKE_SECONDS + 60.0) if d.job == JOB)


def _collectives(node: int, culprit: int, seq: int, dump_ts: float) -> list[CollectiveState]:
    out = []
    for local in range(GPUS):
        rank = node * GPUS + local
        entered = seq - 1 if rank == culprit else seq
        completed = seq - 1
        out.append(CollectiveState(job=JOB, rank=rank, group="0", group_size=NODES * GPUS, last_entered_seq=entered,
                                   last_completed_seq=completed, op="allreduce", stage="started",
                                   size_bytes=25 * 1024 * 1024, dump_ts=dump_ts, reason="timeout"))
        # A second group (tensor parallel within the node) in step on every rank: no culprit there.
        out.append(CollectiveState(job=JOB, rank=rank, group="1", group_size=GPUS, last_entered_seq=seq // 3,
                                   last_completed_seq=seq // 3, op="allgather", stage="completed",
                                   size_bytes=4 * 1024 * 1024, dump_ts=dump_ts, reason="timeout"))
    return out


def culprit_drills(rng: random.Random, culprit_dumps: bool = True) -> tuple[int, int, list[float]]:
    """(drills named right, drills with another node drained, seconds from the last dump to the decision).
    ``culprit_dumps`` False: the culprit rank writes no dump (a process stopped whole: SIGSTOP, or
    wedged in the kernel), its node's other ranks do."""
    right = wrong = 0
    delays: list[float] = []
    for drill in range(DRILLS):
        culprit = rng.randrange(NODES * GPUS)
        stop = rng.uniform(120.0, 180.0)
        timeout = 60.0  # the job's collective timeout: the dumps are written then
        dumps: dict[int, tuple[float, list[CollectiveState]]] = {}
        seq = rng.randrange(100, 50_000)
        late = rng.randrange(NODES) if drill % 3 == 0 else -1
        for node in range(NODES):
            at = stop + timeout + rng.uniform(0.0, 10.0) + (REPORT_SECONDS if node == late else 0.0)
            dumps[node] = (at, [c for c in _collectives(node, culprit, seq, at) if culprit_dumps or c.rank != culprit])
        written = max(at for at, _ in dumps.values())
        decisions = _drive(_Job([(0.0, "training"), (stop, "busy_spin")], rng), written + 60.0, dumps)
        drains = [(t, d) for t, d in decisions if d.detector == "collective_culprit" and d.action.value == "drain"]
        named = {d.node for _, d in drains}
        if named == {f"node-{culprit // GPUS:04d}"}:
            right += 1
            delays.append(min(t for t, _ in drains) - written)
        elif named:
            wrong += 1
    return right, wrong, delays


def measure() -> list[Measurement]:
    rng = random.Random(43)
    times = telemetry_drills(rng)
    every_report = telemetry_drills(rng, 0.0)
    checkpoint, evaluation = lookalike_decisions("idle", rng), lookalike_decisions("evaluating", rng)
    right, wrong, delays = culprit_drills(rng)
    delay = median(delays) if delays else float("nan")
    silent_right, silent_wrong, _ = culprit_drills(rng, culprit_dumps=False)
    return [
        Measurement(f"uninstrumented hang -> alert from telemetry (max of {DRILLS} drills)", max(times), "s",
                    ALERT_BUDGET_SECONDS,
                    note=(f"p50 {median(times):.1f} s; {NODES} nodes x {GPUS} GPUs, no heartbeats, shipped defaults; "
                          f"readings at the agents' {TELEMETRY_SECONDS:.0f} s telemetry resolution; with "
                          f"telemetry_seconds 0 (every report): p50 {median(every_report):.1f} s, "
                          f"max {max(every_report):.1f} s")),
        Measurement("uninstrumented job, 5-min checkpoint / 5-min evaluation: decisions",
                    float(checkpoint + evaluation), "decisions", 0.0,
                    note=f"checkpoint {checkpoint}, evaluation {evaluation}"),
        Measurement(f"flight recorder: culprit node named right ({DRILLS} drills)", right / DRILLS * 100.0, "%",
                    ACCURACY_TARGET * 100.0, higher_is_better=True,
                    note=(f"{wrong} drills drained another node; decision {delay:.1f} s "
                          f"(p50) after the last dump reached its agent; {NODES} nodes x {GPUS} ranks, random culprit, "
                          "second process group, skewed and late dumps")),
        Measurement(f"flight recorder, the culprit rank writes no dump: named right ({DRILLS} drills)",
                    silent_right / DRILLS * 100.0, "%", None,
                    note=(f"{silent_wrong} drills drained another node; a rank stopped whole (SIGSTOP) dumps nothing "
                          "and collective_culprit judges a group only with every rank's dump")),
    ]


if __name__ == "__main__":
    for m in measure():
        print(f"{m.what}: {m.value:.1f} {m.unit} (budget {m.budget}) {m.note}")
