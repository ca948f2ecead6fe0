"""dcgm-exporter compatibility: re-serves the agent's vigil_gpu_* samples as the core
``DCGM_FI_DEV_*`` and ``DCGM_FI_PROF_*`` series and the exporter's own ``DCGM_EXP_XID_ERRORS_COUNT``
and ``DCGM_EXP_CLOCK_EVENTS_COUNT``, with dcgm-exporter's names, types, labels and units (MHz, W,
mJ, MiB, percent), so a site's dcgm-exporter dashboards and alerts keep working when vigil replaces it.

It reads only the snapshot's samples (never NVML) and converts; a value vigil does not have
(the vGPU licence, which exists only inside a vGPU guest; the DCP profiling fields before Hopper;
NVLink bandwidth on a GPU without NVLink) is absent, never faked. It attributes no GPU to a pod
itself: a GPU's pod, namespace and container come from the snapshot's `vigil_gpu_process_info`
(agent.attribution: the process's cgroup, named by its runtime bundle) or a `pod_labels` hook. The
vigil_* series stay the primary interface.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PromCollector

from vigil.agent.attribution import PROCESS_INFO, kubernetes_labels
from vigil.agent.metric import Sample
from vigil.contract.validation import StrictModel

# dcgm-exporter's label names and order (internal/pkg/rendermetrics/render_metrics.go at commit
# d5e5f510, see tests/fixtures/dcgm-exporter). Current dcgm-exporter spells the host label
# `hostname` (renamed from `Hostname` by PR #655); vigil follows the current exporter only. Its
# official dashboard keys on `instance` and `gpu`, not the host label; a dashboard written against
# the old `Hostname` needs `label_replace(..., "Hostname", "$1", "hostname", "(.*)")`.
LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "hostname", "DCGM_FI_DRIVER_VERSION")
# A MIG GPU instance's series carry these two as well (the same template: `{{if $metric.MigProfile}},
# GPU_I_PROFILE=...,GPU_I_ID=...{{end}}`), beside its parent's gpu and UUID. prometheus-client writes
# labels sorted by name, here as for the others: the order means nothing to Prometheus.
MIG_LABELS = ("GPU_I_PROFILE", "GPU_I_ID")
# Labels dcgm-exporter adds when its Kubernetes pod mapping attributes a GPU, in its order.
POD_LABELS = ("pod", "namespace", "container")
# uuid -> {"pod": ..., "namespace": ..., "container": ...}: the attribution hook. A GPU absent from
# the mapping (or a mapping without a key) carries no such label, as in dcgm-exporter.
PodLabels = Callable[[], Mapping[str, Mapping[str, str]]]

# dcgm-exporter's `--xid-count-window-size` and `--clock-events-count-window-size` default
# (pkg/cmd/app.go at d5e5f510: 5 minutes); the value is also served as the `window_size_in_ms` label.
EXP_WINDOW_MS = 300_000

_MHZ = 1e-6  # vigil clocks are hertz; DCGM_FI_DEV_*_CLOCK are MHz
_MIB = 1.0 / (1 << 20)  # vigil memory is bytes; DCGM_FI_DEV_FB_* are MiB
_PERCENT = 100.0  # vigil utilisation is a 0..1 ratio; DCGM_FI_DEV_*_UTIL are percent
_MILLIJOULES = 1000.0  # vigil energy is joules; DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION is mJ

# DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL is not a counter, whatever dcgm-exporter's TYPE line says. DCGM
# (dcgmlib/src/DcgmCacheManager.cpp, ReadAndCacheNvLinkBandwidth; the field is an alias of
# DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL, 449) sums NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX and _TX over all
# links (scopeId UINT_MAX; KiB of payload), differences that sum against its previous sample, divides
# by the seconds between them and by 1000: a rate of tx + rx payload in KiB/s / 1000 (its comment
# says MiB/s), 0 for the first sample. vigil serves the same quantity from
# vigil_gpu_nvlink_data_bytes_total, over this collector's scrapes of the last NVLINK_RATE_WINDOW_S.
NVLINK_BANDWIDTH = "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"
NVLINK_BANDWIDTH_HELP = "Total number of NVLink bandwidth counters for all lanes."
# DCGM's rate spans its update interval (dcgm-exporter collects every 30 s by default). vigil reads the
# counters every gpu.nvlink_interval_seconds (10 s), so a rate over 60 s of scrapes is off by at most
# that read interval over the window (1/6 at the defaults), where 30 s would allow a third.
NVLINK_RATE_WINDOW_S = 60.0
_DCGM_NVLINK_RATE = 1.0 / 1024 / 1000  # bytes/s -> DCGM's (KiB/s) / 1000


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
    Field("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", "vigil_gpu_encoder_utilization_ratio",
          _PERCENT),
    Field("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", "vigil_gpu_decoder_utilization_ratio",
          _PERCENT),
    Field("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
          "vigil_gpu_memory_reserved_bytes", _MIB),
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
    # DCGM's profiling (DCP) fields, from NVML's GPM metrics (Hopper and later; absent on older GPUs).
    # DCGM_FI_PROF_* activities are 0..1 ratios as vigil's are; PCIe is bytes per second in both.
    Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
          "vigil_gpu_graphics_engine_active_ratio"),
    Field("DCGM_FI_PROF_SM_ACTIVE", "gauge", "The ratio of cycles an SM has at least 1 warp assigned.",
          "vigil_gpu_sm_active_ratio"),
    Field("DCGM_FI_PROF_SM_OCCUPANCY", "gauge", "The ratio of number of warps resident on an SM.",
          "vigil_gpu_sm_occupancy_ratio"),
    Field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
          "vigil_gpu_tensor_active_ratio"),
    Field("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
          "Ratio of cycles the device memory interface is active sending or receiving data.",
          "vigil_gpu_dram_active_ratio"),
    Field("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "gauge", "Ratio of cycles the fp64 pipes are active.",
          "vigil_gpu_fp64_active_ratio"),
    Field("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "gauge", "Ratio of cycles the fp32 pipes are active.",
          "vigil_gpu_fp32_active_ratio"),
    Field("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "gauge", "Ratio of cycles the fp16 pipes are active.",
          "vigil_gpu_fp16_active_ratio"),
    Field("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
          "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads"
          " - in bytes per second.",
          "vigil_gpu_pcie_throughput_bytes_per_second", match=(("direction", "tx"),)),
    Field("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
          "The rate of data received over the PCIe bus - including both protocol headers and data payloads"
          " - in bytes per second.",
          "vigil_gpu_pcie_throughput_bytes_per_second", match=(("direction", "rx"),)),
)

FB_FREE_HELP = "Framebuffer memory free (in MiB)."
FB_USED_HELP = "Framebuffer memory used (in MiB)."
XID_HELP = "Value of the last XID error encountered."
XID_COUNT_HELP = "reported XIDs during last window"  # help texts as etc/default-counters.csv
CLOCK_EVENTS_HELP = "reported clock events"

# err_msg text for the Xids vigil's detectors act on, as dcgm-exporter prints them
# (internal/pkg/collector/xid_errors.go at d5e5f510, itself NVIDIA's Xid catalog,
# docs.nvidia.com/deploy/xid-errors). Other codes carry dcgm-exporter's "Unknown Error" text only
# for codes past its table; a code missing here gets "" (vigil knows no text for it).
XID_MESSAGES: dict[int, str] = {
    0: "No Error",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
}
UNKNOWN_XID = "Unknown Error"  # dcgm-exporter's text for codes past its table (gpu_collector.go)
XID_TABLE_END = 160  # codes below this are in dcgm-exporter's table; vigil lacks the text for most

# vigil_gpu_clock_event_active{reason} -> dcgm-exporter's clock_event label
# (clock_events_collector.go at d5e5f510, from dcgmi's CommandLineParser.cpp).
CLOCK_EVENT_NAMES: dict[str, str] = {
    "gpu_idle": "gpu_idle",
    "applications_clocks_setting": "clocks_setting",
    "sw_power_cap": "power_cap",
    "hw_slowdown": "hw_slowdown",
    "sync_boost": "sync_boost",
    "sw_thermal_slowdown": "sw_thermal",
    "hw_thermal_slowdown": "hw_thermal",
    "hw_power_brake_slowdown": "hw_power_brake",
    "display_clock_setting": "display_clocks",
}
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
    ``hostname`` label; ``pod_labels`` (optional; default: from the samples' process attribution)
    gives each attributed GPU's pod, namespace and container; ``clock`` (seconds, monotonic) times
    the DCGM_EXP_* windows. Register it in the agent's registry.
    """

    def __init__(self, samples: Callable[[], Iterable[Sample]], hostname: str = "",
                 pod_labels: PodLabels | None = None, clock: Callable[[], float] = time.monotonic,
                 window_ms: int = EXP_WINDOW_MS) -> None:
        self._samples = samples
        self._hostname = hostname
        self._pod_labels = pod_labels
        self._clock = clock
        self._window_ms = window_ms
        # Per scrape: (time, {(uuid, code): Xid count}) and (time, {(uuid, reason) active}).
        self._xid_history: deque[tuple[float, dict[tuple[str, str], float]]] = deque()
        self._clock_history: deque[tuple[float, frozenset[tuple[str, str]]]] = deque()
        self._pods: Mapping[str, Mapping[str, str]] = {}
        # (uuid) -> (source, code) -> count seen at the previous scrape, to find the newest Xid.
        self._xid_counts: dict[str, dict[tuple[str, str], float]] = {}
        self._last_xid: dict[str, int] = {}
        # uuid -> (scrape time, NVLink payload bytes tx + rx) of the scrapes in the rate window.
        self._nvlink_history: dict[str, deque[tuple[float, float]]] = defaultdict(deque)

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
        self._pods = self._pod_labels() if self._pod_labels is not None else \
            kubernetes_labels(by_name.get(PROCESS_INFO.name, ()))
        now = self._clock()
        for f in FIELDS:
            family = self._family(f, by_name.get(f.source, ()), identities)
            if family is not None:
                yield family
        yield from self._framebuffer(by_name, identities)
        nvlink = self._nvlink_bandwidth(by_name, identities, now)
        if nvlink is not None:
            yield nvlink
        yield from self._xid(by_name, identities)
        yield self._xid_count(by_name, identities, now)
        clock_events = self._clock_events(by_name, identities, now)
        if clock_events is not None:
            yield clock_events

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

    def _labels(self, ident: _Identity, mig: tuple[str, str] | None = None, **extra: str) -> dict[str, str]:
        """dcgm-exporter's labels for a GPU, or with ``mig`` (profile, GPU instance id) for one of
        its MIG GPU instances."""
        labels = dict(zip(LABELS, self._label_values(ident), strict=True))
        if mig is not None:
            labels.update(zip(MIG_LABELS, mig, strict=True))
        labels.update(extra)
        pod = self._pods.get(ident.uuid, {})
        for key in POD_LABELS:
            if pod.get(key):
                labels[key] = pod[key]
        return labels

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
            family.add_sample(f.name, self._labels(identities[uuid]),
                              value * f.scale)
        return family

    def _framebuffer(self, by_name: dict[str, list[Sample]], identities: dict[str, _Identity]) -> Iterator[Metric]:
        """DCGM_FI_DEV_FB_USED and _FREE as DCGM reads them (nvmlMemory_v2_t since R510, DcgmCacheManager's
        ReadAndCacheFBMemoryInfo): used is allocated memory without the reserve, free = total - used -
        reserved. vigil's used counts the reserve (NVML v1), so the reserve comes off where known."""
        used = {s.label("uuid"): s.value for s in by_name.get("vigil_gpu_memory_used_bytes", ())}
        total = {s.label("uuid"): s.value for s in by_name.get("vigil_gpu_memory_total_bytes", ())}
        reserved = {s.label("uuid"): s.value for s in by_name.get("vigil_gpu_memory_reserved_bytes", ())}
        used_family = Metric("DCGM_FI_DEV_FB_USED", FB_USED_HELP, "gauge")
        free_family = Metric("DCGM_FI_DEV_FB_FREE", FB_FREE_HELP, "gauge")
        for uuid, ident in sorted(identities.items(), key=lambda kv: _gpu_order(kv[1].gpu)):
            if uuid not in used:
                continue
            allocated = max(used[uuid] - reserved.get(uuid, 0.0), 0.0)
            used_family.add_sample(used_family.name, self._labels(ident), allocated * _MIB)
            if uuid in total:
                free_family.add_sample(free_family.name, self._labels(ident),
                                       max(total[uuid] - used[uuid], 0.0) * _MIB)
        self._mig_framebuffer(by_name, identities, used_family, free_family)
        for family in (used_family, free_family):
            if family.samples:
                yield family

    def _mig_framebuffer(self, by_name: dict[str, list[Sample]], identities: dict[str, _Identity],
                         used_family: Metric, free_family: Metric) -> None:
        """The same two fields for each MIG GPU instance (DCGM watches FB_USED/FB_FREE per GPU
        instance), labelled GPU_I_PROFILE and GPU_I_ID beside the parent's gpu and UUID. From
        vigil_gpu_mig_memory_*_bytes, the instance's own memory (NVML v1 on its MIG handle, no
        reserve apart), so free = total - used. The first compute instance of a GPU instance stands
        for it (one fills each in the usual layouts)."""
        profiles: dict[tuple[str, str], str] = {}
        for s in by_name.get("vigil_gpu_mig_device_info", ()):
            uuid, gi = s.label("uuid"), s.label("gpu_instance_id")
            if uuid is not None and gi is not None:
                profiles.setdefault((uuid, gi), s.label("profile") or "")
        used: dict[tuple[str, str], float] = {}
        total: dict[tuple[str, str], float] = {}
        for name, into in (("vigil_gpu_mig_memory_used_bytes", used), ("vigil_gpu_mig_memory_total_bytes", total)):
            for s in by_name.get(name, ()):
                uuid, gi = s.label("uuid"), s.label("gpu_instance_id")
                if uuid is not None and gi is not None:
                    into.setdefault((uuid, gi), s.value)
        order = sorted((key for key in used if key[0] in identities and key in profiles),
                       key=lambda k: (_gpu_order(identities[k[0]].gpu), int(k[1]) if k[1].isdigit() else 1 << 31))
        for uuid, gi in order:
            labels = self._labels(identities[uuid], mig=(profiles[(uuid, gi)], gi))
            used_family.add_sample(used_family.name, labels, used[(uuid, gi)] * _MIB)
            if (uuid, gi) in total:
                free_family.add_sample(free_family.name, labels, max(total[(uuid, gi)] - used[(uuid, gi)], 0.0) * _MIB)

    def _nvlink_bandwidth(self, by_name: dict[str, list[Sample]], identities: dict[str, _Identity],
                          now: float) -> Metric | None:
        """DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL in DCGM's quantity (see NVLINK_BANDWIDTH): the tx + rx
        payload rate over this collector's scrapes of the last NVLINK_RATE_WINDOW_S, in (KiB/s) / 1000;
        0 until a second scrape (DCGM's first sample is 0 too) and after a counter restart. Absent on a
        GPU without NVLink counters (dcgm-exporter serves 0 there; vigil serves what it measured)."""
        totals: dict[str, float] = {}
        for s in by_name.get("vigil_gpu_nvlink_data_bytes_total", ()):
            uuid = s.label("uuid")
            if uuid is not None and uuid in identities:
                totals[uuid] = totals.get(uuid, 0.0) + s.value
        for gone in set(self._nvlink_history) - set(totals):
            del self._nvlink_history[gone]
        if not totals:
            return None
        family = Metric(NVLINK_BANDWIDTH, NVLINK_BANDWIDTH_HELP, _exposition_type("counter"))
        start = now - NVLINK_RATE_WINDOW_S
        for uuid, total in sorted(totals.items(), key=lambda kv: _gpu_order(identities[kv[0]].gpu)):
            history = self._nvlink_history[uuid]
            if history and total < history[-1][1]:
                history.clear()  # the counters restarted (driver reload): start over, as DCGM would
            history.append((now, total))
            while len(history) >= 2 and history[1][0] <= start:
                history.popleft()
            (t0, v0), (t1, v1) = history[0], history[-1]
            rate = (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0
            family.add_sample(NVLINK_BANDWIDTH, self._labels(identities[uuid]), rate * _DCGM_NVLINK_RATE)
        return family

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
            labels = self._labels(ident, err_code=str(last), err_msg=xid_message(last))
            family.add_sample("DCGM_FI_DEV_XID_ERRORS", labels, float(last))
        yield family

    def _window_start(self, now: float) -> float:
        return now - self._window_ms / 1000.0

    def _xid_count(self, by_name: dict[str, list[Sample]], identities: dict[str, _Identity],
                   now: float) -> Metric:
        """DCGM_EXP_XID_ERRORS_COUNT{xid, window_size_in_ms}: Xids per code in the last window; a GPU
        with none gets one sample of 0 without an xid label (expcollector.go). vigil's per-code
        counters are differenced against the newest scrape at or before the window's start; before
        the agent has seen a full window, counts since its first scrape (plus any at it) are used."""
        counts: dict[tuple[str, str], float] = {}
        for source in _XID_SOURCES:
            for s in by_name.get(source, ()):
                uuid, code = s.label("uuid"), s.label("code")
                if uuid is not None and code is not None and code.isdigit():
                    counts[(uuid, code)] = max(counts.get((uuid, code), 0.0), s.value)
        history = self._xid_history
        history.append((now, counts))
        start = self._window_start(now)
        while len(history) >= 2 and history[1][0] <= start:
            history.popleft()
        baseline = history[0][1] if history[0][0] <= start else {}
        per_gpu: dict[str, dict[str, float]] = defaultdict(dict)
        for (uuid, code), value in counts.items():
            grown = value - baseline.get((uuid, code), 0.0)
            if grown < 0:  # the counter restarted (a new agent or driver): count from zero
                grown = value
            if grown > 0:
                per_gpu[uuid][code] = grown
        family = Metric("DCGM_EXP_XID_ERRORS_COUNT", XID_COUNT_HELP, "unknown")
        window = str(self._window_ms)
        for uuid, ident in sorted(identities.items(), key=lambda kv: _gpu_order(kv[1].gpu)):
            codes = per_gpu.get(uuid)
            if not codes:
                family.add_sample(family.name, self._labels(ident, window_size_in_ms=window), 0.0)
            for code, grown in sorted(codes.items(), key=lambda kv: int(kv[0])) if codes else ():
                family.add_sample(family.name, self._labels(ident, window_size_in_ms=window, xid=code), grown)
        return family

    def _clock_events(self, by_name: dict[str, list[Sample]], identities: dict[str, _Identity],
                      now: float) -> Metric | None:
        """DCGM_EXP_CLOCK_EVENTS_COUNT{clock_event, window_size_in_ms}: in dcgm-exporter, how many of
        DCGM's samples in the window carried each clock-event reason; here, how many of this
        collector's scrapes in the window saw vigil_gpu_clock_event_active{reason} at 1. Absent when
        the GPUs report no clock-event reasons at all."""
        samples = by_name.get("vigil_gpu_clock_event_active", ())
        if not samples:
            return None
        active = frozenset((uuid, name) for s in samples if s.value > 0
                           and (uuid := s.label("uuid")) is not None
                           and (name := CLOCK_EVENT_NAMES.get(s.label("reason") or "")) is not None)
        history = self._clock_history
        history.append((now, active))
        start = self._window_start(now)
        while history and history[0][0] <= start:
            history.popleft()
        seen: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for _, held in history:
            for uuid, name in held:
                seen[uuid][name] += 1
        family = Metric("DCGM_EXP_CLOCK_EVENTS_COUNT", CLOCK_EVENTS_HELP, "unknown")
        window = str(self._window_ms)
        for uuid, ident in sorted(identities.items(), key=lambda kv: _gpu_order(kv[1].gpu)):
            reasons = seen.get(uuid)
            if not reasons:
                family.add_sample(family.name, self._labels(ident, window_size_in_ms=window), 0.0)
                continue
            for name, n in sorted(reasons.items()):
                family.add_sample(family.name, self._labels(ident, window_size_in_ms=window, clock_event=name),
                                  float(n))
        return family


def xid_message(code: int) -> str:
    """dcgm-exporter's err_msg for an Xid code, where vigil carries its text (XID_MESSAGES)."""
    if code in XID_MESSAGES:
        return XID_MESSAGES[code]
    return UNKNOWN_XID if code < 0 or code >= XID_TABLE_END else ""
