"""Xid detector: NVIDIA Xid errors judged per GPU by the catalog's rules.

It reads each GPU's de-duplicated Xid occurrences (an Xid seen by both the kernel log and NVML
is one) and its row-remap flags, and hands them to ``judge_xids`` with NVIDIA's Xid catalog: the
catalog decides the action per code, repetition rules turn repeated application Xids into a node
problem. It does not parse log lines (the agent does) nor hold the catalog (xid_catalog does).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from agent.collectors.collector import StrictModel
from aggregator.decision import Action, Finding
from aggregator.fleet import FleetView
from aggregator.xid_catalog import XidCatalog, XidOccurrence, judge_xids

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


class XidDetector:
    name = NAME

    def __init__(self, config: XidConfig, catalog: XidCatalog | None = None) -> None:
        self.config = config
        overrides: Mapping[int, Action] | None = config.overrides or None
        self.catalog = catalog or XidCatalog.default(overrides=overrides, unknown_action=config.unknown_action)

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
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
                        reason=v.reason,
                        evidence={"signal": "xid", "codes": list(v.codes), "uuid": uuid,
                                  "sources": sorted({s for r in records if r.code in v.codes for s in r.sources})}))
        return out
