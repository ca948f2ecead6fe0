"""The amdgpu detector: AMD kernel-log events judged per GPU, and the lookalikes that must not act."""

from __future__ import annotations

from pathlib import Path

from tests.aggregator.conftest import FakeNode
from vigil.agent.collectors.xid import XidCollector, XidConfig
from vigil.agent.kernel_log_readers import StreamReader
from vigil.aggregator.amdgpu_catalog import ENTRIES, AmdgpuCatalog
from vigil.aggregator.decision import REMOVING_ACTIONS, Action
from vigil.aggregator.detectors.amdgpu import AmdgpuConfig, AmdgpuDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import Event

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "kernel-log" / "amdgpu"
DETECTOR = AmdgpuDetector(AmdgpuConfig())


def amd(name: str, ts: float, gpu: int | None = 0, code: int | None = None, pci: str | None = None) -> Event:
    return Event(kind=f"amdgpu_{name}", ts=ts, code=code, gpu=gpu, pci_bus_id=pci, source="kmsg", urgent=True)


def judge(events_at: dict[float, list[Event]], end: float = 30.0, config: AmdgpuConfig | None = None):
    detector = AmdgpuDetector(config) if config else DETECTOR
    node = FakeNode("a")
    fleet = Fleet()
    t = 0.0
    while t <= end:
        fleet.ingest(node.report(t, events=events_at.get(t, [])), t)
        t += 2.5
    return detector.evaluate(fleet.view(), t - 2.5)


def test_uncorrectable_umc_error_resets_its_gpu_from_one_line():
    [f] = judge({10.0: [amd("ras_uncorrectable", 9.0, gpu=3, code=0)]})
    assert (f.gpu, f.action, f.key) == (3, Action.RESET_GPU, "amdgpu:ras_uncorrectable:umc")
    assert f.evidence["block"] == "umc" and f.since == 9.0


def test_uncorrectable_xgmi_error_is_its_own_episode():
    found = judge({10.0: [amd("ras_uncorrectable", 9.0, gpu=2, code=7), amd("ras_uncorrectable", 9.5, gpu=2, code=0)]})
    assert sorted(f.key for f in found) == ["amdgpu:ras_uncorrectable:umc", "amdgpu:ras_uncorrectable:xgmi_wafl"]


def test_failed_reset_reboots_and_bad_page_threshold_inspects():
    found = judge({10.0: [amd("gpu_reset_failed", 9.0), amd("bad_page_threshold", 9.1, gpu=1)]})
    assert {f.key: f.action for f in found} == {"amdgpu:gpu_reset_failed": Action.REBOOT_NODE,
                                                "amdgpu:bad_page_threshold": Action.INSPECT_HARDWARE}


def test_lookalikes_do_not_act():
    # A correctable count, a timeout the driver soft-recovered, a reset that succeeded: no finding.
    assert judge({10.0: [amd("ras_correctable", 9.0, code=0), amd("ring_timeout_recovered", 9.1),
                         amd("gpu_reset_begin", 9.2), amd("gpu_reset_succeeded", 9.3)]}) == []


def test_a_users_ring_timeout_once_is_the_jobs():
    [f] = judge({10.0: [amd("ring_timeout", 9.0, gpu=None), amd("gpu_reset_begin", 9.0, gpu=1),
                        amd("gpu_reset_succeeded", 9.4, gpu=1)]})
    assert f.action is Action.OBSERVE and f.evidence["bursts"] == 1


def test_ring_timeouts_repeating_in_separate_bursts_drain():
    events = {float(t): [amd("ring_timeout", t - 0.5, gpu=4)] for t in (10, 300, 600)}
    [f] = judge(events, end=700.0)
    assert f.action is Action.DRAIN and f.key == "amdgpu:ring_timeout:repeat" and f.evidence["bursts"] == 3
    # Two bursts: still the job's.
    [g] = judge({float(t): [amd("ring_timeout", t - 0.5, gpu=4)] for t in (10, 300)}, end=700.0)
    assert g.action is Action.OBSERVE


def test_a_line_naming_no_gpu_drains_the_node_instead_of_resetting():
    [f] = judge({10.0: [amd("poison_consumed", 9.0, gpu=None)]})
    assert f.gpu is None and f.action is Action.DRAIN
    # A GPU index the node does not report (FakeNode has 8) is no GPU to reset either.
    [g] = judge({10.0: [amd("poison_consumed", 9.0, gpu=4000)]})
    assert g.gpu is None and g.action is Action.DRAIN


def test_bus_id_names_the_gpu_when_the_agent_could_not():
    # FakeNode's GPU 2 is on 00000000:1A:00.0 (NVML's form); the line named 0000:1a:00.
    [f] = judge({10.0: [amd("ras_fatal", 9.0, gpu=None, pci="0000:1a:00")]})
    assert f.gpu == 2 and f.action is Action.RESET_GPU


def test_events_age_out_and_overrides_win():
    assert judge({10.0: [amd("ras_fatal", 9.0)]}, end=4000.0, config=AmdgpuConfig(window_seconds=600.0)) == []
    [f] = judge({10.0: [amd("ras_fatal", 9.0)]}, config=AmdgpuConfig(overrides={"ras_fatal": Action.ALERT}))
    assert f.action is Action.ALERT


def test_unknown_event_alerts_and_every_entry_has_a_source():
    [f] = judge({10.0: [amd("something_new", 9.0)]})
    assert f.action is Action.ALERT
    assert all(e.source for e in ENTRIES) and len(AmdgpuCatalog().names()) == len(ENTRIES)


class _Gpus:
    """The GPU backend's identity, as an MI300X node's amd-smi reports bus ids."""

    rows = [(0, "GPU-amd-0", "0000:08:00.0"), (1, "GPU-amd-1", "0000:dd:00.0")]

    def device_count(self) -> int:
        return len(self.rows)

    def identity(self, index: int):
        from types import SimpleNamespace

        i, uuid, bus = self.rows[index]
        return SimpleNamespace(index=i, uuid=uuid, pci_bus_id=bus)


def test_real_lines_through_the_collector_to_decisions():
    """Real driver lines (fixtures) -> the agent's xid collector -> wire events -> the detector."""
    import io

    text = "".join((FIXTURES / name).read_text() for name in
                   ("incident-mi50-umc-ue.log", "rocm-4021-mi300x-xgmi-ce-mode1-reset.log"))
    collector = XidCollector(XidConfig(), open_source=lambda: StreamReader(io.StringIO(text)), nvml=_Gpus())
    try:
        collected = collector.collect(100.0)
    finally:
        collector.close()
    kinds = sorted(e.kind for e in collected.events)
    assert "amdgpu_ras_uncorrectable" in kinds and "amdgpu_ras_correctable" in kinds
    counted = {(dict(s.labels)["gpu"], dict(s.labels)["event"]): s.value
               for s in collected.samples if s.name == "vigil_amdgpu_events_total"}
    assert counted[("0", "ras_uncorrectable")] == 1 and counted[("1", "gpu_reset_begin")] == 1
    assert counted[("", "gpu_reset_begin")] == 1  # "amdgpu: GPU reset begin!" names no device
    node = FakeNode("a")
    fleet = Fleet()
    fleet.ingest(node.report(100.0, events=collected.events), 100.0)
    found = DETECTOR.evaluate(fleet.view(), 100.0)
    acting = {(f.gpu, f.key) for f in found if f.action in REMOVING_ACTIONS}
    # GPU 0 (0000:08:00): the fatal interrupt and the umc UE; the xgmi correctable count on an
    # unknown bus and the resets never act.
    assert acting == {(0, "amdgpu:ras_fatal"), (0, "amdgpu:ras_uncorrectable:umc")}
