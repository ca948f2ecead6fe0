"""AMD device profiles: what one Instinct model reports through amdsmi when idle and when loaded.

Each profile is a DeviceProfile (agent/nvml/profiles.py: the same scenario machinery drives both
fakes) with vendor "amd", plus what only amdsmi reports (AmdProfile: market name, device id, XGMI,
RAS blocks). Values come from AMD's public specifications and a public ``rocm-smi`` recording,
cited per value. Profiles hold data only; FakeAmdSmi turns them into amdsmi answers over time.
"""

from __future__ import annotations

from dataclasses import dataclass

from vigil.agent.nvml.profiles import MIB, DeviceProfile


@dataclass(frozen=True, slots=True)
class AmdProfile:
    device: DeviceProfile  # the shared part (clocks in MHz, power in mW, as DeviceProfile keeps them)
    device_id: int  # PCI device id, amdsmi_get_gpu_asic_info()["device_id"]
    compute_units: int
    vram_vendor: str
    # RAS blocks whose ECC is enabled on this board (amdsmi_get_gpu_ecc_enabled's bitmask, by
    # AmdSmiGpuBlock name).
    ecc_blocks: tuple[str, ...]
    # Temperature sensors amdsmi answers NOT_SUPPORTED for (AmdSmiTemperatureType names).
    temperature_not_supported: frozenset[str]
    hotspot_emergency_celsius: int  # HOTSPOT EMERGENCY: the board shuts down past it
    bad_page_threshold: int  # amdgpu's default RMA threshold of retired pages (informational)
    energy_counter_resolution_uj: float  # amdsmi_get_energy_count()["counter_resolution"], uJ


# AMD Instinct MI300X, OAM module, 8 to a node on a UBB baseboard. AMD Instinct MI300X data sheet
# (https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/
# amd-instinct-mi300x-data-sheet.pdf) and product page
# (https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html): 304 compute units,
# peak engine clock 2100 MHz, 192 GB HBM3 at 5.2 Gbps (a 1300 MHz memory clock), 5.3 TB/s, 750 W
# total board power, PCIe Gen5 x16, 7 AMD Infinity Fabric (XGMI) links of 128 GB/s (896 GB/s
# peer-to-peer). Public recording (tests/fixtures/amdsmi/rocm-smi-concise-8xMI300X.txt): PCI device
# id 0x74a1, idle junction 35-40 C, idle socket power 137-143 W, idle SCLK 132 MHz and MCLK 900 MHz,
# PwrCap 750 W on each of 8 GPUs. The VRAM size amdsmi reports (196592 MiB), the thermal limits and
# the busy figures are not from a recording here: recalled or modelled, marked as such.
MI300X_DEVICE = DeviceProfile(
    key="mi300x-oam-192gb",
    name="AMD Instinct MI300X",
    memory_total_bytes=196592 * MIB,  # recalled: amd-smi "VRAM TOTAL: 196592 MB" (MiB) on MI300X
    memory_reserved_bytes=0,  # amdsmi reports no reserve apart from used
    sm_clock_max_mhz=2100,
    memory_clock_max_mhz=1300,
    sm_clock_idle_mhz=132,
    power_limit_mw=750_000,
    power_idle_mw=140_000,
    power_busy_mw=700_000,  # modelled: a training load below the 750 W cap
    temperature_idle_celsius=37,
    temperature_busy_celsius=78,  # modelled
    memory_temperature_idle_celsius=33,  # modelled
    memory_temperature_busy_celsius=62,  # modelled
    shutdown_temperature_celsius=115,  # not recorded: HOTSPOT EMERGENCY
    slowdown_temperature_celsius=110,  # not recorded: HOTSPOT CRITICAL (hwmon temp2_crit)
    gpu_max_temperature_celsius=110,
    memory_max_temperature_celsius=105,  # not recorded: VRAM CRITICAL
    nvlink_count=7,  # XGMI links per GPU (data sheet: 7 Infinity Fabric links)
    vbios_version="113-M3000100-102",  # not recorded here: the form MI300X VBIOS part numbers take
    driver_version="6.8.5",  # amdgpu driver as amdsmi_get_gpu_driver_info reports it (ROCm 6.2)
    cuda_driver_version=0,  # no CUDA on AMD: never reported
    # Bus ids of the 8 OAM slots (not recorded: a common MI300X platform's layout), amdsmi's form.
    pcie_bus_ids=("0000:05:00.0", "0000:26:00.0", "0000:46:00.0", "0000:65:00.0",
                  "0000:85:00.0", "0000:a6:00.0", "0000:c6:00.0", "0000:e5:00.0"),
    pcie_max_bytes_per_second=64_000_000_000,  # PCIe Gen5 x16, per direction
    not_supported=frozenset(),
    pcie_link_generation_max=5,
    pcie_link_width_max=16,
    vendor="amd",
)

MI300X_OAM_192GB = AmdProfile(
    device=MI300X_DEVICE,
    device_id=0x74A1,  # recording: "[0x74a1 : 0x00]"
    compute_units=304,
    vram_vendor="HYNIX",  # not recorded here
    # The RAS blocks amd-smi lists with ECC on an MI300X (not recorded here): memory (UMC), the
    # graphics engine, SDMA, MMHUB, the XGMI links (XGMI_WAFL) and the PCIe interface.
    ecc_blocks=("UMC", "SDMA", "GFX", "MMHUB", "PCIE_BIF", "XGMI_WAFL"),
    # MI300X has no edge sensor: amd-smi prints "EDGE: N/A" (recalled), junction (hotspot) only.
    temperature_not_supported=frozenset({"EDGE"}),
    hotspot_emergency_celsius=115,
    # amdgpu's bad_page_threshold default (-1) derives the limit from the VRAM size; recalled, not
    # used by vigil's memory detector (docs/amd.md).
    bad_page_threshold=128,
    energy_counter_resolution_uj=15.259,  # amdsmi README: "a 15.3 uJ resolution"
)

AMD_PROFILES: dict[str, AmdProfile] = {p.device.key: p for p in (MI300X_OAM_192GB,)}
# The shared DeviceProfile of each, for the node scenario's checks (agent/nvml/scenario.py).
AMD_DEVICE_PROFILES: dict[str, DeviceProfile] = {k: p.device for k, p in AMD_PROFILES.items()}
