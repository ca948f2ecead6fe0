"""The fleet's settings (``fleet:`` in the aggregator's configuration): how much history it keeps,
how long a silent node or job is remembered, and the caps one node's credential can make it hold.

Read by Fleet and NodeState; it decides nothing itself.
"""

from __future__ import annotations

from pydantic import Field

from vigil.contract.validation import StrictModel


class FleetConfig(StrictModel):
    # Non-zero counter increases kept per series (zero increases are not stored: a healthy
    # counter costs nothing). 240 is 10 minutes of a counter that moves every 2.5 s report.
    history_reports: int = Field(default=240, ge=4, le=100_000)
    # Compact per-report GPU and port samples (flags, clocks, state) for persistence checks:
    # 32 reports is 80 s at 2.5 s, enough for the thermal detector's 60 s persistence. The
    # whole fleet state measures ~0.25 MB per 8-GPU node (~3 GB for 12,500 nodes).
    state_history_reports: int = Field(default=32, ge=4, le=10_000)
    # Per-rank summary windows kept for the straggler's consecutive-window test (one entry per
    # agent window, not per report: 16 is 80 s of 5 s windows; the detector judges each window
    # once, within a reporting interval of its end, and keeps only its verdicts after that).
    rank_history_reports: int = Field(default=16, ge=2, le=10_000)
    event_history: int = Field(default=256, ge=8)
    # An Xid seen by the kernel log and by NVML's event API is one fault; both readers timestamp
    # it within a second or two of each other.
    xid_dedup_seconds: float = Field(default=5.0, ge=0)
    # A job none of whose ranks reported for this long is forgotten (bounded memory).
    job_forget_seconds: float = Field(default=3600.0, gt=0)
    # Membership. A node silent this long has left the fleet: it is forgotten (its summary is
    # handed to the store's archive), decisions may no longer name it, and it no longer counts
    # toward the breaker's budget. A day: far beyond any reboot or network blip (minutes), and
    # beyond the silence detector's own action (minutes), so nothing still being judged is
    # dropped; a node back from a multi-day repair re-joins as new with a fresh baseline.
    forget_after_seconds: float = Field(default=86400.0, ge=60)
    # A node whose clock is further than this from the aggregator's is reported as skewed (its
    # node state, vigil_aggregator_nodes_clock_skewed, VigilNodeClockSkewed); its reports and
    # events are still taken, their times placed on the aggregator's clock. NTP keeps a cluster
    # within milliseconds; two minutes is far beyond any drift, so only a step or a dead time
    # source shows.
    max_clock_skew_seconds: float = Field(default=120.0, gt=0)
    # A report's own time minus its receive time is the node's clock offset less the report's
    # delay (the agent stamps a report just before sending it; its POST times out after 5 s). An
    # offset within this of the one held is that delay, not a new offset: the held one (0 for a
    # node within it of the aggregator: nothing is moved) places event and window times.
    clock_offset_tolerance_seconds: float = Field(default=5.0, gt=0)
    # State one node's credential can make the aggregator keep, over time and not only per report
    # (the wire bounds a report: 256 GPUs, 256 ports, 1,024 ranks). What is over a cap is refused
    # and counted (vigil_aggregator_refusals_total{door="reports"}, reason too_many_gpus,
    # too_many_ports, too_many_counters, too_many_ranks, too_many_jobs; too_many_pcie_devices
    # below); ports, ranks and jobs
    # not in the node's latest report are evicted first, oldest first, so only a report listing
    # more than a cap at once is refused. GPUs are never evicted: one that left the reports is
    # the evidence of a GPU fallen off the bus. The largest nodes have 8 to 16 GPUs and as many
    # RDMA ports (HGX/DGX: 8 ConnectX plus 2 BlueField ports of two each); 64 of each is four
    # times that.
    max_gpus_per_node: int = Field(default=64, ge=1, le=1 << 20)
    max_ports_per_node: int = Field(default=64, ge=1, le=1 << 20)
    # Counter names kept per port (a compact entry merges the ones that moved into the port's):
    # mlx5 exposes ~30 port counters and ~60 hw_counters; a report entry carries at most 256.
    max_counters_per_port: int = Field(default=256, ge=1, le=1 << 20)
    # The agent holds at most 256 ranks and 16 jobs (training.max_ranks, training.max_jobs) and
    # reports each while it lives and 15 minutes after: twice that here, so a site that raises the
    # agent's limits has room before anything is refused. Raise these with them.
    max_ranks_per_node: int = Field(default=512, ge=1, le=1 << 20)
    max_jobs_per_node: int = Field(default=32, ge=1, le=1 << 20)
    # A (job, rank) a node reported live (running or hung) within this long is that node's: another
    # node's report naming it is refused for that entry (rank_owner_conflict) until the hold lapses.
    # A rank that really moved (a requeued job on new nodes) ended on its old node first: its agent
    # reports it "exited" within a collector cycle, which ends the hold at once; 30 s is twelve
    # reports at 2.5 s, beyond a lost report or two of a node that still claims it.
    rank_hold_seconds: float = Field(default=30.0, gt=0)
    # The sequence number of a boot may advance by at most this many reports per second since
    # the node's last accepted report, plus ``max_seq_jump``: enough for urgent pushes between
    # periodic ones, never the 2**62 jump that would make every real report look replayed.
    max_reports_per_second: float = Field(default=20.0, gt=0)
    max_seq_jump: int = Field(default=1000, ge=1)
    # PCIe devices kept per node from a report's ``pcie`` section (GPUs and HCAs: 16 + 16 on the
    # largest nodes; the wire allows 256). Over it, the rest of a section is refused and counted
    # (reason too_many_pcie_devices).
    max_pcie_devices_per_node: int = Field(default=64, ge=1, le=1 << 20)
