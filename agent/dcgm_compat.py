"""dcgm-exporter compatibility: re-serves the agent's vigil_gpu_* samples as the core
``DCGM_FI_DEV_*`` series, with dcgm-exporter's names, types, labels and units (MHz, W, mJ, MiB,
percent), so a site's dcgm-exporter dashboards and alerts keep working when vigil replaces it.

It reads only the snapshot's samples (never NVML) and converts; a value vigil does not have
(encoder/decoder utilisation, reserved framebuffer, NVLink bandwidth, DCP profiling fields) is
absent, never faked. It does not replace the vigil_* series, which stay the primary interface.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PromCollector

from vigil.agent.metric import Sample
from vigil.agent.validation import StrictModel

# dcgm-exporter's label names and order (etc/default-counters.csv run by GPU Operator; see
# tests/fixtures/dcgm-exporter). `Hostname` is the old spelling that deployed dashboards use;
# dcgm-exporter renamed it to `hostname` in 2025 (PR #655).
LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")

_MHZ = 1e-6  # vigil clocks are hertz; DCGM_FI_DEV_*_CLOCK are MHz
_MIB = 1.0 / (1 << 20)  # vigil memory is bytes; DCGM_FI_DEV_FB_* are MiB
_PERCENT = 100.0  # vigil utilisation is a 0..1 ratio; DCGM_FI_DEV_*_UTIL are percent
_MILLIJOULES = 1000.0  # vigil energy is joules; DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION is mJ


class ExporterConfig(StrictModel):
    """The agent config's `exporter:` section."""

    # Also serve the core DCGM_FI_DEV_* series on /metrics (off by default: it doubles the GPU series).
    dcgm_compat: bool = False


@dataclass(frozen=True, slots=True)
class Field:
    """One DCGM field served from one vigil metric (optionally one label value of it)."""

    name: str
    kind: str  # "gauge" or "counter", as dcgm-exporter declares the field (see _exposition_type)
    help: str
    source: str
    scale: float = 1.0
    match: tuple[tuple[str, str], ...] = ()  # extra labels the source sample must carry
    sum_over: bool = False  # several source series per GPU (NVLink links) summed into one


# Help texts are dcgm-exporter's (etc/default-counters.csv), so `# HELP` lines match too.
FIELDS: tuple[Field, ...] = (
    Field("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "vigil_gpu_sm_clock_hertz", _MHZ),
    Field("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "vigil_gpu_memory_clock_hertz",
          _MHZ),
    Field("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "vigil_gpu_memory_temperature_celsius"),
    Field("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "vigil_gpu_temperature_celsius"),
    Field("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "vigil_gpu_power_watts"),
    Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
          "vigil_gpu_energy_joules_total", _MILLIJOULES),
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
          "vigil_gpu_pcie_replay_total"),
    Field("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "vigil_gpu_utilization_ratio", _PERCENT),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "vigil_gpu_memory_utilization_ratio",
          _PERCENT),
    Field("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "vigil_gpu_memory_used_bytes", _MIB),
    Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for uncorrectable errors",
          "vigil_gpu_remapped_rows_total", match=(("error_type", "uncorrectable"),)),
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
          "vigil_gpu_remapped_rows_total", match=(("error_type", "correctable"),)),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
          "vigil_gpu_row_remap_failure"),
    # Fields dcgm-exporter ships commented out in its default list; sites that enabled them keep them.
    Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors.",
          "vigil_gpu_ecc_errors_total", match=(("error_type", "corrected"), ("counter", "volatile"))),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.",
          "vigil_gpu_ecc_errors_total", match=(("error_type", "uncorrected"), ("counter", "volatile"))),
    Field("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "Total number of single-bit persistent ECC errors.",
          "vigil_gpu_ecc_errors_total", match=(("error_type", "corrected"), ("counter", "aggregate"))),
    Field("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Total number of double-bit persistent ECC errors.",
          "vigil_gpu_ecc_errors_total", match=(("error_type", "uncorrected"), ("counter", "aggregate"))),
    Field("DCGM_FI_DEV_RETIRED_SBE", "counter", "Total number of retired pages due to single-bit errors.",
          "vigil_gpu_retired_pages_total", match=(("cause", "sbe"),)),
    Field("DCGM_FI_DEV_RETIRED_DBE", "counter", "Total number of retired pages due to double-bit errors.",
          "vigil_gpu_retired_pages_total", match=(("cause", "dbe"),)),
    Field("DCGM_FI_DEV_RETIRED_PENDING", "counter", "Total number of pages pending retirement.",
          "vigil_gpu_retired_pages_pending"),
    Field("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink flow-control CRC errors.",
          "vigil_gpu_nvlink_errors_total", match=(("error_type", "crc"),), sum_over=True),
    Field("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink retries.",
          "vigil_gpu_nvlink_errors_total", match=(("error_type", "replay"),), sum_over=True),
    Field("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink recovery errors.",
          "vigil_gpu_nvlink_errors_total", match=(("error_type", "recovery"),), sum_over=True),
)

FB_FREE_HELP = "Framebuffer memory free (in MiB)."
XID_HELP = "Value of the last XID error encountered."
# Both Xid sources: the kernel log (xid collector) and NVML's event API (gpu collector).
_XID_SOURCES = ("vigil_gpu_xid_errors_total", "vigil_gpu_nvml_xid_events_total")


@dataclass(frozen=True, slots=True)
class _Identity:
    gpu: str
    uuid: str
    pci_bus_id: str = ""
    model: str = ""
    driver: str = ""


def _exposition_type(kind: str) -> str:
    """The family type to hand prometheus-client. Its text renderer names every counter family
    `<name>_total` (OpenMetrics' rule), but dcgm-exporter's counters have no `_total`, and the series
    name is what dashboards and alerts match. Such fields are rendered untyped under their exact
    dcgm-exporter name: queries (rate(), increase()) work the same; only the TYPE line differs."""
    return "unknown" if kind == "counter" else kind


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu) if gpu.isdigit() else 1 << 31, gpu)


class DcgmCompatCollector(PromCollector):
    """A prometheus-client collector yielding ``DCGM_FI_DEV_*`` families from vigil samples.

    ``samples`` is the snapshot's sample source (``Snapshot.samples``); ``hostname`` fills the
    ``Hostname`` label dcgm-exporter dashboards group by. Register it in the agent's registry.
    """

    def __init__(self, samples: Callable[[], Iterable[Sample]], hostname: str = "") -> None:
        self._samples = samples
        self._hostname = hostname
        # (uuid) -> (source, code) -> count seen at the previous scrape, to find the newest Xid.
        self._xid_counts: dict[str, dict[tuple[str, str], float]] = {}
        self._last_xid: dict[str, int] = {}

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on what the GPUs report; nothing to pre-declare

    def collect(self) -> Iterator[Metric]:
        by_name: dict[str, list[Sample]] = defaultdict(list)
        for s in self._samples():
            if s.name.startswith("vigil_gpu_"):
                by_name[s.name].append(s)
        identities = self._identities(by_name)
        if not identities:
            return
        for f in FIELDS:
            family = self._family(f, by_name.get(f.source, ()), identities)
            if family is not None:
                yield family
        free = self._fb_free(by_name, identities)
        if free is not None:
            yield free
        yield from self._xid(by_name, identities)

    def _identities(self, by_name: dict[str, list[Sample]]) -> dict[str, _Identity]:
        out: dict[str, _Identity] = {}
        for s in by_name.get("vigil_gpu_info", ()):
            labels = dict(s.labels)
            out[labels["uuid"]] = _Identity(labels["gpu"], labels["uuid"], labels.get("pci_bus_id", ""),
                                            labels.get("name", ""), labels.get("driver_version", ""))
        # A GPU whose identity is not (yet) known still gets its series, with blank identity labels.
        for name in ("vigil_gpu_temperature_celsius", "vigil_gpu_utilization_ratio"):
            for s in by_name.get(name, ()):
                uuid, gpu = s.label("uuid"), s.label("gpu")
                if uuid is not None and gpu is not None and uuid not in out:
                    out[uuid] = _Identity(gpu, uuid)
        return out

    def _label_values(self, ident: _Identity) -> list[str]:
        # dcgm-exporter names the device node after the NVML index: /dev/nvidia<gpu>.
        return [ident.gpu, ident.uuid, ident.pci_bus_id, f"nvidia{ident.gpu}", ident.model, self._hostname,
                ident.driver]

    def _family(self, f: Field, samples: Iterable[Sample], identities: dict[str, _Identity]) -> Metric | None:
        totals: dict[str, float] = {}
        for s in samples:
            uuid = s.label("uuid")
            if uuid is None or uuid not in identities or any(s.label(k) != v for k, v in f.match):
                continue
            if f.sum_over:
                totals[uuid] = totals.get(uuid, 0.0) + s.value
            else:
                totals.setdefault(uuid, s.value)
        if not totals:
            return None
        family = Metric(f.name, f.help, _exposition_type(f.kind))
        for uuid, value in sorted(totals.items(), key=lambda kv: _gpu_order(identities[kv[0]].gpu)):
            family.add_sample(f.name, dict(zip(LABELS, self._label_values(identities[uuid]), strict=True)),
                              value * f.scale)
        return family

    def _fb_free(self, by_name: dict[str, list[Sample]], identities: dict[str, _Identity]) -> Metric | None:
        # nvmlDeviceGetMemoryInfo (v1) defines free = total - used, which is what DCGM reports.
        used = {s.label("uuid"): s.value for s in by_name.get("vigil_gpu_memory_used_bytes", ())}
        total = {s.label("uuid"): s.value for s in by_name.get("vigil_gpu_memory_total_bytes", ())}
        family = Metric("DCGM_FI_DEV_FB_FREE", FB_FREE_HELP, "gauge")
        for uuid, ident in identities.items():
            if uuid in used and uuid in total:
                family.add_sample("DCGM_FI_DEV_FB_FREE", dict(zip(LABELS, self._label_values(ident), strict=True)),
                                  max(total[uuid] - used[uuid], 0.0) * _MIB)
        return family if family.samples else None

    def _xid(self, by_name: dict[str, list[Sample]], identities: dict[str, _Identity]) -> Iterator[Metric]:
        """DCGM_FI_DEV_XID_ERRORS is a gauge holding the newest Xid code (0 before any). vigil keeps
        counters per code, so the newest is the code whose count grew since the previous scrape."""
        counts: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
        for source in _XID_SOURCES:
            for s in by_name.get(source, ()):
                uuid, code = s.label("uuid"), s.label("code")
                if uuid is not None and code is not None and code.isdigit():
                    counts[uuid][(source, code)] = s.value
        for uuid, now in counts.items():
            before = self._xid_counts.get(uuid)
            grown = [int(key[1]) for key, value in now.items()
                     if value > 0 and (before is None or value > before.get(key, 0.0))]
            # Several codes new in one scrape interval (or counts from before this agent started)
            # carry no order; the highest code is chosen so the result does not depend on dict order.
            if grown:
                self._last_xid[uuid] = max(grown)
            self._xid_counts[uuid] = now
        family = Metric("DCGM_FI_DEV_XID_ERRORS", XID_HELP, "gauge")
        for uuid, ident in sorted(identities.items(), key=lambda kv: _gpu_order(kv[1].gpu)):
            last = self._last_xid.get(uuid, 0)
            labels = dict(zip(LABELS, self._label_values(ident), strict=True))
            # dcgm-exporter adds err_code/err_msg; its message table is not ours to copy, so only the
            # "no error" text it uses for 0 is reproduced and other codes carry an empty message.
            labels["err_code"] = str(last)
            labels["err_msg"] = "No Error" if last == 0 else ""
            family.add_sample("DCGM_FI_DEV_XID_ERRORS", labels, float(last))
        yield family
