"""amdgpu detector: AMD Instinct kernel-log events judged per GPU by aggregator/amdgpu_catalog.py.

It reads each node's recent events of kind ``amdgpu_*`` (the agent's xid collector parses the
driver's lines: RAS uncorrectable errors, the fatal RAS interrupt, poison consumption, the bad-page
threshold, failed GPU resets, ring timeouts) and decides per GPU: a hardware event acts from one
line with its catalog action; a ring timeout is the job's unless it repeats on one GPU in separate
bursts; correctable counts, soft-recovered timeouts and successful resets never act. It parses no
line and keeps no state. Window, thresholds, false-removal rate: docs/detectors.md, "amdgpu".
"""

from __future__ import annotations

from pydantic import Field

from vigil.aggregator.amdgpu_catalog import AmdgpuCatalog, block_name, event_name
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.fleet import FleetView, NodeState
from vigil.aggregator.fleet.view import MarkedNodes
from vigil.aggregator.xid_catalog import APP_BURST_SECONDS, burst_spans
from vigil.contract.validation import StrictModel
from vigil.contract.wire import Event

NAME = "amdgpu"


class AmdgpuConfig(StrictModel):
    """AMD GPUs' kernel-log events (amdgpu RAS errors, poison, bad pages, failed resets, ring timeouts)."""

    enabled: bool = True
    # Per-event action overrides on top of vigil's amdgpu catalog (e.g. {ring_timeout: alert}).
    overrides: dict[str, Action] = Field(default_factory=dict)
    # How long an event keeps its GPU's finding (as the xid detector's window: one hour).
    window_seconds: float = Field(default=3600.0, gt=0)
    # A ring timeout is the job's (its kernel hung) once; the same GPU timing out in this many
    # separate bursts within the window points at the GPU, as NVIDIA's guidance for Xid 8/13
    # ("if the error persists"): vigil's xid detector's app_repeat_threshold.
    ring_timeout_repeat_threshold: int = Field(default=3, ge=1)
    ring_timeout_repeat_action: Action = Action.DRAIN


class AmdgpuDetector:
    name = NAME

    def __init__(self, config: AmdgpuConfig) -> None:
        self.config = config
        self.catalog = AmdgpuCatalog(config.overrides or None)

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        horizon = now - self.config.window_seconds
        # The fleet marks the nodes that reported an amdgpu event, with the newest one's time
        # (MarkedNodes.amdgpu_events, NodeState.amdgpu_event_ts): only those with one in the window
        # are read, in the fleet's order (a walk of 12,500 NodeStates: 5-7 ms a pass, issue 47).
        marked = view.marked if view.revision is not None else None
        nodes = view.nodes.values() if marked is None else [
            node for node in MarkedNodes.in_order(marked.amdgpu_events) if node.amdgpu_event_ts >= horizon]
        for node in nodes:
            if not node.events:
                continue
            # (gpu, event name, block) -> the times of its lines in the window, oldest first.
            seen: dict[tuple[int | None, str, int | None], list[float]] = {}
            last: dict[tuple[int | None, str, int | None], Event] = {}
            for ts, event in reversed(node.events):
                if ts < horizon:
                    break
                name = event_name(event.kind)
                if name is None or ts > now:
                    continue
                key = (_gpu_of(node, event), name, event.code)
                seen.setdefault(key, []).append(ts)
                last.setdefault(key, event)
            for key, times in seen.items():
                times.reverse()
                finding = self._judge(node, key, times, last[key])
                if finding is not None:
                    out.append(finding)
        return out

    def _judge(self, node: NodeState, key: tuple[int | None, str, int | None], times: list[float],
               event: Event) -> Finding | None:
        gpu, name, code = key
        entry = self.catalog.entry(name)
        block = block_name(code)
        where = f" in the {block} block" if block else ""
        subject = f"GPU {gpu}" if gpu is not None else "an unnamed GPU"
        evidence: dict[str, object] = {"signal": "amdgpu", "event": name, "block": block, "lines": len(times),
                                       "uuid": node.gpus[gpu].uuid if gpu is not None and gpu in node.gpus else None,
                                       "source": entry.source, "message": event.message}
        action = entry.action
        finding_key = f"amdgpu:{name}" + (f":{block}" if block else "")
        if entry.category == "app":
            bursts = burst_spans(times, APP_BURST_SECONDS)
            evidence["bursts"] = len(bursts)
            if len(bursts) >= self.config.ring_timeout_repeat_threshold:
                action = self.config.ring_timeout_repeat_action
                finding_key += ":repeat"
                reason = (f"{subject}: amdgpu {name} in {len(bursts)} separate bursts within "
                          f"{self.config.window_seconds:g}s (threshold {self.config.ring_timeout_repeat_threshold}): "
                          f"possible hardware fault, run diagnostics")
                return self._finding(node, gpu, action, times[0], finding_key, reason, evidence, times[-1])
            reason = (f"{subject}: amdgpu {name} ({entry.meaning}) in {len(bursts)} burst(s): the job's, "
                      f"until it repeats {self.config.ring_timeout_repeat_threshold} times on this GPU")
            return self._finding(node, gpu, action, times[0], finding_key, reason, evidence, times[-1])
        if action == Action.OBSERVE:
            return None  # the driver working (a correctable count, a soft recovery, a reset that succeeded)
        if gpu is None and action == Action.RESET_GPU:
            action = Action.DRAIN  # a line that names no GPU we know: the node, not a GPU to reset
        reason = f"{subject}: {len(times)} amdgpu {name} line(s){where}: {entry.meaning} -> {action.value}"
        return self._finding(node, gpu, action, times[0], finding_key, reason, evidence, times[-1])

    @staticmethod
    def _finding(node: NodeState, gpu: int | None, action: Action, since: float, key: str, reason: str,
                 evidence: dict[str, object], latest: float) -> Finding:
        return Finding(detector=NAME, node=node.name, gpu=gpu, action=action, since=since, key=key, reason=reason,
                       latest=latest, evidence=evidence)


def _gpu_of(node: NodeState, event: Event) -> int | None:
    """The event's GPU: as the agent named it (one its node reports; an index it does not report is
    no GPU to reset), else the node's GPU of the PCI bus id it names."""
    if event.gpu is not None:
        return event.gpu if event.gpu in node.gpus else None
    if event.pci_bus_id is None:
        return None
    wanted = _bus(event.pci_bus_id)
    for hist in node.gpus.values():
        if hist.last.pci_bus_id and _bus(hist.last.pci_bus_id) == wanted:
            return hist.index
    return None


def _bus(text: str) -> tuple[int, ...] | str:
    """A PCI bus id as numbers ("00000000:DD:00.0" == "0000:dd:00"), or the text where it is none."""
    try:
        return tuple(int(p, 16) for p in text.split(".", 1)[0].split(":")[-3:])
    except ValueError:
        return text.lower()
