"""Reports as the real agent sends them, for the ingest benchmark (bench/bench_ingest.py) and the
load generator (``vigil loadgen``): consecutive reports of one agent built by the agent's own
pipeline over FakeNvml (8x H100 SXM training at their power cap, a process each), 8 ConnectX-7
HCAs with their traffic counters moving, and 8 training ranks sending heartbeats; then given a
node's name, boot id, seq, time and rank numbers.

It reads a scratch directory of its own (the HCA sysfs tree, the kernel log) and emits report
dicts (each round in the forms the agent can send it: whole, and compact relative to the round
before) and pre-rendered JSON templates; it sends nothing and talks to no service.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vigil.agent.attribution import IN_PROCESS
from vigil.agent.config import AggregatorTarget, parse_config
from vigil.agent.daemon import Agent
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.agent.report_delta import delta, whole
from vigil.agent.runner import collect_once
from vigil.contract.seams import Seams
from vigil.contract.wire import Report, convert
from vigil.sim import fabric

HCAS = 8
RANKS = 8
INTERVAL_SECONDS = 2.5  # the agent's default report interval
TELEMETRY_SECONDS = AggregatorTarget().telemetry_seconds  # and how often its compact ones carry telemetry
START_TS = 1_700_000_000.0
# The GPUs as a real H100 training node reports them: busy at the power cap (sw_power_cap), a
# process per GPU (scenarios/node/training-h100.yaml, from the real H100 recording).
SCENARIO = "training-h100"
# Counters that move on a busy NDR port between two reports (bytes are in 4-byte words in sysfs).
TRAFFIC = {"port_xmit_data": 2_500_000_000, "port_rcv_data": 2_500_000_000, "port_xmit_packets": 2_400_000,
           "port_rcv_packets": 2_400_000, "unicast_xmit_packets": 2_400_000, "unicast_rcv_packets": 2_400_000,
           "port_xmit_wait": 30_000}


class Clock:
    def __init__(self, t: float = START_TS) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def build_agent(tmp: Path, clock: Clock, hca_template: Path | None = None) -> Agent:
    """The real agent over FakeNvml (``SCENARIO``) and an 8-HCA sysfs tree under ``tmp``:
    ``hca_template`` (a recorded ``class/infiniband/<hca>`` directory) copied 8 times, or the
    fleet simulator's ConnectX-7 NDR tree when None (it ships with the package)."""
    kmsg = tmp / "kern.log"
    kmsg.write_text("")
    sysfs = tmp / "sys"
    if hca_template is not None:
        ib = sysfs / "class" / "infiniband"
        ib.mkdir(parents=True)
        for i in range(HCAS):
            shutil.copytree(hca_template, ib / f"mlx5_{i}")
    else:
        fabric.build_tree(sysfs, HCAS)
    config = parse_config({"node": "bench-node", "nvml": {"backend": "fake", "scenario": SCENARIO}})
    backend = PynvmlBackend(FakeNvml(load_node_scenario(SCENARIO), clock, start=clock()))
    backend.init()
    proc = tmp / "proc"  # the ranks' processes, as a node without Slurm or pods shows them (pid only)
    proc.mkdir()
    seams = Seams(nvml=backend, clock=clock, kmsg=str(kmsg), sysfs_root=sysfs, state_dir=tmp, proc_root=proc,
                  extra={"pid_alive": lambda pid: True})
    return Agent(config, seams)


def agent_reports(rounds: int, hca_template: Path | None = None, interval_seconds: float = INTERVAL_SECONDS,
                  compact: bool = False, build_cpu_seconds: list[float] | None = None) -> list[dict[str, Any]]:
    """``rounds`` consecutive reports of one agent (JSON-ready dicts, as the agent serialises
    them), one every ``interval_seconds`` of its fake clock; the first cycle (no deltas yet) is
    not among them. Each is whole (no report was accepted), or with ``compact`` each report was
    accepted, so the first is whole and each later one lists what changed since the one before
    (its ``base_seq`` is renumbered by ``for_node``), the telemetry that moved only every
    ``TELEMETRY_SECONDS`` of the fake clock (in the 13th of 13 rounds at 2.5 s).
    ``build_cpu_seconds``, when given, gets the CPU time of each of those reports' building by
    the Reporter (build_body, and taking the answer when ``compact``), for bench_agent."""
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="vigil-reports-") as d:
        agent = build_agent(Path(d), clock, hca_template)
        training = next(c for c in agent.collectors if c.name == "training")
        files = [(f, TRAFFIC[f.name]) for f in Path(d).glob("sys/class/infiniband/*/ports/*/counters/*")
                 if f.name in TRAFFIC]
        out = []
        try:
            for seq in range(rounds + 1):
                clock.t += interval_seconds
                for f, step in files:
                    f.write_text(f"{int(f.read_text()) + step}\n")
                for rank in range(RANKS):
                    for step_n in (2 * seq, 2 * seq + 1):
                        # A real step's time wanders by about 1% from step to step (so each window's
                        # quantiles differ, and a compact report carries them); the data time does not.
                        jitter = ((rank * 31 + step_n * 17) % 9 - 4) * 0.003
                        hb = {"job": "llm-405b", "rank": rank, "step": step_n, "step_seconds": 1.21 + jitter,
                              "compute_seconds": 0.91 + 0.7 * jitter, "comm_seconds": 0.28 + 0.3 * jitter,
                              "data_seconds": 0.02, "gpu": rank, "pid": 4000 + rank}
                        training.ingest(json.dumps(hb).encode(), clock.t, IN_PROCESS)  # type: ignore[attr-defined]
                for c in agent.collectors:
                    agent.snapshot.put(c.name, collect_once(c, clock.t))
                started = time.process_time()
                body = agent.reporter.build_body()[0]
                if compact and seq > 0:  # accepted: the base of the next (the first kept is whole)
                    agent.reporter.accepted({"status": "accepted"})
                if seq > 0:  # the first cycle has no deltas yet
                    if build_cpu_seconds is not None:
                        build_cpu_seconds.append(time.process_time() - started)
                    out.append(json.loads(body))
        finally:
            for c in agent.collectors:
                c.close()
    return out


@dataclass(frozen=True)
class RoundForms:
    """One round of an agent's reports in each form the agent sends it (agent/reporter.py): whole
    (the first, or after a 409 ``delta_base``), and compact relative to the round before
    (``base_seq`` renumbered by ``for_node``); None when the structure changed and the agent
    would send it whole."""

    whole: dict[str, Any]
    compact: dict[str, Any] | None


def report_forms(rounds: int, hca_template: Path | None = None,
                 interval_seconds: float = INTERVAL_SECONDS) -> list[RoundForms]:
    """``agent_reports``' rounds in both forms, built with the agent's own functions
    (report_delta.whole and report_delta.delta). The first
    round's compact form is relative to the last round, so a sender may cycle through them. As
    the agent does by default, a compact form carries the telemetry that moved once every
    ``TELEMETRY_SECONDS`` of rounds (every 12th at 2.5 s) and holds it back in the others."""
    states = [whole(convert(r, Report)) for r in agent_reports(rounds, hca_template, interval_seconds)]
    every = max(1, round(TELEMETRY_SECONDS / interval_seconds))
    out = []
    for k, state in enumerate(states):
        # delta puts held-back telemetry back into the state it is given: give it a copy.
        compact = delta(states[k - 1], copy.deepcopy(state), telemetry=k % every == 0)
        out.append(RoundForms(state, None if compact is None else {**compact, "base_seq": state["seq"] - 1}))
    return out


def topology_of(n: int) -> dict[str, str]:
    """Node ``n``'s place: 256 nodes a row, 8 a rack, 32 a leaf switch."""
    return {"row": f"row-{n // 256}", "rack": f"rack-{n // 8}", "leaf_switch": f"leaf-{n // 32}"}


def for_node(template: dict[str, Any], n: int, node: str, boot_id: str, seq: int, ts: float) -> dict[str, Any]:
    """``template`` as node number ``n`` sends it: its name, boot id, seq, time, place, and rank
    numbers ``8n..8n+7`` (times in the ranks keep their distance to the report's ``ts``)."""
    shift = ts - template["ts"]
    report = dict(template, node=node, boot_id=boot_id, seq=seq, ts=ts)
    if "base_seq" in template:  # compact: relative to this node's previous report; its place is known
        report["base_seq"] = seq - 1
    else:
        report["topology"] = topology_of(n)
    report["ranks"] = [
        {**r, "rank": n * RANKS + r["rank"], **{k: v + shift for k, v in r.items() if k.endswith("_ts")}}
        for r in template["ranks"]]
    return report


_SLOT = re.compile(rb'"@@vigil:([a-z_]+):(-?[0-9.e+-]+)@@"')


@dataclass(frozen=True)
class RenderedReport:
    """One report's JSON cut around what differs per node and send, so that rendering a send is
    a join of bytes (a 28 KiB ``json.dumps`` per send would cost the generator more than the
    aggregator's whole intake). Slots: ``node``, ``boot_id``, ``seq``, ``ts`` (+ offset seconds),
    ``rank`` (+ offset), and ``topology`` in a whole report or ``base_seq`` (seq - 1) in a
    compact one (which leaves the unchanged topology out)."""

    parts: tuple[bytes, ...]  # len(slots) + 1 pieces of literal JSON
    slots: tuple[tuple[str, float], ...]  # (kind, offset) between consecutive parts

    @classmethod
    def of(cls, template: dict[str, Any]) -> RenderedReport:
        ts = template["ts"]
        marked = dict(template, node="@@vigil:node:0@@", boot_id="@@vigil:boot_id:0@@", seq="@@vigil:seq:0@@",
                      ts="@@vigil:ts:0@@")
        if "base_seq" in template:
            marked["base_seq"] = "@@vigil:base_seq:0@@"
        else:
            marked["topology"] = "@@vigil:topology:0@@"
        marked["ranks"] = [
            {**r, "rank": f"@@vigil:rank:{r['rank']}@@",
             **{k: f"@@vigil:ts:{v - ts!r}@@" for k, v in r.items() if k.endswith("_ts")}}
            for r in template["ranks"]]
        raw = json.dumps(marked, separators=(",", ":")).encode()
        pieces = _SLOT.split(raw)  # literal, kind, offset, literal, kind, offset, ..., literal
        parts = tuple(pieces[0::3])
        slots = tuple((kind.decode(), float(offset)) for kind, offset in zip(pieces[1::3], pieces[2::3], strict=True))
        return cls(parts, slots)

    def render(self, n: int, node_json: bytes, boot_json: bytes, topology_json: bytes, seq: int, ts: float) -> bytes:
        """The report of node number ``n`` (its name, boot id and topology given as JSON bytes)."""
        out = [self.parts[0]]
        for (kind, offset), part in zip(self.slots, self.parts[1:], strict=True):
            if kind == "ts":
                out.append(repr(ts + offset).encode())
            elif kind == "rank":
                out.append(str(n * RANKS + int(offset)).encode())
            elif kind == "seq":
                out.append(str(seq).encode())
            elif kind == "base_seq":
                out.append(str(seq - 1).encode())
            elif kind == "node":
                out.append(node_json)
            elif kind == "boot_id":
                out.append(boot_json)
            else:
                out.append(topology_json)
            out.append(part)
        return b"".join(out)
