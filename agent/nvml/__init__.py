"""The NVML boundary: PynvmlBackend over pynvml (or FakeNvml), device profiles and node scenarios.

``open_backend`` builds the backend the agent configuration asks for. Nothing outside this
package calls NVML.
"""

from vigil.agent.nvml.backend import GpuIdentity, GpuReading, NvLinkReading, PynvmlBackend, XidEvent, open_backend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import NodeScenario, ScenarioError, load_node_scenario

__all__ = [
    "FakeNvml",
    "GpuIdentity",
    "GpuReading",
    "NodeScenario",
    "NvLinkReading",
    "PynvmlBackend",
    "ScenarioError",
    "XidEvent",
    "load_node_scenario",
    "open_backend",
]
