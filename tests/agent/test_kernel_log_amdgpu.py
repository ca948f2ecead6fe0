"""amdgpu (AMD Instinct) kernel-log lines: the real logs in tests/fixtures/kernel-log/amdgpu, counted by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil.agent.kernel_log import AMDGPU_RAS_BLOCKS, KernelLogParser, ParsedLine

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kernel-log" / "amdgpu"


def parse(lines: list[str]) -> list[ParsedLine]:
    parser = KernelLogParser()
    return [parser.feed(line) for line in lines]


def events(name: str) -> list[tuple[str | None, str | None, int | None]]:
    """(event name, bus id, RAS block) of each event of fixture ``name``."""
    return [(p.event.error, p.event.pci_bus_id, p.event.code)
            for p in parse((FIXTURES / name).read_text().splitlines()) if p.event is not None]


UMC, XGMI = AMDGPU_RAS_BLOCKS["umc"], AMDGPU_RAS_BLOCKS["xgmi_wafl"]

# Hand counts (tests/fixtures/kernel-log/amdgpu/PROVENANCE.md).
EXPECTED = {
    "rocm-4021-mi300x-athub-aca.log": [("ras_fatal", "0000:dd:00", None)],
    # The "in total" line repeats the "new" count: folded; MODE1/smu lines and "trying to resume" are no events.
    "rocm-4021-mi300x-xgmi-ce-mode1-reset.log": [("ras_correctable", "0000:9d:00", XGMI),
                                                 ("gpu_reset_begin", "0000:dd:00", None)],
    "kernel-bugzilla-201957-reset-failed-soft-recovered.log": [
        ("ring_timeout", None, None), ("gpu_reset_begin", "0000:06:00", None), ("gpu_reset_failed", "0000:06:00", None),
        ("ring_timeout_recovered", None, None), ("ring_timeout_recovered", None, None), ("ring_timeout", None, None),
        ("gpu_reset_begin", "0000:06:00", None)],
    "rocm-1886-mi50-athub-dmesg-T.log": [("ras_fatal", "0000:e3:00", None), ("gpu_reset_begin", "0000:e3:00", None)],
    "rocm-2533-sdma-timeout-syslog.log": [("ring_timeout", None, None), ("gpu_reset_begin", "0000:0a:00", None),
                                          ("gpu_reset_succeeded", "0000:0a:00", None)],
    "incident-mi50-umc-ue.log": [("ras_fatal", "0000:08:00", None), ("ras_correctable", "0000:08:00", UMC),
                                 ("ras_uncorrectable", "0000:08:00", UMC), ("gpu_reset_begin", None, None)],
    "amd-node-scraper-ras-iso.log": [
        ("poison_consumed", "0000:68:00", None), ("poison_created", "0000:68:00", None),
        ("poison_consumed", "0000:01:00", None), ("poison_created", "0000:02:00", None),
        ("bad_page_threshold", "0000:08:00", None), ("bad_page_threshold", None, None)],
    "pop-os-3764-ring-reset-newer-driver.log": [("ring_timeout", "0000:28:00", None),
                                                ("gpu_reset_begin", "0000:28:00", None)],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_amdgpu_logs_give_the_hand_counted_events(name: str) -> None:
    assert events(name) == EXPECTED[name]


def test_every_fixture_is_counted() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.log")) == sorted(EXPECTED)


def test_running_total_is_folded_into_its_new_count() -> None:
    parsed = parse((FIXTURES / "rocm-4021-mi300x-xgmi-ce-mode1-reset.log").read_text().splitlines())
    assert [p.folded for p in parsed if p.folded] == ["amdgpu"]


@pytest.mark.parametrize("line", [
    # The driver saying the GPU is fine: a zero or "no" count is no event.
    "amdgpu 0000:c3:00.0: amdgpu: 0 uncorrectable hardware errors detected in umc block",
    "amdgpu 0000:c3:00.0: amdgpu: no uncorrectable hardware errors detected in umc block",
    # Init, page-fault detail and reset progress lines.
    "amdgpu 0000:e3:00.0: amdgpu: MEM ECC is active.",
    "amdgpu 0000:dd:00.0: amdgpu: GPU reset succeeded, trying to resume",
    "[drm:amdgpu_job_timedout [amdgpu]] *ERROR* Process information: process firefox pid 21156 thread x pid 2",
    "amdgpu: Failed to restore process queues",
    "amdgpu 0000:3d:00.0: amdgpu: [mmhub0] no-retry page fault (src_id:0 ring:160 vmid:3 pasid:32790)",
])
def test_lines_that_are_no_fault(line: str) -> None:
    [p] = parse([line])
    assert p.event is None and p.unparsed is None


def test_collected_log_host_prefix_is_read_for_amdgpu_lines() -> None:
    [p] = parse(["gpu-17: amdgpu 0000:9d:00.0: {1}socket: 0, die: 0, 2 new uncorrectable hardware errors "
                 "detected in umc block"])
    assert p.event is not None and p.event.host == "gpu-17" and p.event.error == "ras_uncorrectable"
    assert p.event.code == UMC and p.event.pci_bus_id == "0000:9d:00"
