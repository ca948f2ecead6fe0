"""Telemetry hang detector: a job hung with no heartbeat to say so, seen in its GPUs and its fabric.

It reads, per job (the agents' GPU-to-job attribution, ``aggregator/job_telemetry.py``), each GPU's
latest NVML and GPM readings and the RDMA data counters of the job's nodes. A multi-node job whose
every GPU busy-spins while no port moves data is alerted, then restarted (``restart_job``, key "hang",
naming no node); it judges no job that sends heartbeats (hang.py's), no single-node job and no job
lacking the readings, and says so in ``unjudged``. The signature's limits, windows, lookalikes and the
designed false-removal rate: docs/detectors.md, "telemetry_hang".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field, model_validator

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding
from vigil.aggregator.detectors.hang import JOB_NODES_NAMED
from vigil.aggregator.fleet import FleetView, GpuHistory, port_is_active
from vigil.aggregator.job_telemetry import JobNode, JobNodes
from vigil.contract.validation import StrictModel

NAME = "telemetry_hang"
# The IBTA PortCounters data counters (sysfs ports/N/counters; the agent reports them in bytes).
DATA_COUNTERS = ("port_xmit_data", "port_rcv_data")


class TelemetryHangConfig(StrictModel):
    """Hangs of jobs that send no heartbeats, from GPU busy-spin and flat RDMA (docs/detectors.md)."""
    enabled: bool = True
    # scitix/sichek's GPU hang check (components/hang/config/default_spec.yaml) flags a GPU whose
    # readings hold the busy-spin signature for 60 s (duration_threshold), sampled every 10 s. vigil
    # waits 20 s: agents send the DRAM/PCIe/NVLink readings and the port counters at telemetry
    # resolution (30 s), so the signature is seen up to ~33 s late, and the alert must come within
    # 60 s of the hang (bench/bench_uninstrumented_hang.py prints it). An alert acts on nothing; the
    # restart below still needs five minutes of the signature, across ten telemetry refreshes.
    alert_seconds: float = Field(default=20.0, gt=0)
    # The heartbeat hang detector's stall_seconds (hang.py): half of PyTorch's default NCCL
    # watchdog timeout (600 s), so the restart comes before the job tears itself down blind.
    # ByteRobust treats zero RDMA traffic for 10 minutes as a hang to investigate; busy-spinning
    # GPUs on every node besides make 5 minutes enough.
    restart_seconds: float = Field(default=300.0, gt=0)
    # sichek: "sm" (nvidia-smi dmon's SM column, NVML utilization.gpu: a kernel ran in the sample
    # period) above 95. NCCL's kernels stay resident while they poll: 100% (NVIDIA/nccl#257,
    # cupy/cupy#3557: "100% occupied, although the temperature remained low").
    min_utilization_ratio: float = Field(default=0.95, ge=0, le=1)
    # sichek: SM and graphics clock above 1400 MHz (A100's top 1410 MHz), 1900 MHz for H100
    # (0x2330, top 1980 MHz): the GPU is held at its boost clock, not idling down.
    min_sm_clock_ratio: float = Field(default=0.9, ge=0, le=1)
    # sichek: power below 100 W (A100, 400 W limit), 160 W (H100, 700 W): a polling kernel on a few
    # SMs draws a fifth to a quarter of the limit, a training step 70-100% of it.
    max_power_limit_ratio: float = Field(default=0.3, ge=0, le=1)
    # sichek: memory utilization below 5%; GPM's DRAM bandwidth ratio is the same reading.
    max_dram_active_ratio: float = Field(default=0.05, ge=0, le=1)
    # sichek: PCIe RX and TX each below 20 MB/s; NVLink held to the same figure (a collective that
    # moves data over NVLink moves GB/s).
    max_pcie_bytes_per_second: float = Field(default=20e6, ge=0)
    max_nvlink_bytes_per_second: float = Field(default=20e6, ge=0)
    # ByteRobust and MegaScale: a hung job's RDMA traffic goes to zero. Subnet management and
    # keep-alives move KB/s; a 400 Gb/s port in a training step moves GB/s. Per port, each way.
    max_port_bytes_per_second: float = Field(default=1e6, ge=0)
    # A job on one node has no RDMA traffic to go flat: not judged.
    min_nodes: int = Field(default=2, ge=2)
    # A node whose report is this many intervals late says nothing current: the job is not judged.
    late_report_intervals: float = Field(default=4.0, gt=0)

    @model_validator(mode="after")
    def _restart_after_alert(self) -> TelemetryHangConfig:
        if self.restart_seconds < self.alert_seconds:
            raise ValueError("restart_seconds must not be shorter than alert_seconds")
        return self


@dataclass(slots=True)
class _Flat:
    """A job seen hung since ``since``: each port's data counters then (node, device, port)."""

    since: float
    base: dict[tuple[str, str, int], tuple[int, int]] = field(default_factory=dict)


class TelemetryHangDetector:
    name = NAME

    def __init__(self, config: TelemetryHangConfig) -> None:
        self.config = config
        self._flat: dict[str, _Flat] = {}
        # The fleet's GPUs by job, listed again only when GPUs or their attribution changed.
        self._job_nodes = JobNodes()
        # Job -> why it was not judged at the last evaluation (missing readings, a late node).
        self.unjudged: dict[str, str] = {}

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        self.unjudged = {}
        held: set[str] = set()
        for job, nodes in self._job_nodes.of(view).items():
            ranks = view.jobs.get(job)
            if ranks is not None and ranks.ranks:
                continue  # instrumented: the heartbeat hang detector judges it
            if len(nodes) < self.config.min_nodes:
                continue
            figures = self._spinning(job, nodes, now)
            if figures is None:
                continue
            counters = self._counters(job, nodes)
            if counters is None:
                continue
            flat = self._flat.get(job)
            if flat is None or self._moved(flat, counters, now):
                self._flat[job] = _Flat(now, dict(counters))
                held.add(job)
                continue
            held.add(job)
            finding = self._finding(job, nodes, flat, counters, figures, now)
            if finding is not None:
                out.append(finding)
        for job in [j for j in self._flat if j not in held]:
            del self._flat[job]
        return out

    def _spinning(self, job: str, nodes: dict[str, JobNode], now: float) -> dict[str, dict[str, float]] | None:
        """Each node's figures when every GPU of the job busy-spins; None otherwise (the reason
        noted in ``unjudged`` when the readings are missing or late, not when they are healthy)."""
        out: dict[str, dict[str, float]] = {}
        for name, entry in nodes.items():
            node = entry.node
            if now - node.last_seen > self.config.late_report_intervals * node.interval_seconds:
                self.unjudged[job] = f"{name}: report {now - node.last_seen:.0f} s old"
                return None
            figures: list[dict[str, float]] = []
            for gpu in entry.gpus:
                reading = _reading(gpu)
                if reading is None:
                    self.unjudged[job] = (f"{name} GPU {gpu.index}: no GPM readings "
                                          "(utilization, clock, power, DRAM, PCIe)")
                    return None
                if not self._spins(reading):
                    return None
                figures.append(reading)
            out[name] = {
                "gpus": float(len(figures)),
                "min_utilization_ratio": min(f["utilization"] for f in figures),
                "min_sm_clock_ratio": min(f["sm_clock"] for f in figures),
                "max_power_limit_ratio": max(f["power"] for f in figures),
                "max_dram_active_ratio": max(f["dram"] for f in figures),
                "max_pcie_bytes_per_second": max(f["pcie"] for f in figures),
                "max_nvlink_bytes_per_second": max(f["nvlink"] for f in figures),
            }
        return out

    def _spins(self, r: dict[str, float]) -> bool:
        cfg = self.config
        return (r["utilization"] >= cfg.min_utilization_ratio and r["sm_clock"] >= cfg.min_sm_clock_ratio
                and r["power"] <= cfg.max_power_limit_ratio and r["dram"] <= cfg.max_dram_active_ratio
                and r["pcie"] <= cfg.max_pcie_bytes_per_second and r["nvlink"] <= cfg.max_nvlink_bytes_per_second)

    def _counters(self, job: str, nodes: dict[str, JobNode]) -> dict[tuple[str, str, int], tuple[int, int]] | None:
        """The data counters of every active port of the job's nodes; None when a node has no
        active port with both (nothing to see go flat: unjudged)."""
        out: dict[tuple[str, str, int], tuple[int, int]] = {}
        for name, entry in nodes.items():
            found = False
            for port in entry.ports:
                state = port.last
                if not port_is_active(state):
                    continue
                xmit, rcv = (state.counters.get(c) for c in DATA_COUNTERS)
                if xmit is None or rcv is None or any(state.flags.get(c) for c in DATA_COUNTERS):
                    continue
                out[(name, port.device, port.port)] = (xmit, rcv)
                found = True
            if not found:
                self.unjudged[job] = f"{name}: no active port with RDMA data counters"
                return None
        return out

    def _moved(self, flat: _Flat, counters: dict[tuple[str, str, int], tuple[int, int]], now: float) -> bool:
        """Whether any port moved data since the job was first seen flat (a counter reset counts:
        the baseline is gone). A port first seen now takes its baseline now."""
        allowed = self.config.max_port_bytes_per_second * max(now - flat.since, 1.0)
        for key, (xmit, rcv) in counters.items():
            base = flat.base.get(key)
            if base is None:
                flat.base[key] = (xmit, rcv)
                continue
            dx, dr = xmit - base[0], rcv - base[1]
            if dx < 0 or dr < 0 or dx > allowed or dr > allowed:
                return True
        return False

    def _finding(self, job: str, nodes: dict[str, JobNode], flat: _Flat,
                 counters: dict[tuple[str, str, int], tuple[int, int]],
                 figures: dict[str, dict[str, float]], now: float) -> Finding | None:
        cfg = self.config
        held = now - flat.since
        if held < cfg.alert_seconds:
            return None
        action = Action.RESTART_JOB if held >= cfg.restart_seconds else Action.ALERT
        moved: dict[str, float] = {}
        for (name, device, port), (xmit, rcv) in counters.items():
            base = flat.base.get((name, device, port), (xmit, rcv))
            moved[name] = moved.get(name, 0.0) + (xmit - base[0]) + (rcv - base[1])
        per_node = {name: {**f, "ports": float(sum(1 for k in counters if k[0] == name)),
                           "rdma_bytes_since": moved.get(name, 0.0)}
                    for name, f in list(figures.items())[:JOB_NODES_NAMED]}
        gpus = sum(len(e.gpus) for e in nodes.values())
        return Finding(
            detector=NAME, node=WHOLE_JOB, job=job, action=action, since=flat.since, key="hang",
            reason=(f"job {job}: all {gpus} GPUs on {len(nodes)} nodes busy-spin (kernels resident, no DRAM, "
                    f"PCIe or NVLink traffic) and its RDMA ports moved no data for {held:.0f} s; no heartbeats, "
                    f"no culprit known" + ("" if action is Action.RESTART_JOB
                                           else f"; restart after {cfg.restart_seconds:.0f} s")),
            evidence={"signal": "telemetry_hang", "flat_seconds": round(held, 1),
                      "alert_seconds": cfg.alert_seconds, "restart_seconds": cfg.restart_seconds,
                      "gpus": gpus, "nodes": len(nodes), "ports": len(counters),
                      "job_nodes": sorted(nodes)[:JOB_NODES_NAMED], "culprit_nodes": [], "per_node": per_node})


def _reading(gpu: GpuHistory) -> dict[str, float] | None:
    """The GPU's busy-spin readings as ratios and bytes per second; None when any is missing."""
    s = gpu.last
    u, clock, clock_max, power, limit = (s.utilization_gpu_ratio, s.sm_clock_hertz, s.sm_clock_max_hertz,
                                         s.power_watts, s.power_limit_watts)
    dram, tx, rx = s.dram_active_ratio, s.pcie_tx_bytes_per_second, s.pcie_rx_bytes_per_second
    if u is None or clock is None or not clock_max or power is None or not limit or dram is None or tx is None \
            or rx is None:
        return None
    nvlink = max(s.nvlink_tx_bytes_per_second or 0.0, s.nvlink_rx_bytes_per_second or 0.0)
    return {"utilization": u, "sm_clock": clock / clock_max, "power": power / limit, "dram": dram,
            "pcie": max(tx, rx), "nvlink": nvlink}
