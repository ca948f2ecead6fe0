"""AMD's amdgpu kernel-log events as data: event name -> meaning, class, vigil action and its source.

Read by the ``amdgpu`` detector (the agent's xid collector forwards each event as kind
``amdgpu_<name>``, its ``code`` the RAS block's number). The actions are vigil policy on top of
what AMD's driver and documentation say each line means; it holds no state, reads no clock, and
does not judge repeats (the detector does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from vigil.aggregator.decision import Action

# The wire kind's prefix: "amdgpu_ras_uncorrectable" is event "ras_uncorrectable".
KIND_PREFIX = "amdgpu_"

# AMD's RAS blocks by number (Linux drivers/gpu/drm/amd/amdgpu/amdgpu_ras.h, enum amdgpu_ras_block),
# for evidence and reasons; the agent parses the name (agent/kernel_log.py AMDGPU_RAS_BLOCKS).
RAS_BLOCKS: Mapping[int, str] = {
    0: "umc", 1: "sdma", 2: "gfx", 3: "mmhub", 4: "athub", 5: "pcie_bif", 6: "hdp", 7: "xgmi_wafl",
    8: "df", 9: "smn", 10: "sem", 11: "mp0", 12: "mp1", 13: "fuse", 14: "mca", 15: "vcn", 16: "jpeg",
    17: "ih", 18: "mpio",
}
BLOCK_UMC = 0
BLOCK_XGMI = 7

_RAS_DOC = ("Linux amdgpu RAS (docs.kernel.org/gpu/amdgpu/ras.html; drivers/gpu/drm/amd/amdgpu/amdgpu_ras.c: "
            "an uncorrectable error raises the RAS interrupt, the driver retires the bad page and resets the GPU)")


@dataclass(frozen=True)
class AmdgpuEntry:
    """One event. ``category``: hardware (the GPU is at fault from one line), app (a job's work
    timed out: the job's fault unless it repeats on one GPU), info (the driver working: no action)."""

    name: str
    meaning: str
    action: Action
    category: str
    source: str


ENTRIES: tuple[AmdgpuEntry, ...] = (
    AmdgpuEntry("ras_uncorrectable", "uncorrectable ECC/parity errors counted in a RAS block (umc: HBM)",
                Action.RESET_GPU, "hardware",
                f"{_RAS_DOC}; vigil drains the node and resets the GPU, as for NVIDIA Xid 48 (DBE)"),
    AmdgpuEntry("ras_fatal", "the driver's fatal RAS interrupt (ERREVENT_ATHUB_INTERRUPT): a GPU-wide reset follows",
                Action.RESET_GPU, "hardware", _RAS_DOC),
    AmdgpuEntry("poison_consumed", "a kernel read poisoned (uncorrectable) memory: the driver kicks off a GPU reset",
                Action.RESET_GPU, "hardware",
                "amdgpu amdkfd event_interrupt_poison_consumption (\"kick off gpu reset flow\"); AMD node-scraper "
                "classes it RAS error"),
    AmdgpuEntry("bad_page_threshold",
                "retired (bad) VRAM pages reached the driver's threshold: the GPU is to be replaced",
                Action.INSPECT_HARDWARE, "hardware",
                "amdgpu module parameter bad_page_threshold (\"the GPU entering bad status when the number of total "
                "faulty pages by ECC exceeds the threshold\"); amdgpu_ras_eeprom_check sends the RMA reason"),
    AmdgpuEntry("gpu_reset_failed", "the driver's GPU reset failed: the GPU is hung until the node is rebooted",
                Action.REBOOT_NODE, "hardware",
                "amdgpu_device_gpu_recover (\"GPU reset(N) failed\"); ROCm issue 3766: a failed recovery on MI300X "
                "\"is left in an undefined state. A system reboot is needed\""),
    AmdgpuEntry("ring_timeout",
                "a job on a ring did not finish in time (amdgpu_job_timedout): the driver resets the GPU",
                Action.OBSERVE, "app",
                "amdgpu_job.c amdgpu_job_timedout; usually the job's kernel (real logs: tests/fixtures/kernel-log/"
                "amdgpu), a GPU fault when it repeats on one GPU, as NVIDIA's Xid 8/13 guidance"),
    AmdgpuEntry("ras_deferred", "deferred (poisoned, not yet consumed) errors in a RAS block: the page is retired",
                Action.ALERT, "info", f"{_RAS_DOC}; AMD node-scraper 'RAS Deferred Error'"),
    AmdgpuEntry("poison_created", "poison was written for an uncorrectable error not yet consumed", Action.ALERT,
                "info", "AMD node-scraper 'RAS Poison created' (the consuming read is poison_consumed)"),
    AmdgpuEntry("ras_correctable", "correctable errors counted in a RAS block", Action.OBSERVE, "info",
                "Linux amdgpu RAS: corrected by hardware; growth is the memory detector's (GPU counters)"),
    AmdgpuEntry("ring_timeout_recovered", "a ring timeout the driver soft-recovered (no reset)", Action.OBSERVE,
                "info", "amdgpu_job_timedout (\"but soft recovered\"): the driver succeeded"),
    AmdgpuEntry("gpu_reset_begin", "the driver began a GPU reset", Action.OBSERVE, "info",
                "amdgpu_device_gpu_recover; the cause is the line before it"),
    AmdgpuEntry("gpu_reset_succeeded", "the driver's GPU reset succeeded", Action.OBSERVE, "info",
                "amdgpu_device_gpu_recover (\"GPU reset(N) succeeded!\")"),
)

# An event the catalog does not know (a newer agent's): seen by a person, removes nothing.
UNKNOWN_ACTION = Action.ALERT


class AmdgpuCatalog:
    """Event name -> entry, with per-name action overrides (site policy)."""

    def __init__(self, overrides: Mapping[str, Action] | None = None) -> None:
        entries = {e.name: e for e in ENTRIES}
        for name, action in (overrides or {}).items():
            base = entries.get(name) or _unknown(name)
            entries[name] = replace(base, action=Action(action), source=f"configured override (was {base.action})")
        self._entries = entries

    def entry(self, name: str) -> AmdgpuEntry:
        return self._entries.get(name) or _unknown(name)

    def names(self) -> list[str]:
        return sorted(self._entries)


def _unknown(name: str) -> AmdgpuEntry:
    return AmdgpuEntry(name, f"amdgpu event {name!r} is not in vigil's catalog", UNKNOWN_ACTION, "unknown",
                       "vigil: unknown event")


def event_name(kind: str) -> str | None:
    """The catalog name of a wire kind ("amdgpu_ras_fatal" -> "ras_fatal"), None for other kinds."""
    return kind[len(KIND_PREFIX):] if kind.startswith(KIND_PREFIX) else None


def block_name(code: int | None) -> str | None:
    return None if code is None else RAS_BLOCKS.get(code, f"block {code}")
