"""The GPU and xid collectors keep samples built in earlier cycles while what made them is the same
(a GPU's health and clock-event samples, the NVML Xid counters, the kernel-log counters). Each test
runs a twin that forgets every kept sample before each cycle and requires equal output, across
the events that change them: a GPU lost and back after a reset, a reset required, throttle
windows, MIG reconfigured and applied by a reset, NVML gone, Xids, kernel-log lines, truncation
and rotation."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest

from vigil.agent.collectors.collector import Collection
from vigil.agent.collectors.gpu import GpuCollector, GpuConfig
from vigil.agent.collectors.xid import XidCollector, XidConfig, open_kernel_log
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _gpu_pair(scenario: str, clock: Clock, **config: object) -> list[tuple[FakeNvml, GpuCollector]]:
    out = []
    for _ in range(2):
        fake = FakeNvml(load_node_scenario(scenario), clock, start=0.0)
        backend = PynvmlBackend(fake)
        backend.init()
        config.setdefault("xid_events", False)
        out.append((fake, GpuCollector(GpuConfig.model_validate(config), backend, clock)))
    return out


def _reset(fake: FakeNvml, bus_id: str) -> None:
    """nvidia-smi --gpu-reset; a GPU in use (or NVML gone) refuses, as the real one does."""
    with contextlib.suppress(subprocess.CalledProcessError):
        fake.nvidia_smi(["nvidia-smi", "--gpu-reset", "-i", bus_id], 60.0)


def _forget(collector: GpuCollector) -> None:
    """A fresh build: nothing kept from earlier cycles."""
    collector._xid_memo = None
    for gpu in collector._gpus or []:
        gpu.health_samples = {}
        gpu.clock_event_samples = {}
        gpu.link_memo = None


def _same(got: Collection, want: Collection) -> None:
    assert got.samples == want.samples
    assert got.report == want.report
    assert got.events == want.events


@pytest.mark.parametrize("scenario", ["gpu-lost", "reset-required", "thermal-throttle", "power-brake",
                                      "faults-h100", "mig-a100", "nvml-unavailable", "busy-spin-h100"])
def test_gpu_samples_kept_equal_a_fresh_build(scenario: str) -> None:
    clock = Clock()
    (inc_fake, inc), (ref_fake, ref) = _gpu_pair(scenario, clock, nvlink_interval_seconds=5)
    kept = 0
    before: set[int] = set()
    previous: Collection | None = None
    try:
        for t in range(0, 240, 3):
            clock.t = float(t)
            if t == 120:  # an administrator resets every GPU: lost / reset-required ones come back
                for fake in (inc_fake, ref_fake):
                    for handle in fake.handles:
                        _reset(fake, handle.pci_bus_id)
            if t == 150 and scenario == "mig-a100":  # MIG off after the next reset, then reset
                for fake in (inc_fake, ref_fake):
                    fake.configure_mig(0, [], enabled=True, pending=False)
            if t == 180 and scenario == "mig-a100":
                for fake in (inc_fake, ref_fake):
                    _reset(fake, fake.handles[0].pci_bus_id)
            if t == 90:
                for fake in (inc_fake, ref_fake):
                    fake.set_busy_spin([1, 2], t < 200)
            _forget(ref)
            got, want = inc.collect(clock.t), ref.collect(clock.t)
            _same(got, want)
            kept += sum(1 for s in got.samples if id(s) in before)
            before = {id(s) for s in got.samples}
            previous = got  # holds the samples, so that their ids stay theirs
    finally:
        inc.close()
        ref.close()
    assert previous is not None
    if scenario != "nvml-unavailable":
        assert kept > 0  # the kept samples were used, not rebuilt every cycle


def test_nvml_xid_counters_kept_equal_a_fresh_build() -> None:
    clock = Clock()
    (_, inc), (_, ref) = _gpu_pair("xid", clock, xid_events=True, event_wait_ms=10)
    try:
        _same(inc.collect(0.0), ref.collect(0.0))
        clock.t = 60.0  # the scenario's Xid 79 on GPU 4 is delivered by each worker within its wait
        seen = {id(inc): 0, id(ref): 0}
        deadline = time.monotonic() + 10.0
        while min(seen.values()) == 0 and time.monotonic() < deadline:
            for c in (inc, ref):
                if not seen[id(c)]:
                    seen[id(c)] = len(c.collect(60.0).events)
            time.sleep(0.01)
        assert seen == {id(inc): 1, id(ref): 1}
        for t in range(61, 90, 3):
            clock.t = float(t)
            _forget(ref)
            got, want = inc.collect(clock.t), ref.collect(clock.t)
            _same(got, want)
            assert [s.value for s in got.samples if s.name == "vigil_gpu_nvml_xid_events_total"
                    and s.label("gpu") == "4" and s.label("code") == "79"] == [1.0]
    finally:
        inc.close()
        ref.close()


XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
MLX5 = "mlx5_core 0000:0c:00.0: mlx5_health_poll_health:800:(pid 0): Fatal error 1 detected"


def test_kernel_log_samples_kept_equal_a_fresh_build(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    cfg = XidConfig.model_validate({"source": "file", "path": str(log), "file_start": "beginning"})
    inc = XidCollector(cfg, open_source=lambda: open_kernel_log(cfg, None), nvml=None,
                       boot_id_path=Path("/nonexistent/boot_id"))
    ref = XidCollector(cfg, open_source=lambda: open_kernel_log(cfg, None), nvml=None,
                       boot_id_path=Path("/nonexistent/boot_id"))
    writes = {
        3: f"[ 3.0] {XID79}\n",
        5: "[ 5.0] unrelated line\n[ 5.1] NVRM: Xid (PCI:0000:3b:00): garbage\n",
        7: "[ 7.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1",  # a partial line: waits for its newline
        8: ", GPU has fallen off the bus.\n",
        10: f"[10.0] {MLX5}\n",
    }
    try:
        for cycle in range(20):
            text = writes.get(cycle)
            if text is not None:
                with log.open("a") as fh:
                    fh.write(text)
            if cycle == 13:  # truncated (logrotate copytruncate) and written again
                log.write_text(f"[ 1.0] {XID79}\n")
            if cycle == 16:  # rotated: a new file under the name
                log.rename(tmp_path / "kern.log.1")
                log.write_text(f"[ 2.0] {XID79}\n")
            ref._rest_samples = None
            ref._xid_samples = None
            got, want = inc.collect(float(cycle)), ref.collect(float(cycle))
            _same(got, want)
        assert inc._lines == ref._lines == 7
    finally:
        inc.close()
        ref.close()
