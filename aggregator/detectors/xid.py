"""Xid detector: NVIDIA Xid errors judged per GPU by the catalog's rules.

It reads each GPU's de-duplicated Xid occurrences, its row-remap flags and NVML's recovery action,
and hands them to ``judge_xids`` with NVIDIA's Xid catalog, which decides the action per code (NVLink
Xids 74 and 144-150 as their registers decode). An application-class Xid is the job's (one alert, no
removal) in the bursts its peer GPUs share, and drains its GPU only on repeated solo bursts; it does
not parse log lines (the agent does) nor hold the catalog (``xid_catalog`` does). Peer bursts, the
NVLink decode, the recovery action and the designed false-drain rate: docs/detectors.md, "xid".
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping

from pydantic import Field

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding, JobAction
from vigil.aggregator.fleet import FleetView, GpuHistory, NodeState
from vigil.aggregator.fleet.view import MarkedNodes
from vigil.aggregator.xid_catalog import (
    APP_BURST_SECONDS,
    NVML_RECOVERY_ACTIONS,
    XidCatalog,
    burst_spans,
    judge_xids,
)
from vigil.contract.validation import StrictModel

NAME = "xid"
Gpu = tuple[str, int | None]  # (node, GPU index; None: the node's Xids not tied to a GPU)
Scopes = dict[tuple[str, ...], tuple[set[Gpu], set[str]]]  # jobs (or ("", node)) -> (peer GPUs, jobs)


class XidConfig(StrictModel):
    enabled: bool = True
    # Per-code action overrides on top of NVIDIA's catalog (e.g. {13: observe} on a site whose
    # users' kernels fault often).
    overrides: dict[int, Action] = Field(default_factory=dict)
    unknown_action: Action = Action.ALERT
    # Application Xids (13, 31, 43, ...) are the job's fault once; the same code repeating on one
    # GPU across jobs within an hour points at the GPU (NVIDIA Xid guide: "if the error persists").
    window_seconds: float = Field(default=3600.0, gt=0)
    app_repeat_threshold: int = Field(default=3, ge=1)
    # A burst of an application Xid is the job's, not the GPU's, when at least this share of its
    # peer GPUs (its jobs' GPUs, else its node's) logged the same code within
    # app_peer_burst_seconds of it: the same user bug runs on every rank, a bad GPU is one.
    app_peer_share: float = Field(default=0.25, gt=0, le=1)
    # How close a peer's line must be to count as the same burst. A job-wide crash lands on every
    # rank within seconds: the ranks of a synchronous job are never a step apart (each step ends in
    # a collective), the agent stamps a line within its 0.5 s kernel-log read (agent
    # collectors.xid.interval_seconds) and places it on the aggregator's clock within 5 s
    # (fleet clock_offset_tolerance_seconds). 60 s covers steps up to ~50 s; a relaunch after a
    # crash takes minutes (requeue, model load), so the next crash is a burst of its own.
    app_peer_burst_seconds: float = Field(default=60.0, ge=0)
    job_action: JobAction = Action.ALERT
    # Act on NVML's recovery action (GpuState.recovery_action, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION):
    # the driver's own verdict, acted on from one report (gpu_reset -> reset_gpu, node_reboot ->
    # reboot_node, drain_p2p -> drain, drain_and_reset -> reset_gpu; none never acts).
    recovery_action: bool = True


class XidDetector:
    name = NAME

    def __init__(self, config: XidConfig, catalog: XidCatalog | None = None) -> None:
        self.config = config
        overrides: Mapping[int, Action] | None = config.overrides or None
        self.catalog = catalog or XidCatalog.default(overrides=overrides, unknown_action=config.unknown_action)

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        # The fleet marks the nodes with an Xid record (with the newest one's time) or a GPU asking for
        # a recovery action (MarkedNodes): only those are read (an Xid older than the window is no
        # finding), in the fleet's order; a view without it, every node (12,500 nodes of 8 GPUs:
        # 36-44 ms a pass, issue 47).
        marked = view.marked if view.revision is not None else None
        window = self.config.window_seconds  # _judge's test of each record, on the newest's time
        out = self._judge(view.nodes.values() if marked is None else [
            node for node in MarkedNodes.in_order(marked.xids) if now - node.xid_event_ts <= window], now)
        if self.config.recovery_action:
            out.extend(self._recovery_actions(
                view.nodes.values() if marked is None else MarkedNodes.in_order(marked.recovery_actions)))
        repeats = [f for f in out if f.key.endswith(":repeat")]
        if not repeats:
            return out
        kept: list[Finding] = [f for f in out if not f.key.endswith(":repeat")]
        peers_of: Scopes = {}
        lines_of: dict[tuple[tuple[str, ...], int], tuple[list[float], list[Gpu]]] = {}
        near: dict[tuple[tuple[str, ...], int, int, int], set[Gpu]] = {}
        jobs_alerted: set[tuple[str, int]] = set()
        for f in repeats:
            code = int(f.key.split(":")[1])
            scope, peers, jobs = self._scope(view, view.nodes[f.node], f.gpu, peers_of)
            if (scope, code) not in lines_of:
                lines_of[scope, code] = self._peer_lines(view, peers, code, now)
            kept.extend(self._judge_repeat(view, f, code, scope, peers, jobs, lines_of[scope, code], near,
                                           jobs_alerted, now))
        return kept

    def _judge_repeat(self, view: FleetView, f: Finding, code: int, scope: tuple[str, ...], peers: set[Gpu],
                      jobs: set[str], lines: tuple[list[float], list[Gpu]],
                      near: dict[tuple[tuple[str, ...], int, int, int], set[Gpu]],
                      jobs_alerted: set[tuple[str, int]], now: float) -> list[Finding]:
        """Split ``f``'s repeating GPU's bursts into the job's (shared by its peers) and its own."""
        cfg = self.config
        me = (f.node, f.gpu)
        others = len(peers - {me})
        needed = max(1.0, cfg.app_peer_share * others)
        records = view.nodes[f.node].xids.get(f.gpu, ())
        times = sorted(r.ts for r in records if r.code == code and f.since <= r.ts <= now
                       and now - r.ts <= cfg.window_seconds)
        own: list[tuple[float, float]] = []
        shared: list[tuple[float, float]] = []
        sharing = 0
        line_ts, line_gpu = lines
        for first, last in burst_spans(times, APP_BURST_SECONDS):
            lo = bisect_left(line_ts, first - cfg.app_peer_burst_seconds)
            hi = bisect_right(line_ts, last + cfg.app_peer_burst_seconds)
            gpus = near.get((scope, code, lo, hi))
            if gpus is None:
                gpus = near[scope, code, lo, hi] = set(line_gpu[lo:hi])
            n = len(gpus - {me})
            if others and n >= needed:
                shared.append((first, last))
                sharing = max(sharing, n)
            else:
                own.append((first, last))
        bursts = {"bursts_own": len(own), "bursts_shared": len(shared)}
        if len(own) >= cfg.app_repeat_threshold:
            what = f"Xid {code} ({self.catalog.entry(code).name})"
            excused = f"; {len(shared)} other burst(s) its peers shared were the job's" if shared else ""
            return [f.model_copy(update={
                "since": own[0][0],
                "reason": f"{what} repeated in {len(own)} separate bursts on this GPU alone within "
                          f"{cfg.window_seconds:g}s (threshold {cfg.app_repeat_threshold}){excused}: "
                          f"possible hardware fault, run diagnostics",
                "evidence": {**f.evidence, **bursts, "peers": others}})]
        scope_text = f"job {', '.join(sorted(jobs))}" if jobs else f"node {f.node}"
        out = [f.model_copy(update={
            "action": self.catalog.entry(code).action, "key": f"xid:{code}:shared",
            "reason": f"Xid {code} repeats on this GPU, and {len(shared)} of its {len(shared) + len(own)} bursts "
                      f"were shared by up to {sharing} of the {others} other GPUs of {scope_text}: the "
                      f"application's fault; {len(own)} burst(s) of its own (threshold {cfg.app_repeat_threshold})",
            "evidence": {**f.evidence, **bursts, "peers": others, "peers_sharing": sharing}})]
        for job in sorted(jobs):
            if (job, code) in jobs_alerted:
                continue
            jobs_alerted.add((job, code))
            members = sorted({n for n, _ in peers})
            out.append(Finding(
                detector=NAME, node=WHOLE_JOB, job=job, action=cfg.job_action, since=f.since,
                key=f"xid:{code}:job",
                reason=f"job {job}: application Xid {code} repeats on {sharing + 1} of its {others + 1} GPUs at "
                       f"once: the job's fault (a user's bug or input), no node is removed",
                evidence={"signal": "xid", "codes": [code], "gpus": others + 1, "gpus_sharing": sharing + 1,
                          "nodes": len(members)}))
        return out

    def _peer_lines(self, view: FleetView, peers: set[Gpu], code: int, now: float) -> tuple[list[float], list[Gpu]]:
        """Times (sorted) and GPUs of the peers' lines of ``code`` within the window (widened by
        the burst tolerance, so a burst at the window's start still sees its peers)."""
        t0 = now - self.config.window_seconds - self.config.app_peer_burst_seconds
        lines: list[tuple[float, Gpu]] = []
        for name, gpu in peers:
            node = view.nodes.get(name)
            if node is None:
                continue
            lines.extend((r.ts, (name, gpu)) for r in node.xids.get(gpu, ()) if r.code == code and t0 <= r.ts <= now)
        lines.sort(key=lambda line: line[0])
        return [ts for ts, _ in lines], [g for _, g in lines]

    @staticmethod
    def _scope(view: FleetView, node: NodeState, gpu: int | None,
               peers_of: Scopes) -> tuple[tuple[str, ...], set[Gpu], set[str]]:
        """The GPUs this GPU is compared with: every GPU of the jobs with a rank on it (a rank
        without a GPU index puts its whole node in), else every GPU of its node; computed once
        per set of jobs (a job-wide crash makes every GPU of a large job ask)."""
        jobs = tuple(sorted({r.job for r in node.ranks.values()
                             if (r.gpu is None or gpu is None or r.gpu == gpu) and r.job in view.jobs}))
        if jobs and jobs not in peers_of:
            peers: set[Gpu] = set()
            for name in jobs:
                for r in view.jobs[name].ranks.values():
                    if r.gpu is not None:
                        peers.add((r.node, r.gpu))
                    else:
                        member = view.nodes.get(r.node)
                        peers.update((r.node, g) for g in (member.gpus if member is not None else ()))
            peers_of[jobs] = (peers, set(jobs))
        if jobs and peers_of[jobs][0]:
            return (jobs, *peers_of[jobs])
        scope = ("", node.name)  # no job name is empty: the node's own scope
        if scope not in peers_of:
            peers_of[scope] = ({(node.name, g) for g in node.gpus}, set())
        return (scope, *peers_of[scope])

    @staticmethod
    def _recovery_actions(nodes: Iterable[NodeState]) -> list[Finding]:
        """The driver's recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) of each GPU in its
        node's latest report: one report is enough, it is the driver's verdict on the GPU's state
        (held until the action is done), not a sample of a noisy signal; "none" is no finding."""
        out: list[Finding] = []
        for node in nodes:
            for gpu in node.gpus.values():
                wanted = gpu.last.recovery_action
                if wanted is None or wanted == "none" or gpu.last_seen < node.last_seen:
                    continue
                action = NVML_RECOVERY_ACTIONS[wanted]
                out.append(Finding(
                    detector=NAME, node=node.name, gpu=gpu.index, action=action, since=_recovery_since(gpu, wanted),
                    key=f"recovery:{wanted}",
                    reason=f"GPU {gpu.index}: the driver's recovery action is {wanted} "
                           f"(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): {action.value}",
                    evidence={"signal": "recovery_action", "recovery_action": wanted, "uuid": gpu.uuid}))
        return out

    def _judge(self, nodes: Iterable[NodeState], now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        for node in nodes:
            for gpu, records in node.xids.items():
                if not records:
                    continue
                occurrences = [r for r in records if now - r.ts <= cfg.window_seconds]
                if not occurrences:
                    continue
                state = node.gpus[gpu].last if gpu is not None and gpu in node.gpus else None
                verdicts = judge_xids(
                    self.catalog, occurrences,
                    remap_pending=state.remap_pending if state is not None else None,
                    remap_failure=state.remap_failure if state is not None else None,
                    now=now, window_seconds=cfg.window_seconds, app_repeat_threshold=cfg.app_repeat_threshold)
                uuid = node.gpus[gpu].uuid if gpu is not None and gpu in node.gpus else None
                for v in verdicts:
                    evidence: dict[str, object] = {"signal": "xid", "codes": list(v.codes), "uuid": uuid,
                                "sources": sorted({s for r in records if r.code in v.codes for s in r.sources})}
                    if v.nvlink is not None:
                        evidence["nvlink"] = v.nvlink.evidence()
                    out.append(Finding(
                        detector=NAME, node=node.name, gpu=gpu, action=v.action, since=v.since, key=v.key,
                        reason=v.reason, latest=max(o.ts for o in occurrences if o.code in v.codes),
                        evidence=evidence))
        return out


def _recovery_since(gpu: GpuHistory, wanted: str) -> float:
    """When the GPU's reports began to carry this recovery action (its recent history's run)."""
    since = gpu.last_seen
    for sample in reversed(gpu.samples):
        if sample.recovery_action != wanted:
            break
        since = sample.ts
    return since
