"""The H100 device profile checked against a recorded `nvidia-smi -q` of an 8x H100 node."""

from __future__ import annotations

import re
from pathlib import Path

from vigil.agent.nvml.profiles import H100_SXM_80GB, MIB, PROFILES

RECORDING = Path(__file__).parents[2] / "fixtures" / "nvidia-smi" / "nvidia-smi-q-8xH100-535.161.08.txt"


def _gpus(text: str) -> list[dict[str, list[str]]]:
    """Each GPU section as {key: [values in order]} (nested keys flattened, e.g. 'Total')."""
    sections = re.split(r"^GPU (?=[0-9A-F]{8}:)", text, flags=re.M)[1:]
    out = []
    for section in sections:
        fields: dict[str, list[str]] = {}
        bus_id = section.splitlines()[0].strip()
        fields["__bus_id"] = [bus_id]
        for line in section.splitlines()[1:]:
            if ":" in line:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), []).append(value.strip())
        out.append(fields)
    return out


def test_h100_profile_matches_the_recording():
    text = RECORDING.read_text()
    driver = re.search(r"Driver Version\s+: (\S+)", text)
    assert driver is not None
    assert driver.group(1) == H100_SXM_80GB.driver_version
    cuda_match = re.search(r"CUDA Version\s+: (\S+)", text)
    assert cuda_match is not None
    cuda = cuda_match.group(1)
    assert cuda == f"{H100_SXM_80GB.cuda_driver_version // 1000}.{H100_SXM_80GB.cuda_driver_version % 1000 // 10}"
    gpus = _gpus(text)
    assert len(gpus) == 8
    assert tuple(g["__bus_id"][0] for g in gpus) == H100_SXM_80GB.pcie_bus_ids
    for g in gpus:
        assert g["Product Name"] == [H100_SXM_80GB.name]
        assert g["VBIOS Version"] == [H100_SXM_80GB.vbios_version]
        assert g["Bus Id"] == [g["__bus_id"][0]]
        assert g["Total"][0] == f"{H100_SXM_80GB.memory_total_bytes // MIB} MiB"  # FB memory comes first
        assert g["Reserved"][0] == f"{H100_SXM_80GB.memory_reserved_bytes // MIB} MiB"
        assert g["Encoder"] == ["0 %"] and g["Decoder"] == ["0 %"]  # answered, not N/A: no NotSupported
        # Max Clocks: Graphics, SM, Memory, Video follow the current and application clocks.
        assert f"{H100_SXM_80GB.sm_clock_max_mhz} MHz" in g["SM"]
        assert f"{H100_SXM_80GB.memory_clock_max_mhz} MHz" in g["Memory"]
        assert g["Current Power Limit"][0] == f"{H100_SXM_80GB.power_limit_mw / 1000:.2f} W"
        # Queries the profile marks NotSupported print N/A.
        assert g["Fan Speed"] == ["N/A"]
        assert g["Single Bit ECC"] == ["N/A"] and g["Pending Page Blacklist"] == ["N/A"]
        assert g["Performance State"] == ["P0"]
        # Driver 535 prints limits relative to T.Limit: T.Limit = current + margin.
        current = int(g["GPU Current Temp"][0].split()[0])
        t_limit = current + int(g["GPU T.Limit Temp"][0].split()[0])
        assert abs(t_limit - H100_SXM_80GB.gpu_max_temperature_celsius) <= 2
        shutdown = H100_SXM_80GB.gpu_max_temperature_celsius - int(g["GPU Shutdown T.Limit Temp"][0].split()[0])
        slowdown = H100_SXM_80GB.gpu_max_temperature_celsius - int(g["GPU Slowdown T.Limit Temp"][0].split()[0])
        assert (shutdown, slowdown) == (H100_SXM_80GB.shutdown_temperature_celsius,
                                        H100_SXM_80GB.slowdown_temperature_celsius)


def test_profiles_are_consistent():
    for key, p in PROFILES.items():
        assert p.key == key
        assert len(p.pcie_bus_ids) == 8 and len(set(p.pcie_bus_ids)) == 8
        assert p.power_idle_mw < p.power_busy_mw <= p.power_limit_mw
        assert p.temperature_busy_celsius < p.gpu_max_temperature_celsius <= p.slowdown_temperature_celsius
        assert p.slowdown_temperature_celsius < p.shutdown_temperature_celsius
        assert p.sm_clock_idle_mhz < p.sm_clock_max_mhz


def test_h100_configuration_fabric_and_link_match_the_recording():
    """Issue 44's facts as the recorded 535.161.08 node printed them on each of its 8 GPUs: what
    FakeNvml's config_facts, fabric and PCIe link answers come from (at idle: 0 % utilization, SM clock
    86 MHz, yet PCIe Gen5 current = max: the link does not downclock here)."""
    gpus = _gpus(RECORDING.read_text())
    for g in gpus:
        assert g["Persistence Mode"] == ["Enabled"]
        assert g["Image Version"] == [H100_SXM_80GB.inforom_image_version]
        # "Current" in file order: MIG mode, two N/A (virtualization), PCIe generation, link width, ECC.
        assert g["Max"][:2] == [str(H100_SXM_80GB.pcie_link_generation_max), f"{H100_SXM_80GB.pcie_link_width_max}x"]
        assert g["Current"] == ["Disabled", "N/A", "N/A", "5", "16x", "Enabled"] and g["Device Current"] == ["5"]
        assert g["Gpu"] == ["0 %"] and g["SM"][0] == f"{H100_SXM_80GB.sm_clock_idle_mhz} MHz"
        assert g["State"] == ["Completed"] and g["Status"] == ["Success"]  # Fabric, the v1 call's two fields
        assert "CliqueId" not in g and "Health" not in g  # driver 535 prints no V-call fields
        assert "GPU Recovery Action" not in g and g["Reset Required"] == ["No"]  # the field came later
        # Current, then Applications, Default Applications and Max clocks: the application clocks are the maxima.
        assert g["Graphics"][1:4] == [f"{H100_SXM_80GB.sm_clock_max_mhz} MHz"] * 3
    assert H100_SXM_80GB.nvswitch_fabric and not H100_SXM_80GB.recovery_action_supported
    assert "nvmlDeviceGetGpuFabricInfoV" in H100_SXM_80GB.functions_missing
