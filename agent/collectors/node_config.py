"""Node configuration collector: the facts every node of a job should have alike, on a slow cadence.

Reads the driver, CUDA version and each GPU's configuration through the NVML backend
(``config_facts``), the kernel release from ``<proc>/sys/kernel/osrelease``, each HCA's board id,
firmware and first active port's rate from ``<sysfs>/class/infiniband``, the MLNX_OFED release from
``<sysfs>/module/mlx5_core/version`` and the rdma-core release from libibverbs' file name. The HCA
facts are those of the node's main HCA model (its most common board id), not of a front-end NIC. Emits
``vigil_node_config_info`` (one series, the facts as labels) and the report's ``config`` section
(``NodeConfig``) every cycle; the reporter leaves it out while unchanged. It compares the node with
nobody: the aggregator judges drift against the job's peers and the site manifest.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.collectors.pcie import Unusable, read_attribute
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.nvml.backend import error_reason
from vigil.contract.wire import NodeConfig

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

log = logging.getLogger("vigil.agent.collectors.node_config")

# Where distributions install libibverbs (Debian/Ubuntu multiarch, RHEL/SUSE lib64, and rdma-core's
# own default prefix /usr/local when built from source).
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64",
                "/usr/lib", "/usr/local/lib64", "/usr/local/lib")


class NodeConfigConfig(CollectorConfig):
    # Once a minute: these facts change with an administrator's change or a roll-out, and drift is
    # judged over minutes; each cycle is ~12 NVML calls per GPU and ~5 sysfs reads per HCA.
    interval_seconds: float = Field(default=60.0, gt=0)
    timeout_seconds: float = Field(default=10.0, gt=0)
    # Where libibverbs.so.1 is looked for: the name its link resolves to carries rdma-core's release.
    library_dirs: list[str] = Field(default=list(LIBRARY_DIRS), max_length=16)


# The facts, in NodeConfig's order, as the info series' labels ("" where unknown).
FACTS = ("driver_version", "cuda_driver_version", "kernel", "gpu_model", "gpu_count", "vbios_version",
         "gpu_inforom_version", "ecc_mode", "persistence_mode", "mig_mode", "power_limit_watts",
         "application_sm_clock_hertz", "application_memory_clock_hertz", "hca_count", "hca_board_id",
         "hca_firmware", "hca_link_rate_bits_per_second", "ofed_version", "rdma_core_version")
INFO = MetricSpec("vigil_node_config_info", MetricKind.INFO,
                  "The node's configuration facts (NodeConfig), one label each, \"\" where unknown; `mixed` "
                  "names, comma-separated, the facts on which the node's own GPUs or HCAs disagree.",
                  labels=(*FACTS, "mixed"))
READ_ERRORS = MetricSpec("vigil_node_config_read_errors_total", MetricKind.COUNTER,
                         "Configuration facts that could not be read, by source (nvml, kernel, hca, ofed) and "
                         "reason (an NVML error's name, unreadable, empty, malformed, too_long).",
                         labels=("source", "reason"))
SPECS = (INFO, READ_ERRORS)

# IBTA port state "4: ACTIVE" (the rdma collector's STATE_ACTIVE) and the kernel's rate text,
# "400 Gb/sec (4X NDR)" (drivers/infiniband/core/sysfs.c rate_show).
_ACTIVE = "4: ACTIVE"
_RATE = re.compile(r"^(\d+(?:\.\d+)?) Gb/sec")
# rdma-core names libibverbs libibverbs.so.1.<ABI minor>.<PACKAGE_VERSION> (libibverbs/CMakeLists.txt:
# rdma_library(ibverbs ... 1 1.14.${PACKAGE_VERSION}); Documentation/versioning.md).
_LIBIBVERBS = re.compile(r"^libibverbs\.so\.1\.\d+\.(\d[0-9A-Za-z.]*)$")
# A fact longer than this is not a version string: left out and counted (the wire allows 256).
MAX_FACT_CHARS = 128


def _mode(value: bool | None) -> str | None:
    return None if value is None else "enabled" if value else "disabled"


def _label(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)  # 400000000000, not 4e+11
    return str(value)


class NodeConfigCollector:
    name = "node_config"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: NodeConfigConfig, *, nvml: Any = None, sysfs_root: Path = Path("/sys"),
                 proc_root: Path = Path("/proc")) -> None:
        self._config = config
        self._nvml = nvml
        self._root = Path(sysfs_root)
        self._proc = Path(proc_root)
        self._errors: Counter[tuple[str, str]] = Counter()

    def _count(self, source: str, reason: str) -> None:
        if not self._errors[(source, reason)]:
            log.warning("node configuration: a %s fact could not be read (%s); it is left out (logged once per "
                        "source and reason, counted in vigil_node_config_read_errors_total)", source, reason)
        self._errors[(source, reason)] += 1

    def _text(self, source: str, path: Path) -> str | None:
        try:
            text = read_attribute(path)
        except Unusable as exc:
            self._count(source, exc.reason)
            return None
        if text is not None and len(text) > MAX_FACT_CHARS:
            self._count(source, "too_long")
            return None
        return text

    # -- sources -------------------------------------------------------------------------------

    def _gpu_facts(self, facts: dict[str, Any], mixed: list[str]) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        try:
            count = nvml.device_count()
        except Exception as exc:  # noqa: BLE001 - NVML's errors are one class per return code
            self._count("nvml", error_reason(exc))
            return
        facts["gpu_count"] = count
        per_gpu: dict[str, list[Any]] = {}
        for index in range(count):
            try:
                model: str | None = nvml.identity(index).name or None
            except Exception as exc:  # noqa: BLE001 - a lost GPU: its facts are unknown, the others stand
                self._count("nvml", error_reason(exc))
                model = None
            try:
                g = nvml.config_facts(index)
            except Exception as exc:  # noqa: BLE001 - as above
                self._count("nvml", error_reason(exc))
                continue
            for _, reason in g.errors:
                self._count("nvml", reason)
            values = {
                "driver_version": g.driver_version, "cuda_driver_version": g.cuda_driver_version,
                "gpu_model": model, "vbios_version": g.vbios_version,
                "gpu_inforom_version": g.inforom_image_version, "ecc_mode": _mode(g.ecc_mode_current),
                "persistence_mode": _mode(g.persistence_mode), "mig_mode": _mode(g.mig_mode_current),
                "power_limit_watts": g.power_limit_watts, "application_sm_clock_hertz": g.application_sm_clock_hertz,
                "application_memory_clock_hertz": g.application_memory_clock_hertz,
            }
            for key, value in values.items():
                per_gpu.setdefault(key, []).append(value)
        _first_and_mixed(per_gpu, facts, mixed)

    def _hca_facts(self, facts: dict[str, Any], mixed: list[str]) -> None:
        ib = self._root / "class" / "infiniband"
        try:
            hcas = sorted(os.listdir(ib))
        except FileNotFoundError:
            facts["hca_count"] = 0
            return
        except OSError:
            self._count("hca", "unreadable")
            return
        facts["hca_count"] = len(hcas)
        boards: dict[str, str | None] = {hca: self._text("hca", ib / hca / "board_id") for hca in hcas}
        # The node's main HCA model is its most common board id (ties: the first HCA's): GPU nodes
        # carry a front-end or storage NIC of another model beside the compute HCAs (the recorded
        # H100 node: two ConnectX-7 NDR HCAs and a 200G RoCE bond of another board and firmware).
        # The per-HCA facts are those HCAs' own, and only their disagreement is `mixed`; every node
        # of the SKU has the same extra NIC, and hca_count still counts it.
        known = [b for b in boards.values() if b is not None]
        main = max(known, key=known.count) if known else None
        per_hca: dict[str, list[Any]] = {"hca_board_id": [main], "hca_firmware": [],
                                         "hca_link_rate_bits_per_second": []}
        for hca in hcas:
            if boards[hca] not in (main, None):  # another model; one whose board id is unreadable stays
                continue
            per_hca["hca_firmware"].append(self._text("hca", ib / hca / "fw_ver"))
            try:
                ports = sorted(os.listdir(ib / hca / "ports"), key=lambda p: (len(p), p))
            except OSError:
                ports = []
            for port in ports:
                if self._text("hca", ib / hca / "ports" / port / "state") != _ACTIVE:
                    continue
                rate = self._text("hca", ib / hca / "ports" / port / "rate")
                match = _RATE.match(rate or "")
                if rate is not None and match is None:
                    self._count("hca", "malformed")
                per_hca["hca_link_rate_bits_per_second"].append(float(match.group(1)) * 1e9 if match else None)
        _first_and_mixed(per_hca, facts, mixed)

    def _ofed_version(self, kernel: str | None) -> str | None:
        # MLNX_OFED's and DOCA-OFED's mlx5_core declare their release as the module version; the inbox
        # driver has no version file (Mellanox/nic-feature-discovery, "mofed-version": "no version
        # file, its most likely inbox"), or on some distributions the kernel's release (NGC containers'
        # entrypoint check compares it with `uname -r`): neither is an OFED.
        version = self._text("ofed", self._root / "module" / "mlx5_core" / "version")
        return None if version == kernel else version

    def _rdma_core_version(self) -> str | None:
        for directory in self._config.library_dirs:
            link = Path(directory) / "libibverbs.so.1"
            if not link.exists():
                continue
            match = _LIBIBVERBS.match(os.path.basename(os.path.realpath(link)))
            return match.group(1) if match else None
        return None

    # -- one cycle -----------------------------------------------------------------------------

    def collect(self, now: float) -> Collection:
        facts: dict[str, Any] = dict.fromkeys(FACTS)
        mixed: list[str] = []
        self._gpu_facts(facts, mixed)
        facts["kernel"] = self._text("kernel", self._proc / "sys" / "kernel" / "osrelease")
        self._hca_facts(facts, mixed)
        facts["ofed_version"] = self._ofed_version(facts["kernel"])
        facts["rdma_core_version"] = self._rdma_core_version()
        config = NodeConfig(**facts, mixed=tuple(mixed))
        out = Collection(report={"config": config})
        out.samples.append(Sample.of(INFO, 1, mixed=",".join(mixed), **{k: _label(v) for k, v in facts.items()}))
        for (source, reason), n in sorted(self._errors.items()):
            out.samples.append(Sample.of(READ_ERRORS, n, source=source, reason=reason))
        return out

    def close(self) -> None:
        pass


def _first_and_mixed(values: dict[str, list[Any]], facts: dict[str, Any], mixed: list[str]) -> None:
    """Each fact's first known value into ``facts``; a fact whose known values differ into ``mixed``."""
    for key, seen in values.items():
        known = [v for v in seen if v is not None]
        facts[key] = known[0] if known else None
        if len(set(known)) > 1:
            mixed.append(key)


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = NodeConfigConfig
DESCRIPTION = "The node's configuration facts (driver, firmware, OFED, kernel, modes, counts) on a slow cadence."


def build(config: AgentConfig, seams: Seams) -> NodeConfigCollector:
    return NodeConfigCollector(config.collectors.section("node_config", NodeConfigConfig), nvml=seams.nvml,
                               sysfs_root=seams.sysfs_root, proc_root=seams.proc_root)
