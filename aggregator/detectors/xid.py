"""Xid detector: NVIDIA Xid errors judged per GPU by the catalog's rules.

It reads each GPU's de-duplicated Xid occurrences (an Xid seen by both the kernel log and NVML
is one) and its row-remap flags, and hands them to ``judge_xids`` with NVIDIA's Xid catalog: the
catalog decides the action per code, repetition rules turn repeated application Xids into a node
problem. It does not parse log lines (the agent does) nor hold the catalog (xid_catalog does).

Peer-relative: an application-class Xid (the catalog's category "app": 13, 31, 43, 45, 68, ...)
repeating on one GPU points at the GPU only while its peers (the other GPUs of its jobs, or of
its node when no job is known) do not log the same code. A user's bug on every GPU of a job is
the job's: one alert for the job, no removal. Designed false-drain rate: a job-wide application
fault never drains (0 by construction); a GPU is drained only on >= 3 separate bursts within an
hour while at most a quarter of its peers share the code.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from vigil.agent.validation import StrictModel
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.fleet import FleetView, NodeState
from vigil.aggregator.xid_catalog import XidCatalog, XidOccurrence, judge_xids

NAME = "xid"


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
    # A repeating application Xid is the GPU's only while fewer than this share of its peer GPUs
    # (its jobs' GPUs, else its node's) logged the same code within the window: the same user
    # bug runs on every rank, a bad GPU is one.
    app_peer_share: float = Field(default=0.25, gt=0, le=1)
    job_action: Action = Action.ALERT


class XidDetector:
    name = NAME

    def __init__(self, config: XidConfig, catalog: XidCatalog | None = None) -> None:
        self.config = config
        overrides: Mapping[int, Action] | None = config.overrides or None
        self.catalog = catalog or XidCatalog.default(overrides=overrides, unknown_action=config.unknown_action)

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out = self._judge(view, now)
        repeats = [f for f in out if f.key.endswith(":repeat")]
        if not repeats:
            return out
        # Peer-relative: which GPUs logged each application code within the window.
        cfg = self.config
        having: dict[int, set[tuple[str, int | None]]] = {}
        for f in repeats:
            code = int(f.key.split(":")[1])
            if code in having:
                continue
            having[code] = {(n.name, gpu) for n in view.nodes.values() for gpu, records in n.xids.items()
                            if any(r.code == code and now - r.ts <= cfg.window_seconds for r in records)}
        kept: list[Finding] = [f for f in out if not f.key.endswith(":repeat")]
        jobs_alerted: set[tuple[str, int]] = set()
        for f in repeats:
            code = int(f.key.split(":")[1])
            node = view.nodes[f.node]
            peers, jobs = self._peers(view, node, f.gpu)
            sharing = len((peers & having[code]) - {(f.node, f.gpu)})
            others = len(peers - {(f.node, f.gpu)})
            if others == 0 or sharing < max(1.0, cfg.app_peer_share * others):
                kept.append(f)
                continue
            scope = f"job {', '.join(sorted(jobs))}" if jobs else f"node {f.node}"
            kept.append(f.model_copy(update={
                "action": self.catalog.entry(code).action, "key": f"xid:{code}:shared",
                "reason": f"Xid {code} repeats on this GPU and on {sharing} of the {others} other GPUs of "
                          f"{scope}: the application's fault, not this GPU's",
                "evidence": {**f.evidence, "peers": others, "peers_sharing": sharing}}))
            for job in sorted(jobs):
                if (job, code) in jobs_alerted:
                    continue
                jobs_alerted.add((job, code))
                members = sorted({n for n, _ in peers})
                kept.append(Finding(
                    detector=NAME, node=members[0], job=job, action=cfg.job_action, since=f.since,
                    key=f"xid:{code}:job",
                    reason=f"job {job}: application Xid {code} repeats on {sharing + 1} of its {others + 1} GPUs: "
                           f"the job's fault (a user's bug or input), no node is removed",
                    evidence={"signal": "xid", "codes": [code], "gpus": others + 1, "gpus_sharing": sharing + 1,
                              "nodes": len(members)}))
        return kept

    @staticmethod
    def _peers(view: FleetView, node: NodeState, gpu: int | None) -> tuple[set[tuple[str, int | None]], set[str]]:
        """The GPUs this GPU is compared with: every GPU of the jobs with a rank on it (a rank
        without a GPU index puts its whole node in), else every GPU of its node."""
        jobs = {r.job for r in node.ranks.values() if r.gpu is None or gpu is None or r.gpu == gpu}
        peers: set[tuple[str, int | None]] = set()
        for name in jobs:
            job = view.jobs.get(name)
            if job is None:
                continue
            for r in job.ranks.values():
                if r.gpu is not None:
                    peers.add((r.node, r.gpu))
                else:
                    member = view.nodes.get(r.node)
                    peers.update((r.node, g) for g in (member.gpus if member is not None else ()))
        if not peers:
            peers = {(node.name, g) for g in node.gpus}
        return peers, {j for j in jobs if j in view.jobs}

    def _judge(self, view: FleetView, now: float) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        for node in view.nodes.values():
            for gpu, records in node.xids.items():
                if not records:
                    continue
                occurrences = [XidOccurrence(code=r.code, ts=r.ts, count=r.count, message=r.message)
                               for r in records if now - r.ts <= cfg.window_seconds]
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
                    out.append(Finding(
                        detector=NAME, node=node.name, gpu=gpu, action=v.action, since=v.since, key=v.key,
                        reason=v.reason, latest=max(o.ts for o in occurrences if o.code in v.codes),
                        evidence={"signal": "xid", "codes": list(v.codes), "uuid": uuid,
                                  "sources": sorted({s for r in records if r.code in v.codes for s in r.sources})}))
        return out
