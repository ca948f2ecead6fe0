"""GpuBackend: what the GPU collector, job attribution, node configuration and node actions need of a
GPU library, whichever vendor's. PynvmlBackend (agent/nvml) and AmdSmiBackend (agent/amdsmi) satisfy it.

It describes the seam (a Protocol), the one value only the AMD side produces (a device notification
that is not an Xid), and picks the backend the configuration names (open_gpu_backend); the readings
are the NVML package's dataclasses, which both backends fill. amdsmi is imported only when chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from vigil.agent.nvml.backend import GpuConfigFacts, GpuIdentity, GpuReading, XidEvent

if TYPE_CHECKING:
    from vigil.agent.config import NvmlConfig

log = logging.getLogger(__name__)

Vendor = Literal["nvidia", "amd"]


@dataclass(frozen=True, slots=True)
class GpuNotification:
    """An event a GPU library delivers that is not an NVIDIA Xid: amdsmi's event notifications
    (VMFAULT, THERMAL_THROTTLE, GPU_PRE_RESET, GPU_POST_RESET, RING_HANG), by their amdsmi name
    lower-cased ("ring_hang")."""

    index: int
    kind: str
    message: str = ""


class GpuBackend(Protocol):
    """One vendor's GPUs. Every call that fails in the library raises one of ``library_errors``;
    ``health_of`` says which of those mean a GPU (or the library) is gone."""

    @property
    def vendor(self) -> Vendor: ...

    # Clock-event (throttle) reason words this backend's masks decode to (reason_names), in order.
    @property
    def reason_words(self) -> tuple[str, ...]: ...

    @property
    def library_errors(self) -> tuple[type[BaseException], ...]: ...

    @property
    def library(self) -> Any: ...

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def identity(self, index: int) -> GpuIdentity: ...
    def read(self, index: int, *, slow: bool = True) -> GpuReading: ...
    def health_of(self, exc: BaseException) -> str | None: ...
    def error_reason(self, exc: BaseException) -> str: ...
    def reason_names(self, mask: int) -> list[str]: ...
    def running_processes(self, index: int) -> list[Any] | None: ...
    def running_pids(self, index: int) -> list[int] | None: ...
    def config_facts(self, index: int) -> GpuConfigFacts: ...
    def reset_gpu(self, index: int, timeout_seconds: float = ...) -> str: ...
    def open_events(self, indices: list[int]) -> list[int]: ...
    def wait_xid(self, timeout_ms: int) -> XidEvent | GpuNotification | None: ...
    def close_events(self) -> None: ...


def open_gpu_backend(config: NvmlConfig, clock: Callable[[], float]) -> GpuBackend | None:
    """The backend ``nvml.backend`` names, initialised, or None (after one ERROR line) where that
    library does not initialise. ``auto`` probes NVML, then amdsmi, and takes the first that
    initialises (a node with both vendors' GPUs is not supported: NVML wins, logged); it never
    chooses the fake."""
    from vigil.agent.nvml.backend import open_backend

    if config.backend == "fake" and config.scenario is not None:
        from vigil.agent.nvml.scenario import ALL_PROFILES, ScenarioError, load_node_scenario

        board = ALL_PROFILES[load_node_scenario(config.scenario).profile]
        if board.vendor != config.vendor:
            raise ScenarioError(f"nvml.scenario {config.scenario!r} runs {board.key}, an {board.vendor} board, but "
                                f"nvml.vendor is {config.vendor}: set --vendor {board.vendor}")
    if (config.backend == "fake" and config.vendor == "amd") or config.backend == "amdsmi":
        from vigil.agent.amdsmi.backend import open_amdsmi_backend

        return open_amdsmi_backend(config, clock)
    if config.backend != "auto":
        return open_backend(config, clock)
    nvidia = _probe_nvml()
    if nvidia is not None:
        log.info("GPU backend auto: NVML initialised; NVIDIA GPUs (amdsmi not probed)")
        return nvidia
    from vigil.agent.amdsmi.backend import open_amdsmi_backend

    amd = open_amdsmi_backend(config, clock, quiet=True)
    if amd is not None:
        log.info("GPU backend auto: NVML did not initialise, amdsmi did; AMD GPUs")
        return amd
    log.error("GPU backend auto: neither NVML nor amdsmi initialises on this node; no GPU metrics from this agent")
    return None


def _probe_nvml() -> GpuBackend | None:
    """PynvmlBackend over pynvml if nvmlInit succeeds, quietly None otherwise."""
    try:
        import pynvml
    except ImportError:
        return None
    from vigil.agent.nvml.backend import PynvmlBackend

    backend = PynvmlBackend(pynvml)
    try:
        backend.init()
    except pynvml.NVMLError as exc:
        log.info("GPU backend auto: nvmlInit failed (%s)", type(exc).__name__)
        return None
    return backend
